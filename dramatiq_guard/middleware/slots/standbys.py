"""Standbys: parked waiters sent to the broker ahead of a free slot, and the threads they block.

A worker that releases a slot of a key with waiters also sends the next
waiters to the broker *ahead*, so that a freed slot does not wait for the
broker to deliver the next message; picked up, a standby blocks its worker
thread in its FIFO place until a slot is handed to it by a push. A process
lets at most ``standby_threads`` threads block so (docs/slots.md, "Standbys").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from dramatiq import Broker
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, Waiter
from dramatiq_guard.delivery import Courier
from dramatiq_guard.middleware.slots.waits import time_limit_paused
from dramatiq_guard.waiting import wait_for_slot

__all__ = ["DEFAULT_LOOKAHEAD", "StandbySeats", "Standbys", "wait_as_standby"]

logger = logging.getLogger("dramatiq_guard.middleware.slots")

#: How many waiters per key are kept on the broker ahead when ``lookahead`` is None: the key's
#: standby window (its limit, at least 4: ``MIN_STANDBY_WINDOW``), at most this. A release reads
#: that many waiters to find the ones to send, so the window costs Redis time on every release of
#: a key with waiters: 16 keeps it flat in the limit (a limit of 10,000 with the whole limit as
#: the window took 24 ms of Redis time per release), and covers 16 hand-offs of a worker's pickup
#: latency.
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
    """

    def __init__(self, lookahead: int | None, seats: int) -> None:
        self.lookahead = lookahead
        self.seats = StandbySeats(seats)

    def count(self) -> int:
        """How many waiters per key to keep on the broker (0 if this process lets no standby block)."""
        if self.seats.seats <= 0:
            return 0
        return self.lookahead if self.lookahead is not None else DEFAULT_LOOKAHEAD

    def send(
        self,
        backend: GuardBackend,
        courier: Courier,
        deliver: Callable[[Sequence[Handoff]], None],
        key: str,
        limit: int,
    ) -> None:
        """Send the oldest parked waiters of ``key`` ahead (each enqueued, then confirmed).

        Failures are logged: an unsent standby parks again on its own.
        """
        count = self.count()
        if count <= 0:
            return
        try:
            handoffs, sent = backend.send_standbys(key, limit=limit, count=count)
        except Exception:
            logger.warning("Could not send the standbys of %r; they stay parked.", key, exc_info=True)
            return
        deliver(handoffs)
        courier.send_ahead(sent)


def wait_as_standby(
    broker: Broker,
    backend: GuardBackend,
    message: MessageProxy,
    key: str,
    payload: bytes,
    seats: StandbySeats,
    *,
    limit: int,
    ttl_ms: int,
    wait_ms: int,
    deliver: Callable[[Sequence[Handoff]], None],
    generation: int,
    runner: str | None = None,
) -> AcquireResult:
    """Block as a standby until a slot is handed to the message, up to ``wait_ms``.

    ``generation``: of the copy the worker holds (every acquire passes it, so
    the copy is stale once it has parked again); ``runner``: who runs it (as
    :func:`~dramatiq_guard.waiting.wait_for_slot`'s).

    Returns the acquired result, or a parked one: the standby parks again in
    its place when ``wait_ms`` passes, when its entry lapsed meanwhile (it
    parks at the back), or at once when every seat is taken.
    """
    holder = message.message_id
    if not seats.take():
        result = backend.acquire(
            key, holder, limit=limit, ttl_ms=ttl_ms, wait=Waiter(payload=payload), generation=generation,
            runner=runner,
        )  # fmt: skip
        deliver(result.handoffs)
        return result
    try:
        with time_limit_paused(broker, message) as rearm:
            result = wait_for_slot(
                backend,
                key,
                holder,
                limit=limit,
                ttl_ms=ttl_ms,
                deadline=time.monotonic() + wait_ms / 1000,
                deliver=deliver,
                payload=payload,
                info=message.actor_name,
                generation=generation,
                runner=runner,
            )
            if result.acquired:
                rearm()
            return result
    finally:
        seats.give_back()
