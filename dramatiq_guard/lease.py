"""Leases: what a holder of a mutex or a concurrency slot holds.

A :class:`Lease` is one holder's membership of a guard key, with a deadline
on the backend's clock. While it is held, the process's lease renewer
(:mod:`dramatiq_guard.renewer`) extends it every third of its duration; if
the process dies, renewals stop and the lease lapses within one lease
duration, after which any operation on the key reclaims the slot.

Every acquire returns a *fencing token* that is strictly greater than every
token issued before for the same key. Pass it along with writes to a
downstream system that can check it (reject a write whose token is lower
than one it has already seen): a holder that was paused past its lease and
lost it then cannot overwrite the work of the holder that came after it.

A holder is always told when it loses its lease: :attr:`Lease.lost` turns
True when a renewal is refused (the lease lapsed and was taken, or was
released by force), and at the latest when the lease's *known-valid time*
passes without a renewal having come back: the moment the acquire (or the
last renewal that came back) was sent, plus its ttl, less a margin for clock
drift (see :mod:`dramatiq_guard.renewer`). That holds whatever the client is
doing: a Redis that stops answering without closing the connection leaves
the renewal blocked in its socket, and the lease is lost on time all the
same. Then :meth:`Lease.check` raises :class:`~dramatiq_guard.errors.LeaseLost`,
and the release reports it (:attr:`Lease.lost`; a backend that still finds
the lease gone says ``released=False``). Lost is final.

``cap`` (the ``ttl`` of a ``mutex`` or ``concurrency`` option, and of the
standalone lock) bounds how long a lease may be held, renewals included:
when it passes, renewals stop and the lease is expired on the backend at
once (the holder sees it as lost).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import cast

from dramatiq_guard.backends.base import GuardBackend, ReleaseResult
from dramatiq_guard.errors import LeaseLost
from dramatiq_guard.renewer import LeaseHandle, LostFlag, get_renewer, known_valid_until

logger = logging.getLogger(__name__)

#: A random id of this process, made again in a forked child (a Dramatiq worker process).
_process_id = os.urandom(8).hex()


def _new_process_id() -> None:
    global _process_id
    _process_id = os.urandom(8).hex()


if hasattr(os, "register_at_fork"):  # POSIX: a forked worker process is a runner of its own
    os.register_at_fork(after_in_child=_new_process_id)


def runner_id() -> str:
    """Who runs a job on this thread: ``"<a random id of this process>:<the thread's id>"``.

    The guard middlewares acquire a message's slot with it (the ``runner`` of
    :meth:`~dramatiq_guard.backends.GuardBackend.acquire`): a second copy of
    the message, delivered again while the first still holds the slot, runs
    on another thread and is refused instead of running beside it.
    """
    return f"{_process_id}:{threading.get_ident()}"


class Lease:
    """A held slot of a guard key: its holder, fencing token and whether it is still held.

    Leases are made by the guard middlewares (``dramatiq_guard.current_lease()``
    inside a guarded actor) and by :class:`dramatiq_guard.lock.Lock`; do not
    build one yourself.

    Parameters:
      backend(GuardBackend): The backend the lease lives on.
      key(str): The guard key (with its capability prefix, e.g. ``"mutex:report"``).
      holder(str): The holder id (a message id, or a random id for the standalone lock).
      token(int): The fencing token of this acquire.
      limit(int): The default limit of the key, used to hand the slot on at release.
      ttl_ms(int): The lease duration (renewed every third of it).
      cap_ms(int|None): The most the lease may be held, renewals included.
      reserved_ms(int|None): Given when the slot was taken by a wake
        (:attr:`AcquireResult.reserved_ms
        <dramatiq_guard.backends.AcquireResult>`): the backend deadline is
        still the hand-off reservation, at least this long from
        ``valid_from``, so the lease is renewed (a third of the way into
        that), whatever ``cap_ms``.
      valid_from(float|None): :attr:`AcquireResult.valid_from
        <dramatiq_guard.backends.AcquireResult>`: when the lease surely
        started (``time.monotonic()`` before the acquire was sent, or when the
        wake was taken). None: when this object is made.

    Attributes:
      key(str): The guard key.
      holder(str): The holder id.
      token(int): The fencing token: strictly greater than every token issued
        before it for this key.
      acquired_at(float): When it was acquired (``time.time()``).
      release_result(ReleaseResult|None): What the release reported, once released.
    """

    def __init__(  # noqa: PLR0913
        self,
        backend: GuardBackend,
        key: str,
        holder: str,
        token: int,
        *,
        limit: int,
        ttl_ms: int,
        cap_ms: int | None = None,
        reserved_ms: int | None = None,
        valid_from: float | None = None,
    ) -> None:
        self.backend = backend
        self.key = key
        self.holder = holder
        self.token = token
        self.limit = limit
        self.ttl_ms = ttl_ms
        self.cap_ms = cap_ms
        self.acquired_at = time.time()
        self.release_result: ReleaseResult | None = None
        self._released = False
        self._lost = LostFlag()
        self._handle: LeaseHandle | None = None
        start = time.monotonic() if valid_from is None else valid_from
        # Past these (time.monotonic()) the lease is lost: the cap, and (when it
        # is not renewed) the known-valid time of the acquire.
        self._ends_at = None if cap_ms is None else start + cap_ms / 1000
        self._valid_until: float | None = None
        if cap_ms is None or cap_ms > ttl_ms or reserved_ms is not None:
            # The backend deadline is ttl_ms (or a reservation): keep it alive while held.
            renew_ms = ttl_ms if cap_ms is None else min(ttl_ms, cap_ms)
            self._handle = get_renewer().register(
                backend, key, holder, renew_ms, valid_for_ms=reserved_ms, valid_from=valid_from
            )
            self._handle.on_lost.append(lambda _handle: self._lost.set())
        else:
            # The acquire's own deadline (cap_ms) ends it: nothing to renew.
            self._valid_until = known_valid_until(start, cap_ms)
        if cap_ms is not None:
            _expirer.schedule(self, max(0, int((start - time.monotonic()) * 1000) + cap_ms))

    @property
    def fencing_token(self) -> int:
        """The fencing token (same as :attr:`token`)."""
        return self.token

    @property
    def lost(self) -> bool:
        """Whether the lease was lost while held: it lapsed, was reclaimed, or hit its cap.

        True from the moment the lease's known-valid time passed without a
        renewal having come back, even while a renewal is still blocked on a
        backend that does not answer: from then on another holder may have
        it. Once True it stays True (also after :meth:`release`).
        """
        if self._lost.is_set():
            return True
        if self._released:
            return False
        if self._handle is not None and self._handle.lost:  # marks it lost past its known-valid time
            self._lost.set()
            return True
        now = time.monotonic()
        if (self._valid_until is not None and now >= self._valid_until) or (
            self._ends_at is not None and now >= self._ends_at
        ):
            self._lost.set()
            return True
        return False

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    @property
    def held(self) -> bool:
        """Whether the lease is, as far as this process knows, still held.

        False once it was released or found lost, and from its known-valid
        time on. True is only true at the moment it is read: a process paused
        right after (a long GC, SIGSTOP) may act on it after the lease lapsed,
        so protect downstream writes with :attr:`token`, not with this flag
        alone.
        """
        return not self._released and not self.lost

    def check(self) -> None:
        """Raise :class:`~dramatiq_guard.errors.LeaseLost` if the lease was lost.

        Raises:
          LeaseLost: The lease lapsed, was taken over, or its known-valid time passed.
        """
        if self.lost:
            raise LeaseLost(self.key, self.holder)

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is found lost, or ``timeout`` seconds pass.

        Returns:
          bool: Whether it is lost.
        """
        return self._lost.wait(timeout) or self.lost

    def release(self, *, send_ahead: int = 0) -> ReleaseResult:
        """Stop renewing the lease and give the slot back (checked: only this holder's own).

        The freed slot is handed to the oldest waiter of the key; the result's
        ``handoffs`` with a payload must be re-enqueued by the caller (the
        middlewares and the lock do it), and its ``standbys`` (sent ahead when
        ``send_ahead`` > 0, see
        :meth:`~dramatiq_guard.backends.GuardBackend.release`) enqueued and
        confirmed. If ``released`` is False the lease had been lost before it
        was released: :attr:`lost` is then True. :attr:`lost` is also True
        (with ``released`` True) when its known-valid time passed before the
        release: the backend did not answer a renewal in time, so the holder
        was told it lost the lease, though nobody had taken it. The caller
        reports a loss by :attr:`lost`. Releasing twice returns the first
        result.

        On a backend that does not answer, the call lasts as long as the
        client lets it (its socket timeout).

        Raises:
          BackendUnavailable: The backend could not be reached; the lease is
            no longer renewed and lapses within one lease duration
            (:attr:`lost` says whether it was lost before).
        """
        if self.release_result is not None:
            return self.release_result
        self._stop()
        return self._released_as(
            self.backend.release(self.key, self.holder, limit=self.limit, send_ahead=send_ahead)
        )

    def _stop(self) -> None:
        """Decide whether it was lost (before the release), and stop renewing and capping it."""
        _ = self.lost  # past its known-valid time: lost is decided now, before the release
        self._released = True
        if self._handle is not None:
            self._handle.unregister()
        if self.cap_ms is not None:  # only a capped lease was scheduled: no other takes the expirer's lock
            _expirer.cancel(self)

    def _released_as(self, result: ReleaseResult) -> ReleaseResult:
        if not result.released:
            self._lost.set()
        self.release_result = result
        return result

    def _expire(self) -> None:
        """The cap passed: stop renewing, tell the holder, and end the lease on the backend now.

        The backend call runs on a thread of its own: a backend that does not
        answer holds back neither this lease's holder nor the other caps.
        """
        if self._released:
            return
        if self._handle is not None:
            self._handle.unregister()
        logger.warning(
            "The lease of %r on guard key %r reached its ttl of %d ms and was ended.",
            self.holder,
            self.key,
            self.cap_ms,
        )
        if self._handle is not None:
            self._handle.mark_lost()
        self._lost.set()
        threading.Thread(target=self._end_on_backend, name="dramatiq-guard-lease-end", daemon=True).start()

    def _end_on_backend(self) -> None:
        try:
            # A renewal to 0 ms ends the lease now; the next operation on the key reclaims it.
            self.backend.renew(self.key, self.holder, ttl_ms=0)
        except Exception:
            logger.warning(
                "Could not expire the capped lease of %r on %r.", self.holder, self.key, exc_info=True
            )

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self.lost else "held"
        return f"Lease(key={self.key!r}, holder={self.holder!r}, token={self.token}, {state})"


