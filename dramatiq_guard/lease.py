"""Leases: what a holder of a mutex or a concurrency slot holds.

A lease is renewed by the process's renewer (:mod:`dramatiq_guard.renewer`) and is lost, at the
latest, when its known-valid time passes without a renewal coming back (docs/failure-model.md,
"A silent Redis"); its fencing token and ``cap`` are described in docs/slots.md, "Execution".
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

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, ReleaseResult
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

    The ``runner`` a message's slot is acquired with (docs/slots.md, "Execution").
    """
    return f"{_process_id}:{threading.get_ident()}"


class Lease:
    """A held slot of a guard key: its holder, fencing token and whether it is still held.

    Leases are made by the guard middlewares (``dramatiq_guard.current_lease()``
    inside a guarded actor) and by :class:`dramatiq_guard.lock.Lock`; do not
    build one yourself.

    It lives on ``backend`` under ``key`` (with its capability prefix, e.g. ``"mutex:report"``)
    for ``holder``, from ``acquired`` (its token; ``valid_from``, None: now; and ``reserved_ms``
    for a slot taken by a wake, renewed a third of the way into that). ``limit`` hands the slot
    on at release; it is renewed every third of ``ttl_ms`` and held at most ``cap_ms``.

    Attributes:
      token(int): The fencing token: greater than every token issued before it for this key.
      acquired_at(float): When it was acquired (``time.time()``).
      release_result(ReleaseResult|None): What the release reported, once released.
    """

    def __init__(
        self,
        backend: GuardBackend,
        key: str,
        holder: str,
        acquired: AcquireResult,
        *,
        limit: int,
        ttl_ms: int,
        cap_ms: int | None = None,
    ) -> None:
        if acquired.token is None:
            raise ValueError(f"a lease is made from an acquire that took the slot, not {acquired!r}")
        self.backend = backend
        self.key = key
        self.holder = holder
        self.token = acquired.token
        self.limit = limit
        self.ttl_ms = ttl_ms
        self.cap_ms = cap_ms
        self.acquired_at = time.time()
        self.release_result: ReleaseResult | None = None
        self._released = False
        self._lost = LostFlag()
        self._handle: LeaseHandle | None = None
        valid_from, reserved_ms = acquired.valid_from, acquired.reserved_ms
        start = time.monotonic() if valid_from is None else valid_from
        # Past these (time.monotonic()) the lease is lost: the cap, and (when it
        # is not renewed) the known-valid time of the acquire.
        self._ends_at = None if cap_ms is None else start + cap_ms / 1000
        self._valid_until: float | None = None
        if cap_ms is None or cap_ms > ttl_ms or reserved_ms is not None:
            # The backend deadline is ttl_ms (or a reservation): keep it alive while held.
            renew_ms = ttl_ms if cap_ms is None else min(ttl_ms, cap_ms)
            # The handle sets this lease's flag once it is found lost (no callback made per lease).
            self._handle = get_renewer().register(
                backend, key, holder, renew_ms, valid_for_ms=reserved_ms, valid_from=valid_from,
                lost=self._lost,
            )  # fmt: skip
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
        """Whether the lease was lost while held: it lapsed, was reclaimed, hit its cap, or its
        known-valid time passed without a renewal coming back. Once True it stays True."""
        if self._lost.value:
            return True
        if self._released:
            return False
        if self._handle is not None and self._handle.lost:  # marks it lost past its known-valid time
            self._lost.set()
            return True
        if self._valid_until is None and self._ends_at is None:
            return False  # (most leases: no clock to read)
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

        True only at the moment it is read: protect downstream writes with :attr:`token`.
        """
        return not self._released and not self.lost

    def check(self) -> None:
        """Raise :class:`~dramatiq_guard.errors.LeaseLost` if the lease was lost (it lapsed, was taken
        over, or its known-valid time passed)."""
        if self.lost:
            raise LeaseLost(self.key, self.holder)

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is found lost, or ``timeout`` seconds pass; return whether it is lost."""
        return self._lost.wait(timeout) or self.lost

    def release(self, *, send_ahead: int = 0) -> ReleaseResult:
        """Stop renewing the lease and give the slot back (checked: only this holder's own).

        The caller delivers the result's ``handoffs`` and ``standbys``
        (:meth:`~dramatiq_guard.backends.GuardBackend.release`) and reports a
        loss by :attr:`lost`. Releasing twice returns the first result.

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
        """The cap passed: stop renewing, tell the holder, and end the lease on the backend now
        (on a thread of its own: a silent backend holds back no other cap)."""
        if self._released:
            return
        logger.warning("The lease of %r on %r reached its ttl of %d ms.", self.holder, self.key, self.cap_ms)
        if self._handle is not None:
            self._handle.mark_lost()  # which unregisters it
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
    """:meth:`Lease.release` for several ``(lease, send_ahead)`` of ``backend``, in one
    :meth:`~GuardBackend.release_many`. A lease released before keeps its first result. If the
    backend cannot be reached (BackendUnavailable), none is renewed: each lapses within its ttl.
    """
    pending = [(lease, send_ahead) for lease, send_ahead in releases if lease.release_result is None]
    for lease, _ in pending:
        lease._stop()
    results = backend.release_many([(lease.key, lease.holder, lease.limit, n) for lease, n in pending])
    for (lease, _), result in zip(pending, results, strict=True):
        lease._released_as(result)
    # Each has a result now (one cast for the list: not a call per lease).
    return cast("list[ReleaseResult]", [lease.release_result for lease, _ in releases])


class _Expirer:
    """One daemon thread that ends capped leases when their cap passes (a timer heap).

    A cancelled entry stays in the heap until cancelled entries are half of it (O(log n)
    amortized); the thread is woken only by a cap earlier than the one it sleeps until.
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
