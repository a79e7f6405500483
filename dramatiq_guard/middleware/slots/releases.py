"""Releasing finished messages' leases off the worker thread, in batches (docs/slots.md, "Execution").

In a worker on a real broker, a worker thread that finished a guarded message
of a key without waiters hands its lease to this process's release thread and
takes its next message at once; the thread releases every lease handed to it
meanwhile in one backend call (one pipelined round trip on Redis), then
delivers what those releases handed on. A release lands within about one round
trip of the message's end. A key this process saw waiters on lately
(:class:`ContendedKeys`: its last release here handed the slot on or sent
standbys, or a message of it here did not get a slot at once) is released on the
worker thread: there the next holder is waiting for the slot, and the hop to
another thread would only delay it (docs/slots.md, "Execution").

Invariant: every lease handed here is released (or, if the backend cannot be
reached, stops being renewed and lapses within ``lease_ttl``), and what each
release hands on is delivered, exactly as a release on the worker thread
would. What changes is only when: the message may be acked a moment before its
slot frees. So a message whose completion enqueues a follow-up
(``pipe_target``, ``on_success``, ``on_failure``) is still released on its
worker thread, before the follow-up exists: a follow-up on the same key never
finds its predecessor holding it. On a StubBroker (tests) every release is on
the worker thread, so ``broker.join()`` and ``worker.join()`` return with the
slots free. A worker's shutdown, and the interpreter's exit, release what is
left (:meth:`~dramatiq_guard.batching.Batcher.flush`); a process killed with
releases pending leaves them to lapse, as it does the leases of the messages
it was running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    """Whether the completion of ``message`` enqueues another message (see the module docstring)."""
    options = message.options
    return any(name in options for name in FOLLOW_UP_OPTIONS)


class Releaser(Batcher[Release]):
    """Releases leases in batches, one call per backend (:func:`~dramatiq_guard.lease.release_leases`)."""

    thread_name = "dramatiq-guard-releases"

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

    A key is marked when a message of it did not get a slot at once here (it
    parked, waited, was dropped, or took a slot handed to it), and when a
    release here handed the slot on or sent standbys; a release that handed
    nothing on unmarks it. At most ``most`` keys are kept (past that the marks
    start over: a key unmarked by mistake costs one release's hop, nothing more).
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
