"""What the guard needs from its Redis, checked at install (:func:`check`), and what it lost while
workers run, found at each sweep pass (:func:`watch`): docs/failure-model.md."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol, cast

import redis
import redis.cluster

from dramatiq_guard import events
from dramatiq_guard.backends.redis_client import UNAVAILABLE, RedisClient, run_script, text
from dramatiq_guard.backends.redis_scripts import PROCESS_TTL_MS, ScriptLibrary
from dramatiq_guard.errors import BackendRefused, BackendUnavailable, EvictingRedis, LayoutTooNew

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

#: How often, by default, a process checks every waiting key's waiters, at most...
KEYS_EVERY_S = 30.0
#: ...and no oftener than this many keys a second on average.
KEYS_PER_S = 50
_UNREACHABLE: tuple[type[Exception], ...] = (*UNAVAILABLE, BackendUnavailable)


class RedisBackendLike(Protocol):
    """What this module uses of a RedisBackend."""

    client: RedisClient
    namespace: str
    scripts: ScriptLibrary


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """What a Redis server (``where``: ``host:port``, several for a cluster) does with the guard's keys:
    its ``maxmemory_policy`` (a cluster's: an evicting one if any primary has one), ``appendonly``
    (a cluster's: on every primary) and RDB ``save`` schedule (``""``: none), each None if it could
    not be read; ``notes``: what could not be read, and why."""

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
        return False if self.appendonly is False and self.save is not None else None

    def as_dict(self) -> dict[str, Any]:
        """The settings and their verdicts, for JSON."""
        found = dataclasses.asdict(self) | {"evicting": self.evicting, "persistent": self.persistent}
        return found | {"notes": list(self.notes)}

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
            lines.append(f"persistence: appendonly {'yes' if self.appendonly else 'no'}, save {self.save!r}")
        elif self.persistent is False:
            lines.append(
                "persistence: none; a restart loses every parked message, dedup lock and holder "
                "(set 'appendonly yes')"
            )
        return lines + [f"note: {note}" for note in self.notes]


def where(client: RedisClient) -> str:
    if isinstance(client, redis.cluster.RedisCluster):
        return "a Redis Cluster"
    kwargs = client.get_connection_kwargs()
    return str(kwargs["path"]) if "path" in kwargs else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _read_one(client: redis.Redis) -> RedisSettings:
    notes: list[str] = []
    found: dict[str, str | None] = {}
    for name in ("maxmemory-policy", "appendonly", "save"):
        try:
            reply = cast("dict[Any, Any]", client.config_get(name))
        except redis.exceptions.ResponseError as e:  # NOPERM, or CONFIG renamed or disabled
            notes.append(
                f"CONFIG GET {name} was refused by {where(client)} ({e}); check it by hand "
                f"(see docs/failure-model.md in dramatiq-guard's repository)"
            )
            continue
        found[name] = next((text(v) for k, v in reply.items() if text(k) == name), None)
        if found[name] is None:
            notes.append(f"{where(client)} did not report {name}")
    appendonly = found.get("appendonly")
    return RedisSettings(
        where(client),
        found.get("maxmemory-policy"),
        None if appendonly is None else appendonly == "yes",
        found.get("save"),
        tuple(notes),
    )


def read_settings(client: RedisClient) -> RedisSettings:
    """Read the server's ``maxmemory-policy``, ``appendonly`` and ``save`` (best effort; every primary)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return _read_one(client)
    found = [_read_one(client.get_redis_connection(node)) for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    policies = [s.maxmemory_policy for s in found]
    evicting = [p for p in policies if p is not None and p != "noeviction"]
    policy = evicting[0] if evicting else (None if None in policies else "noeviction")
    persistent = [s.persistent for s in found]
    appendonly, save = (False, "") if False in persistent else (None, None)
    if all(persistent):
        appendonly = all(s.appendonly for s in found)
        save = "" if appendonly else "(every primary)"
    notes = tuple(note for s in found for note in s.notes)
    return RedisSettings(", ".join(s.where for s in found), policy, appendonly, save, notes)


# -- the check at install -------------------------------------------------------

_lock = threading.Lock()
_settings: weakref.WeakKeyDictionary[RedisBackendLike, RedisSettings] = weakref.WeakKeyDictionary()
_allowed: weakref.WeakSet[RedisBackendLike] = weakref.WeakSet()
_warned: weakref.WeakSet[RedisBackendLike] = weakref.WeakSet()


def check(backend: RedisBackendLike, *, allow_evicting: bool | None = None) -> RedisSettings | None:
    """``RedisBackend.check_health``: the server is read once per backend and process (None if it
    does not answer: read at the next call); the verdict is given again at each call."""
    with _lock:
        if allow_evicting:
            _allowed.add(backend)
        env = os.environ.get(ALLOW_EVICTING_ENV, "").strip().lower() in ("1", "true", "yes")
        allowed = backend in _allowed or env
        settings = first = _settings.get(backend)
        if settings is None:
            try:
                settings = read_settings(backend.client)
                check_layout(backend)
            except UNAVAILABLE as e:
                logger.warning(
                    "Could not check the guard's Redis settings (%s); they are checked when it answers.", e
                )
                return None
            _settings[backend] = settings
        warn_evicting = bool(settings.evicting) and allowed and backend not in _warned
        if warn_evicting:
            _warned.add(backend)
    if first is None:  # the first time: the notes, no persistence, and the gauges
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
    if settings.evicting and not allowed:
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
    """The layout recorded (``record``: :data:`LAYOUT` recorded if none is); :class:`LayoutTooNew`
    if it is newer than :data:`LAYOUT`, :class:`BackendRefused` if the ACL user may not read it."""
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
        where_ = f"namespace {backend.namespace!r} of {where(backend.client)}"
        raise LayoutTooNew(layout, LAYOUT, where_, key)
    return layout


def _check_logged(backend: RedisBackendLike, after: str = "") -> None:
    """:func:`check` again (at a pass, or after a restart), an evicting policy logged as an error."""
    try:
        check(backend)
    except EvictingRedis as e:
        logger.error("%s%s.", after, e)


# -- the watch while workers run --------------------------------------------------


def _info(reply: Any) -> dict[str, Any]:
    return reply if isinstance(reply, dict) else {}


def _keys(keys: list[str], most: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:most]) or "none"
    return shown if len(keys) <= most else f"{shown} and {len(keys) - most} more"


class StateWatch:
    """Detects state the guard's Redis lost since the previous check; one per backend and process
    (:meth:`check` is not thread-safe: the sweep thread calls it). The server checks (run id,
    flushes, evictions) run at every :meth:`check`; the waiters check (it reads every waiting key)
    every ``keys_every_s`` (0: every check), or ``keys / KEYS_PER_S`` s if longer, and at once after
    a restart or a flush."""

    def __init__(self, backend: RedisBackendLike, *, keys_every_s: float = KEYS_EVERY_S) -> None:
        self._backend = weakref.ref(backend)  # weak: the watches are kept per backend, weakly
        self.run_id: str | None = None
        self.flushes: int | None = None
        self.evicted: int | None = None
        self.waiting: list[str] = []  # the guard keys that had waiters at the last waiters check
        self.keys_every_s = keys_every_s
        self.keys_checked: float | None = None  # time.monotonic() of the last waiters check
        self.announced: float | None = None  # time.monotonic() of this process's last record
        self._announce_refused = False

    @property
    def backend(self) -> RedisBackendLike:
        """The backend watched (``ReferenceError`` if it was garbage-collected)."""
        backend = self._backend()
        if backend is None:
            raise ReferenceError("the watched backend is gone")
        return backend

    def check(self) -> list[str]:
        """Compare the server with the previous check; log, count and return the losses found
        (``"restart"``, ``"flush"``, ``"vanished"``). Raises if Redis cannot be reached."""
        if isinstance(self.backend.client, redis.cluster.RedisCluster):
            return []
        run_id, flushes, evicted, counted = self._server_facts()
        indexed, vanished, payloads, unindexed = self._key_facts(run_id, flushes, counted)
        losses: list[str] = []
        if self.run_id is not None and run_id is not None and run_id != self.run_id:
            losses += self._restarted(run_id, indexed)
        elif self.flushes is not None and counted and flushes > self.flushes:
            self._lost(
                "flush",
                "The guard's Redis (%s) was flushed (FLUSHALL/FLUSHDB) while workers ran: if it was "
                "the guard's database, it lost %s. Keys waiting before: %s.",
                where(self.backend.client),
                RESTART_LOSES,
                _keys(self.waiting),
            )
            losses.append("flush")
        losses += self._lost_keys(vanished, payloads, unindexed)
        if evicted is not None and self.evicted is not None and evicted > self.evicted and not losses:
            logger.warning(
                "The guard's Redis (%s) evicted %d key(s) since the last check (its maxmemory-policy "
                "evicts): guard keys may be among them.",
                where(self.backend.client),
                evicted - self.evicted,
            )
        self.run_id = run_id or self.run_id
        self.flushes = flushes if counted else self.flushes
        self.evicted, self.waiting = evicted, indexed
        return losses

    def _server_facts(self) -> tuple[str | None, int, int | None, bool]:
        """The server's run id, FLUSHALL/FLUSHDB calls, evicted keys, and whether commands are counted."""
        pipe = self.backend.client.pipeline(transaction=False)
        for section in ("server", "stats", "commandstats"):
            pipe.info(section)
        server, stats, commands = (_info(r) for r in pipe.execute(raise_on_error=False))
        run_id, evicted = server.get("run_id"), stats.get("evicted_keys")
        flushes = sum(
            int(_info(commands.get(f"cmdstat_{c}")).get("calls", 0)) for c in ("flushall", "flushdb")
        )
        return (
            None if run_id is None else str(run_id),
            flushes,
            None if evicted is None else int(evicted),
            bool(commands),
        )

    def _key_facts(
        self, run_id: str | None, flushes: int, counted: bool
    ) -> tuple[list[str], list[Any], list[Any], list[Any]]:
        """The waiting keys indexed now, and those vanished (with their payloads left) or unindexed."""
        now = time.monotonic()
        every = 0.0 if self.keys_every_s <= 0 else max(self.keys_every_s, len(self.waiting) / KEYS_PER_S)
        due = self.keys_checked is None or now - self.keys_checked >= every
        if not (due or run_id != self.run_id or (counted and flushes != self.flushes)):
            return self.waiting, [], [], []
        b = self.backend
        script, index = b.scripts["health"], f"{b.namespace}:waiting"
        found, vanished, payloads, unindexed = run_script(
            b.client, b.scripts, script, [index], [b.namespace, *self.waiting]
        )
        self.keys_checked = now
        return [text(k) for k in found], vanished, payloads, unindexed

    def _lost(self, reason: str, message: str, *args: Any) -> None:
        logger.error(message, *args)
        events.redis_state_lost(reason)

    def _lost_keys(self, vanished: list[Any], payloads: list[Any], unindexed: list[Any]) -> list[str]:
        """Log and count each key whose waiters vanished, or that vanished from the index."""
        server, namespace = where(self.backend.client), self.backend.namespace
        for key, left in zip(vanished, payloads, strict=True):
            self._lost(
                "vanished",
                "The waiters of guard key %r vanished from the guard's Redis (%s) without being handed "
                "a slot (evicted or deleted): its parked messages are lost%s.",
                text(key),
                server,
                f" ({left} stored payload(s) are left in {namespace}:{{{text(key)}}}:payloads)"
                if int(left)
                else "",
            )
        for key in unindexed:
            self._lost(
                "vanished",
                "Guard key %r has waiters but had vanished from the waiting-keys index of the guard's "
                "Redis (%s; evicted or deleted): put back, so the sweeps hand its slots on again.",
                text(key),
                server,
            )
        return ["vanished"] * (len(vanished) + len(unindexed))

    def announce(self, interval_s: float) -> None:
        """Record the library this process runs for ``PROCESS_TTL_MS`` or three passes (``interval_s``),
        refreshed once a quarter of that passed. Never raises: a refused record is logged once."""
        ttl_ms = max(PROCESS_TTL_MS, int(interval_s * 3000))
        now = time.monotonic()
        if self.announced is not None and now - self.announced < ttl_ms / 4000:
            return
        try:
            self.backend.scripts.announce(self.backend.client, self.backend.namespace, ttl_ms)
        except redis.RedisError as e:
            if isinstance(e, redis.exceptions.ResponseError) and not self._announce_refused:
                self._announce_refused = True
                logger.warning(
                    "dramatiq-guard: could not record which function library this worker runs (%s): "
                    "'dramatiq-guard functions prune' will not see it.",
                    e,
                )
            return
        self.announced = now

    def _restarted(self, run_id: str, indexed: list[str]) -> list[str]:
        gone = [k for k in self.waiting if k not in indexed]
        with _lock:
            settings = _settings.pop(self.backend, None)  # read again: they may have changed
            _warned.discard(self.backend)
        _check_logged(self.backend, "After its restart: ")
        persistent = settings is not None and settings.persistent
        server = where(self.backend.client)
        if persistent and not gone:
            logger.warning(
                "The guard's Redis (%s) restarted (run id %s -> %s) and reloaded its data; the "
                "writes of its last moments before the restart may be lost (appendfsync).",
                server,
                self.run_id,
                run_id,
            )
            return []
        self._lost(
            "restart",
            "The guard's Redis (%s) restarted (run id %s -> %s)%s: it lost %s. Keys waiting before, "
            "gone now: %s. New work is guarded on the state Redis has now.",
            server,
            self.run_id,
            run_id,
            "" if persistent else " without persistence",
            RESTART_LOSES,
            _keys(gone),
        )
        return ["restart"]


_watches: weakref.WeakKeyDictionary[RedisBackendLike, StateWatch] = weakref.WeakKeyDictionary()


def watch(backend: RedisBackendLike, interval_s: float = 1.0) -> None:
    """One check of ``backend``'s state (:class:`StateWatch`), its library record and its settings if
    not read yet (an evicting policy logged as an error). Never raises: a failed check is logged."""
    try:
        state = _watches.get(backend)
        if state is None:
            state = _watches[backend] = StateWatch(backend)
        state.announce(interval_s)
        if backend not in _settings:
            _check_logged(backend)
        state.check()
    except _UNREACHABLE:
        logger.debug("The guard's Redis state check could not reach Redis; retrying.", exc_info=True)
    except Exception:
        logger.warning("The guard's Redis state check failed; retrying.", exc_info=True)


def leave(backend: RedisBackendLike) -> None:
    """Withdraw this process's record of the library it runs (its sweep stopped). Never raises."""
    state = _watches.get(backend)
    if state is None or state.announced is None:
        return
    state.announced = None
    try:
        backend.scripts.withdraw(backend.client, backend.namespace)
    except Exception:  # it lapses by itself
        logger.debug("Could not withdraw this worker's record of its library.", exc_info=True)
