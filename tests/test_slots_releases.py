"""Releases off the worker thread (``dramatiq_guard.middleware.slots.releases``), on a real RedisBroker.

In a worker on a real broker a finished message's lease is released by the process's release
thread, in batches. The invariants held here: every lease is released (none is left behind by
a worker that stopped), and a follow-up that a message's completion enqueues (a pipeline's next
step, a callback) never finds the key still held by the message before it.
"""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.middleware import Middleware
from harness import RedisServer, wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend, Stake
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.slots.releases import Releaser
from dramatiq_guard.renewer import get_renewer
from dramatiq_guard.testing import join

pytestmark = pytest.mark.redis

WAIT = 30.0


class KeyAtEnqueue(Middleware):
    """Records the holders of ``key`` when a message of ``actor`` is enqueued."""

    def __init__(self, backend: RedisBackend, key: str, actor: str) -> None:
        self.backend, self.key, self.actor = backend, key, actor
        self.seen: list[tuple[str, ...]] = []

    def before_enqueue(self, broker: dramatiq.Broker, message: dramatiq.Message[Any], delay: int) -> None:
        if message.actor_name == self.actor:
            self.seen.append(tuple(holder for holder, _ in self.backend.inspect(self.key).holders))


def three_parked_behind_the_first(
    broker: Any, backend: RedisBackend, key: str, actor: Any
) -> dramatiq.Worker:
    """Start a worker running message 0 of ``actor`` (it holds ``key``), then send 1, 2 and 3: they park."""
    actor.send(0)
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        wait_until(lambda: backend.inspect(key).holders != (), WAIT, "the first to hold the key")
        for n in (1, 2, 3):
            actor.send(n)
        wait_until(lambda: len(backend.inspect(key).waiters) == 3, WAIT, "the others to park")
    except BaseException:
        worker.stop()
        raise
    return worker


