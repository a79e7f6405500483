"""Enqueue-time deduplication: the ``dedup`` actor option (docs/dedup.md).

``send()`` takes a limit-1 lease per dedup key, held by the message's id; while it holds, an
identical message is diverted at the enqueue gate. The lock is confirmed in the background once
pushed, and released at the holder's terminal event for its strategy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Retries, SkipMessage

from dramatiq_guard.backends.base import GuardBackend, ReleaseResult, Stake
from dramatiq_guard.delivery import generation_of
from dramatiq_guard.errors import BackendUnavailable, DuplicateMessage
from dramatiq_guard.middleware.base import execution_state, fail_open
from dramatiq_guard.middleware.dedup_send import (
    BY_OPTION,
    EXEMPT_OPTION,
    KEY_OPTION,
    LOCK_OPTION,
    PREFIX,
    RERUN_OPTION,
    DedupSender,
    deduplicated_by,
    rerun_id,
)
from dramatiq_guard.middleware.sweep import join_sweep, leave_sweep
from dramatiq_guard.policies import DedupPolicy
from dramatiq_guard.renewer import LeaseHandle, get_renewer

__all__ = [
    "BY_OPTION",
    "EXEMPT_OPTION",
    "KEY_OPTION",
    "LOCK_OPTION",
    "PREFIX",
    "RERUN_OPTION",
    "Deduplication",
    "DuplicateMessage",
    "deduplicated_by",
    "rerun_id",
]

logger = logging.getLogger("dramatiq_guard.dedup")


class Deduplication(DedupSender):
    """Enqueue-time deduplication for actors declared with ``dedup=`` (docs/dedup.md).

    Place it before Retries, after the mutex and concurrency middlewares
    (:func:`dramatiq_guard.install` does).

    Example:

      >>> @dramatiq.actor(dedup="until_executing")
      ... def refresh_authorizations(user_id): ...
      >>> first = refresh_authorizations.send(42)
      >>> second = refresh_authorizations.send(42)
      >>> deduplicated_by(second) == first.message_id
      True

    Parameters:
      redis: The backend (see :class:`~dramatiq_guard.middleware.base.GuardMiddleware`).
      pending_ttl(int|timedelta): How long a lock taken by ``send()`` lives
        before its push is confirmed, in ms. A producer that dies between the
        lock and the push blocks duplicates this long. Default: 10 seconds.
      sweep_interval(int|timedelta): How often each worker sweeps the dedup
        keys that have a ``reschedule_once`` rerun waiting, so a rerun whose
        re-enqueue failed is handed on again. Default: 1 second.
    """

    # --- execution time ---------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        options = message.options
        if getattr(self._local, "pipe_next", None) is not None:
            self._local.pipe_next = None
        key = options.get(LOCK_OPTION)
        if not isinstance(key, str):
            return  # not a holder: nothing to do (nor for any actor that opts into nothing)
        guard = self.guard_of(message)
        if guard is not None and guard.policy.strategy == "until_expired":
            return
        backend = self.backend(broker)
        holder = message.message_id
        try:
            if guard is None or guard.policy.strategy == "until_executing":
                # (An actor no longer declared with dedup here: release at once.)
                released = backend.release(key, holder, limit=1)
                # Later attempts (retries) of a started holder take no lock.
                message.options.pop(LOCK_OPTION, None)
                message.options[EXEMPT_OPTION] = "started"
                self._deliver(broker, released.handoffs)
                return
            policy = guard.policy
            held, valid_from = self._take_lock(broker, backend, message, key, policy)
            if not held:
                return
            lease: LeaseHandle = get_renewer().register(
                backend, key, holder, policy.ttl_ms, valid_from=valid_from
            )
            execution_state(message).data[self.option] = lease
        except BackendUnavailable as e:
            if guard is None:
                raise
            fail_open(guard.policy.fail_open, e, f"{message} runs anyway")

    def _take_lock(
        self, broker: Broker, backend: GuardBackend, message: MessageProxy, key: str, policy: DedupPolicy
    ) -> tuple[bool, float | None]:
        """Make the holder's lock its lease as it starts, counting its ``ttl`` from now: whether it
        holds the lock (False: it runs without it), and the lease's start for the renewer.

        A first run renews the lock its send took (cheaper than an acquire); a lapsed one, and a
        rerun (checked by its generation), is acquired; a stale copy of a rerun is skipped
        (SkipMessage). A ``reschedule_once`` holder cancels the rerun asked for before it started:
        its run covers it.
        """
        holder = message.message_id
        generation = generation_of(message, key)
        if generation is None:
            sent = time.monotonic()
            if backend.renew(key, holder, ttl_ms=policy.ttl_ms):
                self._cancel_covered_rerun(broker, backend, key, holder, policy)
                return True, sent
            if policy.on_duplicate == "reschedule_once":
                # Its rerun stays queued behind the lapsed lock: this run covers it all the same.
                self._cancel_covered_rerun(broker, backend, key, holder, policy)
                _started_without_lock(holder, key, None)
                return False, None
        # A dedup lock fences nothing: no token kept per key.
        stake = Stake(
            key, holder, 1, policy.ttl_ms, info=message.actor_name, generation=generation, fenced=False
        )
        result = backend.acquire(stake)
        self._deliver(broker, result.handoffs)
        if result.stale:
            execution_state(message).parked = True  # not a terminal event: the newer copy runs
            message.options["store_results"] = False
            logger.info("Skipped %s: a stale copy (a newer hand-off of %r runs instead).", message, key)
            raise SkipMessage(f"stale copy of a hand-off of {key!r}")
        if not result.acquired:
            _started_without_lock(holder, key, result.holders)
            return False, None
        self._cancel_covered_rerun(broker, backend, key, holder, policy)
        return True, result.valid_from

    def _cancel_covered_rerun(
        self, broker: Broker, backend: GuardBackend, key: str, holder: str, policy: DedupPolicy
    ) -> None:
        """Of a ``reschedule_once`` holder: duplicates sent before its start are covered by its run."""
        if policy.on_duplicate == "reschedule_once":
            cancelled = backend.cancel_wait(key, rerun_id(holder), limit=1)
            self._deliver(broker, cancelled.handoffs)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        options = message.options
        target = options.get("pipe_target")
        if isinstance(target, dict) and exception is None and not message.failed:
            # Pipelines (after this middleware) enqueues this next step from this thread: let it through.
            self._local.pipe_next = target.get("message_id")
        if LOCK_OPTION not in options:
            return  # not a holder (its lock and lease exist only with the option): nothing to release
        will_retry = exception is not None and not message.failed and self._has_retries(broker)
        self._finish(broker, message, terminal=not will_retry)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if LOCK_OPTION in message.options:
            self._finish(broker, message, terminal=not execution_state(message).parked)

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        """Join this process's sweep: a rerun whose re-enqueue failed is handed on again."""
        self._sweeper = join_sweep(self, broker, self.sweep_interval_ms)

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        leave_sweep(self, self._sweeper)
        self._sweeper = None
        self.flush()

    def sweep_limit(self, key: str) -> int:
        """A dedup lock's limit: 1 (the sweep reclaims a lapsed lock or rerun reservation)."""
        return 1

    def swept(self, broker: Broker, key: str, result: ReleaseResult) -> None:
        """Re-enqueue the rerun the sweep of ``key`` handed the lock to."""
        self._deliver(broker, result.handoffs)

    def _finish(self, broker: Broker, message: MessageProxy, *, terminal: bool) -> None:
        lease = execution_state(message).data.pop(self.option, None)
        if isinstance(lease, LeaseHandle):
            lease.unregister()
        key = message.options.get(LOCK_OPTION)
        if not terminal or not isinstance(key, str):
            return
        guard = self.guard_of(message)
        if guard is not None and guard.policy.strategy == "until_expired":
            return
        holder = message.message_id
        try:
            released = self.backend(broker).release(key, holder, limit=1)
        except BackendUnavailable:
            logger.error(
                "Could not release dedup lock %r of %s: it lapses at its ttl.", key, holder, exc_info=True
            )
            return
        if not released.released:
            logger.debug("Dedup lock %r of %s had lapsed before its release.", key, holder)
        self._deliver(broker, released.handoffs)

    def _has_retries(self, broker: Broker) -> bool:
        known = self._retries.get(id(broker))
        if known is None:
            known = self._retries[id(broker)] = any(isinstance(m, Retries) for m in broker.middleware)
        return known


def _started_without_lock(holder: str, key: str, holders: Sequence[str] | None) -> None:
    """Log that ``holder`` runs without its lock (``holders``: who holds it now, None: not asked)."""
    now = "" if holders is None else f" and {', '.join(holders) or 'nobody'} holds it now"
    logger.warning("Message %s starts without its dedup lock %r: it lapsed%s.", holder, key, now)
