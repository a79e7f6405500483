"""Leases: what a holder of a mutex or a concurrency slot holds.

A lease is renewed by the process's renewer (:mod:`dramatiq_guard.renewer`) and is lost, at the
latest, when its known-valid time passes without a renewal coming back (docs/failure-model.md,
"A silent Redis"); its fencing token and ``cap`` are described in docs/slots.md, "Execution".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import cast

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, ReleaseResult
from dramatiq_guard.errors import LeaseLost
from dramatiq_guard.renewer import LeaseHandle, get_renewer

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


class Lease(LeaseHandle):
    """A held slot of a guard key: its holder, fencing token and whether it is still held.

    Leases are made by the guard middlewares (``dramatiq_guard.current_lease()``
    inside a guarded actor) and by :class:`dramatiq_guard.lock.Lock`; do not
    build one yourself.

    It lives on ``backend`` under ``key`` (with its capability prefix, e.g. ``"mutex:report"``)
    for ``holder``, from ``acquired`` (its token; ``valid_from``, None: now; and ``reserved_ms``
    for a slot taken by a wake, renewed a third of the way into that). ``limit`` hands the slot
    on at release; the process's renewer renews it every third of ``ttl_ms`` and ends it at
    ``cap_ms`` (:class:`~dramatiq_guard.renewer.LeaseHandle`).

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
        super().__init__(
            backend, key, holder, ttl_ms if cap_ms is None else min(ttl_ms, cap_ms),
            valid_for_ms=acquired.reserved_ms, valid_from=acquired.valid_from, cap_ms=cap_ms,
        )  # fmt: skip
        self.token = acquired.token
        self.limit = limit
        self.acquired_at = time.time()
        self.release_result: ReleaseResult | None = None
        self._released = False
        get_renewer().add(self)

    @property
    def fencing_token(self) -> int:
        """The fencing token (same as :attr:`token`)."""
        return self.token

    @property
    def lost(self) -> bool:
        """Whether the lease was lost while held: it lapsed, was reclaimed, hit its cap, or its
        known-valid time passed without a renewal coming back. Once True it stays True."""
        return super().lost

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
        """Decide whether it was lost (before the release), and stop keeping its time."""
        _ = self.lost  # past its known-valid time: lost is decided now, before the release
        self._released = True
        self.unregister()

    def _released_as(self, result: ReleaseResult) -> ReleaseResult:
        if not result.released:
            self._lost.set()
        self.release_result = result
        return result

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
