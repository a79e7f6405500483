"""Failover of the guard's Redis: what a promoted replica knows, and the tokens it issues.

Replication is asynchronous: a failover loses what the replica had not received. What is promised
(``docs/scaling.md``, ``docs/redis.md``):

* fencing tokens never go backwards for a key across a failover, whatever the new primary's clock
  says, for a key used within ``stale_ttl_ms`` (its last token outlives its state that long);
* with replica waits (``replica_waits=1``), every decision the caller was told of survives.

Each test starts its own topology (:mod:`harness.topology`) on loopback ports.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from harness import FakeClock, RedisServer, libfaketime, unavailable, wait_until
from harness.topology import RedisCluster3x1, ReplicatedRedis, SentinelRedis, replicate_all

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.backends.redis_client import ReplicaWaits
from dramatiq_guard.errors import BackendUnavailable, ConfigurationError, ReplicasBehind
from dramatiq_guard.lock import Lock
from dramatiq_guard.middleware.dedup import Deduplication, deduplicated_by

T = TypeVar("T")

KEY = "failover:report"
HOUR_MS = 3_600_000


@pytest.fixture
def behind() -> Iterator[FakeClock]:
    """A frozen clock an hour behind the real one, for a replica."""
    if libfaketime() is None:
        unavailable("libfaketime is not installed (apt-get install libfaketime)")
    clock = FakeClock(int(time.time() * 1000) - HOUR_MS)
    yield clock
    clock.close()


@pytest.mark.parametrize("idle", [True, False], ids=["key_idle", "key_held"])
def test_a_token_never_goes_back_across_a_failover_to_a_replica_whose_clock_is_behind(
    behind: FakeClock, idle: bool
) -> None:
    with ReplicatedRedis(replica_env=behind.server_env()) as pair:
        with pair.primary.client() as client:
            old = RedisBackend(client)
            first = old.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000))
            assert first.acquired and first.token is not None
            if idle:  # the key drains: nothing of it is left but its last token
                assert old.release(KEY, "m1", limit=1).released
            replicate_all(client)
        new_primary = pair.promote()
        with new_primary.client() as client:
            seconds, micros = client.time()
            assert seconds * 1_000_000 + micros < first.token - HOUR_MS * 1000 // 2, "the clock is not behind"
            new = RedisBackend(client)
            if not idle:  # the holder's release reached the new primary
                assert new.release(KEY, "m1", limit=1).released
            second = new.acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000))
            assert second.acquired and second.token is not None
            assert second.token > first.token


# --- Replica waits -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["partitioned", "gone"])
def test_with_replica_waits_a_decision_no_replica_acknowledges_fails_closed(how: str) -> None:
    with ReplicatedRedis() as pair, pair.primary.client() as client:
        assert pair.replica is not None
        # While the replica is healthy, WAIT returns once it acknowledged: a generous timeout keeps a
        # loaded machine's slow acknowledgement from failing the decision (it costs nothing otherwise).
        healthy = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=10_000)
        assert healthy.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000)).acquired
        assert healthy.release(KEY, "m1", limit=1).released
        backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=50)  # waits in vain
        if how == "partitioned":
            pair.partition()
        else:
            pair.replica.stop()
        with pytest.raises(ReplicasBehind) as caught:
            backend.acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000))
        assert isinstance(caught.value, BackendUnavailable)
        assert (caught.value.acknowledged, caught.value.wanted) == (0, 1)
        with pytest.raises(ReplicasBehind):
            backend.renew(KEY, "m2", ttl_ms=60_000)
        with pytest.raises(ReplicasBehind):
            backend.renew_many([(KEY, "m2", 60_000)])
        with pytest.raises(ReplicasBehind):
            backend.try_lock("dedup:x", "m3", ttl_ms=60_000)
        with pytest.raises(ReplicasBehind):
            backend.release(KEY, "m2", limit=1)


@pytest.mark.parametrize("replica_waits", [0, 1])
def test_a_failover_loses_an_acquire_the_replica_did_not_get_unless_replica_waits_refused_it(
    replica_waits: int,
) -> None:
    """The replica is cut off while the primary decides, then promoted: what did the caller see?"""
    with ReplicatedRedis() as pair:
        assert pair.replica is not None
        with pair.primary.client() as client:
            backend = RedisBackend(client, replica_waits=replica_waits, replica_wait_timeout_ms=50)
            pair.partition()
            if replica_waits:
                with pytest.raises(ReplicasBehind):  # the caller does not start: fail closed
                    backend.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000))
            else:  # the caller starts, on a decision no replica has
                assert backend.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000)).acquired
            pair.primary.stop()
        with pair.promote().client() as client:
            second = RedisBackend(client).acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000))
            assert second.acquired  # the new primary never heard of m1
            # With replica waits, m1 was told it did not acquire: one holder. Without, two run.


def test_with_replica_waits_a_holder_and_a_parked_message_survive_a_failover() -> None:
    with ReplicatedRedis() as pair:
        with pair.primary.client() as client:
            backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=5_000)
            assert backend.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000)).acquired
            parked = backend.acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"msg:m2"))
            assert parked.parked
        with pair.promote().client() as client:
            new = RedisBackend(client, replica_waits=0)
            refused = new.acquire(Stake(KEY, "m3", limit=1, ttl_ms=60_000))
            assert not refused.acquired and refused.holders == ("m1",)
            [handoff] = new.release(KEY, "m1", limit=1).handoffs
            assert (handoff.waiter_id, handoff.payload) == ("m2", b"msg:m2")


def test_replica_waits_are_checked_and_need_redis() -> None:
    with pytest.raises(ValueError, match="replica_waits"):
        RedisBackend(redis.Redis(), replica_waits=-1)
    with pytest.raises(ValueError, match="replica_wait_timeout_ms"):
        RedisBackend(redis.Redis(), replica_waits=1, replica_wait_timeout_ms=0)
    with pytest.raises(ValueError, match="replica_wait_timeout_ms"):
        dramatiq_guard.install(StubBroker(), replica_waits=1, replica_wait_timeout_ms=-5)
    with pytest.raises(ConfigurationError, match="replica_waits=1 needs the guard's state on Redis"):
        dramatiq_guard.install(StubBroker(), replica_waits=1)


# --- A decision that failed closed leaves nothing a retry trips on --------------------------------


@contextlib.contextmanager
def lagging_replica(broker: StubBroker) -> Iterator[tuple[ReplicatedRedis, RedisBackend]]:
    """A guard on a primary whose one replica is cut off (replica waits of 1): every decision the
    primary takes raises ``ReplicasBehind``, after the script ran. ``heal()`` it with
    :func:`healed`."""
    with ReplicatedRedis() as pair, pair.primary.client() as client:
        # 2 s: the sends before the partition must be acknowledged in time on a loaded machine
        # (300 ms failed once in CI); a decision after it waits that long in vain.
        backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=2_000)
        dramatiq_guard.install(broker, redis=backend)
        yield pair, backend


def healed(pair: ReplicatedRedis) -> None:
    """Reconnect the replica and wait until it acknowledged every write of the primary."""
    assert pair.link is not None
    pair.link.thaw()
    with pair.primary.client() as client:
        replicate_all(client)


def test_with_a_lagging_replica_a_dedup_send_that_raises_leaves_no_lock_for_its_retry(
    stub_broker: StubBroker,
) -> None:
    with lagging_replica(stub_broker) as (pair, _backend):

        @dramatiq.actor(dedup="until_executed")
        def refresh(user_id: int) -> None: ...

        pair.partition()
        with pytest.raises(ReplicasBehind):
            refresh.send(7)
        healed(pair)
        retry = refresh.send(7)
        assert deduplicated_by(retry) is None, "the retry was dropped as a duplicate of a message never sent"
        assert stub_broker.queues["default"].qsize() == 1
        next(m for m in stub_broker.middleware if isinstance(m, Deduplication)).flush()  # while Redis is up


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail_closed", "fail_open"])
def test_with_a_lagging_replica_a_send_that_parks_and_raises_leaves_no_parked_copy(
    stub_broker: StubBroker, fail_open: bool
) -> None:
    with lagging_replica(stub_broker) as (pair, backend):

        @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k", "fail_open": fail_open})
        def job(n: int) -> None: ...

        job.send(1)  # reserves the one slot
        pair.partition()
        if fail_open:  # sent unguarded: it must not run a second time from the lockwait area
            job.send(2)
        else:
            with pytest.raises(ReplicasBehind):
                job.send(2)
        healed(pair)
        assert backend.inspect("concurrency:k").waiters == ()
        if not fail_open:
            job.send(2)  # the caller's retry parks the one copy
            assert len(backend.inspect("concurrency:k").waiters) == 1


def test_with_a_lagging_replica_a_lock_acquire_that_raises_leaves_the_lock_free(
    stub_broker: StubBroker,
) -> None:
    with lagging_replica(stub_broker) as (pair, backend):
        pair.partition()
        with pytest.raises(ReplicasBehind):
            Lock("report", redis=backend).acquire(blocking=False)
        healed(pair)
        retry = Lock("report", redis=backend)
        assert retry.acquire(blocking=False), "the retry found the lock of an acquire that failed"
        retry.release()


# --- Topologies: a Sentinel-managed primary, a Redis Cluster of 3 primaries with 1 replica each -----


def retried(call: Callable[[], T]) -> T:
    """``call()``, tried again while the backend is unavailable: what Dramatiq's Retries would do."""

    def attempt() -> tuple[T] | None:
        try:
            return (call(),)
        except BackendUnavailable:
            return None

    return wait_until(attempt, timeout=30, what="the backend to answer after the failover")[0]


