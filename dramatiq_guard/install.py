"""``install()``: every guard middleware on a broker, in the right place, in one call."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.middleware import Retries

from dramatiq_guard.backends.base import GuardBackend, check_max_payload_bytes
from dramatiq_guard.errors import ConfigurationError
from dramatiq_guard.middleware.base import GuardMiddleware
from dramatiq_guard.middleware.dedup import Deduplication
from dramatiq_guard.middleware.idempotency import Idempotency
from dramatiq_guard.middleware.slots import Concurrency, Debounce, Mutex, Throttle
from dramatiq_guard.resolve import name_route, resolve_backend

logger = logging.getLogger(__name__)

#: The guard middlewares, in broker order: slots first (a message they park has not started for
#: deduplication), then deduplication, then the ledger around the actor's work. Enqueue-time order
#: is each middleware's ``gate_priority``.
MIDDLEWARE: tuple[type[GuardMiddleware[Any]], ...]
MIDDLEWARE = (Mutex, Concurrency, Throttle, Debounce, Deduplication, Idempotency)


def _keywords(cls: type[Middleware]) -> set[str]:
    """The keyword arguments ``cls`` takes (a guard middleware's are keyword-only), following
    ``**kwargs`` up to the base classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


@dataclasses.dataclass(frozen=True)
class InstallSettings:
    """The settings :func:`install` takes for itself; every other goes to the middlewares that take it.

    Parameters:
      allow_evicting_redis(bool): Run on a Redis whose ``maxmemory-policy``
        may evict keys, with a warning, instead of refusing it.
      max_payload_bytes(int|None): The largest encoded message that may park
        (None: the backend's, 256 KiB); a larger one is refused at ``send()``
        with :class:`~dramatiq_guard.errors.PayloadTooLarge`.
      route(str|None): The name under which this process's parked messages
        are recorded and delivered: the same in every process of one
        application and in no other (docs/failure-model.md). None:
        ``DRAMATIQ_GUARD_ROUTE``, else the broker as configured; required
        for a broker the guard cannot describe.
      replica_waits(int): How many replicas of the guard's Redis must
        acknowledge every decision (Redis ``WAIT``; docs/redis.md). 0: none.
      replica_wait_timeout_ms(int): How long to wait for them; fewer in time
        fail the operation closed (:class:`~dramatiq_guard.errors.ReplicasBehind`).
    """

    allow_evicting_redis: bool = False
    max_payload_bytes: int | None = None
    route: str | None = None
    replica_waits: int = 0
    replica_wait_timeout_ms: int = 1_000


#: The names of :class:`InstallSettings`.
INSTALL_SETTINGS = frozenset(field.name for field in dataclasses.fields(InstallSettings))


def install(broker: Broker, *, redis: Any = None, ledger: Any = None, **settings: Any) -> list[Middleware]:
    """Add every guard middleware to ``broker`` and return them, in broker order.

    Call it before importing the modules that declare guarded actors. The
    middlewares go just before Retries (else at the end); a second call adds
    nothing. It checks the guard's Redis (eviction, persistence) and warns if
    a call could block longer than the shortest lease.

    Parameters:
      broker(Broker): The broker.
      redis: Where the guard keeps its state: a redis-py client (Redis,
        RedisCluster, or one made by Sentinel), a URL, a GuardBackend, or
        None: the RedisBroker's own client; an in-memory backend for a
        StubBroker; for any other broker the ``DRAMATIQ_GUARD_REDIS_URL``
        environment variable, else a ConfigurationError.
      ledger: The idempotency ledger's database: an SQLAlchemy Engine, a
        URL, or None: ``DRAMATIQ_GUARD_LEDGER_URL``, else a SQLite file.
      **settings: Those of :class:`InstallSettings`; any other goes to each
        middleware that takes a keyword of that name (e.g. ``lease_ttl``).

    Raises:
      ConfigurationError: If no backend can be found, a setting is taken by
        no middleware, no route is given where one is needed, or
        ``replica_waits`` is not 0 for a backend with no replicas. Nothing is
        installed.
      EvictingRedis: If the guard's Redis may evict keys and
        ``allow_evicting_redis`` is False.
      ValueError: If ``max_payload_bytes``, ``replica_waits`` or
        ``replica_wait_timeout_ms`` is out of range.
    """
    existing = [m for m in broker.middleware if type(m) in MIDDLEWARE]
    if existing:
        return existing
    accepted = {cls: _keywords(cls) for cls in MIDDLEWARE}
    own, passed = _split_settings(settings, accepted)
    backend = _backend(broker, redis, own)
    installed = _add(broker, accepted, passed, {"redis": backend, "ledger": ledger})
    _warn_of_slow_calls(backend, installed)
    return installed


def _split_settings(
    settings: dict[str, Any], accepted: dict[type[GuardMiddleware[Any]], set[str]]
) -> tuple[InstallSettings, dict[str, Any]]:
    """``install()``'s own settings, and those for the middlewares; a ConfigurationError lists the
    settings that exist if one is neither."""
    known = (set().union(*accepted.values()) - {"redis", "ledger"}) | INSTALL_SETTINGS
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigurationError(
            f"dramatiq_guard.install() got unknown setting(s) {', '.join(unknown)}; "
            f"the settings are: {', '.join(sorted(known)) or 'none'}"
        )
    own = InstallSettings(**{name: value for name, value in settings.items() if name in INSTALL_SETTINGS})
    return own, {name: value for name, value in settings.items() if name not in INSTALL_SETTINGS}


def _add(
    broker: Broker,
    accepted: dict[type[GuardMiddleware[Any]], set[str]],
    settings: dict[str, Any],
    stores: dict[str, Any],
) -> list[Middleware]:
    """Each middleware class of ``accepted``, made with what it takes, added just before Retries."""
    retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
    added: list[Middleware] = []
    for cls, names in accepted.items():
        kwargs = {name: value for name, value in settings.items() if name in names}
        kwargs.update({name: store for name, store in stores.items() if name in names})
        middleware = cls(**kwargs)
        broker.add_middleware(middleware, before=Retries if retries is not None else None)
        middleware.attach(broker)
        added.append(middleware)
    return added


def _warn_of_slow_calls(backend: GuardBackend, installed: list[Middleware]) -> None:
    """Log :meth:`~dramatiq_guard.backends.GuardBackend.slow_call_warning` for the shortest lease, if any."""
    leases = [ttl for m in installed if isinstance(ttl := getattr(m, "lease_ttl_ms", None), int)]
    warning = backend.slow_call_warning(min(leases, default=30_000))
    if warning is not None:
        logger.warning(warning)


def _backend(broker: Broker, redis: Any, settings: InstallSettings) -> GuardBackend:
    """The backend of ``broker``, with the install's route, payload bound and replica waits; checked
    (it raises what :func:`install` says)."""
    route = settings.route
    if route is not None:
        name_route(broker, route)
    backend = resolve_backend(broker, redis)
    if route is not None:
        backend.route = route
    logger.info("dramatiq-guard: this process delivers the parked messages of route %r.", backend.route)
    if settings.max_payload_bytes is not None:
        backend.max_payload_bytes = check_max_payload_bytes(settings.max_payload_bytes)
    backend.wait_for_replicas(settings.replica_waits, settings.replica_wait_timeout_ms)
    backend.check_health(allow_evicting=settings.allow_evicting_redis)
    return backend
