"""When Redis forgets (issue 16): eviction refused, no persistence warned, lost state found, payloads bounded.

Every Redis here is a real ``redis-server`` started by the test (``RedisServer``),
configured as the test needs: an evicting ``maxmemory-policy``, AOF on, an ACL
that forbids ``CONFIG``, or restarted empty while messages are parked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError
from harness import wait_until
from harness.redis_server import RedisServer
from prometheus_client import CollectorRegistry

import dramatiq_guard
from dramatiq_guard import events
from dramatiq_guard.backends import MemoryBackend, RedisBackend, Stake, Waiter, redis_health
from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.cli import main
from dramatiq_guard.errors import BackendUnavailable, EvictingRedis, PayloadTooLarge
from dramatiq_guard.metrics import GuardMetrics
from dramatiq_guard.middleware.slots import Concurrency
from dramatiq_guard.testing import join

T = TypeVar("T")
MINUTE = 60_000
HEALTH_LOGGER = "dramatiq_guard.backends.redis_health"


@pytest.fixture
def servers(redis_server_on_path: str) -> Iterator[Callable[..., RedisServer]]:
    """Start ``redis-server`` processes with extra options; all are closed at the end."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(executable=redis_server_on_path, args=args).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """GuardMetrics on a registry of the test's own, receiving the guard's events."""
    previous = events.get_sink()
    registry = CollectorRegistry()
    GuardMetrics().setup(registry)
    yield registry
    events.set_sink(previous)


def lost(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("dramatiq_guard_redis_state_lost_total", {"reason": reason}) or 0.0


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HEALTH_LOGGER and r.levelno == level]


def eventually(operation: Callable[[], T], what: str) -> T:
    """``operation()``, tried again while Redis is unavailable (a pooled connection from before a restart)."""
    outcome: list[T] = []

    def attempt() -> bool:
        try:
            outcome.append(operation())
        except BackendUnavailable:
            return False
        return True

    wait_until(attempt, what=what)
    return outcome[0]


@pytest.fixture
def worker_for() -> Iterator[Callable[[dramatiq.Broker], dramatiq.Worker]]:
    workers: list[dramatiq.Worker] = []

    def start(broker: dramatiq.Broker) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=20)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


# --- the check at install -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_install_refuses_an_evicting_redis(
    policy: str,
    servers: Callable[..., RedisServer],
    worker_for: Callable[[dramatiq.Broker], dramatiq.Worker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = servers("--maxmemory", "3mb", "--maxmemory-policy", policy)
    broker: dramatiq.Broker = RedisBroker(url=server.url)
    try:
        with pytest.raises(EvictingRedis) as raised:
            dramatiq_guard.install(broker)  # zero config: the RedisBroker's own Redis
        message = str(raised.value)
        assert repr(policy) in message
        assert "maxmemory-policy noeviction" in message  # what to set
        assert "allow_evicting_redis=True" in message  # and the opt-out
    finally:
        broker.close()

    # With the opt-out it runs, and warns.
    broker = StubBroker()
    broker.emit_after("process_boot")
    caplog.set_level(logging.WARNING, logger="dramatiq_guard")
    dramatiq_guard.install(broker, redis=server.url, allow_evicting_redis=True)
    [warning] = [m for m in messages(caplog, logging.WARNING) if "maxmemory-policy" in m]
    assert policy in warning and "running anyway" in warning
    done: list[int] = []

    @dramatiq.actor(broker=broker, concurrency={"limit": 1, "key": lambda n: "k"})
    def job(n: int) -> None:
        done.append(n)

    for n in range(3):
        job.send(n)
    worker_for(broker)
    join(broker, job.queue_name, timeout=10_000)
    assert sorted(done) == [0, 1, 2]


def test_a_standalone_middleware_refuses_an_evicting_redis_on_first_use(
    servers: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without install(), the middleware checks when it first resolves its backend."""
    server = servers("--maxmemory-policy", "allkeys-lfu")
    broker = RedisBroker(url=server.url)
    try:
        concurrency = Concurrency()
        broker.add_middleware(concurrency)

        @dramatiq.actor(broker=broker, concurrency=1)
        def job() -> None: ...

        with pytest.raises(EvictingRedis, match="allkeys-lfu"):
            job.send()
        assert isinstance(EvictingRedis("x", "y"), MiddlewareError)  # so send() raises it
        assert broker.client.llen("dramatiq:default") == 0

        monkeypatch.setenv(redis_health.ALLOW_EVICTING_ENV, "1")
        job.send()
        assert broker.client.llen("dramatiq:default") == 1
    finally:
        broker.close()