def survives_failover(
    backend: RedisBackend,
    fail_over: Callable[[], None],
    restore_a_replica: Callable[[], None],
    meanwhile: Callable[[], None] = lambda: None,
) -> None:
    """A limit-1 key's holder and parked message are still there after ``fail_over()``.

    The new primary has no replica (its only one was the old primary), so with replica waits
    every operation fails closed (no decision can be made durable) until a replica is back.
    """
    assert backend.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"msg:m2")).parked
    fail_over()

    def replicas_behind() -> bool:
        try:
            backend.acquire(Stake(KEY, "m3", limit=1, ttl_ms=60_000))
        except ReplicasBehind:
            return True
        except BackendUnavailable:
            return False
        raise AssertionError("an operation stood without a replica to acknowledge it")

    wait_until(replicas_behind, timeout=30, what="the new primary to answer (and fail closed)")
    meanwhile()
    restore_a_replica()
    refused = retried(lambda: backend.acquire(Stake(KEY, "m3", limit=1, ttl_ms=60_000)))
    assert not refused.acquired and refused.holders == ("m1",)  # no second holder
    [handoff] = retried(lambda: backend.release(KEY, "m1", limit=1)).handoffs
    assert (handoff.waiter_id, handoff.payload) == ("m2", b"msg:m2")


