"""Standbys: parked waiters sent to the broker ahead of a free slot, and the threads they block.

A worker that releases a slot of a key with waiters also sends the next
waiters to the broker *ahead*, so that a freed slot does not wait for the
broker to deliver the next message; picked up, a standby blocks its worker
thread in its FIFO place until a slot is handed to it by a push. A process
lets at most ``standby_threads`` threads block so (docs/slots.md, "Standbys").

Long jobs: a release sends only the standbys expected to get a slot within ``standby_wait``
(:meth:`Standbys.count_after`). Slots of a limit of ``L`` free about every ``held / L``, so the
``k``-th standby waits about ``k x held / L``; one that waits longer only blocks its thread for
``standby_wait``, parks again, and is sent again by the next release, a broker pickup each time
(docs/slots.md, "Long jobs").
"""

from __future__ import annotations

import threading
import time

from dramatiq import Broker
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import AcquireResult, Waiter
from dramatiq_guard.claim import Claim, Deliver
from dramatiq_guard.middleware.slots.waits import time_limit_paused

#: How many waiters per key are kept on the broker ahead when ``lookahead`` is None: the key's
#: standby window (its limit, at least ``MIN_STANDBY_WINDOW``), at most this. A release reads that
#: many waiters to find the ones to send, so the window costs Redis time on every release of a key
#: with waiters: 16 keeps it flat in the limit (docs/slots.md, "Standbys"), and covers 16
#: hand-offs of a worker's pickup latency.
DEFAULT_LOOKAHEAD = 16


class StandbySeats:
    """How many threads of this process may block as standbys at once (``standby_threads``)."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self._taken = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Take a seat for this thread, unless all are taken."""
        with self._lock:
            if self._taken >= self.seats:
                return False
            self._taken += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._taken -= 1


class Standbys:
    """How many waiters per key a process keeps on the broker ahead, and its standby seats.

    Parameters:
      lookahead(int|None): Waiters per key sent ahead (at most the key's
        limit, or ``MIN_STANDBY_WINDOW`` for a smaller one); None:
        :data:`DEFAULT_LOOKAHEAD`; 0: none.
      seats(int): How many threads may block as standbys (``standby_threads``).
      wait_ms(int): How long a picked-up standby blocks for a slot (``standby_wait``).
    """

    def __init__(self, lookahead: int | None, seats: int, wait_ms: int = 5_000) -> None:
        self.lookahead = lookahead
        self.seats = StandbySeats(seats)
        self.wait_ms = wait_ms

    def count(self) -> int:
        """How many waiters per key to keep on the broker (0 if this process lets no standby block)."""
        if self.seats.seats <= 0:
            return 0
        return self.lookahead if self.lookahead is not None else DEFAULT_LOOKAHEAD

    def count_after(self, held_ms: float, limit: int | None) -> int:
        """How many waiters to keep on the broker after a job that held its slot ``held_ms``.

        :meth:`count`, but no more than are expected to get a slot within
        ``standby_wait`` (``wait_ms``): a slot of ``limit`` frees about every
        ``held_ms / limit``, so the ``k``-th standby waits about ``k`` times
        that (see the module docstring); none after a job that held its slot
        longer than ``standby_wait`` times the limit. ``limit`` None (not
        known here) counts as 1.
        """
        count = self.count()
        if count <= 0 or held_ms <= 0:
            return count
        slots = limit if limit is not None and limit > 0 else 1
        return min(count, int(self.wait_ms * slots // held_ms))


def wait_as_standby(
    broker: Broker, message: MessageProxy, claim: Claim, payload: bytes, seats: StandbySeats, *, wait_ms: int,
    deliver: Deliver,
) -> AcquireResult:  # fmt: skip
    """Block as a standby until a slot is handed to the message, up to ``wait_ms``.

    ``claim`` carries the generation of the copy the worker holds (every acquire passes it, so
    the copy is stale once it has parked again) and who runs it.

    Returns the acquired result, or a parked one: the standby parks again in
    its place when ``wait_ms`` passes, when its entry lapsed meanwhile (it
    parks at the back), or at once when every seat is taken.
    """
    if not seats.take():
        result = claim.acquire(Waiter(payload=payload))
        deliver(result.handoffs)
        return result
    try:
        with time_limit_paused(broker, message) as rearm:
            result = claim.block(time.monotonic() + wait_ms / 1000, deliver, payload=payload)
            if result.acquired:
                rearm()
            return result
    finally:
        seats.give_back()
