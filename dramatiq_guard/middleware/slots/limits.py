"""Limits: an actor's run-time default, and which actor a guard key belongs to
(docs/slots.md, "Limits at run time")."""

from __future__ import annotations

import collections
import threading
import time
from typing import Generic, TypeVar

from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.middleware.base import ActorGuard
from dramatiq_guard.policies import Policy

P = TypeVar("P", bound=Policy)

#: The pseudo-key prefix whose run-time limit is an actor's default limit.
ACTOR_LIMIT_PREFIX = "concurrency-default"


class ActorLimits:
    """Actors' run-time default limits, each read from the backend used for ``cache_ms``, by one
    thread at a time: while it reads, the others use the value it replaces."""

    def __init__(self, cache_ms: int) -> None:
        self.cache_ms = cache_ms
        self._cache: dict[str, tuple[float, int | None]] = {}
        self._reading = threading.Lock()

    @staticmethod
    def read(backend: GuardBackend, actor_name: str) -> int | None:
        """The actor's run-time default limit, from the backend (no cache)."""
        return backend.get_limit(f"{ACTOR_LIMIT_PREFIX}:{actor_name}")

    def get(self, backend: GuardBackend, actor_name: str) -> int | None:
        """The actor's run-time default limit, or None (cached); the last value read if the backend
        cannot be reached (the operation that needs it fails closed, or open, there next)."""
        now = time.monotonic()
        cached = self._cache.get(actor_name)
        if cached is not None and (cached[0] > now or not self._reading.acquire(blocking=False)):
            return cached[1]  # fresh, or another thread is reading it
        try:
            value = self.read(backend, actor_name)
        except BackendUnavailable:
            return None if cached is None else cached[1]
        finally:
            if cached is not None:
                self._reading.release()
        self._cache[actor_name] = (now + self.cache_ms / 1000, value)
        return value

    def set(self, backend: GuardBackend, actor_name: str, limit: int | None) -> None:
        """Set (None: clear) the actor's run-time default limit, for every process."""
        backend.set_limit(f"{ACTOR_LIMIT_PREFIX}:{actor_name}", limit, default=0)
        self._cache.pop(actor_name, None)


class KeyDirectory(Generic[P]):
    """Which guard of ``guard_lists``' actors a guard key belongs to, as far as this process can tell:
    a key it computed (the last ``size``), or a digested key (``<prefix>:<scope>:<sha256>``, the
    scope an actor's name, ``#<index>`` added for a later guard of a list)."""

    def __init__(
        self, prefix: str, guard_lists: dict[str, tuple[ActorGuard[P], ...]], size: int = 10_000
    ) -> None:
        self.prefix = prefix
        self.guard_lists = guard_lists
        self.size = size
        self._known: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: The (key, scope) remembered last: the last of ``_known`` (remembering it again changes nothing).
        self._last: tuple[str, str] | None = None

    def remember(self, key: str, scope: str) -> None:
        """Record that ``key`` is a key of the guard of ``scope`` (:attr:`ActorGuard.scope`)."""
        if self._last == (key, scope):
            return  # (one key for every message of an actor: remembered with no call)
        with self._lock:
            self._last = (key, scope)
            self._known[key] = scope
            self._known.move_to_end(key)
            if len(self._known) > self.size:
                self._known.popitem(last=False)

    def guard_of(self, key: str) -> ActorGuard[P] | None:
        """The guard ``key`` belongs to, or None if this process cannot tell."""
        with self._lock:
            scope = self._known.get(key)
        guard = self._scoped(scope) if scope is not None else None
        if guard is None:
            scope, _, digest = key[len(self.prefix) + 1 :].rpartition(":")
            candidate = self._scoped(scope)
            if candidate is not None and not callable(candidate.resolve_key.spec) and len(digest) == 64:
                guard = candidate
        return guard

    def _scoped(self, scope: str) -> ActorGuard[P] | None:
        actor_name, later, index = scope.partition("#")
        guards = self.guard_lists.get(actor_name, ())
        position = (int(index) if index.isdigit() else -1) if later else 0
        return guards[position] if 0 <= position < len(guards) else None
