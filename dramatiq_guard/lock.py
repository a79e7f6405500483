"""A standalone lock for code that is not an actor, with the mutex's lease, renewal and fencing,
in the shape of redis-py's :class:`redis.lock.Lock` (docs/lock.md)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import dramatiq
from dramatiq import Broker

from dramatiq_guard.backends.base import GuardBackend, Handoff, Waiter
from dramatiq_guard.claim import BACKSTOP_MS, Claim, entry_ms
from dramatiq_guard.delivery import courier_for
from dramatiq_guard.errors import BackendUnavailable, LeaseLost, LockNotAcquired
from dramatiq_guard.lease import Lease
from dramatiq_guard.policies import duration_ms, timeout_s
from dramatiq_guard.resolve import backend_from, resolve_backend, route_of

__all__ = ["Lock", "LockNotAcquired", "LockRun"]  # LockNotAcquired lives in dramatiq_guard.errors

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LockRun(Generic[T]):
    """What :meth:`Lock.run` did: whether it acquired the lock and ran the function, its return
    value (None if it did not run) and the fencing token it ran under."""

    ran: bool
    value: T | None = None
    token: int | None = None


class Lock:
    """A lock on ``name``, for code outside actors (docs/lock.md), in the shape of redis-py's.

    Example:

      >>> with Lock("nightly-report", blocking_timeout=5) as lease:  # seconds, as in redis-py
      ...     build_report(fencing_token=lease.token)

    Its guard key is ``"mutex:<name>"``; its keywords and their defaults are in the table of
    docs/lock.md, "API" (``blocking_timeout`` in seconds, as in redis-py; the other durations in
    ms). Every duration runs from 0 to 366 days; a value out of range, or of another type, is a
    :class:`ValueError` naming it.
    """

    def __init__(
        self,
        name: str,
        *,
        redis: Any = None,
        broker: Broker | None = None,
        lease_ttl: int | datetime.timedelta = 30_000,
        ttl: int | datetime.timedelta | None = None,
        blocking: bool = True,
        blocking_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if not name:
            raise ValueError("a lock needs a non-empty name")
        self.name = name
        self.key = f"mutex:{name}"
        self.lease_ttl_ms = duration_ms(lease_ttl, what="lease_ttl") or 30_000
        self.ttl_ms = duration_ms(ttl, what="ttl", allow_none=True)
        self.blocking = blocking
        timeout_s(blocking_timeout, what="blocking_timeout")  # refused now, not at the first acquire
        self.blocking_timeout = blocking_timeout
        self._redis = redis
        self._broker = broker
        self._backend: GuardBackend | None = None
        self.lease: Lease | None = None
        self._last_holders: tuple[str, ...] = ()

    # -- backend and hand-offs ------------------------------------------------

    def backend(self) -> GuardBackend:
        """The guard backend (resolved on first use)."""
        if self._backend is None:
            if self._redis is not None:
                self._backend = backend_from(self._redis)
                if self._broker is not None and not self._backend.route:
                    self._backend.route = route_of(self._broker)
            else:
                self._backend = resolve_backend(self._broker or dramatiq.get_broker())
        return self._backend

    def _deliver(self, handoffs: Sequence[Handoff]) -> None:
        """Re-enqueue parked ``mutex`` messages this lock handed the key to (on its broker)."""
        if not any(h.payload is not None for h in handoffs):
            return
        try:
            broker = self._broker or dramatiq.get_broker()
        except Exception:
            logger.info("No broker to re-enqueue a hand-off on: the workers' sweep re-enqueues it.")
            return
        courier_for(broker, self.backend(), self.key).deliver(handoffs)

    # -- redis-py's shape -----------------------------------------------------

    def acquire(
        self, blocking: bool | None = None, blocking_timeout: float | datetime.timedelta | None = None
    ) -> bool:
        """Acquire the lock, waiting for it if ``blocking``, at most ``blocking_timeout`` seconds
        (None: as long as it takes; both default to the lock's).

        Returns:
          bool: Whether it was acquired (:attr:`lease` is then set).

        Raises:
          BackendUnavailable: The backend could not be reached, or no replica
            acknowledged the acquire; whatever it may have done was taken back
            first (or lapses within ``lease_ttl``), so a retry does not find it.
          RuntimeError: This object already holds the lock.
          ValueError: ``blocking_timeout`` is out of range (0 to 366 days).
        """
        if self.lease is not None and self.lease.held:
            raise RuntimeError(f"this Lock already holds {self.key!r}; make one Lock object per holder")
        blocking = self.blocking if blocking is None else blocking
        timeout = timeout_s(
            self.blocking_timeout if blocking_timeout is None else blocking_timeout, what="blocking_timeout"
        )
        ttl = self.lease_ttl_ms if self.ttl_ms is None else max(1, min(self.lease_ttl_ms, self.ttl_ms))
        claim = Claim(self.key, uuid.uuid4().hex, 1, ttl, backend=self.backend())
        try:
            wait_ms = BACKSTOP_MS if timeout is None else int(timeout * 1000)
            result = claim.acquire(Waiter(wait_ms=entry_ms(wait_ms)) if blocking else None)
        except BackendUnavailable:
            # The acquire may have been done (a reply lost): a fresh holder id has nothing else to lose.
            undone = claim.take_back()
            if undone is not None:
                self._deliver(undone.handoffs)
            raise
        self._deliver(result.handoffs)
        if blocking and not result.acquired:
            result = claim.block(None if timeout is None else time.monotonic() + timeout, self._deliver)
        if not result.acquired:
            self._last_holders = result.holders
            return False
        ttl_ms, cap_ms = self.lease_ttl_ms, self.ttl_ms
        self.lease = Lease(
            claim.backend, self.key, claim.holder, result, limit=1, ttl_ms=ttl_ms, cap_ms=cap_ms
        )
        return True

    def release(self) -> None:
        """Release the lock and hand it to the next waiter.

        Raises:
          LeaseLost: The lease was lost before the release (another holder may
            have taken it meanwhile), whether the release then succeeded or not.
          BackendUnavailable: The backend could not be reached (and the lease
            was not lost before): it lapses within ``lease_ttl``.
          RuntimeError: This object does not hold the lock.
        """
        lease = self.lease
        if lease is None or lease.released:
            raise RuntimeError(f"this Lock does not hold {self.key!r}")
        try:
            result = lease.release()
        except BackendUnavailable as exc:
            if lease.lost:
                logger.error("%r was lost before it was released, and the release failed: %s", lease, exc)
                raise LeaseLost(self.key, lease.holder) from exc
            raise
        self._deliver(result.handoffs)
        if lease.lost:
            logger.error("%r was lost before it was released: %r", lease, result)
            raise LeaseLost(self.key, lease.holder)

    def owned(self) -> bool:
        """Whether this object holds the lock (as far as this process knows)."""
        return self.lease is not None and self.lease.held

    def locked(self) -> bool:
        """Whether anyone holds the lock (a snapshot)."""
        return bool(self.backend().inspect(self.key).holders)

    def __enter__(self) -> Lease:
        if not self.acquire():
            raise LockNotAcquired(self.key, self._last_holders)
        assert self.lease is not None
        return self.lease

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            self.release()
        except LeaseLost:
            if exc is None:
                raise
            logger.error("The lease of %r was lost while the block raised %r.", self.key, exc)

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> LockRun[T]:
        """Run ``fn(*args, **kwargs)`` under the lock, if it can be acquired (the lock's defaults): whether
        it ran, its value and its fencing token.

        Raises:
          LeaseLost: It ran but the lease was lost before it finished.
        """
        if not self.acquire():
            return LockRun(False)
        assert self.lease is not None
        token = self.lease.token
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            self.__exit__(None, Exception("the function raised"), None)
            raise
        self.release()
        return LockRun(True, value, token)
