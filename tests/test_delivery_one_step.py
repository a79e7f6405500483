"""A handed-off (or standby) parked message going back to a RedisBroker that shares the guard's Redis:
the push of its copy and the confirmation of its hand-off in one script.

What a user relies on: the copy is one request to Redis, a message the broker fetches, runs and
acks like its own, with every other middleware's enqueue hooks once; a delivery whose connection
drops, before the request reaches Redis or after it ran and before its reply, loses nothing and
runs the message once; a broker on another Redis takes the two steps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import cast

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from harness import wait_until
from harness.one_step import EnqueueHooks as Hooks
from harness.one_step import command_counts as calls
from harness.proxy import SilentProxy
from redis.backoff import NoBackoff
from redis.retry import Retry

import dramatiq_guard
from dramatiq_guard.backends import GuardBackend
from dramatiq_guard.backends.values import Enqueue, Handoff
from dramatiq_guard.delivery import GENERATIONS_OPTION
from dramatiq_guard.middleware.slots.concurrency import Concurrency

KEY = "concurrency:k"


def scripts(client: redis.Redis) -> int:
    counts = calls(client)
    return counts.get("fcall", 0) + counts.get("evalsha", 0)


def queued(client: redis.Redis, queue: str = "default") -> list[dict[str, object]]:
    """The messages on the broker's queue, in its order."""
    ids = client.lrange(f"dramatiq:{queue}", 0, -1)
    found = [client.hget(f"dramatiq:{queue}.msgs", i) for i in ids]
    return [json.loads(cast(bytes, m)) for m in found]


def parked(client: redis.Redis) -> set[str]:
    """The waiters of ``KEY`` with a stored payload: parked, or handed a slot and not confirmed."""
    return {cast(bytes, w).decode() for w in client.hkeys(f"dramatiq-guard:{{{KEY}}}:payloads")}


def holders(client: redis.Redis) -> set[str]:
    return {cast(bytes, h).decode() for h in client.zrange(f"dramatiq-guard:{{{KEY}}}:holders", 0, -1)}


def key_is_idle(client: redis.Redis) -> bool:
    """Whether ``KEY`` has no holder, waiter, payload, reservation nor standby left."""
    fields = ("holders", "waiters", "payloads", "reserved", "standbys")
    return client.exists(*(f"dramatiq-guard:{{{KEY}}}:{field}" for field in fields)) == 0


def concurrency(broker: dramatiq.Broker) -> Concurrency:
    return next(m for m in broker.middleware if isinstance(m, Concurrency))


def limit_one(broker: RedisBroker) -> tuple[dramatiq.Actor[[int], None], list[int]]:
    """An actor on one key of limit 1, and the arguments of its runs, in order."""
    ran: list[int] = []
    lock = threading.Lock()

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k"}, queue_name="default", max_retries=0)
    def job(n: int) -> None:
        with lock:
            ran.append(n)

    return job, ran


def hand_off_first(broker: RedisBroker, holder: str) -> tuple[GuardBackend, tuple[Handoff, ...]]:
    """Release ``holder``'s reservation (as its worker's release would): its slot goes to the first
    parked message, whose hand-off is returned for delivery."""
    backend = concurrency(broker).backend(broker)
    handoffs = backend.release(KEY, holder, limit=1).handoffs
    assert len(handoffs) == 1 and handoffs[0].payload is not None
    return backend, handoffs


def drain(broker: RedisBroker, ran: list[int], count: int) -> None:
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=50)
    worker.start()
    try:
        wait_until(lambda: len(ran) >= count, timeout=20, what=f"{count} runs")
        worker.join()
    finally:
        worker.stop()


