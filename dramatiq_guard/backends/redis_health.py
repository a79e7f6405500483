"""What the guard needs from its Redis, checked; and state that Redis lost, detected.

Parked messages (the lockwait area), dedup locks and holders live only in
Redis. Two Redis setups lose them silently:

* an evicting ``maxmemory-policy``: every policy but ``noeviction`` evicts.
  ``allkeys-*`` may evict any guard key, parked messages included;
  ``volatile-*`` evicts keys that have an expiry, which are the holders
  (a limit is then exceeded), dedup locks (a duplicate gets in) and wake-ups;
* no persistence (``appendonly no`` and no RDB ``save`` schedule): a restart
  comes back empty.

At install (:func:`check`, called by :func:`dramatiq_guard.install` and by a
standalone middleware when it first resolves its backend) the server's
``maxmemory-policy``, ``appendonly`` and ``save`` are read with ``CONFIG GET``
(on a Redis Cluster, from every primary). An evicting policy raises
:class:`~dramatiq_guard.errors.EvictingRedis`, unless the user opted out
(``install(broker, allow_evicting_redis=True)``, or the
``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` environment variable set to ``1``,
``true`` or ``yes``), which logs a warning instead. No persistence logs a
warning that says what a restart would lose. The check is best effort: a
``CONFIG GET`` refused (an ACL without ``+config``, a managed Redis that
renamed it) logs a note and is not an error; a Redis that cannot be reached
at install is checked on first use instead. Each backend is read once per
process.

While workers run (:func:`watch`, called once per pass by each worker
process's slot sweep), a :class:`StateWatch` per backend compares what it
sees with what it saw at its previous pass, in two round trips:

* the server's ``run_id`` changed: Redis restarted. Unless it persists and
  every key that had waiters at the previous pass is still waiting, the
  restart lost state (``reason="restart"``);
* ``FLUSHALL`` / ``FLUSHDB`` were called since (``INFO commandstats``; a flush
  of another database of the same server counts too): ``reason="flush"``;
* a guard key's waiters vanished while its waiting-keys index entry stayed
  (an eviction or a ``DEL``): ``reason="vanished"``; the entry is dropped so
  it is reported once, and stored payloads left behind are kept and counted
  in the log line for an operator; or the index entry vanished while the
  waiters stayed: the entry is put back so the sweeps find the key again,
  also ``reason="vanished"``;
* the server's ``evicted_keys`` grew: a warning (it may be the guard's keys
  or any other key of that server).

Each loss is one ERROR log line naming what was lost, and counted by
:func:`dramatiq_guard.events.redis_state_lost` (the metric
``dramatiq_guard_redis_state_lost_total``, by reason). The worker keeps
running, and new work is guarded as usual on the state Redis has now. The
waiters check runs on a standalone Redis (or one found through Sentinel)
only: on a Redis Cluster the index is not kept atomically with the keys
(see :mod:`dramatiq_guard.backends.redis`), so only the settings are checked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from importlib import resources
from typing import Any, cast

import redis
import redis.cluster
from redis.commands.core import Script

from dramatiq_guard import events
from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.backends.redis import RedisBackend, RedisClient
from dramatiq_guard.errors import EvictingRedis

__all__ = [
    "ALLOW_EVICTING_ENV",
    "RedisSettings",
    "StateWatch",
    "check",
    "read_settings",
    "watch",
]

logger = logging.getLogger(__name__)

#: The environment variable that lets the guard run on an evicting Redis (``1``, ``true``, ``yes``).
ALLOW_EVICTING_ENV = "DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS"

#: What a restart of a Redis without persistence loses (for log lines).
RESTART_LOSES = (
    "every parked message (the lockwait area: they are never run), every dedup lock (a duplicate "
    "gets in) and every holder (a limit can be exceeded while the holders from before still run)"
)

_UNREACHABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _load_lua(name: str) -> str:
    return resources.files("dramatiq_guard.backends").joinpath(f"lua/{name}.lua").read_text("utf-8")


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """What a Redis server was found to do with the guard's keys.

    Parameters:
      where(str): The server (``host:port``; several for a cluster).
      maxmemory_policy(str|None): Its ``maxmemory-policy`` (on a cluster, an
        evicting one if any primary has one), or None if it could not be read.
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


def _where(client: redis.Redis) -> str:
    kwargs = client.get_connection_kwargs()
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _config(client: redis.Redis, name: str, notes: list[str]) -> str | None:
    try:
        reply = cast("dict[Any, Any]", client.config_get(name))
    except redis.exceptions.ResponseError as e:  # NOPERM, or CONFIG renamed or disabled
        notes.append(
            f"CONFIG GET {name} was refused by {_where(client)} ({e}); check it by hand "
            f"(see the README, 'Failure model')"
        )
        return None
    for key, value in reply.items():
        if _text(key) == name:
            return _text(value)
    notes.append(f"{_where(client)} did not report {name}")
    return None


