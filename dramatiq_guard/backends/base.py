"""The guard backend contract: the atomic operations every capability stands on.

The model they keep, per guard key (holders, limit, fencing token, waiters, hand-off, standbys,
recorded limits, routes, generations), is written once, in ``docs/contract.md``; each method's
docstring says what it does of it. ``tests/test_backend_contract.py`` holds every backend to it.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, TypedDict

from dramatiq_guard.backends.checks import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    check_key,
    check_max_payload_bytes,
    check_ms,
    check_replica_waits,
)
from dramatiq_guard.backends.values import (
    AcquireResult,
    Due,
    Enqueue,
    Handoff,
    KeyState,
    KeySummary,
    ReleaseResult,
    Stake,
    Waiter,
    WaiterPeek,
    Woken,
)
from dramatiq_guard.errors import BackendUnavailable, ConfigurationError, PayloadTooLarge

__all__ = [
    "AcquireResult",
    "BackendSettings",
    "GuardBackend",
    "Handoff",
    "KeyState",
    "KeySummary",
    "ReleaseResult",
    "Stake",
    "Waiter",
    "WaiterPeek",
    "Woken",
    "check_key",
    "check_max_payload_bytes",
]

logger = logging.getLogger("dramatiq_guard.backends")


class BackendSettings(TypedDict, total=False):
    """The settings of :class:`GuardBackend`, as a backend's ``**settings`` passes them on."""

    handoff_ttl_ms: int
    max_payload_bytes: int
    stale_ttl_ms: int


