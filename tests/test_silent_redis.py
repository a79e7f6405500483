"""A silent Redis: the connection stays open and nothing answers (a frozen primary, a partition).

The guard's Redis is reached through ``harness.SilentProxy``, which forwards to
the test's real Redis until frozen, then keeps every socket open and forwards
nothing. A lease is lost when its known-valid time passes, whatever the
client is doing; the holder is told (``lost``, ``check()``), the release and
the metrics report it, and another client, going straight to Redis, takes the
key once the lease lapsed there, with a higher fencing token.

No timing is asserted: each wait is for an event, with a deadline of several
leases, so a slow machine is not a failure; a hang is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from harness import SilentProxy, wait_until
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.retry import Retry

import dramatiq_guard
from dramatiq_guard import events
from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.errors import LeaseLost
from dramatiq_guard.lease import Lease
from dramatiq_guard.lock import Lock
from dramatiq_guard.metrics import GuardMetrics

#: The lease of these tests: short, so that a lapse comes soon; a renewal every third of it.
TTL_MS = 1_000
#: How long each wait for an event may take: several leases (a deadline, not a measure).
DEADLINE_S = 8 * TTL_MS / 1000
#: The socket timeout of the clients that have one: the release on a silent Redis ends after it.
SOCKET_TIMEOUT_S = 1.0


@pytest.fixture
def proxy(redis_url: str) -> Iterator[SilentProxy]:
    """A proxy to the test's Redis; thawed at teardown so blocked calls end."""
    direct = redis.Redis.from_url(redis_url)
    host, port = (
        direct.connection_pool.connection_kwargs["host"],
        direct.connection_pool.connection_kwargs["port"],
    )
    direct.close()
    with SilentProxy(host, port) as silent:
        yield silent
        silent.thaw()


def through(proxy: SilentProxy, *, socket_timeout: float | None) -> RedisBackend:
    """A backend whose client goes through ``proxy``, and tries a timed-out call once."""
    client = redis.Redis(
        host=proxy.host,
        port=proxy.port,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
    )
    return RedisBackend(client)


def hold(backend: RedisBackend, name: str) -> tuple[Lock, Lease]:
    """Take the lock ``name`` (guard key ``mutex:<name>``) with a lease of ``TTL_MS``."""
    lock = Lock(name, redis=backend, lease_ttl=TTL_MS)
    assert lock.acquire(blocking=False) and lock.lease is not None
    return lock, lock.lease


def deadline_ms(backend: RedisBackend, key: str, holder: str) -> int:
    return dict(backend.inspect(key).holders).get(holder, 0)


def take_over(backend: RedisBackend, key: str, holder: str) -> int:
    """Acquire ``key`` for ``holder`` once the lease in the way lapsed; the new token."""
    result = wait_until(
        lambda: (r := backend.acquire(Stake(key, holder, limit=1, ttl_ms=60_000))).acquired and r,
        timeout=DEADLINE_S,
        what=f"{key!r} to lapse and be taken by {holder!r}",
    )
    assert result.token is not None
    return result.token


def test_a_lease_on_a_silent_redis_is_lost_on_time_without_a_socket_timeout(
    proxy: SilentProxy, redis_url: str
) -> None:
    # The case: a client with no socket timeout, as the RedisBroker's own client was
    # (redis-py before 6): a renewal sent to a silent Redis blocks in its socket for good.
    silent = through(proxy, socket_timeout=None)
    direct = RedisBackend.from_url(redis_url)
    lock, lease = hold(silent, "silent")
    first = deadline_ms(direct, "mutex:silent", lease.holder)
    # Renewals go through while Redis answers.
    wait_until(lambda: deadline_ms(direct, "mutex:silent", lease.holder) > first, DEADLINE_S, "a renewal")
    assert not lease.lost

    proxy.freeze()
    # The holder is told when the lease's time is up, though a renewal is still blocked.
    assert lease.wait_lost(DEADLINE_S)
    assert lease.lost and not lease.held
    with pytest.raises(LeaseLost):
        lease.check()
    # The lease lapses in Redis, and another client takes the key with a higher token.
    assert take_over(direct, "mutex:silent", "b") > lease.token

    # Redis answers again: the blocked renewal comes back refused (b holds the key) and the lease
    # stays lost; the release finds it gone, says so, and frees nothing of b's.
    proxy.thaw()
    with pytest.raises(LeaseLost):
        lock.release()
    assert lease.release_result is not None and not lease.release_result.released and lease.lost
    assert [h for h, _ in direct.inspect("mutex:silent").holders] == ["b"]
    assert direct.release("mutex:silent", "b", limit=1).released
    direct.close()


def test_a_silent_backend_holds_back_no_other_backends_renewals(proxy: SilentProxy, redis_url: str) -> None:
    silent = through(proxy, socket_timeout=None)
    direct = RedisBackend.from_url(redis_url)
    stuck_lock, stuck = hold(silent, "stuck")
    alive_lock, alive = hold(direct, "alive")
    proxy.freeze()
    assert stuck.wait_lost(DEADLINE_S)
    # The other backend's lease is still renewed, for more than a lease after the first was lost.
    renewed_past = deadline_ms(direct, "mutex:alive", alive.holder) + TTL_MS
    wait_until(
        lambda: deadline_ms(direct, "mutex:alive", alive.holder) > renewed_past,
        DEADLINE_S,
        "the renewals of the answering backend's lease",
    )
    assert not alive.lost
    alive_lock.release()
    assert not alive.lost
    proxy.thaw()
    with pytest.raises(LeaseLost):
        stuck_lock.release()
    direct.close()