@pytest.mark.parametrize("follow_up", ["pipeline", "on_success"])
def test_a_follow_up_on_the_same_key_never_finds_its_predecessor_holding_it(
    follow_up: str, redis_broker: Any, redisdb: redis.Redis
) -> None:
    backend = RedisBackend(redisdb, namespace="releases")
    dramatiq_guard.install(redis_broker, redis=backend)
    seen = KeyAtEnqueue(backend, "mutex:shared", "second")
    redis_broker.add_middleware(seen)
    ran = threading.Event()
    shared = {"key": lambda *args: "shared", "on_busy": "drop"}

    @dramatiq.actor(mutex=shared, queue_name="releases")
    def first() -> None: ...

    @dramatiq.actor(mutex=shared, queue_name="releases")
    def second(*_: Any) -> None:
        ran.set()

    if follow_up == "pipeline":
        dramatiq.pipeline([first.message(), second.message()]).run()
    else:
        first.send_with_options(on_success=second)
    worker = dramatiq.Worker(redis_broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        assert ran.wait(WAIT), "the follow-up did not run (dropped: its key was still held)"
    finally:
        worker.stop()
    assert seen.seen == [()]  # the first had released the key before the follow-up existed


def test_a_stopped_worker_leaves_no_lease_behind(redis_broker: Any, redisdb: redis.Redis) -> None:
    backend = RedisBackend(redisdb, namespace="releases")
    dramatiq_guard.install(redis_broker, redis=backend)
    done = threading.Semaphore(0)
    count = 200

    @dramatiq.actor(mutex=True, queue_name="releases")
    def job(n: int) -> None:
        done.release()

    for n in range(count):
        job.send(n)
    worker = dramatiq.Worker(redis_broker, worker_timeout=50, worker_threads=8)
    worker.start()
    try:
        for _ in range(count):
            assert done.acquire(timeout=WAIT)
    finally:
        worker.stop()
    # No wait: the worker's shutdown released what its release thread still held.
    assert redisdb.keys("releases:*:holders") == []


def test_the_testing_join_returns_with_every_finished_message_released(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    backend = RedisBackend(redisdb, namespace="releases")
    dramatiq_guard.install(redis_broker, redis=backend)

    @dramatiq.actor(mutex=True, queue_name="releases")
    def job(n: int) -> None: ...

    for n in range(100):
        job.send(n)
    worker = dramatiq.Worker(redis_broker, worker_timeout=50, worker_threads=4)
    worker.start()
    try:
        join(redis_broker, "releases", timeout=int(WAIT * 1000))
        assert redisdb.keys("releases:*:holders") == []  # no wait: join made the pending releases
    finally:
        worker.stop()


def test_a_waiter_parked_behind_a_finished_message_runs_when_the_release_lands(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    backend = RedisBackend(redisdb, namespace="releases")
    dramatiq_guard.install(redis_broker, redis=backend)
    ran: list[int] = []
    gate = threading.Event()

    @dramatiq.actor(mutex={"key": lambda n: "one", "on_busy": "park"}, queue_name="releases")
    def job(n: int) -> None:
        if n == 0:
            assert gate.wait(WAIT)
        ran.append(n)

    worker = three_parked_behind_the_first(redis_broker, backend, "mutex:one", job)
    try:
        gate.set()
        wait_until(lambda: len(ran) == 4, WAIT, "every message to run, one after the other")
    finally:
        worker.stop()
    assert ran == [0, 1, 2, 3]
    assert backend.inspect("mutex:one").holders == ()


def _seen_on(threads: dict[str, list[str]], key: str) -> None:
    """Record the thread that releases ``key`` (not the probe's keys: a one-step send probes the broker)."""
    if not key.startswith("probe:"):
        threads["busy" if key == "mutex:busy" else "free"].append(threading.current_thread().name)


def test_a_key_with_waiters_is_released_on_the_worker_thread_and_a_key_without_on_the_release_thread(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    """The next holder of a key with waiters is waiting for the slot: its release does not wait for
    a hop to another thread. A key nobody waits for is released in the background."""
    backend = RedisBackend(redisdb, namespace="releases")
    dramatiq_guard.install(redis_broker, redis=backend)
    threads: dict[str, list[str]] = {"busy": [], "free": []}
    release_many = backend.release_many

    def spy(releases: Any) -> Any:
        for key, *_ in releases:
            _seen_on(threads, key)
        return release_many(releases)

    backend.release_many = spy  # type: ignore[method-assign]
    release = backend.release

    def spy_one(key: str, holder: str, **options: Any) -> Any:
        _seen_on(threads, key)
        return release(key, holder, **options)

    backend.release = spy_one  # type: ignore[method-assign]
    gate = threading.Event()
    done = threading.Semaphore(0)

    @dramatiq.actor(mutex={"key": lambda n: "busy", "on_busy": "park"}, queue_name="releases")
    def busy(n: int) -> None:
        if n == 0:
            assert gate.wait(WAIT)
        done.release()

    @dramatiq.actor(mutex=True, queue_name="releases")
    def free(n: int) -> None:
        done.release()

    worker = three_parked_behind_the_first(redis_broker, backend, "mutex:busy", busy)
    try:
        gate.set()
        for n in range(4):
            free.send(n)
        for _ in range(8):
            assert done.acquire(timeout=WAIT)
        wait_until(lambda: len(threads["free"]) == 4, WAIT, "the free keys' releases")
    finally:
        worker.stop()
    # Every release of the busy key after its first handed the slot on: on the worker threads.
    assert "dramatiq-guard-releases" not in threads["busy"][1:], threads
    assert set(threads["free"]) == {"dramatiq-guard-releases"}, threads


def test_releases_the_backend_cannot_take_are_reported_and_stop_being_renewed(
    private_redis: RedisServer,
) -> None:
    """A batch whose backend is unreachable hands each lease's caller None (the middleware logs it;
    the lease lapses within its ttl): none is kept renewing, none is retried."""
    client = private_redis.client(socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    backend = RedisBackend(client, namespace="releases")
    taken = [backend.acquire(Stake(f"mutex:k{n}", f"m{n}", limit=1, ttl_ms=60_000)) for n in range(3)]
    leases = [
        Lease(backend, f"mutex:k{n}", f"m{n}", result, limit=1, ttl_ms=60_000)
        for n, result in enumerate(taken)
    ]
    renewing = get_renewer().leases - len(leases)
    private_redis.stop()
    results: list[object] = []
    releaser = Releaser()
    assert releaser.send([(lease, 0, results.append) for lease in leases]) is True  # never retried
    assert results == [None, None, None]
    assert all(lease.released for lease in leases)
    assert get_renewer().leases == renewing  # no longer renewed: each lapses within its ttl
    client.close()