class GuardBackend(abc.ABC):
    """The atomic operations of the guard. The model they keep: ``docs/contract.md``.

    Every method is atomic with respect to every other on the same key, across threads and
    processes sharing the backend; every mutating one first reclaims and hands off (*Hand-off*),
    except :meth:`renew` and :meth:`confirm_handoff` (it reclaims only).

    Parameters:
      handoff_ttl_ms(int): How long a slot handed to a waiter stays reserved (a parked waiter:
        until ``confirm_handoff``; a blocking one: until it acquires).
      max_payload_bytes(int): The largest encoded message :meth:`acquire` parks (default
        256 KiB); a larger one is refused with :class:`~dramatiq_guard.errors.PayloadTooLarge`.
      stale_ttl_ms(int): How long the backend remembers which generation of a waiter may start
        (*generations*), and how long a key's last fencing token outlives its other state.
        Default one day.

    Attributes:
      route(str): Which broker this process delivers parked messages to (*routes*), set when the
        backend is resolved for a broker (:func:`dramatiq_guard.resolve.route_of`); ``""``: none.

    Raises:
      ValueError: If a setting is out of range (:func:`check_ms`).
    """

    def __init__(
        self,
        *,
        handoff_ttl_ms: int = 10_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        stale_ttl_ms: int = 86_400_000,
    ) -> None:
        check_ms(handoff_ttl_ms, "handoff_ttl_ms")
        check_ms(stale_ttl_ms, "stale_ttl_ms")
        self.handoff_ttl_ms = handoff_ttl_ms
        self.max_payload_bytes = check_max_payload_bytes(max_payload_bytes)
        self.stale_ttl_ms = stale_ttl_ms
        self.route = ""

    def check_payload(self, key: str, waiter_id: str, wait: Waiter | None) -> None:
        """Raise :class:`PayloadTooLarge` for a payload over :attr:`max_payload_bytes` (:meth:`acquire`)."""
        if wait is not None and wait.payload is not None and len(wait.payload) > self.max_payload_bytes:
            raise PayloadTooLarge(key, waiter_id, len(wait.payload), self.max_payload_bytes)

    @property
    def wake_ttl_ms(self) -> int:
        """How long a hand-off's push waits to be taken: half the reservation (at least 1 ms)."""
        return max(1, self.handoff_ttl_ms // 2)

    def woken(self, token: int) -> Woken:
        """A wake taken now: its token, and the reservation it has left at least (the other half)."""
        return Woken(token, self.handoff_ttl_ms - self.wake_ttl_ms)

    @abc.abstractmethod
    def acquire(self, stake: Stake, wait: Waiter | None = None) -> AcquireResult:
        """Try to become a holder of ``stake.key``; if refused and ``wait`` is given, queue as a waiter.

        Re-entrant: a holder that holds the key already (a reservation handed to it included) gets
        ``now + ttl_ms`` and a new fencing token, and leaves the waiters (its payload dropped).

        Raises:
          ValueError: If the key, a number or the runner is not allowed (:func:`check_acquire`).
          PayloadTooLarge: If ``wait.payload`` is over :attr:`max_payload_bytes` (nothing written).
          BackendUnavailable: If the store cannot be reached.
        """

    def try_lock(self, key: str, holder: str, *, ttl_ms: int, info: str | None = None) -> AcquireResult:
        """The send-time dedup lock: :meth:`acquire` of ``Stake(key, holder, 1, ttl_ms, info=info)``
        without ``wait`` and without a fencing token (a backend may decide the common cases more
        cheaply): ``acquired``, or the live ``holders`` in the way."""
        result = self.acquire(Stake(key, holder, 1, ttl_ms, info=info))
        return dataclasses.replace(result, token=None)

    def enqueues_on(self, broker: Any) -> bool:
        """Whether :meth:`lock_and_enqueue`, :meth:`reserve_and_enqueue` and :meth:`enqueue_and_confirm`
        can push to ``broker`` (default: never); checked once per broker."""
        return False

    def lock_and_enqueue(
        self, key: str, holder: str, *, ttl_ms: int, info: str, push: Enqueue
    ) -> AcquireResult | None:
        """:meth:`try_lock`, and if it is acquired, the broker's push of ``push`` in the same atomic step
        (only where :meth:`enqueues_on` said yes; the lock gets its whole ``ttl_ms``). None when the
        backend could not decide in one step: nothing was written, lock and push as usual."""
        return None

    def reserve_and_enqueue(self, stake: Stake, push: Enqueue) -> AcquireResult | None:
        """:meth:`acquire` of a new message at send, parked with ``push.data`` if refused; if it acquires,
        the broker's push of ``push`` in the same atomic step (only where :meth:`enqueues_on` said yes).
        None as :meth:`lock_and_enqueue`: acquire and push as usual."""
        return None

    @abc.abstractmethod
    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        """Extend ``holder``'s deadline to ``now + ttl_ms``; False if it no longer holds ``key`` (its
        lease lapsed and was reclaimed, or was released by force): a lost lease is never re-created."""

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        """:meth:`renew` each ``(key, holder, ttl_ms)``, in as few round trips as possible."""
        return [self.renew(key, holder, ttl_ms=ttl_ms) for key, holder, ttl_ms in leases]

    @abc.abstractmethod
    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        """Give up ``holder``'s slot and hand it on; a key left with no holder and no waiter loses all
        its state but a run-time limit.

        Parameters:
          limit(int|None): The default limit (needed to hand off freed slots).
          send_ahead(int): Then, in the same atomic step, :meth:`send_standbys` with this
            ``count`` (0: none); they are the result's ``standbys``.
        """

    def acquire_many(self, stakes: Sequence[Stake]) -> list[AcquireResult]:
        """:meth:`acquire` each stake without a wait (a refusal queues nothing), in as few round trips;
        each acquire is atomic on its own, not the whole (the caller gives back what it does not use)."""
        return [self.acquire(stake) for stake in stakes]

    @abc.abstractmethod
    def give_back(self, key: str, holder: str, *, limit: int | None) -> ReleaseResult:
        """:meth:`release` ``holder``'s slot only if it is reserved for a message not started (taken
        by no runner): a copy parked on another key gives back what it will not use, and never the
        lease of another copy of its message that runs."""

    def release_many(self, releases: Sequence[tuple[str, str, int | None, int]]) -> list[ReleaseResult]:
        """:meth:`release` each ``(key, holder, limit, send_ahead)``, in order, in as few round trips."""
        return [
            self.release(key, holder, limit=limit, send_ahead=send_ahead)
            for key, holder, limit, send_ahead in releases
        ]

    @abc.abstractmethod
    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm that a handed-off parked message was re-enqueued (*Hand-off*): its payload is
        dropped and its reservation set to ``now + ttl_ms``; one put back in the queue meanwhile is
        taken out again (never both on the broker and parked). Whether it still holds its reservation.
        """

    def enqueue_and_confirm(
        self, handoff: Handoff, push: Enqueue, *, ttl_ms: int, standby: bool = False
    ) -> bool | None:
        """The broker's push of ``push``, the re-enqueued copy of ``handoff``, and its confirmation
        (:meth:`confirm_handoff`, or with ``standby`` :meth:`confirm_standby` of ``handoff.payload``)
        in one atomic step (only where :meth:`enqueues_on` said yes); the copy is pushed whatever the
        confirmation answers. Its answer, or None when the backend could not do both in one step:
        nothing was written, push and confirm as usual."""
        return None

    @abc.abstractmethod
    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        """Send up to ``count`` of the oldest parked waiters ahead (*Standbys*), with their payloads
        (the caller enqueues each and confirms it with :meth:`confirm_standby`); returns the hand-offs
        of this operation and the standbys sent."""

    @abc.abstractmethod
    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm that a standby sent by :meth:`send_standbys` was enqueued (*Standbys*): if its stored
        payload is still ``payload`` it is dropped, and it (or a slot handed to it) lasts ``ttl_ms``.
        Whether the standby (or its reserved slot) is in place."""

    @abc.abstractmethod
    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """Block until a blocking waiter is handed a slot (it holds it, and must renew it within
        :attr:`Woken.reserved_ms`): its :class:`Woken`; None once ``timeout_ms`` passed."""

    @abc.abstractmethod
    def forget_parked_copy(self, key: str, waiter_id: str) -> bool:
        """The broker acked the copy of ``waiter_id`` that parked after pickup (*Generations*): a record
        kept for it only is forgotten (whether one was). Only for a broker whose ack is known to have
        landed (:func:`~dramatiq_guard.delivery.acks_are_final`)."""

    def debounce(
        self, key: str, waiter_id: str, payload: bytes, *, wait_ms: int, max_wait_ms: int
    ) -> tuple[tuple[str, ...], int]:
        """Make ``waiter_id`` (message ``payload``) the pending run of ``key``, superseding any other
        (*debounce*): due ``wait_ms`` from now, at most ``max_wait_ms`` after its burst's first send.
        Returns the waiters superseded, and in how many ms the run is due."""
        raise NotImplementedError

    def copy_is_live(self, key: str, waiter_id: str, generation: int) -> bool:
        """Whether the copy of ``waiter_id`` carrying ``generation`` may start (*generations*); if it
        may, it starts: its hand-off is confirmed (as :meth:`confirm_handoff`, for 1 ms) if it was not."""
        raise NotImplementedError

    @abc.abstractmethod
    def cancel_wait(
        self, key: str, waiter_id: str, *, limit: int | None, generation: int | None = None
    ) -> ReleaseResult:
        """Leave the waiters of ``key``; a slot handed to it meanwhile is released and handed on
        (``released``). With ``generation``, only that hand-off or standby send is withdrawn, while
        it is unconfirmed and current."""

    def take_back(self, key: str, holder: str, *, limit: int | None) -> ReleaseResult | None:
        """Undo an acquire of a new ``holder`` that raised (it may have been done: ``ReplicasBehind``,
        a reply lost), so a retry does not trip on it: :meth:`cancel_wait` without a generation. Its
        result (the hand-offs are the caller's to deliver), or None if this failed too (logged; what
        was left lapses, or starts once)."""
        try:
            return self.cancel_wait(key, holder, limit=limit)
        except BackendUnavailable:
            logger.warning(
                "Could not take back (or make durable the take-back of) what %s may hold or have parked "
                "in %r after its acquire failed.",
                holder,
                key,
                exc_info=True,
            )
            return None

    @abc.abstractmethod
    def sweep(self, key: str, *, limit: int | None) -> ReleaseResult:
        """Reclaim lapsed holders and reservations of ``key`` and hand free slots on (each worker, now
        and then); ``released``: a lapsed holder was reclaimed."""

    def sweep_many(self, keys: Sequence[tuple[str, int | None]]) -> list[ReleaseResult]:
        """:meth:`sweep` each ``(key, limit)``, in order; each key's sweep is atomic, not the batch."""
        return [self.sweep(key, limit=limit) for key, limit in keys]

    def due_keys(self, prompt: Sequence[str] = (), *, within_ms: int = 0) -> Due:
        """The waiting keys a sweep should look at now (one a deadline of which passed, or that waits for
        another route), never fewer; and in how many ms the first key starting with one of ``prompt``
        is due, if within ``within_ms``. The default returns :meth:`waiting_keys`, and no time."""
        return Due(self.waiting_keys())

    @abc.abstractmethod
    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        """Set (or with None, clear) the run-time limit of ``key`` and hand on the slots it frees; nobody
        is evicted. ``default``: the limit in force after clearing. ``released`` is False.
        :class:`ValueError` if ``limit`` or ``default`` is out of range (:func:`check_count`)."""

    @abc.abstractmethod
    def get_limit(self, key: str) -> int | None:
        """The run-time limit of ``key``, or None if none is set."""

    @abc.abstractmethod
    def inspect(self, key: str, *, waiters: int | None = None) -> KeyState:
        """A snapshot of ``key``, read atomically (nothing reclaimed), with at most ``waiters`` of its
        first waiters (None: all: the one operation that may read a whole key)."""

    @abc.abstractmethod
    def waiting_keys(self) -> list[str]:
        """Keys that have waiters or unconfirmed reservations, from the backend's own index (no scan)."""

    @abc.abstractmethod
    def limit_keys(self) -> list[str]:
        """Keys that have a run-time limit, sorted, from an index kept by :meth:`set_limit` (no scan)."""

    @abc.abstractmethod
    def summaries(self, keys: Sequence[str], *, waiters: int = 0) -> list[KeySummary]:
        """One :class:`KeySummary` per key of ``keys``, in order (zero counts for no state), with
        ``waiters`` of its first waiters (with their payloads); O(log n + ``waiters``) each, a
        snapshot per key, not of one instant: for display, never for decisions. :class:`ValueError`
        if a key is invalid (:func:`check_key`) or ``waiters`` out of range."""

    # -- what a process asks of the store beyond the operations (neutral defaults) ----------

    def slow_call_warning(self, shortest_lease_ms: int) -> str | None:
        """Why one call could block longer than ``shortest_lease_ms`` on a store that stops answering,
        naming what to set (``install`` logs it), or None (the default)."""
        return None

    def check_health(self, *, allow_evicting: bool | None = None) -> None:
        """Refuse a store that would lose the guard's state silently (at install, or when a middleware
        first resolves it): :class:`EvictingRedis` if it may evict keys, unless ``allow_evicting``
        (True: with a warning; None: as decided before for this backend, else as
        ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` says); :class:`LayoutTooNew` if its state is in a
        layout this version cannot read. The default checks nothing."""
        return

    def watch(self, interval_s: float) -> None:
        """One look at the store by each worker's sweep after each pass (lost state, this process's
        record); never raises. Default: nothing."""
        return

    def stop_watching(self) -> None:
        """The sweep stopped: withdraw what :meth:`watch` recorded of this process. Never raises."""
        return

    def wait_for_replicas(self, count: int, timeout_ms: int) -> None:
        """Make every decision from now on wait until ``count`` replicas acknowledge it (0: no change);
        fewer within ``timeout_ms`` fail it closed (``ReplicasBehind``). :class:`ValueError` if either
        is out of range; :class:`ConfigurationError` for a ``count`` on a store without replicas (the
        default)."""
        check_replica_waits(count, timeout_ms)
        if count:
            raise ConfigurationError(
                f"replica_waits={count} needs the guard's state on Redis, not on a {type(self).__name__}"
            )

    def now_ms(self) -> int:
        """Now on the backend's clock, in ms since the epoch (ages and lapses are measured on it)."""
        return int(time.time() * 1000)

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources held by the backend (connections, threads)."""
