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
from typing import TypedDict

from dramatiq_guard.backends.checks import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    check_acquire,
    check_count,
    check_key,
    check_max_payload_bytes,
    check_ms,
    check_replica_waits,
)
from dramatiq_guard.backends.values import (
    HOLDERS_SHOWN,
    MIN_STANDBY_WINDOW,
    ORIGINAL_GENERATION,
    AcquireResult,
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
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "HOLDERS_SHOWN",
    "MIN_STANDBY_WINDOW",
    "ORIGINAL_GENERATION",
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
    "check_acquire",
    "check_count",
    "check_key",
    "check_max_payload_bytes",
    "check_ms",
]

logger = logging.getLogger("dramatiq_guard.backends")


class BackendSettings(TypedDict, total=False):
    """The settings of :class:`GuardBackend`, as a backend's ``**settings`` passes them on."""

    handoff_ttl_ms: int
    max_payload_bytes: int
    stale_ttl_ms: int


class GuardBackend(abc.ABC):
    """The atomic operations of the guard. The model they keep: ``docs/contract.md``.

    Every method is atomic with respect to every other on the same key, across
    threads and processes sharing the backend. Every mutating method first
    reclaims lapsed holders and returned-waiter reservations of the key and
    hands free slots to waiters, except two that return only a bool and so
    could not report a hand-off: :meth:`renew` looks at the holder's own
    entry only (a lapsed one is left for the next reclaim, never revived),
    and :meth:`confirm_handoff` reclaims but does not hand off (a slot it
    frees is handed on by the next acquire, release or sweep of the key).
    :meth:`try_lock` may skip both when the key is free, or held by a live
    holder with nothing to hand on: its answer is the same.

    Parameters:
      handoff_ttl_ms(int): How long a slot handed to a waiter stays reserved
        before it is re-enqueued (parked waiters: until
        ``confirm_handoff``; blocking waiters: until they acquire).
      max_payload_bytes(int): The largest encoded message :meth:`acquire`
        stores as a parked waiter's payload (default 256 KiB); a larger one
        is refused with :class:`~dramatiq_guard.errors.PayloadTooLarge`
        before anything is written (:meth:`check_payload`).
      stale_ttl_ms(int): How long the backend remembers which generation of a
        waiter's message may start (see *generations*): a stale copy
        that waits on the broker longer than this could start; and how long a
        key's last fencing token outlives its other state (see *fencing
        token*). Default one day.

    Attributes:
      route(str): Which broker this process delivers parked messages to (see
        *routes*); set from the broker when the backend is resolved for one
        (:func:`dramatiq_guard.resolve.route_of`). ``""``: none given.

    Raises:
      ValueError: If ``handoff_ttl_ms`` or ``stale_ttl_ms`` is out of range (:func:`check_ms`).
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
        """Refuse a payload larger than :attr:`max_payload_bytes`; called first by :meth:`acquire`.

        Raises:
          PayloadTooLarge: If ``wait`` carries a payload over the bound.
        """
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
        """Try to become a holder of ``stake.key``.

        Re-entrant: a holder that already holds the key (a reservation handed to it included)
        gets a deadline of ``now + ttl_ms`` and a new fencing token. An acquiring holder leaves
        the waiters (its stored payload dropped). Otherwise it acquires if fewer than the limit
        in force hold the key and no waiter is queued ahead of it; if refused and ``wait`` is
        given, it is queued as a waiter (keeping its place if it was). A ``wait.payload`` over
        :attr:`max_payload_bytes` is refused first, with nothing written (:meth:`check_payload`).

        Parameters:
          stake(Stake): The key, the holder and what identifies the copy that acquires.
          wait(Waiter|None): Queue the holder as a waiter if refused.

        Returns:
          AcquireResult: Its :class:`~dramatiq_guard.backends.AcquireOutcome` and token.

        Raises:
          ValueError: If the key, a number or the runner is not allowed (:func:`check_acquire`).
          PayloadTooLarge: If ``wait.payload`` is over :attr:`max_payload_bytes`.
          BackendUnavailable: If the store cannot be reached.
        """

    def try_lock(self, key: str, holder: str, *, ttl_ms: int, info: str | None = None) -> AcquireResult:
        """Take ``key`` as a limit-1 lock for ``holder`` if it is free: the send-time dedup lock.

        :meth:`acquire` of ``Stake(key, holder, 1, ttl_ms, info=info)`` without ``wait``, except
        that no fencing token is returned (the lock fences no writes). A backend may decide the
        common cases (the key is free, or held by another) more cheaply; the default calls
        :meth:`acquire`.

        Returns:
          AcquireResult: ``acquired``, or the live ``holders`` in the way.
        """
        result = self.acquire(Stake(key, holder, 1, ttl_ms, info=info))
        return dataclasses.replace(result, token=None)

    @abc.abstractmethod
    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        """Extend ``holder``'s deadline to ``now + ttl_ms``.

        Returns:
          bool: False if ``holder`` no longer holds ``key`` (its lease lapsed
          and was reclaimed, or was released by force). A lost lease is never
          re-created by a renewal.
        """

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew several ``(key, holder, ttl_ms)`` leases, in as few round trips as possible.

        The default calls :meth:`renew` for each; the Redis backend pipelines.
        """
        return [self.renew(key, holder, ttl_ms=ttl_ms) for key, holder, ttl_ms in leases]

    @abc.abstractmethod
    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        """Give up ``holder``'s slot (checked: only the holder itself releases it).

        Frees the slot and hands it to a waiter if any (see *hand-off* in
        ``docs/contract.md``). When the key
        has no holder and no waiter left, all its state except a run-time
        limit is deleted.

        Parameters:
          limit(int): The default limit (needed to hand off freed slots).
          send_ahead(int): Then, in the same atomic step, send waiters ahead
            as :meth:`send_standbys` with ``count=send_ahead`` would (0: none);
            they are the result's ``standbys``. One operation where a
            releasing worker would otherwise need two.
        """

    def release_many(self, releases: Sequence[tuple[str, str, int | None, int]]) -> list[ReleaseResult]:
        """Release several ``(key, holder, limit, send_ahead)`` holders, in as few round trips as possible.

        Each is :meth:`release` with those arguments, in order; the default
        calls it for each, the Redis backend pipelines them (one round trip).
        """
        return [
            self.release(key, holder, limit=limit, send_ahead=send_ahead)
            for key, holder, limit, send_ahead in releases
        ]

    @abc.abstractmethod
    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm that a handed-off parked message was re-enqueued.

        Drops its stored payload and sets its reservation deadline to
        ``now + ttl_ms`` (how long it may take to be picked up and start).
        If the reservation had lapsed and the waiter was put back in the
        queue meanwhile, it is taken out again (the re-enqueued copy wins),
        so a message is never both queued on the broker and parked.

        Returns:
          bool: Whether the waiter still holds its reservation.
        """

    @abc.abstractmethod
    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        """Send the oldest parked waiters ahead as standbys, up to ``count`` of them.

        Makes the first ``min(count, window)`` waiters of the queue
        standbys (or other blocking waiters), the window being the limit in
        force, or :data:`MIN_STANDBY_WINDOW` if it is smaller (none while it
        is 0): each parked one among them is
        returned with its payload, which the caller must enqueue on the
        broker and then confirm with :meth:`confirm_standby`. It keeps its
        place and, until confirmed, its payload (``docs/contract.md``).

        Returns:
          tuple: The hand-offs of this operation (as :meth:`release`'s), and
          the standbys sent (``Handoff`` with their payloads).
        """

    @abc.abstractmethod
    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm that a standby sent by :meth:`send_standbys` was enqueued.

        If the stored payload is still ``payload``, it is dropped: the
        standby waits on the broker, without payload, until it is picked up
        or ``ttl_ms`` passes (or, if a slot was handed to it meanwhile, keeps
        it for ``ttl_ms``, as :meth:`confirm_handoff`). A standby that parked itself again
        meanwhile, or that became a parked waiter again because this came too
        late, is left parked (its enqueued copy parks into the same entry
        when picked up).

        Returns:
          bool: Whether the standby (or its reserved slot) is in place.
        """

    @abc.abstractmethod
    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """Block until a blocking waiter is handed a slot, or ``timeout_ms`` passes.

        Woken by a push from the operation that handed the slot, never by
        polling. The hand-off issued the waiter's fencing token and pushed it
        with the wake, so a woken waiter holds the slot at once, without
        another round trip; it must take its reservation up to a lease by
        renewing it within :attr:`Woken.reserved_ms` (at least half of
        ``handoff_ttl_ms``: a wake not taken by then is dropped, and the
        waiter's next :meth:`acquire` finds the slot still reserved for it, or
        reclaimed and handed on if it came after the reservation lapsed).

        Returns:
          Woken|None: The token and the reservation left, or None if no slot
          was handed to the waiter within ``timeout_ms``.
        """

    @abc.abstractmethod
    def forget_parked_copy(self, key: str, waiter_id: str) -> bool:
        """The broker acked the copy of ``waiter_id`` that parked after pickup: it cannot come back.

        The record of which generation may start, written when that copy
        parked (see *generations*), is forgotten if it was kept for that copy
        only: no record existed before the park, and no hand-off or standby
        send of the waiter lapsed since. Any other record stays, for
        ``stale_ttl_ms`` (a copy that must not start may still be on the
        broker). Called only for a broker whose ack is known to have landed
        (:func:`~dramatiq_guard.delivery.acks_are_final`); a copy whose worker
        died before the ack keeps its record, and the broker's second delivery
        of it never starts.

        Returns:
          bool: Whether a record was forgotten.
        """

    @abc.abstractmethod
    def cancel_wait(
        self, key: str, waiter_id: str, *, limit: int | None, generation: int | None = None
    ) -> ReleaseResult:
        """Leave the waiters of ``key``: a blocking waiter that gave up, or a message parked elsewhere.

        If a slot was handed to it meanwhile, the slot is released and handed
        on. ``released`` tells whether it was holding a reservation.

        With ``generation`` (a :attr:`Handoff.generation`), only that hand-off
        or standby send is withdrawn, and only while it is unconfirmed and
        current: the waiter still reserved by it, or still being sent. It is
        what the caller of a hand-off or send does when another guard parked
        the message on its way: the message may come back to ``key`` from
        there before this call (parked again by its enqueue, or taking up the
        reservation), and then its entry is its only place and is left as it
        is (``released`` False). Without it the waiter leaves whatever it is
        doing.
        """

    def take_back(self, key: str, holder: str, *, limit: int | None) -> ReleaseResult | None:
        """Undo an acquire of a new ``holder`` that raised: what the caller does before it reports it.

        An acquire (or :meth:`try_lock`) can raise after it was done: the
        Redis backend's :class:`~dramatiq_guard.errors.ReplicasBehind` comes
        after the script ran, and a connection can drop before its answer
        arrives. A caller told it failed retries, so what it may have left
        (a held slot or lock, a parked message) must not be there to trip the
        retry. For a holder that had nothing in ``key`` before the call (a
        message at ``send()``, a :class:`~dramatiq_guard.lock.Lock`'s fresh
        holder id) this leaves ``key`` as that holder and as that waiter
        (:meth:`cancel_wait` without a generation: a slot it got is handed on,
        a stored payload dropped); for one that had something (a worker's copy
        of a queued message, whose other copy may hold the key) it would undo
        more than the call did, and is not for it.

        Returns:
          ReleaseResult|None: The result (its hand-offs are the caller's to
          deliver), or None if this call failed too (logged): then what the
          acquire left lapses on its own (a lease or reservation at its
          deadline), or, a parked message, stays parked and starts once
          (a retry that re-enqueues the same message, same id, joins it).
        """
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
        """Reclaim lapsed holders and reservations of ``key`` and hand free slots on.

        What a worker runs periodically so waiters are never stranded when
        every holder died.
        """

    def sweep_many(self, keys: Sequence[tuple[str, int | None]]) -> list[ReleaseResult]:
        """:meth:`sweep` each ``(key, limit)``, in order; one result per key.

        The Redis backend sends them in pipelined batches (one round trip per
        batch); the default sweeps one after the other. Each key's sweep is
        atomic on its own, not the batch.
        """
        return [self.sweep(key, limit=limit) for key, limit in keys]

    def due_keys(self) -> list[str]:
        """The waiting keys a sweep should look at now: never fewer than those that need one.

        A key needs a sweep once one of its deadlines passed (a holder's lease
        or reservation, a ready waiter's, a standby's) or when it has a parked
        waiter only a process of another route can take. The Redis backend on
        a standalone Redis keeps its waiting-keys index scored by when each
        key is next due, so this reads only those (and every key at least
        every 30 s); the default (and a Redis Cluster) returns every waiting
        key (:meth:`waiting_keys`).
        """
        return self.waiting_keys()

    @abc.abstractmethod
    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        """Set (or with None, clear) the run-time limit of ``key``.

        Raising it hands the new slots to waiters at once. ``default`` is
        the limit in force after clearing (needed to hand off).
        """

    @abc.abstractmethod
    def get_limit(self, key: str) -> int | None:
        """The run-time limit of ``key``, or None if none is set."""

    @abc.abstractmethod
    def inspect(self, key: str, *, waiters: int | None = None) -> KeyState:
        """A snapshot of ``key`` (does not reclaim).

        ``waiters``: at most this many of the first waiters (None: all of them;
        the count of all is in :meth:`summaries`). Holders are all listed (they
        are bounded by the limit). The one operation that may read a whole key.
        """

    @abc.abstractmethod
    def waiting_keys(self) -> list[str]:
        """Keys that have waiters or unconfirmed reservations, for sweeps and inspection.

        Found through the backend's own index, never by scanning the keyspace.
        A key leaves the index when it has neither; the Redis backend on a
        Redis Cluster keeps a drained key for a grace period (see
        :class:`~dramatiq_guard.backends.RedisBackend`).
        """

    @abc.abstractmethod
    def limit_keys(self) -> list[str]:
        """Keys that have a run-time limit (:meth:`set_limit`), sorted.

        Found through an index kept by :meth:`set_limit`, never by scanning
        the keyspace, so a limited key with no holder and no waiter is found
        too (e.g. by ``dramatiq-guard inspect``).
        """

    @abc.abstractmethod
    def summaries(self, keys: Sequence[str], *, waiters: int = 0) -> list[KeySummary]:
        """A few numbers about each of ``keys``, for an overview of many keys.

        Read only (nothing is reclaimed or handed on), and cheap: O(log n +
        ``waiters``) per key in its holders and waiters, with every key's
        reads sent together (the Redis backend pipelines them, in two round
        trips when ``waiters`` > 0). A key with no state gets zero counts.
        Each key's numbers are a snapshot of that key, but not necessarily
        all of them of one instant (the Redis reads are not a transaction):
        for display, never for decisions.

        Parameters:
          keys(Sequence[str]): The guard keys, e.g. from :meth:`waiting_keys`.
          waiters(int): How many of each key's first waiters to return in
            :attr:`KeySummary.first` (with their payloads), 0 for none.

        Returns:
          list[KeySummary]: One per key, in the order of ``keys``.

        Raises:
          ValueError: If a key is invalid (:func:`check_key`) or ``waiters``
            out of range (:func:`check_count`).
        """

    def slow_call_warning(self, shortest_lease_ms: int) -> str | None:
        """Why one call could block longer than ``shortest_lease_ms`` on a backend that stops answering.

        ``dramatiq_guard.install`` logs it as a WARNING. A lease is lost on
        time whatever a call does (see :mod:`dramatiq_guard.renewer`); this
        is about the worker threads that wait in an acquire or a release.
        The default says nothing (an in-process backend always answers).

        Returns:
          str|None: The warning, naming what to set, or None.
        """
        return None

    # -- what a process asks of the store beyond the operations -----------------------------

    def check_health(self, *, allow_evicting: bool | None = None) -> None:
        """Refuse a store that would lose the guard's state silently; the default checks nothing.

        Called by :func:`dramatiq_guard.install`, and by a guard middleware used
        without it when it first resolves its backend. The Redis backend
        (:mod:`~dramatiq_guard.backends.redis_health`) refuses an evicting
        ``maxmemory-policy`` and state in a newer layout, and warns of no persistence.

        Parameters:
          allow_evicting(bool|None): True: run on a store that may evict keys, with
            a warning. None: as decided before for this backend, else as
            ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` says.

        Raises:
          EvictingRedis: If the store may evict keys and that was not allowed.
          LayoutTooNew: If its state is in a layout this version cannot read.
        """
        return

    def watch(self, interval_s: float) -> None:
        """One look at the store, by each worker process's sweep after each pass; the default does nothing.

        The Redis backend (:mod:`~dramatiq_guard.backends.redis_watch`) reports
        state its server lost since the last look (a restart, a flush, an evicted
        key) and keeps this process's record of the library it runs (for three
        sweep passes of ``interval_s`` at least). Never raises: a failed look is logged.
        """
        return

    def stop_watching(self) -> None:
        """The sweep stopped: withdraw what :meth:`watch` recorded of this process. Never raises."""
        return

    def wait_for_replicas(self, count: int, timeout_ms: int) -> None:
        """Make every decision from now on wait until ``count`` replicas acknowledge it (0: nothing changes).

        The Redis backend follows each script with ``WAIT`` (its ``replica_waits``):
        fewer acknowledgements within ``timeout_ms`` fail the operation closed
        (:class:`~dramatiq_guard.errors.ReplicasBehind`). The default has no replicas.

        Raises:
          ValueError: If ``count`` or ``timeout_ms`` is out of range (:func:`check_replica_waits`).
          ConfigurationError: If ``count`` is not 0 and the store has no replicas.
        """
        check_replica_waits(count, timeout_ms)
        if count:
            raise ConfigurationError(
                f"replica_waits={count} needs the guard's state on Redis, not on a {type(self).__name__}"
            )

    def now_ms(self) -> int:
        """Now on the backend's clock, in milliseconds since the epoch; the default is the wall clock.

        What the command and the dashboard measure ages and lapses against (the
        Redis backend reads Redis ``TIME``, the clock its scripts decide by).

        Raises:
          BackendUnavailable: If the store's clock cannot be read.
        """
        return int(time.time() * 1000)

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources held by the backend (connections, threads)."""