def test_a_locks_release_on_a_silent_redis_reports_the_loss_and_ends(
    proxy: SilentProxy, redis_url: str
) -> None:
    silent = through(proxy, socket_timeout=SOCKET_TIMEOUT_S)
    direct = RedisBackend.from_url(redis_url)
    lock, lease = hold(silent, "silent-lock")
    proxy.freeze()
    assert lease.wait_lost(DEADLINE_S)
    assert take_over(direct, "mutex:silent-lock", "other") > lease.token

    # The release waits for the socket timeout, not for ever, and reports the loss.
    outcome: list[BaseException | None] = []

    def release() -> None:
        try:
            lock.release()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    releasing = threading.Thread(target=release, daemon=True)
    releasing.start()
    releasing.join(DEADLINE_S)
    assert not releasing.is_alive(), "the release hung on the silent Redis"
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost)
    assert [h for h, _ in direct.inspect("mutex:silent-lock").holders] == ["other"]
    direct.close()


@pytest.fixture
def metrics() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    previous = events.get_sink()
    GuardMetrics().setup(registry)
    yield registry
    events.set_sink(previous)


def test_an_actor_is_told_its_lease_was_lost_and_the_release_and_metrics_report_it(
    proxy: SilentProxy,
    redis_url: str,
    restore_global_broker: None,
    metrics: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    silent = through(proxy, socket_timeout=SOCKET_TIMEOUT_S)
    dramatiq_guard.install(broker, redis=silent, lease_ttl=TTL_MS)
    started = threading.Event()
    frozen = threading.Event()
    seen: dict[str, Any] = {}

    @dramatiq.actor(mutex=True, max_retries=0)
    def long_job() -> None:
        lease = dramatiq_guard.current_lease()
        seen["token"] = lease.token
        started.set()
        assert frozen.wait(DEADLINE_S)
        seen["told"] = lease.wait_lost(DEADLINE_S)
        try:
            lease.check()
        except LeaseLost as exc:
            seen["check"] = exc

    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        long_job.send()
        assert started.wait(DEADLINE_S)
        proxy.freeze()
        frozen.set()
        broker.join(long_job.queue_name, timeout=int(DEADLINE_S * 3000))
        worker.join()
    finally:
        proxy.thaw()
        worker.stop()

    assert seen["told"] is True and isinstance(seen.get("check"), LeaseLost)
    lost = metrics.get_sample_value("dramatiq_guard_leases_lost_total", {"actor_name": "long_job"})
    assert lost == 1
    assert any(r.levelno == logging.ERROR and "was lost" in r.getMessage() for r in caplog.records)


def test_install_warns_when_the_client_has_no_socket_timeout(
    redis_url: str, restore_global_broker: None, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=None, socket_connect_timeout=None)
    with caplog.at_level(logging.WARNING, logger="dramatiq_guard.install"):
        dramatiq_guard.install(StubBroker(), redis=client)
    [warning] = [r for r in caplog.records if r.name == "dramatiq_guard.install"]
    message = warning.getMessage()
    assert warning.levelno == logging.WARNING
    assert repr(client) in message and "no socket_timeout" in message
    assert "socket_timeout=" in message and "socket_connect_timeout=" in message
    client.close()


def test_install_is_quiet_when_every_call_is_bounded_below_the_lease(
    redis_url: str, restore_global_broker: None, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RedisBackend.from_url(redis_url)  # 5 s timeouts, no retry of a timed-out call
    with caplog.at_level(logging.WARNING, logger="dramatiq_guard.install"):
        dramatiq_guard.install(StubBroker(), redis=backend)
    assert [r for r in caplog.records if r.name == "dramatiq_guard.install"] == []
    # The same client is too slow for leases shorter than its timeout.
    assert backend.slow_call_warning(2_000) is not None
    backend.close()


class _OneSecondTimeout(redis.Connection):
    """A connection whose default socket timeout is 1 s, not listed in its pool's kwargs."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("socket_timeout", 1.0)
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]


def test_a_blocking_wait_longer_than_the_clients_default_socket_timeout_is_chunked(
    redis_url: str,
) -> None:
    # redis-py's own defaults count (a client made from a URL lists no socket_timeout, yet has
    # one): a wait made of one BLPOP longer than it would fail as a lost connection.
    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=_OneSecondTimeout, host=kwargs["host"], port=kwargs["port"])
    backend = RedisBackend(redis.Redis(connection_pool=pool))
    assert backend.acquire(Stake("mutex:chunked", "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(
        Stake("mutex:chunked", "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)
    ).parked
    assert backend.wait_for_handoff("mutex:chunked", "w", timeout_ms=2_500) is None
    backend.cancel_wait("mutex:chunked", "w", limit=1)
    assert backend.release("mutex:chunked", "a", limit=1).released
    pool.disconnect()
