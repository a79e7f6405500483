"""Routes: every process of one application names its broker alike, and no other application does.

A parked message records the route of the process that parked it, and only a process of that
route puts it back on a broker (docs/failure-model.md, "Two applications on one guard Redis").
So a route must not change when an application's processes restart somewhere else, and must
differ between two applications; where the guard cannot tell them apart, ``install()`` refuses
and asks for ``route=``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import dramatiq
import pytest
import redis
import redis.sentinel
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker

import dramatiq_guard
from dramatiq_guard import admin
from dramatiq_guard.backends import MemoryBackend, RedisBackend, Stake, Waiter
from dramatiq_guard.cli import main
from dramatiq_guard.middleware.base import GuardMiddleware
from dramatiq_guard.resolve import route_of

#: A process of the application, started afresh: the broker's host name resolves to the address
#: given (the address its server has at this start), and the process prints its route.
A_PROCESS_STARTS = """
import socket
import sys

name, address, kind, url = sys.argv[1:]
resolve, resolve_ex, addresses = socket.gethostbyname, socket.gethostbyname_ex, socket.getaddrinfo
socket.gethostbyname = lambda host: address if host == name else resolve(host)
socket.gethostbyname_ex = lambda host: (host, [], [address]) if host == name else resolve_ex(host)
socket.getaddrinfo = lambda host, *a, **k: addresses(address if host == name else host, *a, **k)

if kind == "redis":
    from dramatiq.brokers.redis import RedisBroker as Broker
else:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker as Broker
from dramatiq_guard.resolve import route_of

print(route_of(Broker(url=url)))
"""


def route_at_start(kind: str, url: str, name: str, address: str) -> str:
    """The route of a new process of an application whose broker ``url`` names host ``name``."""
    done = subprocess.run(
        [sys.executable, "-c", A_PROCESS_STARTS, name, address, kind, url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("kind", "url"),
    [
        ("redis", "redis://billing-redis:6379/0"),
        ("rabbitmq", "amqp://guest:guest@billing-rabbit:5672/%2F"),
    ],
)
def test_an_application_restarted_on_a_new_address_keeps_its_route(kind: str, url: str) -> None:
    """Issue #31 (a): the broker's server got a new address (a recreated container, a failed-over
    endpoint) between two starts of the application's processes. The processes started after it
    still deliver what the earlier ones parked: the route is the broker as configured, not the
    address its host name resolved to."""
    name = url.split("@")[-1].split("//")[-1].split(":")[0]
    before = route_at_start(kind, url, name, "10.0.0.5")
    after = route_at_start(kind, url, name, "10.0.0.9")
    assert before == after
    assert name in after


def sentinel_broker(sentinels: list[tuple[str, int]], service: str, **kwargs: Any) -> RedisBroker:
    """A RedisBroker on the primary that ``sentinels`` name ``service`` (nothing is contacted yet)."""
    db = kwargs.pop("db", 0)
    sentinel = cast(Any, redis.sentinel).Sentinel(sentinels, socket_timeout=1)  # redis-py: untyped
    client = sentinel.master_for(service, db=db)
    return RedisBroker(client=client, **kwargs)


def test_applications_on_different_sentinels_have_different_routes() -> None:
    """Issue #31 (b): a RedisBroker made by Sentinel is routed by its Sentinels (in any order),
    its service, database and namespace; two applications on different Sentinels (each with the
    usual service name) no longer share a route, so neither delivers the other's messages."""
    billing = [("sentinel-a.billing", 26379), ("sentinel-b.billing", 26379)]
    shipping = [("sentinel-a.shipping", 26379), ("sentinel-b.shipping", 26379)]
    same = route_of(sentinel_broker(billing, "mymaster"))
    assert route_of(sentinel_broker(list(reversed(billing)), "mymaster")) == same
    others = [
        route_of(sentinel_broker(shipping, "mymaster")),
        route_of(sentinel_broker(billing, "billing")),
        route_of(sentinel_broker(billing, "mymaster", db=1)),
        route_of(sentinel_broker(billing, "mymaster", namespace="billing")),
    ]
    assert len({same, *others}) == 5


