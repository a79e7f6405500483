"""A worker that pushes a hand-off or a standby keeps its own Redis consumer polling briskly.

Dramatiq's Redis consumer doubles its sleep after each empty fetch, up to ``worker_timeout``.
A key's waiters are parked, so its queue holds little but the hand-offs and standbys sent to
it; a consumer deep in its back-off then leaves a freed slot idle until it polls again
(``dramatiq_guard.delivery.PollingPace``). The invariants held here: once a worker process has
pushed a hand-off of a key, its consumer of that message's queue is back at the shortest
back-off and sleeps at most ``BRISK_POLL_MS``; once the pushes stop, it gets its own back-off
back (an idle worker polls no more than it did).
"""

from __future__ import annotations

import threading
from typing import Any, cast

import dramatiq
import pytest
import redis
from harness import wait_until

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend
from dramatiq_guard.delivery import BRISK_POLL_MS, PollingPace
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.slots import Mutex

pytestmark = pytest.mark.redis

WAIT = 30.0
QUEUE = "polling"


def consumer_of(worker: dramatiq.Worker, queue_name: str) -> Any:
    """The broker consumer of ``worker``'s consumer thread for ``queue_name``, once it made it."""
    wait_until(
        lambda: getattr(worker.consumers.get(queue_name), "consumer", None) is not None, WAIT, "consumer"
    )
    return cast(Any, worker.consumers[queue_name]).consumer


def test_a_brisk_consumer_gets_its_own_back_off_back_once_the_pushes_stop(redis_broker: Any) -> None:
    @dramatiq.actor(queue_name=QUEUE)
    def idle() -> None: ...

    @dramatiq.actor(queue_name="other")
    def elsewhere() -> None: ...

    worker = dramatiq.Worker(redis_broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        polling, other = consumer_of(worker, QUEUE), consumer_of(worker, "other")
        wait_until(lambda: polling.misses >= 2 and other.misses >= 2, WAIT, "both consumers to back off")
        polling.misses = other.misses = 30  # as after a long idle spell
        pace = PollingPace(worker, linger_s=0.2)
        pace.hurry(QUEUE)
        assert polling.misses <= 1  # 0, or 1 if it found nothing just before: its shortest sleep
        assert polling.timeout == BRISK_POLL_MS
        assert other.misses >= 30 and other.timeout == 100  # another queue's consumer: left alone
        pace.hurry("no-such-queue")  # nothing to hurry: no error
        PollingPace(None).hurry(QUEUE)  # a process that runs no worker (a producer): no error
        wait_until(lambda: polling.timeout == 100, WAIT, "the consumer's own back-off to come back")
        pace.hurry(QUEUE)
        pace.relax()  # the worker shuts down: given back at once
        assert polling.timeout == 100
    finally:
        worker.stop()


def test_a_hand_off_pushed_by_a_worker_puts_its_consumer_back_to_the_shortest_back_off(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    """A holder's release hands the slot to a parked message and pushes it: that process's
    consumer of the message's queue, deep in its back-off, is reset and capped by the push itself
    (it was asleep, so it did not fetch the message meanwhile)."""
    backend = RedisBackend(redisdb, namespace="polling")
    dramatiq_guard.install(redis_broker, redis=backend)
    mutex = next(m for m in redis_broker.middleware if isinstance(m, Mutex))
    ran = threading.Event()

    @dramatiq.actor(mutex={"key": lambda: "shared", "on_busy": "park"}, queue_name=QUEUE)
    def job() -> None:
        ran.set()

    # The slot is held by a holder of this test's own, so the message sent parks.
    key = f"{mutex.prefix}:{mutex.key_for(job)}"
    held = backend.acquire(key, "outsider", limit=1, ttl_ms=60_000)
    assert held.acquired
    lease = Lease(backend, key, "outsider", cast(int, held.token), limit=1, ttl_ms=60_000)
    job.send()
    assert len(backend.inspect(key).waiters) == 1

    worker = dramatiq.Worker(redis_broker, worker_timeout=3_000, worker_threads=1)
    worker.start()
    try:
        consumer = consumer_of(worker, QUEUE)
        wait_until(lambda: consumer.misses >= 4, WAIT, "the consumer to back off (an empty queue)")
        consumer.misses = 30  # its next sleeps: the longest (worker_timeout)
        mutex.release(redis_broker, lease)  # hands the slot to the parked message and pushes it
        assert consumer.misses <= 1  # 0, or 1 if it found nothing just before: its shortest sleep
        assert consumer.timeout == BRISK_POLL_MS
        assert ran.wait(WAIT)
    finally:
        worker.stop()
    assert consumer.timeout == 3_000  # a stopped worker's consumer has its own back-off back
