"""A claim: one holder's stake in one guard key on one backend, and the verbs that act on it.

The middlewares and :class:`~dramatiq_guard.lock.Lock` make one per (message, key) and call its
verbs; what each does atomically is the backend's contract (:mod:`dramatiq_guard.backends.base`).
A thread that blocks for a slot is a *ready waiter*: woken by the push of the hand-off, it never
polls, and re-checks the key every :data:`BACKSTOP_MS` (:meth:`Claim.block`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, ReleaseResult, Stake, Waiter

logger = logging.getLogger(__name__)

#: The longest a waiting thread sleeps before it re-checks the key.
BACKSTOP_MS = 2_000

#: What a wait without a deadline has left, in ms: always more than a backstop.
_FOREVER_MS = 1 << 62

#: What a claim calls with the hand-offs an operation made to other waiters: the caller
#: re-enqueues the parked ones (:class:`~dramatiq_guard.delivery.Courier`).
Deliver = Callable[[Sequence[Handoff]], None]


def entry_ms(wait_ms: int) -> int:
    """How long a ready waiter's entry lives when it may wait ``wait_ms`` more: past its next re-check
    (a thread that died is dropped from the queue within this, so it strands nothing)."""
    return min(wait_ms, BACKSTOP_MS) + BACKSTOP_MS


def _left_ms(deadline: float | None) -> int:
    return _FOREVER_MS if deadline is None else int((deadline - time.monotonic()) * 1000)


@dataclasses.dataclass(frozen=True)
class Claim(Stake):
    """One holder's claim on one guard key: a :class:`~dramatiq_guard.backends.Stake` on ``backend``.

    ``limit`` is the key's default limit, known here (a run-time limit set on the backend
    overrides it).
    """

    limit: int
    backend: GuardBackend = dataclasses.field(kw_only=True)

    def acquire(self, wait: Waiter | None = None) -> AcquireResult:
        """Try to hold a slot now; queue as ``wait`` says if the key is full (contract: ``acquire``)."""
        return self.backend.acquire(self, wait)

    def release(self) -> ReleaseResult:
        """Give the slot back; a freed slot goes to the oldest waiter (contract: ``release``)."""
        return self.backend.release(self.key, self.holder, limit=self.limit)

    def take_back(self) -> ReleaseResult | None:
        """Undo what an acquire whose reply was lost may have done (contract: ``take_back``)."""
        return self.backend.take_back(self.key, self.holder, limit=self.limit)

    def block(
        self, deadline: float | None, deliver: Deliver, *, payload: bytes | None = None
    ) -> AcquireResult:
        """Block as the ready waiter of the key (already queued: a standby with its ``payload``, or a
        blocking waiter) until it holds a slot: acquired (from a wake: ``reserved_ms`` is set), or the
        last refusal. Woken by the push of the hand-off; re-checks the key every :data:`BACKSTOP_MS`
        (an acquire that keeps its place; its hand-offs to others go to ``deliver``). At ``deadline``
        (``time.monotonic()``; None: never) a blocking waiter leaves the queue, and
        a standby parks again in its place (at once if its entry lapsed)."""
        done = False  # acquired, or refused as running (the entry is another copy's: not ours to cancel)
        try:
            while True:
                left = _left_ms(deadline)
                if left > 0:
                    woken = self.backend.wait_for_handoff(
                        self.key, self.holder, timeout_ms=min(left, BACKSTOP_MS)
                    )
                    if woken is not None:
                        done = True
                        return woken.result(self.limit)  # the hand-off issued its token: it holds now
                    left = _left_ms(deadline)
                result = self.acquire(self._waiter(left, payload))
                deliver(result.handoffs)
                if result.acquired or result.running:
                    done = True
                    return result
                if left <= 0 or (payload is not None and not result.standby):
                    return result
        finally:
            if not done and payload is None:
                self._leave(deliver)

    @staticmethod
    def _waiter(left_ms: int, payload: bytes | None) -> Waiter | None:
        """The entry a re-check keeps with ``left_ms`` to wait: none once the wait is over."""
        if payload is None:
            return Waiter(wait_ms=entry_ms(left_ms)) if left_ms > 0 else None
        return Waiter(payload=payload, wait_ms=entry_ms(left_ms) if left_ms > 0 else 0)

    def _leave(self, deliver: Deliver) -> None:
        """Leave the key's waiters; a slot handed to this waiter meanwhile is handed on."""
        try:
            deliver(self.backend.cancel_wait(self.key, self.holder, limit=self.limit).handoffs)
        except Exception:
            logger.warning("Could not leave the waiters of %r; the entry lapses.", self.key, exc_info=True)