class QueueTableBroker(dramatiq.Broker):
    """A broker of a kind the guard does not know (as dramatiq-postgres's, or one on SQS)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(middleware=[])
        self.dsn = dsn

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> Any:
        raise NotImplementedError

    def declare_queue(self, queue_name: str) -> None:
        self.queues[queue_name] = None

    def enqueue(self, message: Any, *, delay: int | None = None) -> Any:
        raise NotImplementedError


#: A broker module's broker, of no route the guard can tell (``--broker test_routes:UNROUTED``).
UNROUTED = QueueTableBroker("postgresql:///unrouted")


def test_a_broker_the_guard_cannot_describe_must_be_given_a_route(redis_url: str, tmp_path: Path) -> None:
    """Issue #31 (c): the guard cannot tell two applications on brokers of a kind it does not know
    apart (their class is all it sees), so ``install()`` refuses and asks for ``route=``, nothing
    installed; with a route named, each application delivers only its own."""
    ledger = f"sqlite:///{tmp_path / 'l.db'}"
    billing, shipping = QueueTableBroker("postgresql:///billing"), QueueTableBroker("postgresql:///shipping")
    with pytest.raises(dramatiq_guard.ConfigurationError, match=r"route=") as refused:
        dramatiq_guard.install(billing, redis=redis_url, ledger=ledger)
    assert "QueueTableBroker" in str(refused.value)
    assert not any(isinstance(m, GuardMiddleware) for m in billing.middleware)
    with pytest.raises(dramatiq_guard.ConfigurationError, match=r"route="):
        route_of(shipping)

    routes = []
    for broker, route in ((billing, "billing"), (shipping, "shipping")):
        installed = dramatiq_guard.install(broker, redis=redis_url, ledger=ledger, route=route)
        guard = next(m for m in installed if isinstance(m, GuardMiddleware))
        routes.append(guard.backend(broker).route)
        assert route_of(broker) == route
    assert routes == ["billing", "shipping"]


def test_a_redis_broker_is_routed_by_its_server_as_written(redis_url: str) -> None:
    """One Redis written alike gives one route; another database, namespace or way of writing
    the server is another route (names are not resolved: ``localhost`` and ``127.0.0.1`` are
    two routes, so write the server alike in every process, or name the route)."""
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    urls = {
        "one": f"redis://127.0.0.1:{port}/0",
        "same": f"redis://127.0.0.1:{port}/0",
        "db": f"redis://127.0.0.1:{port}/1",
        "name": f"redis://localhost:{port}/0",
    }
    brokers = {what: RedisBroker(url=url) for what, url in urls.items()}
    brokers["namespace"] = RedisBroker(url=urls["one"], namespace="other")
    try:
        routes = {what: route_of(broker) for what, broker in brokers.items()}
    finally:
        for broker in brokers.values():
            broker.close()
    assert routes["one"] == routes["same"] == f"redis://127.0.0.1:{port}/0#dramatiq"
    assert len({routes[what] for what in ("one", "db", "name", "namespace")}) == 4


class DiscoveredPool(redis.ConnectionPool):
    """A connection pool that finds its server when it connects (as a service discovery's might)."""


def test_a_redis_broker_whose_pool_names_no_server_must_be_given_a_route() -> None:
    """Of a pool it does not know, naming no host, the guard can tell nothing: that is refused too
    (a plain pool with no host is redis-py's default, ``localhost``)."""
    unknown = RedisBroker(client=redis.Redis(connection_pool=DiscoveredPool()))
    with pytest.raises(dramatiq_guard.ConfigurationError, match=r"DiscoveredPool, names no server.*route="):
        route_of(unknown)
    default = RedisBroker(client=redis.Redis(connection_pool=redis.ConnectionPool()))
    assert route_of(default) == "redis://localhost:6379/0#dramatiq"


def test_the_route_named_at_install_is_the_brokers_everywhere(tmp_path: Path) -> None:
    """A route named with ``install(broker, route=...)`` is that broker's route for whatever
    else delivers on it in the process (the CLI's and dashboard's ``--broker``, a Lock given the
    broker), not one derived from the broker."""
    broker = StubBroker()
    dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'l.db'}", route="billing")
    assert route_of(broker) == "billing"
    elsewhere = MemoryBackend()
    admin.broker_requeue(broker, elsewhere)
    assert elsewhere.route == "billing"


def test_the_command_refuses_a_broker_of_no_route_before_anything_changes(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--broker`` on a broker the guard cannot describe (and that its module gave no route) is a
    usage error that asks for ``route=``; the limit is not changed, the parked message stays."""
    backend = RedisBackend.from_url(redis_url)
    backend.set_limit("slots:c1", 0)
    assert backend.acquire(Stake("slots:c1", "m1", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"{}")).parked
    argv = ["--redis", redis_url, "limit", "set", "slots:c1", "1", "--broker", "test_routes:UNROUTED"]
    status = main(argv, stdin=io.StringIO(), stdout=io.StringIO())
    assert status == 2
    assert "route=" in capsys.readouterr().err
    assert backend.get_limit("slots:c1") == 0
    assert [w for w, _, _ in backend.inspect("slots:c1").waiters] == ["m1"]


def test_the_environment_names_the_route_of_every_broker_given_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``DRAMATIQ_GUARD_ROUTE`` names the route where ``install()`` is not called (middlewares
    listed by dotted path) or names none; a route given to ``install()`` comes first."""
    monkeypatch.setenv("DRAMATIQ_GUARD_ROUTE", "billing")
    assert route_of(QueueTableBroker("postgresql:///billing")) == "billing"
    assert route_of(StubBroker()) == "billing"
    broker = StubBroker()
    dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'l.db'}", route="shipping")
    assert route_of(broker) == "shipping"
