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
from dramatiq_guard.batching import Batcher, by_backend
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.lease import Lease, release_leases

logger = logging.getLogger("dramatiq_guard.middleware.slots")

#: A lease to release: (lease, how many waiters to send ahead, what to do with the result;
#: None when the backend could not be reached).
Release = tuple[Lease, int, Callable[[ReleaseResult | None], None]]


def starts_follow_ups(message: Message[object] | MessageProxy) -> bool:
    """Whether the completion of ``message`` enqueues another (released first, so it never finds it held):
    it has an option of Dramatiq's Pipelines or Callbacks middleware, which run after the guard's
    release (asked of every message that held a slot: no call made)."""
    options = message.options
    return "pipe_target" in options or "on_success" in options or "on_failure" in options


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
        for backend, group in by_backend(items, lambda item: item[0].backend):
            results: list[ReleaseResult | None]
            try:
                results = list(release_leases(backend, [(lease, n) for lease, n, _ in group]))
            except BackendUnavailable:
                results = [None] * len(group)
            for (lease, _, then), result in zip(group, results, strict=True):
                try:
                    then(result)
                except Exception:
                    logger.exception("Could not hand on what the release of %r did.", lease)
        return True


class ContendedKeys(dict[str, None]):
    """The guard keys this process saw waiters on lately (their releases stay on the worker thread).

    Marked when a message of it did not get a slot at once, or a release handed the slot on or
    sent standbys; unmarked by a release that handed nothing on. Past ``most`` keys the marks
    start over (a key unmarked by mistake costs one release's hop). A dict of the marked keys:
    ``key in contended``, asked at every release, is the dict's own (no call).
    """

    def __init__(self, most: int = 10_000) -> None:
        super().__init__()
        self.most = most

    def mark(self, key: str) -> None:
        if key not in self:
            if len(self) >= self.most:
                self.clear()
            self[key] = None

    def unmark(self, key: str) -> None:
        self.pop(key, None)
