"""What the guard needs from its Redis, checked at install: no eviction, persistence, its layout.

What is checked and why is in ``docs/failure-model.md`` ("What the guard checks"); what is lost
while workers run is detected by :mod:`dramatiq_guard.backends.redis_watch`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from typing import Any, Protocol, cast

import redis
import redis.cluster

from dramatiq_guard import events
from dramatiq_guard.backends.redis_client import RedisClient, text
from dramatiq_guard.backends.redis_scripts import ScriptLibrary
from dramatiq_guard.errors import BackendRefused, EvictingRedis, LayoutTooNew

logger = logging.getLogger(__name__)

#: The environment variable that lets the guard run on an evicting Redis (``1``, ``true``, ``yes``).
ALLOW_EVICTING_ENV = "DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS"

#: What a restart of a Redis without persistence loses (for log lines).
RESTART_LOSES = (
    "every parked message (the lockwait area: they are never run), every dedup lock (a duplicate "
    "gets in) and every holder (a limit can be exceeded while the holders from before still run)"
)

#: The layout of the guard's state in Redis that this version reads and writes, recorded once per
#: namespace in ``<namespace>:layout``; it rises only with a version whose state an older one would
#: misread. A process never starts on a namespace recorded in a newer layout.
LAYOUT = 1

UNREACHABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RedisBackendLike(Protocol):
    """What this module and :mod:`~dramatiq_guard.backends.redis_watch` use of a RedisBackend."""

    client: RedisClient
    namespace: str
    scripts: ScriptLibrary


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """What a Redis server was found to do with the guard's keys.

    Parameters:
      where(str): The server (``host:port``; several for a cluster).
      maxmemory_policy(str|None): Its ``maxmemory-policy`` (on a cluster, an evicting one if
        any primary has one), or None if it could not be read.
      appendonly(bool|None): Whether AOF is on (on a cluster: on every primary).
      save(str|None): The RDB snapshot schedule (``""``: none).
      notes(tuple[str, ...]): What could not be read, and why.
    """

    where: str
    maxmemory_policy: str | None
    appendonly: bool | None
    save: str | None
    notes: tuple[str, ...] = ()

    @property
    def evicting(self) -> bool | None:
        """Whether the server may evict keys (anything but ``noeviction``); None if unknown."""
        return None if self.maxmemory_policy is None else self.maxmemory_policy != "noeviction"

    @property
    def persistent(self) -> bool | None:
        """Whether a restart reloads the data (AOF, or an RDB schedule); None if unknown."""
        if self.appendonly or (self.save is not None and self.save.strip()):
            return True
        if self.appendonly is False and self.save is not None:
            return False
        return None

    def as_dict(self) -> dict[str, Any]:
        """The settings and their verdicts, for JSON."""
        return {
            "where": self.where,
            "maxmemory_policy": self.maxmemory_policy,
            "appendonly": self.appendonly,
            "save": self.save,
            "evicting": self.evicting,
            "persistent": self.persistent,
            "notes": list(self.notes),
        }

    def describe(self) -> list[str]:
        """One line per finding, for people (``dramatiq-guard inspect``)."""
        lines = []
        if self.evicting:
            lines.append(
                f"maxmemory-policy {self.maxmemory_policy}: Redis may evict the guard's keys and lose "
                f"messages; set 'maxmemory-policy noeviction'"
            )
        elif self.evicting is False:
            lines.append("maxmemory-policy noeviction: no guard key is evicted")
        if self.persistent:
            aof = "appendonly yes" if self.appendonly else "appendonly no"
            lines.append(f"persistence: {aof}, save {self.save!r}")
        elif self.persistent is False:
            lines.append(
                "persistence: none; a restart loses every parked message, dedup lock and holder "
                "(set 'appendonly yes')"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return lines


def where(client: redis.Redis) -> str:
    kwargs = client.get_connection_kwargs()
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _config(client: redis.Redis, name: str, notes: list[str]) -> str | None:
    try:
        reply = cast("dict[Any, Any]", client.config_get(name))
    except redis.exceptions.ResponseError as e:  # NOPERM, or CONFIG renamed or disabled
        notes.append(
            f"CONFIG GET {name} was refused by {where(client)} ({e}); check it by hand "
            f"(see docs/failure-model.md in dramatiq-guard's repository)"
        )
        return None
    for key, value in reply.items():
        if text(key) == name:
            return text(value)
    notes.append(f"{where(client)} did not report {name}")
    return None


def _read_one(client: redis.Redis) -> RedisSettings:
    notes: list[str] = []
    policy = _config(client, "maxmemory-policy", notes)
    appendonly = _config(client, "appendonly", notes)
    save = _config(client, "save", notes)
    return RedisSettings(
        where(client), policy, None if appendonly is None else appendonly == "yes", save, tuple(notes)
    )


def read_settings(client: RedisClient) -> RedisSettings:
    """Read the server's ``maxmemory-policy``, ``appendonly`` and ``save`` (best effort; every primary).

    Raises:
      redis.ConnectionError: If the server cannot be reached.
    """
    if not isinstance(client, redis.cluster.RedisCluster):
        return _read_one(client)
    found = [_read_one(client.get_redis_connection(node)) for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    policies = [s.maxmemory_policy for s in found]
    evicting = [p for p in policies if p is not None and p != "noeviction"]
    policy = evicting[0] if evicting else (None if None in policies else "noeviction")
    persistent = [s.persistent for s in found]
    save: str | None = None
    appendonly: bool | None = None
    if all(persistent):
        appendonly = all(s.appendonly for s in found)
        save = "" if appendonly else "(every primary)"
    elif False in persistent:
        appendonly, save = False, ""
    return RedisSettings(
        ", ".join(s.where for s in found),
        policy,
        appendonly,
        save,
        tuple(note for s in found for note in s.notes),
    )


# -- the check at install -------------------------------------------------------

_lock = threading.Lock()
_settings: weakref.WeakKeyDictionary[RedisBackendLike, RedisSettings] = weakref.WeakKeyDictionary()
_allowed: weakref.WeakSet[RedisBackendLike] = weakref.WeakSet()
_warned: weakref.WeakSet[RedisBackendLike] = weakref.WeakSet()


def _env_allows() -> bool:
    return os.environ.get(ALLOW_EVICTING_ENV, "").strip().lower() in ("1", "true", "yes")


def check(backend: RedisBackendLike, *, allow_evicting: bool | None = None) -> RedisSettings | None:
    """Check that ``backend``'s Redis keeps the guard's keys: ``RedisBackend.check_health``.

    The server is read once per backend and process; the verdict is given again at each call, so
    every middleware that resolves the backend is refused alike.

    Returns:
      RedisSettings|None: What was read, or None (unreachable for now: checked at the next call).

    Raises:
      EvictingRedis: If the server may evict keys and that was not allowed.
      LayoutTooNew: If the namespace's state is in a layout newer than :data:`LAYOUT`.
    """
    with _lock:
        if allow_evicting:
            _allowed.add(backend)
        allowed = backend in _allowed or _env_allows()
        settings = _settings.get(backend)
        first = settings is None
        if settings is None:
            try:
                settings = read_settings(backend.client)
                check_layout(backend)
            except UNREACHABLE as e:
                logger.warning(
                    "Could not check the guard's Redis settings (%s); they are checked when it answers.", e
                )
                return None
            _settings[backend] = settings
        warn_evicting = bool(settings.evicting) and allowed and backend not in _warned
        if warn_evicting:
            _warned.add(backend)
    if first:
        _report(settings)
    if settings.evicting:
        if not allowed:
            raise EvictingRedis(str(settings.maxmemory_policy), settings.where)
        if warn_evicting:
            logger.warning(
                "The guard's Redis (%s) has maxmemory-policy %r: it may evict guard keys and lose "
                "parked messages, dedup locks and holders silently; running anyway, as allowed "
                "(allow_evicting_redis / %s).",
                settings.where,
                settings.maxmemory_policy,
                ALLOW_EVICTING_ENV,
            )
    return settings


def check_layout(backend: RedisBackendLike, *, record: bool = True) -> int:
    """Refuse a namespace whose state is in a layout newer than :data:`LAYOUT`.

    Parameters:
      backend(RedisBackendLike): The backend.
      record(bool): Record :data:`LAYOUT` if none is (``SET NX``); False only reads (the command).

    Returns:
      int: The layout recorded (:data:`LAYOUT` if none is).

    Raises:
      LayoutTooNew: If the recorded layout is newer than :data:`LAYOUT`.
      BackendRefused: If the guard's ACL user may not read (or write) the record.
      redis.exceptions.ConnectionError: If Redis cannot be reached.
    """
    key = f"{backend.namespace}:layout"
    try:
        if record:
            pipe = backend.client.pipeline(transaction=False)
            pipe.set(key, LAYOUT, nx=True)
            pipe.get(key)
            stored = pipe.execute()[1]
        else:
            stored = backend.client.get(key)
    except redis.exceptions.NoPermissionError as e:
        raise BackendRefused(
            f"{key}: {e}", f"allow the guard's ACL user the keys {backend.namespace}:*"
        ) from None
    layout = LAYOUT if stored is None else int(stored)
    if layout > LAYOUT:
        client = backend.client
        server = "a Redis Cluster" if isinstance(client, redis.cluster.RedisCluster) else where(client)
        raise LayoutTooNew(layout, LAYOUT, f"namespace {backend.namespace!r} of {server}", key)
    return layout


def _report(settings: RedisSettings) -> None:
    """Log what was read about a server the first time (notes, no persistence) and set the gauges."""
    for note in settings.notes:
        logger.warning("dramatiq-guard: %s.", note)
    if settings.persistent is False:
        logger.warning(
            "The guard's Redis (%s) does not persist its data (appendonly no, no save schedule): "
            "a restart of it loses %s. Set 'appendonly yes' and 'appendfsync everysec' in its "
            "redis.conf if parked messages must survive a restart.",
            settings.where,
            RESTART_LOSES,
        )
    events.redis_settings(settings.evicting, settings.persistent)


def known_settings(backend: RedisBackendLike) -> RedisSettings | None:
    """The settings read from ``backend``'s Redis, if they were read already."""
    with _lock:
        return _settings.get(backend)


def forget_settings(backend: RedisBackendLike) -> None:
    """Read the settings again at the next :func:`check` (after a restart: they may have changed)."""
    with _lock:
        _settings.pop(backend, None)
        _warned.discard(backend)
