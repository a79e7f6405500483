"""Finding the guard backend for a broker (``redis=``, as :func:`dramatiq_guard.install` says; one shared
by the middlewares of a broker given none), and the broker's route (docs/failure-model.md)."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from dramatiq import Broker

from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.errors import ConfigurationError

if TYPE_CHECKING:
    from dramatiq_guard.backends.redis import RedisBackend

REDIS_URL_ENV = "DRAMATIQ_GUARD_REDIS_URL"
#: The Redis of the command and the dashboard when neither names one.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
ROUTE_ENV = "DRAMATIQ_GUARD_ROUTE"

_shared: weakref.WeakKeyDictionary[Broker, GuardBackend] = weakref.WeakKeyDictionary()
_named: weakref.WeakKeyDictionary[Broker, str] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def backend_from(redis: Any) -> GuardBackend:
    """A backend from an explicit ``redis``: a backend, else as :func:`open_backend`."""
    return redis if isinstance(redis, GuardBackend) else open_backend(redis)


def open_backend(redis: Any, namespace: str = "dramatiq-guard") -> RedisBackend:
    """The Redis backend on ``redis``, a redis-py client or a URL (None: ``DRAMATIQ_GUARD_REDIS_URL``,
    else ``redis://localhost:6379/0``), in ``namespace``; else a :class:`ConfigurationError`."""
    from redis import Redis
    from redis.cluster import RedisCluster

    from dramatiq_guard.backends.redis import RedisBackend

    if redis is None or isinstance(redis, str):
        url = redis or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
        return RedisBackend.from_url(url, namespace=namespace)
    if isinstance(redis, (Redis, RedisCluster)):
        return RedisBackend(redis, namespace=namespace)
    raise ConfigurationError(
        f"redis={redis!r} is not usable: pass a redis-py Redis or RedisCluster client, "
        f"a redis:// URL, a dramatiq_guard GuardBackend, or None to let the broker decide"
    )


def resolve_backend(broker: Broker, redis: Any = None) -> GuardBackend:
    """The backend for ``broker``, with the broker's route (ConfigurationError if none can be found)."""
    if redis is not None:
        backend = backend_from(redis)
    else:
        with _lock:
            shared = _shared.get(broker)
            if shared is None:
                shared = _shared[broker] = _default_backend(broker)
        backend = shared
    if not backend.route:
        backend.route = route_of(broker)
    return backend


def name_route(broker: Broker, route: str) -> None:
    """Make ``route`` (a non-empty str) the route of ``broker`` here (``install(broker, route=...)``)."""
    if not isinstance(route, str) or not route:
        raise ConfigurationError(f"dramatiq_guard.install(): route must be a non-empty str, not {route!r}")
    with _lock:
        _named[broker] = route


def route_of(broker: Broker) -> str:
    """Which broker (and queues) a process delivers parked messages to (docs/failure-model.md).

    The route named by ``install(broker, route=...)``, else ``DRAMATIQ_GUARD_ROUTE``, else the broker
    as configured, as written (never a resolved address; a StubBroker: that very object), else a
    :class:`ConfigurationError` (another kind of broker, or a RedisBroker whose pool names no server).
    """
    named = _named.get(broker) or os.environ.get(ROUTE_ENV)
    if named:
        return named
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.brokers.stub import StubBroker

    if isinstance(broker, StubBroker):
        return f"stub:{id(broker):x}"
    if isinstance(broker, RedisBroker):
        pool = broker.client.connection_pool
        server = _redis_server(pool)
        if server is None:
            raise _unnamed(
                broker, f"its client's connection pool, a {type(pool).__qualname__}, names no server"
            )
        return f"{server}/{pool.connection_kwargs.get('db', 0)}#{broker.namespace}"
    rabbitmq = sys.modules.get("dramatiq.brokers.rabbitmq")  # imported if the broker is one
    if rabbitmq is not None and isinstance(broker, rabbitmq.RabbitmqBroker):
        parameters = broker.parameters  # pika connection parameters, one or a list
        hosts = parameters if isinstance(parameters, list) else [parameters]
        names = sorted(f"{p.host.lower()}:{p.port}" for p in hosts)
        return f"amqp://{','.join(names)}/{hosts[0].virtual_host}"
    kind = f"{type(broker).__module__}.{type(broker).__qualname__}"
    raise _unnamed(
        broker,
        "it knows only the brokers of Redis, RabbitMQ and the StubBroker "
        f"(a single application upgrading may name it route={kind!r}, the route earlier versions "
        f"gave it, so that the messages parked before are still delivered)",
    )


def _redis_server(pool: Any) -> str | None:
    """The Redis server (or Sentinels and service) of a connection pool as configured, if it names one."""
    from redis import BlockingConnectionPool, ConnectionPool
    from redis.sentinel import SentinelConnectionPool

    if isinstance(pool, SentinelConnectionPool):
        sentinels = [_redis_server(s.connection_pool) for s in pool.sentinel_manager.sentinels]
        if not sentinels or None in sentinels:
            return None
        names = sorted(s.removeprefix("redis://") for s in sentinels if s is not None)
        return f"redis+sentinel://{','.join(names)}/{pool.service_name}"
    kwargs = pool.connection_kwargs
    if kwargs.get("path"):
        return f"redis://{kwargs['path']}"
    # A host a maintenance notification moved the pool to is not its configured one.
    host = kwargs.get("orig_host_address") or kwargs.get("host")
    if host is None and type(pool) in (ConnectionPool, BlockingConnectionPool):
        host = "localhost"  # redis-py's default
    if not host:
        return None
    return f"redis://{str(host).lower()}:{kwargs.get('port', 6379)}"


def _unnamed(broker: Broker, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"dramatiq-guard cannot tell which application a {type(broker).__name__} belongs to ({why}): "
        f"two applications on such brokers sharing a guard Redis would deliver each other's parked "
        f"messages. Name this application's route, the same in each of its processes and in no other "
        f'application: dramatiq_guard.install(broker, route="billing"), or the {ROUTE_ENV} '
        f"environment variable"
    )


def _default_backend(broker: Broker) -> GuardBackend:
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.brokers.stub import StubBroker

    if isinstance(broker, RedisBroker):
        from dramatiq_guard.backends.redis import RedisBackend

        return RedisBackend(broker.client)
    if isinstance(broker, StubBroker):
        from dramatiq_guard.backends.memory import MemoryBackend

        return MemoryBackend()
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        return backend_from(url)
    raise ConfigurationError(
        f"dramatiq-guard needs Redis for its state with a {type(broker).__name__}: pass "
        f"redis=<a redis-py client or a redis:// URL> to dramatiq_guard.install() (or to the "
        f"middleware), or set the {REDIS_URL_ENV} environment variable"
    )
