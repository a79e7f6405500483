"""Each thread's script calls go through a connection of its own (``ThreadClients``): what a user of
the client's pool relies on.

Invariants: a thread's connection goes back to the pool when the thread ends (a pool never runs dry
of threads that are gone); the guard's threads hold at most half the pool's ``max_connections``,
so the broker's own calls on a shared client still get connections; a forked child never talks
on its parent's connection; a connection Redis closed costs no call an error, whether the thread
was idle (checked before the call) or busy (unchecked: the call runs once more on a new one), and
a Redis that is gone fails the call after that one more try.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
from harness.redis_server import RedisServer

from dramatiq_guard.backends import RedisBackend, Stake, redis_client
from dramatiq_guard.errors import BackendUnavailable

MINUTE = 60_000


@pytest.fixture
def pool(redis_url: str) -> Iterator[redis.ConnectionPool]:
    pool = redis.ConnectionPool.from_url(redis_url, max_connections=4)
    yield pool
    pool.disconnect()


def cycle(backend: RedisBackend, key: str, holder: str) -> None:
    """One holder's life on a key of limit 1: acquired, released."""
    assert backend.acquire(Stake(key, holder, limit=1, ttl_ms=MINUTE)).acquired
    assert backend.release(key, holder, limit=1).released


def in_thread(target: Callable[..., None], *args: object) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target(*args)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors


def take_all(pool: redis.ConnectionPool) -> None:
    """Take every connection the pool may make, then give them back (MaxConnectionsError if it cannot)."""
    taken = [pool.get_connection() for _ in range(pool.max_connections)]
    for connection in taken:
        pool.release(connection)


def test_threads_that_ended_give_their_connections_back(pool: redis.ConnectionPool) -> None:
    backend = RedisBackend(redis.Redis(connection_pool=pool))
    for i in range(3 * pool.max_connections):
        in_thread(cycle, backend, f"concurrency:k{i}", f"m{i}")
    take_all(pool)  # none is still held for a thread that is gone


def test_live_threads_leave_half_the_pool_to_others(pool: redis.ConnectionPool) -> None:
    backend = RedisBackend(redis.Redis(connection_pool=pool))
    threads = 2 * pool.max_connections
    called, done = threading.Barrier(threads + 1), threading.Event()
    failures: list[BaseException] = []
    one_at_a_time = threading.Lock()  # more calls at once than the pool has connections fail anyway

    def worker(i: int) -> None:
        try:
            with one_at_a_time:
                cycle(backend, f"concurrency:k{i}", f"m{i}")
        except BaseException as e:  # pragma: no cover - asserted below
            failures.append(e)
        called.wait()
        done.wait()  # the thread (and what it holds) stays alive meanwhile

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    try:
        called.wait()
        assert not failures, failures
        # The broker's share of the pool: still there while every guard thread lives (MaxConnectionsError).
        others = [pool.get_connection() for _ in range(pool.max_connections // 2)]
        for connection in others:
            pool.release(connection)
    finally:
        done.set()
        for thread in workers:
            thread.join()


def _child_cycles(backend: RedisBackend, key: str, results: multiprocessing.Queue[str]) -> None:
    try:
        results.put(str(backend.clients.here().client_id()))  # the connection the child talks on
        for i in range(200):
            cycle(backend, key, f"child-{i}")
        results.put("ok")
    except BaseException as e:  # pragma: no cover - reported to the parent
        results.put(repr(e))


def test_a_forked_child_talks_on_its_own_connection(redis_url: str) -> None:
    backend = RedisBackend(redis.Redis.from_url(redis_url))
    cycle(backend, "concurrency:parent", "before-fork")  # the parent's thread has its connection now
    parents = str(backend.clients.here().client_id())
    context = multiprocessing.get_context("fork")  # the child is given the backend as it is
    results: multiprocessing.Queue[str] = context.Queue()
    child = context.Process(target=_child_cycles, args=(backend, "concurrency:child", results))
    child.start()
    try:
        assert results.get(timeout=60) != parents
        # Both at once: on one shared socket their replies would cross.
        for i in range(200):
            cycle(backend, "concurrency:parent", f"parent-{i}")
        assert results.get(timeout=60) == "ok"
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert str(backend.clients.here().client_id()) == parents  # and the parent keeps its own


@pytest.mark.parametrize("idle_s", [0.0, 3600.0], ids=["checked", "unchecked"])
def test_a_connection_redis_closed_costs_no_call_an_error(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, idle_s: float
) -> None:
    # checked: every call comes after CHECK_IDLE_S (an idle thread); unchecked: every call within it.
    monkeypatch.setattr(redis_client, "CHECK_IDLE_S", idle_s)
    backend = RedisBackend.from_url(redis_url)  # no retries: redis-py itself would raise
    admin = redis.Redis.from_url(redis_url)
    try:
        cycle(backend, "concurrency:k", "before")
        killed = backend.clients.here().client_id()
        assert admin.client_kill_filter(_id=str(killed)) == 1  # Redis closes the thread's connection
        cycle(backend, "concurrency:k", "after")  # no BackendUnavailable
        assert backend.clients.here().client_id() != killed
    finally:
        admin.close()
        backend.close()


def test_a_redis_that_is_gone_fails_an_unchecked_call_after_one_more_try(
    redis_server_on_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_client, "CHECK_IDLE_S", 3600.0)
    server = RedisServer(executable=redis_server_on_path).start()
    backend = RedisBackend.from_url(server.url)
    try:
        cycle(backend, "concurrency:k", "before")
        server.stop()
        with pytest.raises(BackendUnavailable):
            backend.acquire(Stake("concurrency:k", "after", limit=1, ttl_ms=MINUTE))
    finally:
        backend.close()
        server.close()
