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
"""

from __future__ import annotations

import os
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
        return backend_from(redis)
    with _lock:
        backend = _shared.get(broker)
        if backend is None:
            backend = _default_backend(broker)
            _shared[broker] = backend
        return backend


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