def test_with_replica_waits_a_limit_1_key_survives_a_sentinel_failover() -> None:
    with SentinelRedis() as topology:
        client = topology.sentinel(socket_timeout=2).master_for(topology.name, socket_timeout=2)
        try:
            backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=1_000)
            promoted: list[RedisServer] = []
            survives_failover(
                backend,
                lambda: promoted.append(topology.kill_primary()),
                lambda: topology.restore_old_primary(promoted[0]),
            )
        finally:
            client.close()


def test_with_replica_waits_a_limit_1_key_survives_a_cluster_failover() -> None:
    with RedisCluster3x1() as cluster:
        client = cluster.client(socket_timeout=2, socket_connect_timeout=1)
        try:
            backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=1_000)

            failing = cluster.owner_of(KEY)
            other = next(k for k in (f"other:{i}" for i in range(100)) if cluster.owner_of(k) is not failing)
            assert backend.acquire(Stake(other, "o1", limit=1, ttl_ms=60_000)).acquired

            def fail_over() -> None:
                cluster.fail_over(KEY)

            def renew_both() -> None:
                """A renewal batch with a lease on the failed-over node and one on a healthy node:
                it fails closed, but the healthy node's lease was renewed all the same."""
                before = dict(backend.inspect(other).holders)["o1"]
                with pytest.raises(ReplicasBehind):
                    backend.renew_many([(KEY, "m1", 60_000), (other, "o1", 120_000)])
                assert dict(backend.inspect(other).holders)["o1"] > before

            survives_failover(backend, fail_over, cluster.restore_failed, renew_both)
        finally:
            client.close()


def test_install_sets_replica_waits_on_a_redis_backend_and_warns_of_a_short_socket_timeout(
    private_redis: RedisServer,
) -> None:
    client = private_redis.client(socket_timeout=0.5)
    backend = RedisBackend(client)
    dramatiq_guard.install(StubBroker(), redis=backend, replica_waits=2, replica_wait_timeout_ms=700)
    assert backend.replicas == ReplicaWaits(2, 700)
    assert "replica_wait_timeout_ms=700 is not below" in (backend.slow_call_warning(60_000) or "")
    short = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=100)
    assert "replica_wait_timeout_ms" not in (short.slow_call_warning(60_000) or "")
    assert RedisBackend(client).replicas is None  # 0: no waits


def test_with_replica_waits_a_manual_cluster_failover_moves_calls_to_the_new_primary() -> None:
    """``CLUSTER FAILOVER``: the client's map still names the old primary, now a replica, which
    answers MOVED; the call did nothing there and is re-run once on the new primary."""
    with RedisCluster3x1() as cluster:
        client = cluster.client(socket_timeout=2, socket_connect_timeout=1)
        try:
            backend = RedisBackend(client, replica_waits=1, replica_wait_timeout_ms=1_000)
            assert backend.acquire(Stake(KEY, "m1", limit=1, ttl_ms=60_000)).acquired
            cluster.switch_over(KEY)
            refused = backend.acquire(Stake(KEY, "m2", limit=1, ttl_ms=60_000))  # no retry needed
            assert not refused.acquired and refused.holders == ("m1",)
            assert backend.renew_many([(KEY, "m1", 60_000)]) == [True]
            assert backend.release(KEY, "m1", limit=1).released
        finally:
            client.close()