def _read_one(client: redis.Redis) -> RedisSettings:
    notes: list[str] = []
    policy = _config(client, "maxmemory-policy", notes)
    appendonly = _config(client, "appendonly", notes)
    save = _config(client, "save", notes)
    return RedisSettings(
        _where(client), policy, None if appendonly is None else appendonly == "yes", save, tuple(notes)
    )


def read_settings(client: RedisClient) -> RedisSettings:
    """Read the server's ``maxmemory-policy``, ``appendonly`` and ``save`` (best effort).

    On a Redis Cluster every primary is read: the policy is an evicting one
    if any primary has one, persistence holds only if every primary has it.

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
_settings: weakref.WeakKeyDictionary[GuardBackend, RedisSettings] = weakref.WeakKeyDictionary()
_allowed: weakref.WeakSet[GuardBackend] = weakref.WeakSet()
_warned: weakref.WeakSet[GuardBackend] = weakref.WeakSet()


def _env_allows() -> bool:
    return os.environ.get(ALLOW_EVICTING_ENV, "").strip().lower() in ("1", "true", "yes")


def check(backend: GuardBackend, *, allow_evicting: bool | None = None) -> RedisSettings | None:
    """Check that ``backend``'s Redis keeps the guard's keys (see the module docstring).

    The server is read once per backend and process; the verdict is given
    again at each call (cheaply), so every middleware that resolves the
    backend is refused alike.

    Parameters:
      backend(GuardBackend): The backend; anything but a
        :class:`~dramatiq_guard.backends.RedisBackend` passes unchecked.
      allow_evicting(bool|None): True: run on an evicting Redis with a
        warning (remembered for the backend). None: as decided before for
        this backend, else as ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` says.

    Returns:
      RedisSettings|None: What was read, or None (not Redis, or unreachable
      for now: checked again at the next call).

    Raises:
      EvictingRedis: If the server's ``maxmemory-policy`` may evict keys and
        evicting was not allowed.
    """
    if not isinstance(backend, RedisBackend):
        return None
    with _lock:
        if allow_evicting:
            _allowed.add(backend)
        allowed = backend in _allowed or _env_allows()
        settings = _settings.get(backend)
        first = settings is None
        if settings is None:
            try:
                settings = read_settings(backend.client)
            except _UNREACHABLE as e:
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


def _forget(backend: GuardBackend) -> None:
    """Read the settings again at the next :func:`check` (after a restart: they may have changed)."""
    with _lock:
        _settings.pop(backend, None)
        _warned.discard(backend)


# -- the watch while running ----------------------------------------------------


def _info(reply: Any) -> dict[str, Any]:
    return reply if isinstance(reply, dict) else {}


class StateWatch:
    """Detects state the guard's Redis lost since the previous check (see the module docstring).

    One per backend and process (:func:`watch`); :meth:`check` is not
    thread-safe (the sweep thread calls it).

    Parameters:
      backend(RedisBackend): The backend to watch.
    """

    def __init__(self, backend: RedisBackend) -> None:
        # Weak: the watches are kept in a WeakKeyDictionary keyed by the backend.
        self._backend = weakref.ref(backend)
        self.run_id: str | None = None
        self.flushes: int | None = None
        self.evicted: int | None = None
        #: The guard keys that had waiters at the previous check.
        self.waiting: list[str] = []
        self._script: Script = backend.client.register_script(_load_lua("health"))
        self._cluster = isinstance(backend.client, redis.cluster.RedisCluster)

    @property
    def backend(self) -> RedisBackend:
        """The backend watched.

        Raises:
          ReferenceError: If it was garbage-collected.
        """
        backend = self._backend()
        if backend is None:
            raise ReferenceError("the watched backend is gone")
        return backend

    def check(self) -> list[str]:
        """Compare the server with the previous check; log and count what was lost.

        Returns:
          list[str]: The reasons of the losses found (``"restart"``,
          ``"flush"``, ``"vanished"``), one per loss.

        Raises:
          redis.ConnectionError: If the server cannot be reached (nothing is
            compared; the next check compares with the last one that ran).
        """
        if self._cluster:
            return []
        client = self.backend.client
        pipe = client.pipeline(transaction=False)
        pipe.info("server")
        pipe.info("stats")
        pipe.info("commandstats")
        server, stats, commands = (_info(r) for r in pipe.execute(raise_on_error=False))
        index = f"{self.backend.namespace}:waiting"
        indexed, vanished, payloads, unindexed = self._script(
            keys=[index], args=[self.backend.namespace, *self.waiting]
        )
        indexed = [_text(k) for k in indexed]
        run_id = server.get("run_id")
        run_id = None if run_id is None else str(run_id)
        flushes = sum(
            int(_info(commands.get(f"cmdstat_{c}")).get("calls", 0)) for c in ("flushall", "flushdb")
        )
        evicted = stats.get("evicted_keys")

        losses: list[str] = []
        if self.run_id is not None and run_id is not None and run_id != self.run_id:
            losses += self._restarted(run_id, indexed)
        elif self.flushes is not None and commands and flushes > self.flushes:
            logger.error(
                "The guard's Redis (%s) was flushed (FLUSHALL/FLUSHDB) while workers ran: if it was "
                "the guard's database, it lost %s. Keys waiting before: %s.",
                self._where(),
                RESTART_LOSES,
                _keys(self.waiting),
            )
            events.redis_state_lost("flush")
            losses.append("flush")
        for key, left in zip(vanished, payloads, strict=True):
            logger.error(
                "The waiters of guard key %r vanished from the guard's Redis (%s) without being handed "
                "a slot (evicted or deleted): its parked messages are lost%s.",
                _text(key),
                self._where(),
                f" ({left} stored payload(s) are left in {self.backend.namespace}:{{{_text(key)}}}:payloads)"
                if int(left)
                else "",
            )
            events.redis_state_lost("vanished")
            losses.append("vanished")
        for key in unindexed:
            logger.error(
                "Guard key %r has waiters but had vanished from the waiting-keys index of the guard's "
                "Redis (%s; evicted or deleted): put back, so the sweeps hand its slots on again.",
                _text(key),
                self._where(),
            )
            events.redis_state_lost("vanished")
            losses.append("vanished")
        if evicted is not None and self.evicted is not None and int(evicted) > self.evicted and not losses:
            logger.warning(
                "The guard's Redis (%s) evicted %d key(s) since the last check (its maxmemory-policy "
                "evicts): guard keys may be among them.",
                self._where(),
                int(evicted) - self.evicted,
            )
        self.run_id = run_id or self.run_id
        self.flushes = flushes if commands else self.flushes
        self.evicted = None if evicted is None else int(evicted)
        self.waiting = indexed
        return losses

    def _restarted(self, run_id: str, indexed: list[str]) -> list[str]:
        gone = [k for k in self.waiting if k not in indexed]
        with _lock:
            settings = _settings.get(self.backend)
        _forget(self.backend)
        try:
            check(self.backend)  # its settings may have changed with the restart
        except EvictingRedis as e:
            logger.error("After its restart: %s.", e)
        if settings is not None and settings.persistent and not gone:
            logger.warning(
                "The guard's Redis (%s) restarted (run id %s -> %s) and reloaded its data; the "
                "writes of its last moments before the restart may be lost (appendfsync).",
                self._where(),
                self.run_id,
                run_id,
            )
            return []
        logger.error(
            "The guard's Redis (%s) restarted (run id %s -> %s)%s: it lost %s. Keys waiting before, "
            "gone now: %s. New work is guarded on the state Redis has now.",
            self._where(),
            self.run_id,
            run_id,
            "" if settings is not None and settings.persistent else " without persistence",
            RESTART_LOSES,
            _keys(gone),
        )
        events.redis_state_lost("restart")
        return ["restart"]

    def _where(self) -> str:
        client = self.backend.client
        return _where(client) if isinstance(client, redis.Redis) else "cluster"


def _keys(keys: list[str], most: int = 20) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown if len(keys) <= most else f"{shown} and {len(keys) - most} more"


_watches: weakref.WeakKeyDictionary[GuardBackend, StateWatch] = weakref.WeakKeyDictionary()


def watch(backend: GuardBackend) -> None:
    """One check of ``backend``'s state (:class:`StateWatch`); the slot sweep calls it once per pass.

    Does nothing for a backend that is not Redis. Never raises: a check that
    fails (Redis unreachable) is logged at DEBUG and compared at the next
    one. The first check of a backend whose settings were not read yet
    (Redis was unreachable at install) reads them, and logs an evicting
    policy as an error.
    """
    if not isinstance(backend, RedisBackend):
        return
    try:
        state = _watches.get(backend)
        if state is None:
            state = _watches[backend] = StateWatch(backend)
        with _lock:
            unread = backend not in _settings
        if unread:
            try:
                check(backend)
            except EvictingRedis as e:
                logger.error("%s.", e)
        state.check()
    except _UNREACHABLE:
        logger.debug("The guard's Redis state check could not reach Redis; retrying.", exc_info=True)
    except Exception:
        logger.warning("The guard's Redis state check failed; retrying.", exc_info=True)