def test_a_hand_off_is_one_script_that_pushes_its_copy_and_confirms_it_and_the_broker_runs_and_acks_it(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    job, ran = limit_one(redis_broker)
    first, second, third = (job.send(n) for n in range(3))  # the first reserves; the others park
    _, handoffs = hand_off_first(redis_broker, first.message_id)
    redisdb.config_resetstat()
    hooks.seen.clear()

    concurrency(redis_broker).deliver(redis_broker, handoffs)

    counts = calls(redisdb)
    assert scripts(redisdb) == 1 and counts.get("rpush") == 1 and counts.get("hsetnx") == 1
    copy = queued(redisdb)[-1]
    assert copy["message_id"] == second.message_id
    assert cast(dict[str, object], copy["options"])[GENERATIONS_OPTION] == {KEY: handoffs[0].generation}
    assert parked(redisdb) == {third.message_id}  # the second's payload went with its confirmation
    assert second.message_id in holders(redisdb)
    assert hooks.seen == [("before", second.message_id), ("after", second.message_id)]

    drain(redis_broker, ran, 3)
    assert sorted(ran) == [0, 1, 2]  # each once; the third was handed the slot and delivered too
    assert redisdb.hlen("dramatiq:default.msgs") == 0 and redisdb.llen("dramatiq:default") == 0  # acked
    assert key_is_idle(redisdb)


def test_a_standby_sent_ahead_is_one_script_too(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    job, ran = limit_one(redis_broker)
    job.send(0)
    waiting = job.send(1)
    backend = concurrency(redis_broker).backend(redis_broker)
    _, standbys = backend.send_standbys(KEY, limit=1, count=1)
    assert [s.waiter_id for s in standbys] == [waiting.message_id]
    redisdb.config_resetstat()
    hooks.seen.clear()

    concurrency(redis_broker).courier(redis_broker).send_ahead(standbys)

    assert scripts(redisdb) == 1 and calls(redisdb).get("rpush") == 1
    assert queued(redisdb)[-1]["message_id"] == waiting.message_id
    assert parked(redisdb) == set()  # confirmed: its payload is dropped, it waits as a standby
    assert redisdb.zscore(f"dramatiq-guard:{{{KEY}}}:standbys", waiting.message_id) is not None
    assert hooks.seen == [("before", waiting.message_id), ("after", waiting.message_id)]

    drain(redis_broker, ran, 2)
    assert sorted(ran) == [0, 1]


def test_a_broker_on_another_redis_takes_two_steps(
    redis_broker: RedisBroker, redisdb: redis.Redis, redis_server_url: str
) -> None:
    other = redis.Redis.from_url(redis_server_url.rsplit("/", 1)[0] + "/1")
    other.flushdb()
    try:
        dramatiq_guard.install(redis_broker, redis=other)
        job, ran = limit_one(redis_broker)
        first = job.send(0)
        second = job.send(1)
        backend = concurrency(redis_broker).backend(redis_broker)
        handoffs = backend.release(KEY, first.message_id, limit=1).handoffs
        redisdb.config_resetstat()

        concurrency(redis_broker).deliver(redis_broker, handoffs)

        assert scripts(redisdb) == 2  # the broker's push, then the confirmation
        assert queued(redisdb)[-1]["message_id"] == second.message_id
        assert not other.hkeys(f"dramatiq-guard:{{{KEY}}}:payloads")  # confirmed
        drain(redis_broker, ran, 2)
        assert sorted(ran) == [0, 1]
    finally:
        other.flushdb()
        other.close()


@pytest.fixture
def proxied(redisdb: redis.Redis, restore_global_broker: None) -> Iterator[tuple[RedisBroker, SilentProxy]]:
    """A RedisBroker (and so the guard) reaching the private Redis through a proxy, its client timing a
    call out after 0.5 s and trying it twice more."""
    kwargs = redisdb.connection_pool.connection_kwargs
    with SilentProxy(kwargs["host"], kwargs["port"]) as proxy:
        client = redis.Redis(
            host=proxy.host, port=proxy.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 2)
        )
        broker = RedisBroker(client=client)
        dramatiq.set_broker(broker)
        dramatiq_guard.install(broker)
        yield broker, proxy
        broker.close()


def test_a_delivery_whose_request_never_reaches_redis_loses_nothing_and_runs_the_message_once(
    proxied: tuple[RedisBroker, SilentProxy], redisdb: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broker, proxy = proxied
    job, ran = limit_one(broker)
    first, second = job.send(0), job.send(1)
    concurrency(broker).backend(broker).handoff_ttl_ms = 300  # a hand-off lapses soon
    _, handoffs = hand_off_first(broker, first.message_id)

    proxy.freeze()
    with caplog.at_level(logging.WARNING, "dramatiq_guard.delivery"):
        concurrency(broker).deliver(broker, handoffs)  # every try times out: logged
    proxy.drop_connections()  # what they sent never reaches Redis
    proxy.thaw()
    assert "Could not re-enqueue" in caplog.text
    assert parked(redisdb) == {second.message_id}  # nothing was written: the payload is still stored
    assert redisdb.llen("dramatiq:default") == 1

    drain(broker, ran, 2)  # the reservation lapses, and the sweep hands the message on again
    assert sorted(ran) == [0, 1]
    assert key_is_idle(redisdb)


def test_a_delivery_whose_reply_is_lost_runs_the_message_once(
    proxied: tuple[RedisBroker, SilentProxy], redisdb: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broker, proxy = proxied
    job, ran = limit_one(broker)
    first, second = job.send(0), job.send(1)
    _, handoffs = hand_off_first(broker, first.message_id)
    redisdb.config_resetstat()

    proxy.freeze(replies_only=True)
    with caplog.at_level(logging.WARNING, "dramatiq_guard.delivery"):
        concurrency(broker).deliver(broker, handoffs)  # it ran; its reply never came back
    proxy.thaw()
    assert "Could not re-enqueue" in caplog.text
    assert calls(redisdb).get("rpush") == 1
    assert [m["message_id"] for m in queued(redisdb)] == [first.message_id, second.message_id]
    assert parked(redisdb) == set() and second.message_id in holders(redisdb)  # and confirmed

    drain(broker, ran, 2)
    assert sorted(ran) == [0, 1]
    assert redisdb.hlen("dramatiq:default.msgs") == 0
    assert key_is_idle(redisdb)


def test_the_same_call_run_again_pushes_no_second_copy(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    # A client that tries a call again after losing its reply (redis-py's retry) runs it twice.
    job, ran = limit_one(redis_broker)
    first, second = job.send(0), job.send(1)
    backend, handoffs = hand_off_first(redis_broker, first.message_id)
    data = handoffs[0].payload
    assert data is not None
    push = Enqueue(redis_broker, "default", "the-redis-message-id", data)
    answers = [backend.enqueue_and_confirm(handoffs[0], push, ttl_ms=60_000) for _ in range(2)]

    assert answers == [True, True]
    assert [m["message_id"] for m in queued(redisdb)] == [first.message_id, second.message_id]
    drain(redis_broker, ran, 2)
    assert sorted(ran) == [0, 1]


def test_a_stub_broker_with_the_in_memory_backend_takes_two_steps(stub_broker: StubBroker) -> None:
    dramatiq_guard.install(stub_broker)

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k"}, max_retries=0)
    def job(n: int) -> None: ...

    first, second = job.send(0), job.send(1)
    backend = concurrency(stub_broker).backend(stub_broker)
    handoffs = backend.release(KEY, first.message_id, limit=1).handoffs
    assert not backend.enqueues_on(stub_broker)  # so the courier never asks it to push

    concurrency(stub_broker).deliver(stub_broker, handoffs)  # the broker's push, then the confirmation

    queued = [json.loads(m)["message_id"] for m in stub_broker.queues["default"].queue]
    assert queued == [first.message_id, second.message_id]
    assert backend.inspect(KEY).reserved == ()  # confirmed
