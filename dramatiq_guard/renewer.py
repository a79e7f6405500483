"""The lease renewer: one daemon thread per process keeps every held lease alive.

It renews each registered lease every third of its ttl, one backend's due leases in one
:meth:`~dramatiq_guard.backends.GuardBackend.renew_many` call on a thread of its own (one call in
flight per backend), and marks a lease lost when a renewal is refused or its known-valid time
passes (docs/failure-model.md, "A silent Redis"). A forked child starts with a renewer of its own.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import TypeVar

from dramatiq_guard.backends.base import GuardBackend

logger = logging.getLogger(__name__)


class LostFlag:
    """A :class:`threading.Event` that is never cleared, whose Event is made only when a thread
    waits before it is set (a lease is made per message, and nearly none is waited for). The lock
    that makes the Event is every flag's: it is taken only to set a flag or to wait for one.

    Made with no ``__init__`` of its own: one or two are made for each lease (each message).

    Attributes:
      value(bool): Whether :meth:`set` was called (what :meth:`is_set` says, read without a call).
    """

    _lock = threading.Lock()
    value: bool = False
    _event: threading.Event | None = None

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self.value

    def set(self) -> None:
        """Set the flag and wake the threads waiting for it."""
        self.value = True
        event = self._event
        if event is None:
            with self._lock:  # a waiter may be making it right now
                event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds pass; return whether it is set."""
        if self.value:
            return True
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        # Set before the Event existed: set() found none to wake (it read it under the lock).
        return self.value or event.wait(timeout)


#: How soon a renewal that failed (backend unreachable) is tried again, at most.
RETRY_S = 1.0

#: The share of a ttl kept back from a lease's known-valid time: the most the
#: backend's clock may run faster than this process's (as Redlock's drift factor).
CLOCK_DRIFT = 0.01
#: And a fixed margin on top, in seconds (clock resolution, the server's ms rounding).
CLOCK_MARGIN_S = 0.002


_NOT_RENEWED = "it was not renewed before its known-valid time passed (the backend did not answer in time)"


def known_valid_until(sent: float, ttl_ms: int) -> float:
    """Until when a lease extended by ``ttl_ms`` in a request sent at ``sent`` (``time.monotonic()``)
    is surely held: ``sent`` plus the ttl less 1 % of it and 2 ms."""
    return sent + ttl_ms * (1 - CLOCK_DRIFT) / 1000 - CLOCK_MARGIN_S


#: Taken to mark a lease lost (rare: one lock for every lease, not one made per lease).
_marking = threading.Lock()