def release_leases(backend: GuardBackend, releases: Sequence[tuple[Lease, int]]) -> list[ReleaseResult]:
    """:meth:`Lease.release` for several ``(lease, send_ahead)`` of ``backend``, in one backend call.

    One pipelined round trip on Redis (:meth:`GuardBackend.release_many
    <dramatiq_guard.backends.GuardBackend.release_many>`). A lease released
    before keeps its first result.

    Raises:
      BackendUnavailable: The backend could not be reached; none of them is
        renewed any more, and each lapses within one lease duration.
    """
    pending = [(lease, send_ahead) for lease, send_ahead in releases if lease.release_result is None]
    for lease, _ in pending:
        lease._stop()
    results = backend.release_many([(lease.key, lease.holder, lease.limit, n) for lease, n in pending])
    for (lease, _), result in zip(pending, results, strict=True):
        lease._released_as(result)
    return [cast(ReleaseResult, lease.release_result) for lease, _ in releases]  # each has one now


class _Expirer:
    """One daemon thread that ends capped leases when their cap passes (a timer heap).

    Cost: O(log n) per schedule and, amortized, per cancel, in the capped leases held (a
    limit of 1,000 with a ttl has 1,000): a cancelled entry stays in the heap, skipped when
    it comes up, until cancelled entries are half of the heap, when it is rebuilt without
    them. The thread is woken only by a cap earlier than the one it sleeps until.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Lease]] = []
        # id(lease) -> the sequence number of its live entry; an entry not here is cancelled.
        self._live: dict[int, int] = {}
        self._count = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._sleeping_until = math.inf

    def schedule(self, lease: Lease, after_ms: int) -> None:
        with self._cond:
            if self._thread is None or self._pid != os.getpid():
                self._heap, self._live = [], {}
                self._sleeping_until = math.inf
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="dramatiq-guard-lease-cap", daemon=True
                )
                self._thread.start()
            at = time.monotonic() + after_ms / 1000
            number = next(self._count)
            self._live[id(lease)] = number
            heapq.heappush(self._heap, (at, number, lease))
            if at < self._sleeping_until:  # else the thread wakes first anyway, and looks again then
                self._cond.notify()

    def cancel(self, lease: Lease) -> None:
        with self._cond:
            if self._live.pop(id(lease), None) is None:
                return  # never scheduled (no cap), or already ended
            if len(self._heap) > 64 and len(self._live) * 2 < len(self._heap):
                self._heap = [entry for entry in self._heap if self._live.get(id(entry[2])) == entry[1]]
                heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._live.get(id(self._heap[0][2])) != self._heap[0][1]:
                        heapq.heappop(self._heap)  # cancelled
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    self._sleeping_until = self._heap[0][0] if self._heap else math.inf
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                    self._sleeping_until = -math.inf  # awake: it looks at the heap before sleeping
                _, _, lease = heapq.heappop(self._heap)
                del self._live[id(lease)]
            lease._expire()


_expirer = _Expirer()
