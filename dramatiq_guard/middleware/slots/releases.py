"""Releasing finished messages' leases off the worker thread, in batches (docs/slots.md, "Execution").

Invariant: every lease handed here is released (or lapses within ``lease_ttl``) and what each
release hands on is delivered, as on the worker thread; only the moment changes (a message may be
acked just before its slot frees). A key with waiters, a message that enqueues a follow-up, and
every release on a StubBroker stay on the worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ClassVar

from dramatiq import Message
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import ReleaseResult
from dramatiq_guard.batching import Batcher
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.lease import Lease, release_leases

logger = logging.getLogger("dramatiq_guard.middleware.slots")

#: Message options with which a completion enqueues another message (Dramatiq's
#: Pipelines and Callbacks middleware, which run after the guard's release).
FOLLOW_UP_OPTIONS = ("pipe_target", "on_success", "on_failure")

#: A lease to release: (lease, how many waiters to send ahead, what to do with the result;
#: None when the backend could not be reached).
Release = tuple[Lease, int, Callable[[ReleaseResult | None], None]]


def starts_follow_ups(message: Message[object] | MessageProxy) -> bool:
    """Whether the completion of ``message`` enqueues another (released first, so it never finds it held)."""
    return not message.options.keys().isdisjoint(FOLLOW_UP_OPTIONS)


class Releaser(Batcher[Release]):
    """Releases leases in batches, one call per backend (:func:`~dramatiq_guard.lease.release_leases`)."""

    thread_name = "dramatiq-guard-releases"
    _shared: ClassVar[Releaser | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> Releaser:
        """This process's release thread, one for every slots middleware: the releases of a message's
        guards (a mutex and a concurrency limit, say) go in one batch."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def send(self, items: list[Release]) -> bool:
        """Release ``items`` and hand each result on; a release is never retried (it lapses instead)."""
        groups: dict[int, list[Release]] = {}
        for item in items:
            groups.setdefault(id(item[0].backend), []).append(item)
        for group in groups.values():
            results: list[ReleaseResult | None]
            try:
                results = list(release_leases(group[0][0].backend, [(lease, n) for lease, n, _ in group]))
            except BackendUnavailable:
                results = [None] * len(group)
            for (lease, _, then), result in zip(group, results, strict=True):
                try:
                    then(result)
                except Exception:
                    logger.exception("Could not hand on what the release of %r did.", lease)
        return True


class ContendedKeys:
    """The guard keys this process saw waiters on lately (their releases stay on the worker thread).

    Marked when a message of it did not get a slot at once, or a release handed the slot on or
    sent standbys; unmarked by a release that handed nothing on. Past ``most`` keys the marks
    start over (a key unmarked by mistake costs one release's hop).
    """

    def __init__(self, most: int = 10_000) -> None:
        self.most = most
        self._keys: dict[str, None] = {}

    def mark(self, key: str) -> None:
        if key not in self._keys:
            if len(self._keys) >= self.most:
                self._keys.clear()
            self._keys[key] = None

    def unmark(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