class LeaseHandle:
    """A lease the renewer keeps time for (:meth:`LeaseRenewer.register` makes one; a
    :class:`~dramatiq_guard.Lease` is one).

    It is held ``ttl_ms`` from ``valid_from`` (``time.monotonic()``; None: now), or ``valid_for_ms``
    when less (a slot taken by a wake keeps its reservation's deadline: renewed a third of the way
    into that, so a short job costs no renewal); and at most ``cap_ms`` (None: no cap): it is not
    renewed when the acquire's own deadline is the cap, and it is ended on the backend and marked
    lost when the cap passes.

    Attributes:
      valid_until(float): The lease's known-valid time (``time.monotonic()``), moved forward by
        each renewal that comes back, never past the cap's.
    """

    def __init__(
        self,
        backend: GuardBackend,
        key: str,
        holder: str,
        ttl_ms: int,
        *,
        valid_for_ms: int | None = None,
        valid_from: float | None = None,
        cap_ms: int | None = None,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"a lease ttl must be a positive number of milliseconds, got {ttl_ms!r}")
        self.backend = backend
        self.key = key
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.cap_ms = cap_ms
        self._lost = LostFlag()
        self._renewer: LeaseRenewer | None = None  # the one that keeps its time, once added
        # Set by register, cleared by unregister (under the renewer's lock): whether
        # the lease is judged by time (a lease unregistered to be released is not).
        self._active = False
        now = time.monotonic()
        start = valid_from if valid_from is not None and valid_from < now else now
        # Guarded by the renewer's lock.
        valid_ms = renew_ms = ttl_ms
        if valid_for_ms is not None:
            valid_ms, renew_ms = valid_for_ms, min(ttl_ms, valid_for_ms)
        self.due = start + renew_ms / 3000
        self.valid_until = known_valid_until(start, valid_ms)
        # Past this the cap has surely passed on the backend too: the lease ends.
        self._cap_until = math.inf
        if cap_ms is not None:
            self._cap_until = known_valid_until(start, cap_ms)
            self.valid_until = min(self.valid_until, self._cap_until)
            if cap_ms <= ttl_ms and valid_for_ms is None:
                self.due = math.inf  # the acquire's own deadline is the cap: nothing to renew

    @property
    def lost(self) -> bool:
        """Whether the lease is lost: found so, or (while registered) past its known-valid time,
        which marks it lost at once, for good."""
        if self._lost.value:
            return True
        if self._active and time.monotonic() >= self.valid_until:
            self._lapse()
            return True
        return False

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is found lost or ``timeout`` seconds pass; return whether it is lost."""
        return self._lost.wait(timeout) or self.lost

    def unregister(self) -> None:
        """Stop renewing this lease (call it before releasing the lease)."""
        if self._renewer is not None:
            self._renewer.unregister(self)

    def mark_lost(self, why: str | None = None) -> bool:
        """Record that the lease is lost and stop renewing it; ``why``, if given, is logged as a
        WARNING by whoever marks it first. Returns whether this call marked it."""
        with _marking:
            first = not self._lost.value
            self._lost.value = True
        # Unregistered after it is marked: a reader never finds it neither renewed nor lost.
        self.unregister()
        if first:
            if why is not None:
                logger.warning("The lease of %r on guard key %r was lost: %s.", self.holder, self.key, why)
            self._lost.set()  # wakes wait_lost()
        return first

    def _lapse(self, why: str = _NOT_RENEWED) -> None:
        """Its known-valid time passed (``why``): it is lost; at its cap, it is also ended on the
        backend now (on a thread of its own: a silent backend holds back no other lease)."""
        if self.valid_until < self._cap_until:
            self.mark_lost(why)
        elif self.mark_lost(f"it reached its ttl of {self.cap_ms} ms"):
            threading.Thread(
                target=self._end_on_backend, name="dramatiq-guard-lease-end", daemon=True
            ).start()

    def _end_on_backend(self) -> None:
        try:
            # A renewal to 0 ms ends the lease now; the next operation on the key reclaims it.
            self.backend.renew(self.key, self.holder, ttl_ms=0)
        except Exception:
            logger.warning(
                "Could not end the capped lease of %r on %r.", self.holder, self.key, exc_info=True
            )

    def __repr__(self) -> str:
        return (
            f"LeaseHandle(key={self.key!r}, holder={self.holder!r}, ttl_ms={self.ttl_ms}, lost={self.lost})"
        )


H = TypeVar("H", bound=LeaseHandle)


class LeaseRenewer:
    """Keeps time for registered leases on one daemon thread, and renews them from short-lived ones
    (use the process's instance, :func:`get_renewer`)."""

    def __init__(self) -> None:
        # The condition's lock, taken bare where nothing waits or is woken (no call of the condition's).
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._leases: set[LeaseHandle] = set()
        # Backends (by id) with a renewal call in flight: their leases wait for it.
        self._busy: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # When the thread wakes by itself (monotonic; inf: only when woken, -inf: it is awake).
        self._sleeping_until = -math.inf

    def register(
        self,
        backend: GuardBackend,
        key: str,
        holder: str,
        ttl_ms: int,
        *,
        valid_for_ms: int | None = None,
        valid_from: float | None = None,
    ) -> LeaseHandle:
        """Start renewing a lease that was just acquired, every third of ``ttl_ms`` (the parameters
        are :class:`LeaseHandle`'s). Returns the handle to watch (``lost``) and to unregister;
        :class:`ValueError` if ``ttl_ms`` is not positive."""
        return self.add(
            LeaseHandle(backend, key, holder, ttl_ms, valid_for_ms=valid_for_ms, valid_from=valid_from)
        )

    def add(self, handle: H) -> H:
        """Start keeping time for ``handle`` (a lease just acquired), and return it."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the lease renewer was stopped")
            self._leases.add(handle)
            handle._renewer, handle._active = self, True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dramatiq-guard-renewer", daemon=True)
                self._thread.start()
            if handle.due < self._sleeping_until or handle.valid_until < self._sleeping_until:
                # Only a lease due before the thread wakes anyway wakes it (not one per message).
                self._changed.notify()
        return handle

    def unregister(self, handle: LeaseHandle) -> None:
        """Stop renewing ``handle``'s lease. A renewal already sent may still land; none starts after."""
        with self._lock:
            self._leases.discard(handle)
            handle._active = False

    @property
    def leases(self) -> int:
        """How many leases are being renewed."""
        with self._changed:
            return len(self._leases)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread (for tests and interpreter shutdown); registered leases stop being renewed."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    if self._stopping:
                        return
                    lapsed, batches, next_at = self._next()
                    if lapsed or batches:
                        break
                    self._sleeping_until = math.inf if next_at is None else next_at
                    self._changed.wait(None if next_at is None else max(0.0, next_at - time.monotonic()))
                    self._sleeping_until = -math.inf  # awake: it looks at every lease before sleeping
            for handle in lapsed:
                handle._lapse()
            for batch in batches:
                threading.Thread(
                    target=self._renew, args=(batch,), name="dramatiq-guard-renewal", daemon=True
                ).start()

    def _next(self) -> tuple[list[LeaseHandle], list[list[LeaseHandle]], float | None]:
        """Under the lock: the leases past their known-valid time, the batches to renew now (one
        per backend, marked busy), and the ``time.monotonic()`` of the next look (None: when woken)."""
        now = time.monotonic()
        lapsed = [h for h in self._leases if h.valid_until <= now]
        for handle in lapsed:
            self._leases.discard(handle)  # no longer renewed; mark_lost unregisters it
        next_at = min((h.valid_until for h in self._leases), default=None)
        idle: dict[int, list[LeaseHandle]] = {}
        for handle in self._leases:
            if id(handle.backend) not in self._busy:
                idle.setdefault(id(handle.backend), []).append(handle)
        batches = []
        for backend_id, handles in idle.items():
            next_due = min(h.due for h in handles)
            if next_due <= now:
                # Leases due within half a period more go along, early: one
                # round trip renews them all instead of one round trip each.
                batches.append([h for h in handles if h.due - h.ttl_ms / 6000 <= now])
                self._busy.add(backend_id)
            elif next_at is None or next_due < next_at:
                next_at = next_due
        return lapsed, batches, next_at

    def _renew(self, handles: list[LeaseHandle]) -> None:
        """Renew one backend's due leases (on a thread of its own: the call may block)."""
        backend = handles[0].backend
        sent = time.monotonic()
        try:
            renewed = backend.renew_many([(h.key, h.holder, h.ttl_ms) for h in handles])
        except Exception:
            logger.warning("Could not renew %d guard lease(s); retrying.", len(handles), exc_info=True)
            renewed = None
        refused, lapsed = [], []
        with self._changed:
            self._busy.discard(id(backend))
            self._changed.notify()
            now = time.monotonic()
            for i, handle in enumerate(handles):
                if handle not in self._leases:
                    continue  # unregistered or found lost meanwhile: its result does not matter
                if now >= handle.valid_until:
                    lapsed.append(handle)  # came back too late: it may have lapsed meanwhile
                elif renewed is not None and renewed[i]:
                    handle.valid_until = min(known_valid_until(sent, handle.ttl_ms), handle._cap_until)
                    handle.due = sent + handle.ttl_ms / 3000
                elif renewed is None:
                    handle.due = min(handle.valid_until, now + min(RETRY_S, handle.ttl_ms / 3000))
                else:
                    refused.append(handle)
        for handle in refused:
            handle.mark_lost("a renewal found it lapsed and reclaimed, or released by force")
        for handle in lapsed:
            handle._lapse("its renewal came back after its known-valid time")


_renewer: LeaseRenewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> LeaseRenewer:
    """The process's lease renewer (created on first use, and anew in a forked child)."""
    global _renewer
    renewer = _renewer
    if renewer is not None:  # made already: no lock to read it (one is made per process)
        return renewer
    with _renewer_lock:
        if _renewer is None:
            _renewer = LeaseRenewer()
        return _renewer


def _forget_after_fork() -> None:
    # The parent's renewer thread does not exist in the child, and its leases
    # belong to the parent: the child starts with nothing.
    global _renewer, _renewer_lock, _marking
    _renewer_lock = threading.Lock()
    _marking = threading.Lock()
    _renewer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
