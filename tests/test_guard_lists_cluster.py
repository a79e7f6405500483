"""Composed guards on a Redis Cluster whose keys live on different nodes (issue #33).

One message's guard keys (a ``concurrency`` list and a ``mutex``) hash to different primaries of
a 3-node cluster (:class:`~harness.topology.RedisCluster3x1`), so one round trip of
:meth:`GuardBackend.acquire_many` is a pipeline per node. Checked: each claim is answered as its
own acquire would be, a give-back returns the reservation on its node, and a StubBroker worker
(the broker itself cannot run on a Cluster) never exceeds a limit, runs every message once and
leaves nothing held or parked on any node.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

import dramatiq
import pytest
from harness import RedisServer
from harness.topology import RedisCluster3x1
from test_guard_lists import Running

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.testing import join

pytestmark = pytest.mark.redis

NAMESPACE = "dramatiq-guard"
#: The per-key fields that hold a holder, a waiter or a reservation (the token and a limit may stay).
LIVE_FIELDS = {"holders", "waiters", "payloads", "reserved", "deadlines", "standbys", "ready", "info", "meta"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster3x1]:
    with RedisCluster3x1() as started:
        yield started


@pytest.fixture
def backend(cluster: RedisCluster3x1, request: pytest.FixtureRequest) -> Iterator[RedisBackend]:
    client = cluster.client(socket_timeout=5, socket_connect_timeout=5)
    client.flushall()  # every primary: each test starts from an empty cluster
    waits = getattr(request, "param", 0)
    try:
        yield RedisBackend(client, namespace=NAMESPACE, replica_waits=waits, replica_wait_timeout_ms=1_000)
    finally:
        client.close()


def primaries(cluster: RedisCluster3x1) -> list[RedisServer]:
    """The three primaries (the first three nodes: no failover happens here)."""
    return cluster.nodes[:3]


def spread(cluster: RedisCluster3x1, prefix: str, names: Iterable[str]) -> list[str]:
    """The first of ``names`` whose guard key ``prefix + name`` lives on each primary, in order."""
    found: dict[int, str] = {}
    for name in names:
        found.setdefault(cluster.owner_of(f"{{{prefix}{name}}}").port, name)  # its hash tag (redis_store)
        if len(found) == 3:
            break
    return list(found.values())


def live_on(node: RedisServer) -> dict[str, set[str]]:
    """The guard keys that hold a holder, a waiter or a reservation on ``node``, with those fields."""
    held: dict[str, set[str]] = collections.defaultdict(set)
    with node.client(decode_responses=True) as client:
        for name in client.scan_iter(match=f"{NAMESPACE}:{{*}}:*"):
            key, field = name[len(NAMESPACE) + 2 :].rsplit("}:", 1)
            if field in LIVE_FIELDS:
                held[key].add(field)
    return dict(held)


def nothing_live(cluster: RedisCluster3x1) -> bool:
    """Whether no primary keeps a holder, a waiter or a reservation of any guard key."""
    return all(live_on(node) == {} for node in primaries(cluster))


def stake(key: str, holder: str, limit: int = 1) -> Stake:
    return Stake(key, holder, limit, 60_000, info="contract")


def answer(result: Any) -> tuple[Any, ...]:
    """What an acquire answered, without its token (a separate acquire issues another)."""
    return result.outcome, result.holders, result.limit, result.handoffs


@pytest.mark.parametrize("backend", [0, 1], ids=["pipeline", "replica_waits"], indirect=True)
def test_acquire_many_answers_each_node_as_its_own_acquire_and_gives_back_there(
    cluster: RedisCluster3x1, backend: RedisBackend
) -> None:
    """Three claims on three primaries, the middle one refused: granted on two nodes, parked on the
    refusing key after, each reservation given back on its own node."""
    names = spread(cluster, "concurrency:", (f"k{i}" for i in range(100)))
    assert len(names) == 3, "the keys must live on three nodes"
    twins = spread(cluster, "concurrency:", (f"twin{i}" for i in range(100)))
    keys, twin_keys = [f"concurrency:{n}" for n in names], [f"concurrency:{n}" for n in twins]
    assert nothing_live(cluster)

    for ks in (keys, twin_keys):  # another message holds the middle key's one slot
        assert backend.acquire(stake(ks[1], "other")).acquired
    limits = [2, 1, 1]
    results = backend.acquire_many([stake(k, "m1", limit) for k, limit in zip(keys, limits, strict=True)])
    alone = [backend.acquire(stake(k, "m1", limit)) for k, limit in zip(twin_keys, limits, strict=True)]
    assert [answer(r) for r in results] == [answer(r) for r in alone]
    assert [r.acquired for r in results] == [True, False, True]
    assert results[1].holders == ("other",) and not results[1].parked  # a refusal queues nothing
    for key in keys:  # each key's state is on its own node, and only there
        owners = [node for node in primaries(cluster) if key in live_on(node)]
        assert owners == [cluster.owner_of(f"{{{key}}}")]

    assert backend.acquire(stake(keys[1], "m1"), wait=Waiter(payload=b"m1")).parked
    given = [backend.give_back(k, "m1", limit=limit).released for k, limit in zip(keys, limits, strict=True)]
    assert given == [True, False, True]  # the middle key's: parked there, it holds nothing to give
    assert [[h for h, _ in backend.inspect(k).holders] for k in keys] == [[], ["other"], []]
    assert [live_on(cluster.owner_of(f"{{{k}}}")).get(k, set()) for k in (keys[0], keys[2])] == [set(), set()]

    [handoff] = backend.release(keys[1], "other", limit=1).handoffs  # the parked claim gets the slot
    assert (handoff.waiter_id, handoff.payload) == ("m1", b"m1")
    assert backend.give_back(keys[1], "m1", limit=1).released  # a reservation not taken by a runner
    for key in twin_keys:
        backend.release(key, "m1", limit=None)
        backend.release(key, "other", limit=None)
    assert nothing_live(cluster)


def test_give_back_across_nodes_never_takes_a_running_lease(
    cluster: RedisCluster3x1, backend: RedisBackend
) -> None:
    """A copy parked on one node gives back only reservations: another copy's lease (with a runner)
    on another node stays."""
    first, second = (f"mutex:{n}" for n in spread(cluster, "mutex:", (f"r{i}" for i in range(100)))[:2])
    running = Stake(first, "m1", 1, 60_000, runner="host:1")
    assert [r.acquired for r in backend.acquire_many([running, stake(second, "m1")])] == [True, True]
    assert not backend.give_back(first, "m1", limit=1).released
    assert backend.give_back(second, "m1", limit=1).released
    assert [h for h, _ in backend.inspect(first).holders] == ["m1"]
    assert backend.release(first, "m1", limit=1).released
    assert nothing_live(cluster)


def test_a_worker_keeps_every_limit_when_a_message_s_keys_live_on_different_nodes(
    cluster: RedisCluster3x1, backend: RedisBackend, stub_broker: Any
) -> None:
    """40 messages over 3 tenants: 3 in all, 2 per tenant (a ``concurrency`` list) and one per
    ``mutex`` key; the global key, each tenant's and the mutex keys on different primaries."""
    everyone = cluster.owner_of("{concurrency:all}")
    tenants = spread(cluster, "concurrency:", (f"t{i}" for i in range(100)))
    locks = spread(cluster, "mutex:", (f"m{i}" for i in range(100)))
    assert len(tenants) == len(locks) == 3  # one on each primary: two tenants' keys are not on "all"'s
    assert sum(cluster.owner_of(f"{{concurrency:{t}}}") is not everyone for t in tenants) == 2
    dramatiq_guard.install(stub_broker, redis=backend, sweep_interval=100)
    runs = Running()

    @dramatiq.actor(
        concurrency=[
            {"limit": 3, "key": lambda tenant, n: "all"},
            {"limit": 2, "key": lambda tenant, n: tenant},
        ],
        mutex={"key": lambda tenant, n: locks[n // 3 % 3], "on_busy": "park"},
        max_retries=0,
    )
    def call(tenant: str, n: int) -> None:
        runs.run(["all", tenant, locks[n // 3 % 3]], (tenant, n))

    sent = [(tenants[n % 3], n) for n in range(40)]
    for tenant, n in sent:
        call.send(tenant, n)
    worker = dramatiq.Worker(stub_broker, worker_threads=8, worker_timeout=50)
    worker.start()
    try:
        join(stub_broker, call.queue_name, timeout=30_000, fail_fast=True)
    finally:
        worker.stop()
    assert collections.Counter(runs.ran) == collections.Counter(sent)  # every message ran, once
    assert runs.most["all"] <= 3
    assert all(runs.most[t] <= 2 for t in tenants) and all(runs.most[m] == 1 for m in locks)
    assert nothing_live(cluster)  # nothing held or parked anywhere
