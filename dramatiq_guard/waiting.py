"""Waiting for a slot: the one loop every blocking waiter runs (wake, backstop, give up).

A thread that blocks for a slot (a mutex ``on_busy="wait"``, a standby picked
up, a blocking :class:`~dramatiq_guard.lock.Lock`) is a *ready waiter* of the
key: the backend hands it a freed slot by a push that carries its fencing
token (:meth:`~dramatiq_guard.backends.GuardBackend.wait_for_handoff`). It
never polls; every :data:`BACKSTOP_MS` it re-checks the key with an acquire,
which reclaims a dead holder's lapsed lease and finds a slot whose push it
missed. The contract it stands on is in :mod:`dramatiq_guard.backends.base`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, Waiter

__all__ = ["BACKSTOP_MS", "entry_ms", "wait_for_slot"]

logger = logging.getLogger(__name__)

#: The longest a waiting thread sleeps before it re-checks the key.
BACKSTOP_MS = 2_000

#: What a wait without a deadline has left, in ms: always more than a backstop.
_FOREVER_MS = 1 << 62


def entry_ms(wait_ms: int) -> int:
    """How long a ready waiter's entry lives when it may wait ``wait_ms`` more: past its next re-check.

    A thread that died is dropped from the queue within this, so it strands nothing.
    """
    return min(wait_ms, BACKSTOP_MS) + BACKSTOP_MS


def _left_ms(deadline: float | None) -> int:
    if deadline is None:
        return _FOREVER_MS
    return int((deadline - time.monotonic()) * 1000)


def wait_for_slot(  # noqa: PLR0913
    backend: GuardBackend,
    key: str,
    holder: str,
    *,
    limit: int,
    ttl_ms: int,
    deadline: float | None,
    deliver: Callable[[Sequence[Handoff]], None],
    payload: bytes | None = None,
    info: str | None = None,
    generation: int | None = None,
    runner: str | None = None,
) -> AcquireResult:
    """Block as the ready waiter ``holder`` of ``key`` (already queued) until it holds a slot.

    Woken by the push of the hand-off that gives it the slot; re-checks the
    key every :data:`BACKSTOP_MS` (an acquire that keeps its place). Gives up
    at ``deadline``:

    * a blocking waiter (``payload`` None) leaves the queue
      (:meth:`~GuardBackend.cancel_wait`; a slot handed to it meanwhile is
      handed on);
    * a standby (``payload``: its encoded message) parks again in its place,
      as it does at once if its entry lapsed meanwhile.

    Parameters:
      backend(GuardBackend): The guard backend.
      key(str): The guard key.
      holder(str): The waiter id (a message id, or a lock's holder id).
      limit(int): The key's default limit.
      ttl_ms(int): The lease to take when the re-check acquires.
      deadline(float|None): When to give up, on ``time.monotonic()``; None: never.
      deliver: Called with the hand-offs each re-check made to other waiters
        (the caller re-enqueues the parked ones).
      payload(bytes|None): A standby's encoded message; None for a blocking waiter.
      info(str|None): The holder's description for ``inspect`` (its actor).
      generation(int|None): A standby's: the generation of the copy the worker
        holds (see :meth:`~GuardBackend.acquire`), so the copy is stale once
        it has parked again.
      runner(str|None): Who runs the job once it holds (see
        :meth:`~GuardBackend.acquire`): every re-check passes it.

    Returns:
      AcquireResult: Acquired (from a wake: ``reserved_ms`` is set, and the
      lease must be renewed within it), or the last refused result.
    """
    acquired = False
    theirs = False  # the entry is another copy's (a refusal as running): it is not ours to cancel
    try:
        while True:
            left = _left_ms(deadline)
            if left > 0:
                woken = backend.wait_for_handoff(key, holder, timeout_ms=min(left, BACKSTOP_MS))
                if woken is not None:
                    acquired = True
                    return woken.result(limit)  # the hand-off issued its token: it holds the slot now
                left = _left_ms(deadline)
            if payload is None:
                wait = Waiter(wait_ms=entry_ms(left)) if left > 0 else None
            else:
                wait = Waiter(payload=payload, wait_ms=entry_ms(left) if left > 0 else 0)
            result = backend.acquire(
                key, holder, limit=limit, ttl_ms=ttl_ms, wait=wait, info=info, generation=generation,
                runner=runner,
            )  # fmt: skip
            deliver(result.handoffs)
            if result.acquired:
                acquired = True
                return result
            if result.running:
                theirs = True
                return result
            if left <= 0 or (payload is not None and not result.standby):
                return result
    finally:
        if not acquired and not theirs and payload is None:
            try:
                deliver(backend.cancel_wait(key, holder, limit=limit).handoffs)
            except Exception:
                logger.warning("Could not leave the waiters of %r; the entry lapses.", key, exc_info=True)
