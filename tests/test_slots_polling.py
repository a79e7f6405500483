"""A worker that pushes a hand-off or a standby keeps its own Redis consumer polling.

Dramatiq's Redis consumer doubles its sleep after each empty fetch, up to ``worker_timeout``.
A key's waiters are parked, so its queue holds little but the hand-offs and standbys sent to
it; a consumer deep in its back-off then leaves a freed slot idle until it polls again
(``dramatiq_guard.delivery.keep_polling``). The invariant held here: once a worker process has
pushed a hand-off of a key, its consumer of that message's queue is back at the shortest
back-off.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import dramatiq
import pytest
import redis
from harness import wait_until

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend, Stake
from dramatiq_guard.delivery import keep_polling
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


def test_keep_polling_resets_the_back_off_of_that_queues_consumer_only(redis_broker: Any) -> None:
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
        keep_polling(worker, QUEUE)
        assert polling.misses <= 1  # 0, or 1 if it found nothing just before: its shortest sleep
        assert other.misses >= 30
        keep_polling(worker, "no-such-queue")  # nothing to reset: no error
        keep_polling(None, QUEUE)  # a process that runs no worker (a producer): no error
    finally:
        worker.stop()


def test_a_hand_off_pushed_by_a_worker_puts_its_consumer_back_to_the_shortest_back_off(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    """A holder's release hands the slot to a parked message and pushes it: that process's
    consumer of the message's queue, deep in its back-off, is reset by the push itself (it is
    in a sleep of a few hundred ms, and the release takes a few: it did not fetch the message
    meanwhile, which would reset it too)."""
    backend = RedisBackend(redisdb, namespace="polling")
    dramatiq_guard.install(redis_broker, redis=backend)
    mutex = next(m for m in redis_broker.middleware if isinstance(m, Mutex))
    ran = threading.Event()

    @dramatiq.actor(mutex={"key": lambda: "shared", "on_busy": "park"}, queue_name=QUEUE)
    def job() -> None:
        ran.set()

    # The slot is held by a holder of this test's own, so the message sent parks.
    key = f"{mutex.prefix}:{mutex.key_for(job)}"
    held = backend.acquire(Stake(key, "outsider", limit=1, ttl_ms=60_000))
    assert held.acquired
    lease = Lease(backend, key, "outsider", held, limit=1, ttl_ms=60_000)
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
        assert ran.wait(WAIT)
    finally:
        worker.stop()
