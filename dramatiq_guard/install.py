"""``install()``: every guard middleware on a broker, in the right place, in one call."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.middleware import Retries

from dramatiq_guard.backends import redis_health
from dramatiq_guard.backends.base import GuardBackend, check_max_payload_bytes
from dramatiq_guard.errors import ConfigurationError
from dramatiq_guard.gate import gate_for
from dramatiq_guard.resolve import name_route, resolve_backend

logger = logging.getLogger(__name__)

#: The guard middlewares, in broker order. At execution time the slots
#: middlewares go first (a message they park must not count as started for
#: deduplication), then deduplication, then the ledger, which wraps the
#: actor's own work. Enqueue-time order is set separately by each
#: middleware's ``gate_priority`` (deduplication before parking).
MIDDLEWARE: tuple[str, ...] = (
    "dramatiq_guard.middleware.slots:Mutex",
    "dramatiq_guard.middleware.slots:Concurrency",
    "dramatiq_guard.middleware.dedup:Deduplication",
    "dramatiq_guard.middleware.idempotency:Idempotency",
)


def _load(path: str) -> type[Middleware]:
    module, _, name = path.partition(":")
    cls: type[Middleware] = getattr(importlib.import_module(module), name)
    return cls


def _keywords(cls: type[Middleware]) -> set[str]:
    """The keyword arguments ``cls`` takes, following ``**kwargs`` up to the base classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {
            p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
        }
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def install(
    broker: Broker,
    *,
    redis: Any = None,
    ledger: Any = None,
    allow_evicting_redis: bool = False,
    max_payload_bytes: int | None = None,
    route: str | None = None,
    replica_waits: int = 0,
    replica_wait_timeout_ms: int = 1_000,
    **settings: Any,
) -> list[Middleware]:
    """Add every guard middleware to ``broker`` and return them, in broker order.

    Call it before importing the modules that declare guarded actors:
    Dramatiq rejects actor options no middleware has declared.

    The middlewares go just before Dramatiq's Retries middleware (so they see
    its decision when a message fails), or at the end if the broker has none.
    Calling it again on the same broker adds nothing and returns the guard
    middlewares already there.

    Parameters:
      broker(Broker): The broker.
      redis: Where the guard keeps its state: a redis-py client (Redis,
        RedisCluster, or one made by Sentinel), a URL, a GuardBackend, or
        None: the RedisBroker's own client; an in-memory backend for a
        StubBroker; for any other broker the ``DRAMATIQ_GUARD_REDIS_URL``
        environment variable, else a ConfigurationError.
      ledger: The idempotency ledger's database: an SQLAlchemy Engine, a
        URL, or None: ``DRAMATIQ_GUARD_LEDGER_URL``, else a SQLite file.
      allow_evicting_redis(bool): Run on a Redis whose ``maxmemory-policy``
        may evict keys (anything but ``noeviction``), with a warning, instead
        of refusing it. An evicted guard key is a message lost silently; see
        :mod:`dramatiq_guard.backends.redis_health`.
      max_payload_bytes(int|None): The largest encoded message that may park
        (None: the backend's, 256 KiB by default). A larger message of a
        parking actor is refused at ``send()`` with
        :class:`~dramatiq_guard.errors.PayloadTooLarge`, nothing stored.
      route(str|None): The name under which this process's parked messages
        are recorded and which parked messages it delivers; it becomes the
        broker's route for everything in the process that delivers on it.
        None: the ``DRAMATIQ_GUARD_ROUTE`` environment variable, else the
        broker as configured (:func:`dramatiq_guard.resolve.route_of`: host
        names as written, never resolved). Every process of one application
        must have the same route, and no other application's (see
        docs/failure-model.md, "Two applications on one guard Redis"). It
        is required where the guard cannot describe the broker: a broker
        other than Redis, RabbitMQ or Stub, or a RedisBroker whose
        connection pool names no server.
      replica_waits(int): How many replicas of the guard's Redis must
        acknowledge every decision before it stands (Redis ``WAIT`` after
        each script; see :class:`~dramatiq_guard.backends.RedisBackend`). 0
        (the default): none; a failover may then lose the last decisions
        (docs/scaling.md).
      replica_wait_timeout_ms(int): How long to wait for them; if fewer
        acknowledge in time, the operation fails closed
        (:class:`~dramatiq_guard.errors.ReplicasBehind`, a
        ``BackendUnavailable``: the message is retried).
      **settings: Passed to each middleware that takes a keyword of that
        name.

    The guard's Redis is checked here (its ``maxmemory-policy`` and
    persistence, best effort: a Redis that forbids ``CONFIG`` gets a logged
    note). Without persistence, a warning says what a restart would lose.
    A WARNING is logged if one call to the backend could block longer than
    the shortest lease when Redis stops answering (a client without
    ``socket_timeout``, such as a RedisBroker's made without one; see
    :meth:`~dramatiq_guard.backends.GuardBackend.slow_call_warning`).

    Raises:
      ConfigurationError: If no backend can be found, a setting is taken by
        no middleware (the error lists the settings that exist), or no route
        is given where the guard cannot describe the broker (two applications
        on such brokers would deliver each other's parked messages; the error
        asks for ``route=``). Nothing is installed.
      EvictingRedis: If the guard's Redis may evict keys and
        ``allow_evicting_redis`` is False (the error says what to set).
      ValueError: If ``max_payload_bytes`` is not a positive int, or
        ``replica_waits`` or ``replica_wait_timeout_ms`` is out of range.
    """
    classes = [_load(path) for path in MIDDLEWARE]
    existing = [m for m in broker.middleware if type(m) in classes]
    if existing:
        return existing

    accepted = {cls: _keywords(cls) for cls in classes}
    known = (set().union(*accepted.values()) - {"redis", "ledger"}) | {
        "allow_evicting_redis",
        "max_payload_bytes",
        "route",
        "replica_waits",
        "replica_wait_timeout_ms",
    }
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigurationError(
            f"dramatiq_guard.install() got unknown setting(s) {', '.join(unknown)}; "
            f"the settings are: {', '.join(sorted(known)) or 'none'}"
        )

    backend = _backend(broker, redis, route, max_payload_bytes)
    _wait_for_replicas(backend, replica_waits, replica_wait_timeout_ms)
    redis_health.check(backend, allow_evicting=allow_evicting_redis)
    retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
    installed: list[Middleware] = []
    for cls in classes:
        kwargs = {name: value for name, value in settings.items() if name in accepted[cls]}
        if "redis" in accepted[cls]:
            kwargs["redis"] = backend
        if "ledger" in accepted[cls]:
            kwargs["ledger"] = ledger
        middleware = cls(**kwargs)
        broker.add_middleware(middleware, before=Retries if retries is not None else None)
        attach = getattr(middleware, "attach", None)
        if attach is not None:
            attach(broker)
        installed.append(middleware)
    gate_for(broker)
    leases = [ttl for m in installed if isinstance(ttl := getattr(m, "lease_ttl_ms", None), int)]
    warning = backend.slow_call_warning(min(leases, default=30_000))
    if warning is not None:
        logger.warning(warning)
    return installed


def _backend(broker: Broker, redis: Any, route: str | None, max_payload_bytes: int | None) -> GuardBackend:
    """The backend of ``broker``, with the install's route and payload bound."""
    if route is not None:
        name_route(broker, route)
    backend = resolve_backend(broker, redis)
    if route is not None:
        backend.route = route
    logger.info("dramatiq-guard: this process delivers the parked messages of route %r.", backend.route)
    if max_payload_bytes is not None:
        backend.max_payload_bytes = check_max_payload_bytes(max_payload_bytes)
    return backend


def _wait_for_replicas(backend: GuardBackend, count: int, timeout_ms: int) -> None:
    """Make ``backend`` wait for ``count`` replicas after every decision (a Redis backend only)."""
    from dramatiq_guard.backends.redis import RedisBackend, replica_waits_of

    replicas = replica_waits_of(count, timeout_ms)
    if isinstance(backend, RedisBackend) and backend.checks_server:
        if replicas is not None:
            backend.replicas = replicas
    elif replicas is not None:
        raise ConfigurationError(
            f"dramatiq_guard.install(): replica_waits={count} needs the guard's state on Redis, "
            f"not on a {type(backend).__name__}"
        )
