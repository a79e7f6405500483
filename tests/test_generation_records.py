"""A parked message's generation record lives only while a second copy of it can exist (issue #31, item 7).

A copy picked up from the broker that parks leaves a record (``<ns>:{K}:gens:<waiter>``) saying
that no copy on the broker may start: its worker may die before the ack, and the broker then
delivers it again. Once the broker acked that copy (:meth:`GuardBackend.forget_parked_copy`,
called from ``after_ack`` on a broker whose ack is known to have landed), no second copy can
exist, and the record goes; without the ack (the worker died at the worst moment) it stays,
and the copy delivered again never starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Retries
from harness import wait_until

from dramatiq_guard.backends import Stake
from dramatiq_guard.backends.base import GuardBackend, Waiter
from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.backends.values import ORIGINAL_GENERATION
from dramatiq_guard.gate import gate_for
from dramatiq_guard.middleware.slots import Concurrency

KEY = "concurrency:k"


def records(backend: GuardBackend) -> list[str]:
    """The waiters of KEY with a generation record (the in-memory backend keeps them in its fakeredis)."""
    assert isinstance(backend, RedisBackend)
    prefix = f"{backend.namespace}:{{{KEY}}}:gens:"
    return sorted(k.decode()[len(prefix) :] for k in backend.client.scan_iter(f"{prefix}*".encode()))


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> GuardBackend:
    if request.param == "memory":
        return MemoryBackend()
    redisdb: redis.Redis = request.getfixturevalue("redisdb")
    return RedisBackend(redisdb, namespace=f"gens-{time.time_ns()}")


def park_a_picked_up_copy(backend: GuardBackend) -> None:
    """'h' holds KEY (limit 1); the copy of 'm' a worker (a runner) picked up parks."""
    assert backend.acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    picked_up = Stake(KEY, "m", limit=1, ttl_ms=60_000, generation=ORIGINAL_GENERATION, runner="worker")
    parked = backend.acquire(picked_up, wait=Waiter(payload=b"m"))
    assert parked.parked
    assert records(backend) == ["m"]


def hand_off_and_run(backend: GuardBackend) -> None:
    """'h' finishes; the hand-off to 'm' is confirmed, its copy starts and finishes."""
    [handoff] = backend.release(KEY, "h", limit=1).handoffs
    assert handoff.waiter_id == "m" and handoff.generation is not None
    assert backend.confirm_handoff(KEY, "m", ttl_ms=60_000, generation=handoff.generation)
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, generation=handoff.generation)).acquired
    assert backend.release(KEY, "m", limit=1).released


def test_the_record_of_a_parked_copy_goes_once_the_broker_acked_it(backend: GuardBackend) -> None:
    park_a_picked_up_copy(backend)
    assert backend.forget_parked_copy(KEY, "m")
    assert records(backend) == []
    hand_off_and_run(backend)
    assert records(backend) == [], "a message done and acked left its generation record"


def test_an_ack_that_comes_after_the_hand_off_still_takes_the_record(backend: GuardBackend) -> None:
    park_a_picked_up_copy(backend)
    hand_off_and_run(backend)
    assert records(backend) == ["m"]  # the parked copy's worker has not acked it yet
    assert backend.forget_parked_copy(KEY, "m")
    assert records(backend) == []


def test_without_the_ack_the_record_stays_and_the_copy_delivered_again_never_starts(
    backend: GuardBackend,
) -> None:
    park_a_picked_up_copy(backend)
    hand_off_and_run(backend)
    # The parked copy's worker died before the ack: the broker delivers that copy again.
    again = backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, generation=ORIGINAL_GENERATION))
    assert again.stale and not again.acquired
    assert records(backend) == ["m"]


def test_a_copy_parked_at_the_enqueue_gate_keeps_a_record_no_ack_takes(backend: GuardBackend) -> None:
    """A standby's copy that another guard parked on its way comes back to the gate and parks. No
    broker acks it, and it may come back again (that guard's hand-off of it failed): its record
    is no parked copy's, and stays for ``stale_ttl_ms`` (found by tests/test_model.py)."""
    assert backend.acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"m")).parked
    _, [sent] = backend.send_standbys(KEY, limit=1, count=1)
    assert sent.waiter_id == "m" and sent.generation is not None
    at_the_gate = Stake(KEY, "m", limit=1, ttl_ms=60_000, generation=sent.generation)  # no runner
    assert backend.acquire(at_the_gate, wait=Waiter(payload=b"m")).parked
    assert records(backend) == ["m"]
    hand_off_and_run(backend)
    assert not backend.forget_parked_copy(KEY, "m")
    assert records(backend) == ["m"]
    assert backend.acquire(at_the_gate, wait=Waiter(payload=b"m")).stale  # it came back again


@pytest.fixture
def stub_on_redis(
    restore_global_broker: None, redisdb: redis.Redis
) -> Iterator[tuple[StubBroker, RedisBackend]]:
    backend = RedisBackend(redisdb, namespace="gens-worker")
    broker = StubBroker()
    broker.add_middleware(Concurrency(redis=backend), before=Retries)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker, backend
    broker.close()


def test_a_message_parked_after_pickup_leaves_no_record_once_it_ran(
    stub_on_redis: tuple[StubBroker, RedisBackend],
) -> None:
    broker, backend = stub_on_redis
    ran = threading.Event()

    @dramatiq.actor(queue_name="gens", concurrency={"limit": 1, "key": lambda: "k"})
    def job() -> None:
        ran.set()

    # Another holder has the key; the message reaches the broker without a reservation (sent by
    # a process without the guard), so the worker that picks it up parks it.
    assert backend.acquire(Stake(KEY, "someone", limit=1, ttl_ms=60_000)).acquired
    message = job.message()
    gate_for(broker).original(message)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=20)
    worker.start()
    try:
        wait_until(lambda: backend.inspect(KEY).waiters, what="the message parked after pickup")
        broker.join("gens")
        worker.join()  # the parked copy is acked
        result = backend.release(KEY, "someone", limit=1)
        middleware = next(m for m in broker.middleware if isinstance(m, Concurrency))
        middleware.deliver(broker, result.handoffs)
        assert ran.wait(10)
        broker.join("gens")
        worker.join()
    finally:
        worker.stop()
    wait_until(lambda: not backend.inspect(KEY).holders, what="the slot released")
    left = [k for k in backend.client.scan_iter(b"gens-worker:*") if b":gens:" in k]
    assert left == [], f"the message ran and was acked, and left {left}"
