"""State the guard's Redis lost while workers run: a restart, a flush, a key evicted.

Each worker's sweep calls :func:`watch` once per pass (``RedisBackend.watch``); what it detects and
reports is in ``docs/failure-model.md`` ("What the workers detect"). Each pass also keeps this
process's record of the function library it runs, which ``dramatiq-guard functions prune`` reads;
:func:`leave` withdraws it.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import redis

from dramatiq_guard import events
from dramatiq_guard.backends.redis_client import run_script, text
from dramatiq_guard.backends.redis_health import (
    RESTART_LOSES,
    UNREACHABLE,
    RedisBackendLike,
    check,
    forget_settings,
    known_settings,
    where,
)
from dramatiq_guard.backends.redis_scripts import PROCESS_TTL_MS
from dramatiq_guard.errors import BackendUnavailable, EvictingRedis

#: What a state check that could not reach Redis raises (redis-py's errors, or the health script's).
_UNAVAILABLE: tuple[type[Exception], ...] = (*UNREACHABLE, BackendUnavailable)
logger = logging.getLogger("dramatiq_guard.backends.redis_health")


#: How often, by default, a process checks every waiting key's waiters, at most...
KEYS_EVERY_S = 30.0
#: ...and no oftener than this many keys a second on average.
KEYS_PER_S = 50


def _info(reply: Any) -> dict[str, Any]:
    return reply if isinstance(reply, dict) else {}


class StateWatch:
    """Detects state the guard's Redis lost since the previous check; one per backend and process.

    :meth:`check` is not thread-safe (the sweep thread calls it).

    Parameters:
      backend(RedisBackendLike): The backend to watch.
      keys_every_s(float): How often the waiters check (it reads every waiting key) runs, or
        every ``keys / KEYS_PER_S`` seconds if longer; at once after a restart or a flush. The
        server checks (run id, flushes, evictions) run at every :meth:`check`. 0: every check.
    """

    def __init__(self, backend: RedisBackendLike, *, keys_every_s: float = KEYS_EVERY_S) -> None:
        # Weak: the watches are kept in a WeakKeyDictionary keyed by the backend.
        self._backend = weakref.ref(backend)
        self.run_id: str | None = None
        self.flushes: int | None = None
        self.evicted: int | None = None
        #: The guard keys that had waiters at the previous check of the waiters.
        self.waiting: list[str] = []
        self.keys_every_s = keys_every_s
        self.keys_checked: float | None = None  # time.monotonic() of the last waiters check
        self._cluster = isinstance(backend.client, redis.cluster.RedisCluster)
        self.announced: float | None = None  # time.monotonic() of this process's last record
        self._announce_refused = False

    @property
    def backend(self) -> RedisBackendLike:
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
          list[str]: The reasons of the losses found (``"restart"``, ``"flush"``, ``"vanished"``).

        Raises:
          redis.ConnectionError: If the server cannot be reached (nothing is compared).
          BackendUnavailable: The same, found by the health script's call.
        """
        if self._cluster:
            return []
        run_id, flushes, evicted, counted = self._server_facts()
        indexed, vanished, payloads, unindexed = self._key_facts(run_id, flushes, counted)
        losses: list[str] = []
        if self.run_id is not None and run_id is not None and run_id != self.run_id:
            losses += self._restarted(run_id, indexed)
        elif self.flushes is not None and counted and flushes > self.flushes:
            logger.error(
                "The guard's Redis (%s) was flushed (FLUSHALL/FLUSHDB) while workers ran: if it was "
                "the guard's database, it lost %s. Keys waiting before: %s.",
                self._where(),
                RESTART_LOSES,
                _keys(self.waiting),
            )
            events.redis_state_lost("flush")
            losses.append("flush")
        losses += self._lost_keys(vanished, payloads, unindexed)
        if evicted is not None and self.evicted is not None and evicted > self.evicted and not losses:
            logger.warning(
                "The guard's Redis (%s) evicted %d key(s) since the last check (its maxmemory-policy "
                "evicts): guard keys may be among them.",
                self._where(),
                evicted - self.evicted,
            )
        self.run_id = run_id or self.run_id
        self.flushes = flushes if counted else self.flushes
        self.evicted = evicted
        self.waiting = indexed
        return losses

    def _server_facts(self) -> tuple[str | None, int, int | None, bool]:
        """The server's run id, FLUSHALL/FLUSHDB calls, evicted keys, and whether commands are counted."""
        pipe = self.backend.client.pipeline(transaction=False)
        pipe.info("server")
        pipe.info("stats")
        pipe.info("commandstats")
        server, stats, commands = (_info(r) for r in pipe.execute(raise_on_error=False))
        run_id = server.get("run_id")
        flushes = sum(
            int(_info(commands.get(f"cmdstat_{c}")).get("calls", 0)) for c in ("flushall", "flushdb")
        )
        evicted = stats.get("evicted_keys")
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
        if not (
            self.keys_checked is None
            or now - self.keys_checked >= self._keys_interval_s()
            or run_id != self.run_id
            or (counted and flushes != self.flushes)
        ):
            return self.waiting, [], [], []
        backend = self.backend
        index = f"{backend.namespace}:waiting"
        found, vanished, payloads, unindexed = run_script(
            backend.client,
            backend.scripts,
            backend.scripts["health"],
            [index],
            [backend.namespace, *self.waiting],
        )
        self.keys_checked = now
        return [text(k) for k in found], vanished, payloads, unindexed

    def _lost_keys(self, vanished: list[Any], payloads: list[Any], unindexed: list[Any]) -> list[str]:
        """Log and count each key whose waiters vanished, or that vanished from the index."""
        losses: list[str] = []
        for key, left in zip(vanished, payloads, strict=True):
            logger.error(
                "The waiters of guard key %r vanished from the guard's Redis (%s) without being handed "
                "a slot (evicted or deleted): its parked messages are lost%s.",
                text(key),
                self._where(),
                f" ({left} stored payload(s) are left in {self.backend.namespace}:{{{text(key)}}}:payloads)"
                if int(left)
                else "",
            )
            events.redis_state_lost("vanished")
            losses.append("vanished")
        for key in unindexed:
            logger.error(
                "Guard key %r has waiters but had vanished from the waiting-keys index of the guard's "
                "Redis (%s; evicted or deleted): put back, so the sweeps hand its slots on again.",
                text(key),
                self._where(),
            )
            events.redis_state_lost("vanished")
            losses.append("vanished")
        return losses

    def announce(self, interval_s: float) -> None:
        """Record, or refresh once a quarter of its lifetime passed, the library this process runs.

        The record lasts :data:`~dramatiq_guard.backends.redis_scripts.PROCESS_TTL_MS`, or three
        passes (``interval_s``) if longer. Never raises: a refused record is logged once.
        """
        ttl_ms = max(PROCESS_TTL_MS, int(interval_s * 3000))
        now = time.monotonic()
        if self.announced is not None and now - self.announced < ttl_ms / 4000:
            return
        backend = self.backend
        try:
            backend.scripts.announce(backend.client, backend.namespace, ttl_ms)
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

    def _keys_interval_s(self) -> float:
        """How long between two waiters checks: ``keys_every_s``, longer with many keys (0: every check)."""
        if self.keys_every_s <= 0:
            return 0.0
        return max(self.keys_every_s, len(self.waiting) / KEYS_PER_S)

    def _restarted(self, run_id: str, indexed: list[str]) -> list[str]:
        gone = [k for k in self.waiting if k not in indexed]
        settings = known_settings(self.backend)
        forget_settings(self.backend)
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
        return where(client) if isinstance(client, redis.Redis) else "cluster"


def _keys(keys: list[str], most: int = 20) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown if len(keys) <= most else f"{shown} and {len(keys) - most} more"


_watches: weakref.WeakKeyDictionary[RedisBackendLike, StateWatch] = weakref.WeakKeyDictionary()


def watch(backend: RedisBackendLike, interval_s: float = 1.0) -> None:
    """One check of ``backend``'s state (:class:`StateWatch`) and its library record; never raises.

    A failed check is logged at DEBUG and compared at the next one. Settings not read yet (Redis
    was unreachable at install) are read, an evicting policy logged as an error.
    """
    try:
        state = _watches.get(backend)
        if state is None:
            state = _watches[backend] = StateWatch(backend)
        state.announce(interval_s)
        if known_settings(backend) is None:
            try:
                check(backend)
            except EvictingRedis as e:
                logger.error("%s.", e)
        state.check()
    except _UNAVAILABLE:
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
        state.backend.scripts.withdraw(state.backend.client, state.backend.namespace)
    except Exception:  # it lapses by itself
        logger.debug("Could not withdraw this worker's record of its library.", exc_info=True)
