"""Waiting for conditions by events, with a deadline, never by bare sleeps.

:func:`wait_until` re-evaluates a predicate each time something happens:

* with ``redis=`` it subscribes to Redis keyspace notifications (the harness
  Redis servers run with ``notify-keyspace-events KA``) and re-checks the
  predicate on every notification for the watched keys; a slow backstop
  (``backstop`` seconds) covers state that lives outside Redis;
* without it, it backs off from 1 ms to ``backstop`` between checks.

Prefer the purpose-made waits when they fit: :meth:`harness.Recorder.take`
(BLPOP on the records the actors push) and :meth:`harness.DramatiqWorker.wait_for_log`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Literal, TypeVar

import redis as redis_lib

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait ran out of time. An AssertionError, so a test that times out reads as a failure."""


def wait_until(
    predicate: Callable[[], T | Literal[False] | None],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    redis: redis_lib.Redis | None = None,
    keys: Iterable[str] = ("*",),
    backstop: float = 0.25,
) -> T:
    """Wait until ``predicate()`` returns a truthy value and return that value.

    Parameters:
      predicate: Called once at once, then after every event (or back-off step).
      timeout: Seconds before :class:`WaitTimeout` is raised.
      what: Says what was awaited, for the error message.
      redis: A client of the Redis whose keys the predicate reads; the wait
        then wakes on keyspace notifications for ``keys`` (glob patterns,
        without the ``__keyspace@N__:`` prefix).
      keys: The key patterns to watch (default: every key).
      backstop: The longest pause between two checks.

    Raises:
      WaitTimeout: The predicate stayed falsy for ``timeout`` seconds. The
        message names ``what`` and the predicate's last value.
    """
    deadline = time.monotonic() + timeout
    value = predicate()
    if value:
        return value

    pubsub = None
    if redis is not None:
        db = redis.connection_pool.connection_kwargs.get("db", 0)
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        pubsub.psubscribe(*[f"__keyspace@{db}__:{pattern}" for pattern in keys])
        # Subscribed now: anything that changed before is caught by this check.
        value = predicate()
        if value:
            pubsub.close()
            return value

    pause = 0.001
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what} (last value: {value!r})")
            if pubsub is not None:
                message = pubsub.get_message(timeout=min(remaining, backstop))
                # Drain whatever else arrived, so one check covers a burst of events.
                while message is not None:
                    message = pubsub.get_message(timeout=0)
            else:
                time.sleep(min(remaining, pause))
                pause = min(pause * 2, backstop)
            value = predicate()
            if value:
                return value
    finally:
        if pubsub is not None:
            pubsub.close()


def redis_broker_pending(
    client: redis_lib.Redis, queues: Iterable[str] = ("default",), *, namespace: str = "dramatiq"
) -> int:
    """How many messages a RedisBroker still holds for ``queues`` (queued, delayed or unacked).

    A message stays in ``<namespace>:<queue>.msgs`` (or ``.DQ.msgs``) from its
    enqueue until its ack, so 0 means every message was processed and acked
    (dead-lettered ones excepted: see :func:`redis_broker_dead`).
    """
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.hlen(f"{namespace}:{queue}.msgs")
        pipe.hlen(f"{namespace}:{queue}.DQ.msgs")
    return sum(int(n) for n in pipe.execute())


def guard_leftovers(
    client: redis_lib.Redis, *, keep_limits_index: bool = False, namespace: str = "dramatiq-guard"
) -> list[bytes]:
    """The guard's keys left in Redis (sorted), but for run-time limits, tokens, generation records
    and the waiting-keys index.

    Per-key run-time limits (``<namespace>:{K}:limit``), last fencing tokens
    (``<namespace>:{K}:token``) and waiters' generation records
    (``<namespace>:{K}:gens:<waiter>``, written when a copy parked after pickup),
    which expire ``stale_ttl_ms`` after their last write (left out only while
    they have an expiry), the live workers' records of the function library
    they run (``<namespace>:processes``, also only while it has an expiry),
    ``<namespace>:waiting`` and the layout record (``<namespace>:layout``) are left out;
    ``<namespace>:limits`` too with ``keep_limits_index``, for a test that set
    limits. Once the work drained, anything else is guard state left behind.
    """
    kept = {f"{namespace}:waiting".encode(), f"{namespace}:layout".encode()}
    if keep_limits_index:
        kept.add(f"{namespace}:limits".encode())
    return sorted(
        k
        for k in client.scan_iter(f"{namespace}:*".encode())
        if not k.endswith(b":limit")
        and k not in kept
        and not (
            (k.endswith(b":token") or b"}:gens:" in k or k == f"{namespace}:processes".encode())
            and int(client.pttl(k)) >= 0
        )
    )


def redis_broker_dead(
    client: redis_lib.Redis, queues: Iterable[str] = ("default",), *, namespace: str = "dramatiq"
) -> int:
    """How many dead-lettered messages a RedisBroker holds for ``queues``."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.hlen(f"{namespace}:{queue}.XQ.msgs")
    return sum(int(n) for n in pipe.execute())


def wait_for_redis_broker_drain(
    client: redis_lib.Redis,
    queues: Iterable[str] = ("default",),
    *,
    namespace: str = "dramatiq",
    timeout: float = 30.0,
) -> None:
    """Wait until a RedisBroker has no pending (queued, delayed or unacked) message on ``queues``.

    Woken by keyspace notifications on the broker's keys.
    """
    queues = tuple(queues)
    wait_until(
        lambda: redis_broker_pending(client, queues, namespace=namespace) == 0,
        timeout,
        f"RedisBroker queues {list(queues)} to drain",
        redis=client,
        keys=[f"{namespace}:*"],
    )