def test_no_persistence_is_a_warning_that_says_what_a_restart_loses(
    servers: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dramatiq_guard")
    bare = servers()  # --save "" --appendonly no
    dramatiq_guard.install(StubBroker(), redis=bare.url)
    [warning] = [m for m in messages(caplog, logging.WARNING) if "persist" in m]
    assert "a restart of it loses every parked message" in warning
    assert "appendonly yes" in warning

    caplog.clear()
    durable = servers("--appendonly", "yes")
    dramatiq_guard.install(StubBroker(), redis=durable.url)
    assert messages(caplog, logging.WARNING) == []


def test_a_redis_that_forbids_config_gets_a_note_not_a_crash(
    servers: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = servers()
    with server.client() as admin:
        admin.acl_setuser(
            "guard",
            enabled=True,
            passwords=["+secret"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-config"],
        )
    caplog.set_level(logging.WARNING, logger="dramatiq_guard")
    url = f"redis://guard:secret@{server.host}:{server.port}/0"
    installed = dramatiq_guard.install(StubBroker(), redis=url)
    assert installed
    notes = [m for m in messages(caplog, logging.WARNING) if "CONFIG GET" in m]
    assert any("maxmemory-policy was refused" in note for note in notes), notes


def test_inspect_shows_the_eviction_policy_and_persistence(
    servers: Callable[..., RedisServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = servers("--maxmemory-policy", "allkeys-lru")
    assert main(["--redis", server.url, "inspect", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["redis"]
    assert (found["maxmemory_policy"], found["evicting"], found["persistent"]) == ("allkeys-lru", True, False)
    assert main(["--redis", server.url, "inspect"]) == 0
    out = capsys.readouterr().out
    assert "maxmemory-policy allkeys-lru" in out and "set 'maxmemory-policy noeviction'" in out
    assert "persistence: none" in out


def test_a_full_noeviction_redis_fails_closed(servers: Callable[..., RedisServer]) -> None:
    """At maxmemory, noeviction refuses writes: a guard operation is BackendUnavailable, never unguarded."""
    server = servers("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    client = server.client()
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for n in range(1_000):
            client.set(f"fill:{n}", b"x" * 20_000)
    backend = RedisBackend(client)
    with pytest.raises(BackendUnavailable, match="maxmemory") as raised:
        backend.acquire(Stake("concurrency:k", "m1", limit=1, ttl_ms=MINUTE), wait=Waiter(payload=b"{}"))
    assert isinstance(raised.value, MiddlewareError)  # Dramatiq lets it out of a hook: Retries retries
    client.close()


# --- state lost while running ---------------------------------------------------------------


def test_a_restart_without_persistence_is_reported_and_new_work_is_guarded(
    servers: Callable[..., RedisServer],
    worker_for: Callable[[dramatiq.Broker], dramatiq.Worker],
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = servers()
    broker = StubBroker()
    broker.emit_after("process_boot")
    caplog.set_level(logging.WARNING, logger="dramatiq_guard")
    installed = dramatiq_guard.install(broker, redis=server.url, sweep_interval=50)
    concurrency = next(m for m in installed if isinstance(m, Concurrency))
    backend = concurrency.backend(broker)
    assert isinstance(backend, RedisBackend)
    done: list[int] = []

    @dramatiq.actor(broker=broker, concurrency={"limit": 1, "key": lambda n: "k"}, max_retries=0)
    def job(n: int) -> None:
        done.append(n)

    concurrency.set_limit("k", 0, broker=broker)  # halted: every message parks
    parked = [job.send(n).message_id for n in range(3)]
    assert [w for w, _, _ in backend.inspect("concurrency:k").waiters] == parked
    worker_for(broker)

    def watching() -> bool:
        state = redis_health._watches.get(backend)
        return state is not None and state.run_id is not None and "concurrency:k" in state.waiting

    wait_until(watching, what="the state watch to see the parked key")

    server.stop()
    server.start()  # same port, empty: the parked messages are gone

    wait_until(lambda: lost(registry, "restart") == 1, what="the restart to be counted")
    [error] = [m for m in messages(caplog, logging.ERROR) if "restarted" in m]
    assert "without persistence" in error and "every parked message" in error
    assert "'concurrency:k'" in error
    assert done == []

    # The worker keeps running, and the next messages are guarded as usual.
    eventually(lambda: concurrency.set_limit("k", 0, broker=broker), what="the limit to be set again")
    message = eventually(lambda: job.send(10), what="a send after the restart")
    assert [w for w, _, _ in backend.inspect("concurrency:k").waiters] == [message.message_id]
    concurrency.set_limit("k", 1, broker=broker)  # hands the slot to the parked message
    join(broker, job.queue_name, timeout=10_000)
    assert done == [10]
    assert lost(registry, "restart") == 1


def test_a_restart_with_persistence_that_kept_the_parked_keys_is_not_a_loss(
    servers: Callable[..., RedisServer], registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    server = servers("--appendonly", "yes", "--appendfsync", "always")
    backend = RedisBackend.from_url(server.url)
    try:
        redis_health.check(backend)
        backend.acquire(Stake("concurrency:k", "m1", limit=0, ttl_ms=MINUTE), wait=Waiter(payload=b"{}"))
        watch = redis_health.StateWatch(backend, keys_every_s=0)
        assert watch.check() == []
        server.stop()
        server.start()
        caplog.set_level(logging.WARNING, logger="dramatiq_guard")
        assert eventually(watch.check, what="a check after the restart") == []
        assert any("reloaded its data" in m for m in messages(caplog, logging.WARNING))
        assert [w for w, _, _ in backend.inspect("concurrency:k").waiters] == ["m1"]
        assert lost(registry, "restart") == 0
    finally:
        backend.close()


def test_vanished_waiters_a_lost_index_entry_and_a_flush_are_reported(
    servers: Callable[..., RedisServer], registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    server = servers()
    backend = RedisBackend.from_url(server.url, namespace="g")
    client = backend.client
    try:
        for key, waiter in (("concurrency:a", "m1"), ("concurrency:b", "m2")):
            backend.acquire(Stake(key, waiter, limit=0, ttl_ms=MINUTE), wait=Waiter(payload=b"{}"))
        watch = redis_health.StateWatch(backend, keys_every_s=0)
        caplog.set_level(logging.WARNING, logger="dramatiq_guard")
        assert watch.check() == []

        # An eviction of a's waiters (as allkeys-* may do): its parked message is lost.
        client.delete("g:{concurrency:a}:waiters")
        assert watch.check() == ["vanished"]
        [error] = messages(caplog, logging.ERROR)
        assert (
            "'concurrency:a'" in error
            and "1 stored payload(s) are left in g:{concurrency:a}:payloads" in error
        )
        assert watch.check() == []  # reported once
        assert backend.waiting_keys() == ["concurrency:b"]

        # The index lost b's entry: b still waits, so the entry is put back for the sweeps.
        client.delete("g:waiting")
        assert watch.check() == ["vanished"]
        assert backend.waiting_keys() == ["concurrency:b"]
        assert lost(registry, "vanished") == 2

        caplog.clear()
        client.flushall()
        assert watch.check() == ["flush"]
        [error] = messages(caplog, logging.ERROR)
        assert "flushed" in error and "'concurrency:b'" in error
        assert lost(registry, "flush") == 1
        assert watch.check() == []
    finally:
        backend.close()


def test_the_waiters_check_reads_every_waiting_key_only_every_keys_every_s(
    servers: Callable[..., RedisServer], registry: CollectorRegistry
) -> None:
    """Each sweep pass checks the server; every waiting key only every keys_every_s (its cost is O(keys))."""
    server = servers()
    backend = RedisBackend.from_url(server.url, namespace="g")
    try:
        backend.acquire(Stake("concurrency:a", "m1", limit=0, ttl_ms=MINUTE), wait=Waiter(payload=b"{}"))
        watch = redis_health.StateWatch(backend, keys_every_s=3600)
        assert watch.check() == []  # the first check reads every waiting key
        backend.client.delete("g:{concurrency:a}:waiters")
        assert watch.check() == []  # not again within the hour
        assert lost(registry, "vanished") == 0
        watch.keys_every_s = 0
        assert watch.check() == ["vanished"]
    finally:
        backend.close()


def test_the_watch_ignores_other_backends_and_survives_an_unreachable_redis(
    servers: Callable[..., RedisServer],
) -> None:
    MemoryBackend().watch(1.0)  # the contract's default: nothing to watch
    server = servers()
    backend = RedisBackend.from_url(server.url)
    try:
        server.stop()
        backend.watch(1.0)  # logged, not raised: the sweep goes on
    finally:
        backend.close()


def test_the_redis_settings_gauges(registry: CollectorRegistry) -> None:
    events.redis_settings(True, False)
    assert registry.get_sample_value("dramatiq_guard_redis_evicting") == 1
    assert registry.get_sample_value("dramatiq_guard_redis_persistent") == 0


# --- the payload bound ----------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def small_backend(request: pytest.FixtureRequest) -> Iterator[GuardBackend]:
    """A backend whose parked payloads may take 100 bytes at most."""
    if request.param == "memory":
        yield MemoryBackend(max_payload_bytes=100)
        return
    url = request.getfixturevalue("redis_url")
    backend = RedisBackend(redis.Redis.from_url(url), namespace="small", max_payload_bytes=100)
    yield backend
    backend.client.close()


def test_an_oversize_payload_is_refused_before_anything_is_stored(small_backend: GuardBackend) -> None:
    backend = small_backend
    assert backend.acquire(Stake("concurrency:k", "m0", limit=1, ttl_ms=MINUTE)).acquired
    with pytest.raises(PayloadTooLarge) as raised:
        backend.acquire(Stake("concurrency:k", "m1", limit=1, ttl_ms=MINUTE), wait=Waiter(payload=b"x" * 101))
    assert (raised.value.size, raised.value.limit) == (101, 100)
    assert "max_payload_bytes" in str(raised.value) and "nothing was stored" in str(raised.value)
    assert backend.inspect("concurrency:k").waiters == ()
    assert backend.waiting_keys() == []
    if isinstance(backend, RedisBackend):
        assert not backend.client.exists("small:{concurrency:k}:payloads", "small:{concurrency:k}:waiters")
    # At the bound, it parks.
    result = backend.acquire(
        Stake("concurrency:k", "m2", limit=1, ttl_ms=MINUTE), wait=Waiter(payload=b"x" * 100)
    )
    assert result.parked


def test_an_oversize_message_is_refused_at_send(redis_url: str, redisdb: redis.Redis) -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq_guard.install(broker, redis=redis_url, max_payload_bytes=1_000)

    @dramatiq.actor(broker=broker, concurrency=1)
    def job(data: str) -> None: ...

    job.send("small")  # takes the slot: the next one would park
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes"):
        job.send("x" * 2_000)
    assert broker.queues[job.queue_name].qsize() == 1
    assert not [k for k in redisdb.scan_iter(b"dramatiq-guard:*") if k.endswith((b":payloads", b":waiters"))]

    with pytest.raises(ValueError, match="max_payload_bytes"):
        dramatiq_guard.install(StubBroker(), max_payload_bytes=0)
