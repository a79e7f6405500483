"""Finding the guard backend for a broker.

``redis`` (the argument of :func:`dramatiq_guard.install` and of every guard
middleware) may be:

* a :class:`~dramatiq_guard.backends.GuardBackend`: used as is;
* a redis-py client (``Redis``, ``RedisCluster``, or one made by ``Sentinel``);
* a Redis URL string;
* None: the broker decides. A ``RedisBroker`` lends its own client; a
  ``StubBroker`` gets an in-memory backend; any other broker (RabbitMQ...)
  uses the ``DRAMATIQ_GUARD_REDIS_URL`` environment variable, and without it
  is a :class:`~dramatiq_guard.errors.ConfigurationError`.

Every middleware attached to one broker with ``redis=None`` shares one
backend (so the in-memory backend of a StubBroker is one store).

A backend resolved for a broker records the broker's *route*
(:func:`route_of`): parked messages it parks are delivered back only by
processes of the same route (see the backend contract, *routes*), so two
applications sharing one guard Redis never deliver each other's messages.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import weakref
from typing import Any

from dramatiq import Broker

from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.errors import ConfigurationError

REDIS_URL_ENV = "DRAMATIQ_GUARD_REDIS_URL"

_shared: weakref.WeakKeyDictionary[Broker, GuardBackend] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def backend_from(redis: Any) -> GuardBackend:
    """A backend from an explicit ``redis`` argument (a backend, a client or a URL).

    Raises:
      ConfigurationError: If ``redis`` is none of those.
    """
    if isinstance(redis, GuardBackend):
        return redis
    from redis import Redis
    from redis.cluster import RedisCluster

    from dramatiq_guard.backends.redis import RedisBackend

    if isinstance(redis, str):
        return RedisBackend.from_url(redis)
    if isinstance(redis, (Redis, RedisCluster)):
        return RedisBackend(redis)
    raise ConfigurationError(
        f"redis={redis!r} is not usable: pass a redis-py Redis or RedisCluster client, "
        f"a redis:// URL, a dramatiq_guard GuardBackend, or None to let the broker decide"
    )


def resolve_backend(broker: Broker, redis: Any = None) -> GuardBackend:
    """The backend for ``broker`` (see the module docstring).

    Raises:
      ConfigurationError: If no backend can be found for the broker.
    """
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


def route_of(broker: Broker) -> str:
    """Which broker (and queues) a process delivers parked messages to.

    The same string in every process of one application configured alike
    (a host name is resolved to its address, so ``localhost`` and
    ``127.0.0.1`` agree; ``install(broker, route=...)`` names it outright):
    the Redis server, database and Dramatiq namespace of a RedisBroker; the
    hosts and virtual host of a RabbitmqBroker; this very object for a
    StubBroker (it lives in one process); else the broker's class.
    """
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.brokers.stub import StubBroker

    if isinstance(broker, RedisBroker):
        kwargs = broker.client.connection_pool.connection_kwargs
        host = _address(str(kwargs.get("host", "localhost")))
        where = kwargs.get("path") or f"{host}:{kwargs.get('port', 6379)}"
        return f"redis://{where}/{kwargs.get('db', 0)}#{broker.namespace}"
    if isinstance(broker, StubBroker):
        return f"stub:{id(broker):x}"
    parameters = getattr(broker, "parameters", None)
    if parameters is not None:  # a RabbitmqBroker: pika connection parameters, one or a list
        hosts = parameters if isinstance(parameters, list) else [parameters]
        names = sorted(f"{_address(p.host)}:{p.port}" for p in hosts)
        return f"amqp://{','.join(names)}/{hosts[0].virtual_host}"
    return f"{type(broker).__module__}.{type(broker).__qualname__}"


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


@functools.lru_cache(maxsize=64)
def _address(host: str) -> str:
    """``host``'s IPv4 address if it resolves (so two names of one server agree), else ``host``."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
