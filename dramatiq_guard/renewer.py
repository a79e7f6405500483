"""The lease renewer: one daemon thread per process keeps every held lease alive.

A holder registers its lease right after acquiring it and unregisters it
before releasing it. The renewer renews each lease every ``ttl_ms / 3``,
batching the leases that are due on one backend into one
:meth:`~dramatiq_guard.backends.GuardBackend.renew_many` call (one round trip
on Redis); leases due within half a period more are renewed early along with
them, so leases taken at nearly the same time share their round trips.

A lease is *lost* when a renewal returns False (it lapsed and was reclaimed,
or was released by force) or when it could not be renewed before its
deadline (the backend was unreachable for a whole ttl): its handle's ``lost``
turns True and its ``on_lost`` callbacks run, on the renewer thread.

The renewer is per process: after :func:`os.fork` (Dramatiq forks its worker
processes) the child starts with a fresh, empty renewer of its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from dramatiq_guard.backends.base import GuardBackend

__all__ = ["LeaseHandle", "LeaseRenewer", "get_renewer"]

logger = logging.getLogger(__name__)

#: How soon a renewal that failed (backend unreachable) is tried again, at most.
RETRY_S = 1.0


class LeaseHandle:
    """A lease registered with the renewer.

    Parameters:
      backend(GuardBackend): The backend the lease lives on.
      key(str): The guard key.
      holder(str): The holder id.
      ttl_ms(int): The lease duration each renewal extends it by.

    Attributes:
      on_lost(list[Callable[[LeaseHandle], None]]): Called once, on the
        renewer thread, when the lease is found lost. Exceptions are logged.
    """

    def __init__(
        self,
        renewer: LeaseRenewer,
        backend: GuardBackend,
        key: str,
        holder: str,
        ttl_ms: int,
        valid_for_ms: int | None = None,
    ) -> None:
        self.backend = backend
        self.key = key
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.on_lost: list[Callable[[LeaseHandle], None]] = []
        self._renewer = renewer
        self._lost = threading.Event()
        now = time.monotonic()
        # Guarded by the renewer's lock: when the next renewal is due, and
        # until when the lease is known to be held (counted from before the
        # request that renewed it was sent). A lease that starts with less
        # than its ttl (a hand-off reservation) is renewed at once.
        self.due = now + ttl_ms / 3000 if valid_for_ms is None else now
        self.valid_until = now + (ttl_ms if valid_for_ms is None else valid_for_ms) / 1000

    @property
    def lost(self) -> bool:
        """Whether the lease was found lost (it is then no longer renewed)."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` seconds pass.

        Returns:
          bool: Whether the lease is lost.
        """
        return self._lost.wait(timeout)

    def unregister(self) -> None:
        """Stop renewing this lease (call it before releasing the lease)."""
        self._renewer.unregister(self)

    def mark_lost(self) -> None:
        """Record that the lease is lost, stop renewing it and run the ``on_lost`` callbacks once.

        Also for callers that learn it themselves (a release that reports
        ``released=False``).
        """
        self._renewer.unregister(self)
        if self._lost.is_set():
            return
        self._lost.set()
        for callback in list(self.on_lost):
            try:
                callback(self)
            except Exception:
                logger.exception(
                    "An on_lost callback of the lease of %r on %r failed.", self.holder, self.key
                )

    def __repr__(self) -> str:
        return (
            f"LeaseHandle(key={self.key!r}, holder={self.holder!r}, ttl_ms={self.ttl_ms}, lost={self.lost})"
        )


class LeaseRenewer:
    """Renews registered leases from one daemon thread, started on first use.

    Use the process's instance, :func:`get_renewer`.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._leases: set[LeaseHandle] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def register(
        self, backend: GuardBackend, key: str, holder: str, ttl_ms: int, *, valid_for_ms: int | None = None
    ) -> LeaseHandle:
        """Start renewing a lease that was just acquired.

        Parameters:
          backend(GuardBackend): The backend holding the lease.
          key(str): The guard key.
          holder(str): The holder id.
          ttl_ms(int): The lease duration; renewed every third of it.
          valid_for_ms(int|None): How long the lease is held without renewal
            from now, when less than ``ttl_ms`` (a slot taken by a hand-off
            still has its reservation deadline): it is then renewed at once.

        Returns:
          LeaseHandle: The handle to watch (``lost``) and to unregister.

        Raises:
          ValueError: If ``ttl_ms`` is not positive.
        """
        if ttl_ms <= 0:
            raise ValueError(f"a lease ttl must be a positive number of milliseconds, got {ttl_ms!r}")
        handle = LeaseHandle(self, backend, key, holder, ttl_ms, valid_for_ms)
        with self._changed:
            if self._stopping:
                raise RuntimeError("the lease renewer was stopped")
            self._leases.add(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dramatiq-guard-renewer", daemon=True)
                self._thread.start()
            self._changed.notify()
        return handle

    def unregister(self, handle: LeaseHandle) -> None:
        """Stop renewing ``handle``'s lease. A renewal already sent may still land; none starts after."""
        with self._changed:
            self._leases.discard(handle)

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
                    now = time.monotonic()
                    next_due = min((handle.due for handle in self._leases), default=None)
                    if next_due is not None and next_due <= now:
                        # Leases due within half a period more go along, early: one
                        # round trip renews them all instead of one round trip each.
                        due = [h for h in self._leases if h.due - h.ttl_ms / 6000 <= now]
                        break
                    self._changed.wait(None if next_due is None else next_due - now)
            groups: dict[int, list[LeaseHandle]] = {}
            for handle in due:
                groups.setdefault(id(handle.backend), []).append(handle)
            for handles in groups.values():
                self._renew(handles)

    def _renew(self, handles: list[LeaseHandle]) -> None:
        sent = time.monotonic()
        try:
            renewed = handles[0].backend.renew_many([(h.key, h.holder, h.ttl_ms) for h in handles])
        except Exception:
            logger.warning("Could not renew %d guard lease(s); retrying.", len(handles), exc_info=True)
            renewed = None
        lost = []
        with self._changed:
            now = time.monotonic()
            for i, handle in enumerate(handles):
                if handle not in self._leases:
                    continue  # unregistered meanwhile: its result does not matter
                if renewed is not None and renewed[i]:
                    handle.valid_until = sent + handle.ttl_ms / 1000
                    handle.due = sent + handle.ttl_ms / 3000
                elif renewed is None and now < handle.valid_until:
                    handle.due = min(handle.valid_until, now + min(RETRY_S, handle.ttl_ms / 3000))
                else:
                    lost.append(handle)
        for handle in lost:
            logger.warning("The lease of %r on guard key %r was lost.", handle.holder, handle.key)
            handle.mark_lost()


_renewer: LeaseRenewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> LeaseRenewer:
    """The process's lease renewer (created on first use, and anew in a forked child).

    Returns:
      LeaseRenewer: The renewer of the current process.
    """
    global _renewer
    with _renewer_lock:
        if _renewer is None:
            _renewer = LeaseRenewer()
        return _renewer


def _forget_after_fork() -> None:
    # The parent's renewer thread does not exist in the child, and its leases
    # belong to the parent: the child starts with nothing.
    global _renewer, _renewer_lock
    _renewer_lock = threading.Lock()
    _renewer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
