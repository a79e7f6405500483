"""Standbys: parked waiters sent to the broker ahead of a free slot, and the threads they block
(docs/slots.md, "Standbys" and its "Long jobs")."""

from __future__ import annotations

import threading

from dramatiq import Broker
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import AcquireResult, Waiter
from dramatiq_guard.claim import Claim, Deliver
from dramatiq_guard.middleware.slots.waits import block_for_slot

#: How many waiters per key are kept on the broker ahead when ``lookahead`` is None (at most the
#: key's standby window); every release of a key with waiters reads that many (docs/slots.md).
DEFAULT_LOOKAHEAD = 16


#: How long a standby picked up while every seat of its process is taken waits for one before it
#: parks again (a broker pickup more): Dramatiq's consumers do not share the standbys out evenly, so
#: a process can fetch more of them than it has seats, and a seat frees as soon as a standby blocked
#: on one gets its slot (docs/slots.md, "Standbys").
SEAT_WAIT_S = 0.02


class StandbySeats:
    """How many threads of this process may block as standbys at once (``standby_threads``)."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self._taken = 0
        self._freed = threading.Condition(threading.Lock())

    def take(self, wait_s: float = 0.0) -> bool:
        """Take a seat for this thread; if all are taken, wait up to ``wait_s`` for one to be given back."""
        with self._freed:
            if not self._freed.wait_for(lambda: self._taken < self.seats, wait_s):
                return False
            self._taken += 1
            return True

    def give_back(self) -> None:
        with self._freed:
            self._taken -= 1
            self._freed.notify()


class Standbys:
    """How many waiters per key a process keeps on the broker ahead (``lookahead``), and its
    standby seats (``standby_threads``) and wait (``standby_wait``)."""

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
        """:meth:`count`, but no more than are expected to get a slot within ``wait_ms`` after a
        job that held its slot ``held_ms``: the ``k``-th waits about ``k x held_ms / limit``
        (``limit`` None counts as 1)."""
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

    Returns the acquired result, or a parked one: it parks again in its place when ``wait_ms``
    passes, at the back if its entry lapsed meanwhile, and when every seat stays taken for
    :data:`SEAT_WAIT_S`.
    """
    if not seats.take(SEAT_WAIT_S):
        result = claim.acquire(Waiter(payload=payload))
        deliver(result.handoffs)
        return result
    try:
        return block_for_slot(broker, message, claim, wait_ms=wait_ms, deliver=deliver, payload=payload)
    finally:
        seats.give_back()
