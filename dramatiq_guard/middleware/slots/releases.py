"""Releasing finished messages' leases off the worker thread, in batches (docs/slots.md, "Releases").

In a worker on a real broker, a worker thread that finished a guarded message
hands its lease to this process's release thread and takes its next message at
once; the thread releases every lease handed to it meanwhile in one backend
call (one pipelined round trip on Redis), then delivers what those releases
handed on. A release lands within about one round trip of the message's end.

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

__all__ = ["FOLLOW_UP_OPTIONS", "Releaser", "starts_follow_ups"]

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
