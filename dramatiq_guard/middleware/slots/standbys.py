"""Standbys: parked waiters sent to the broker ahead of a free slot, and the threads they block.

A worker that releases a slot of a key with waiters also sends the next
waiters to the broker *ahead*, so that a freed slot does not wait for the
broker to deliver the next message; picked up, a standby blocks its worker
thread in its FIFO place until a slot is handed to it by a push. A process
lets at most ``standby_threads`` threads block so (docs/slots.md, "Standbys").

Short jobs: a standby has one job's run, on a window of one standby per slot, to get from the
broker to a worker thread, and Dramatiq takes a few ms for that (its consumer polls every 5-10 ms
while busy; a fetched message waits for a free thread). So after a job that held its slot under
:data:`SHORT_HOLD_MS`, a release sends up to two standbys per slot
(:data:`~dramatiq_guard.backends.base.STANDBYS_PER_SLOT`), and a standby of a key whose last job
here was short may block any worker thread but one (unless ``standby_threads`` was given): it waits
a job's run or two, and a thread it holds would otherwise be idle. A long job's standbys keep one
per slot and half the threads: they may wait seconds.

Long jobs: a release sends only the standbys expected to get a slot within ``standby_wait``
(:meth:`Standbys.count_after`). Slots of a limit of ``L`` free about every ``held / L``, so the
``k``-th standby waits about ``k x held / L``; one that waits longer only blocks its thread for
``standby_wait``, parks again, and is sent again by the next release, a broker pickup each time
(3.8 pickups per message on a mutex whose 1 s jobs outlasted a 200 ms ``standby_wait``, where every
slot went to a parked message anyway, 2026-11-26).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from dramatiq import Broker
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import STANDBYS_PER_SLOT, AcquireResult, GuardBackend, Handoff, Waiter
from dramatiq_guard.delivery import Courier
from dramatiq_guard.middleware.slots.releases import MarkedKeys
from dramatiq_guard.middleware.slots.waits import time_limit_paused
from dramatiq_guard.waiting import wait_for_slot

__all__ = ["DEFAULT_LOOKAHEAD", "SHORT_HOLD_MS", "StandbySeats", "Standbys", "wait_as_standby"]

logger = logging.getLogger("dramatiq_guard.middleware.slots")

#: How many waiters per key are kept on the broker ahead when ``lookahead`` is None: the key's
#: standby window (its limit, twice that after a short job, at least 4: ``MIN_STANDBY_WINDOW``),
#: at most this. A release reads
#: that many waiters to find the ones to send, so the window costs Redis time on every release of
#: a key with waiters: 16 keeps it flat in the limit (a limit of 10,000 with the whole limit as
#: the window took 24 ms of Redis time per release), and covers 16 hand-offs of a worker's pickup
#: latency.
DEFAULT_LOOKAHEAD = 16

#: A job that held its slot for less than this (ms) is a *short job* (see the module docstring).
#: Measured on the bench's slot drain (10 ms jobs, limit 8, 2 x 8 threads): with one standby per
#: slot and half the threads, 20-35 % of the freed slots went to a standby no thread held yet, 4-6
#: ms after the slot freed; with two per slot and all threads but one, 7-10 %, and the drain went
#: from 1.01-1.12 to 0.97-1.09 times its unguarded floor (A/Bs and bench runs, 2026-11-26).
SHORT_HOLD_MS = 100


class StandbySeats:
    """How many threads of this process may block as standbys at once (``standby_threads``).

    ``seats`` for any standby; ``short_seats`` (at least ``seats``) for the standbys of short jobs.
    """

    def __init__(self, seats: int, short_seats: int | None = None) -> None:
        self.seats = seats
        self.short_seats = seats if short_seats is None else short_seats
        self._taken = 0
        self._lock = threading.Lock()

    def take(self, *, short: bool = False) -> bool:
        """Take a seat for this thread, unless all are taken (all ``short_seats`` for a ``short`` one)."""
        with self._lock:
            if self._taken >= (self.short_seats if short else self.seats):
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
        limit, twice that after a short job, or ``MIN_STANDBY_WINDOW`` for a
        smaller one); None: :data:`DEFAULT_LOOKAHEAD`; 0: none.
      seats(int): How many threads may block as standbys (``standby_threads``).
      wait_ms(int): How long a picked-up standby blocks for a slot (``standby_wait``).
    """

    def __init__(self, lookahead: int | None, seats: int, wait_ms: int = 5_000) -> None:
        self.lookahead = lookahead
        self.seats = StandbySeats(seats)
        self.wait_ms = wait_ms
        self._short_jobs = MarkedKeys()

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

    def after_job(self, key: str, held_ms: float, limit: int | None) -> tuple[int, int]:
        """What the release of a job of ``key`` that held its slot ``held_ms`` asks the backend for.

        Notes whether the job was short (:meth:`held`), then returns how many
        waiters to keep on the broker ahead (:meth:`count_after`) and within a
        window of how many standbys per slot (:meth:`per_slot`).
        """
        self.held(key, held_ms)
        return self.count_after(held_ms, limit), self.per_slot(key)

    def held(self, key: str, held_ms: float) -> None:
        """Note that a job of ``key`` held its slot ``held_ms`` here: is the key's last job here short?"""
        if held_ms < SHORT_HOLD_MS:
            self._short_jobs.mark(key)
        else:
            self._short_jobs.unmark(key)

    def short(self, key: str) -> bool:
        """Whether the last job of ``key`` here was a short job (see the module docstring)."""
        return key in self._short_jobs

    def per_slot(self, key: str) -> int:
        """How many standbys per slot the window of a send for ``key`` holds."""
        return STANDBYS_PER_SLOT if self.short(key) else 1

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
            handoffs, sent = backend.send_standbys(key, limit=limit, count=count, per_slot=self.per_slot(key))
        except Exception:
            logger.warning("Could not send the standbys of %r; they stay parked.", key, exc_info=True)
            return
        deliver(handoffs)
        courier.send_ahead(sent)


def wait_as_standby(  # noqa: PLR0913
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
    short: bool = False,
) -> AcquireResult:
    """Block as a standby until a slot is handed to the message, up to ``wait_ms``.

    ``generation``: of the copy the worker holds (every acquire passes it, so
    the copy is stale once it has parked again); ``runner``: who runs it (as
    :func:`~dramatiq_guard.waiting.wait_for_slot`'s); ``short``: the key's
    jobs are short (it may take one of the ``short_seats``).

    Returns the acquired result, or a parked one: the standby parks again in
    its place when ``wait_ms`` passes, when its entry lapsed meanwhile (it
    parks at the back), or at once when every seat is taken.
    """
    holder = message.message_id
    if not seats.take(short=short):
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
