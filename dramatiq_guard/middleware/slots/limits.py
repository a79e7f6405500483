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
    """Actors' run-time default limits, each read from the backend used for ``cache_ms``."""

    def __init__(self, cache_ms: int) -> None:
        self.cache_ms = cache_ms
        self._cache: dict[str, tuple[float, int | None]] = {}

    @staticmethod
    def read(backend: GuardBackend, actor_name: str) -> int | None:
        """The actor's run-time default limit, from the backend (no cache)."""
        return backend.get_limit(f"{ACTOR_LIMIT_PREFIX}:{actor_name}")

    def get(self, backend: GuardBackend, actor_name: str) -> int | None:
        """The actor's run-time default limit, or None (cached); the last value read if the backend
        cannot be reached (the operation that needs it fails closed, or open, there next)."""
        now = time.monotonic()
        cached = self._cache.get(actor_name)
        if cached is None or cached[0] <= now:
            try:
                value = self.read(backend, actor_name)
            except BackendUnavailable:
                return None if cached is None else cached[1]
            cached = (now + self.cache_ms / 1000, value)
            self._cache[actor_name] = cached
        return cached[1]

    def set(self, backend: GuardBackend, actor_name: str, limit: int | None) -> None:
        """Set (None: clear) the actor's run-time default limit, for every process."""
        backend.set_limit(f"{ACTOR_LIMIT_PREFIX}:{actor_name}", limit, default=0)
        self._cache.pop(actor_name, None)


class KeyDirectory(Generic[P]):
    """Which of ``guarded``'s actors a guard key belongs to, as far as this process can tell: a key it
    computed (the last ``size``), or a digested key (``<prefix>:<actor>:<sha256>``)."""

    def __init__(self, prefix: str, guarded: dict[str, ActorGuard[P]], size: int = 10_000) -> None:
        self.prefix = prefix
        self.guarded = guarded
        self.size = size
        self._known: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: str, actor_name: str) -> None:
        """Record that ``key`` is a key of ``actor_name``."""
        with self._lock:
            self._known[key] = actor_name
            self._known.move_to_end(key)
            if len(self._known) > self.size:
                self._known.popitem(last=False)

    def guard_of(self, key: str) -> ActorGuard[P] | None:
        """The guard of the actor ``key`` belongs to, or None if this process cannot tell."""
        with self._lock:
            actor_name = self._known.get(key)
        guard = self.guarded.get(actor_name) if actor_name is not None else None
        if guard is None:
            actor_name, _, digest = key[len(self.prefix) + 1 :].rpartition(":")
            candidate = self.guarded.get(actor_name)
            if candidate is not None and not callable(candidate.resolve_key.spec) and len(digest) == 64:
                guard = candidate
        return guard
