"""Enqueue-time deduplication: the ``dedup`` actor option.

``send()`` takes a lock per *dedup key*, a limit-1 lease of the guard backend
held by the sending message's id (the *holder*); while it holds, an
identical message is diverted at the enqueue gate (:mod:`dramatiq_guard.gate`)
instead of pushed. The lock is confirmed in the background once the push
succeeded, and released at the holder's terminal event for its strategy.

What a user needs (strategies, ``on_duplicate``, the message options written
here, failures, cost) is in ``docs/dedup.md``; the backend rules it stands on
are in :mod:`dramatiq_guard.backends.base`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Retries, SkipMessage

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, ReleaseResult, Stake, Waiter
from dramatiq_guard.claim import Claim
from dramatiq_guard.delivery import Courier, generation_of
from dramatiq_guard.errors import BackendUnavailable, DuplicateMessage, GuardOptionError
from dramatiq_guard.gate import Diverted, Outcome
from dramatiq_guard.keys import lone_surrogate
from dramatiq_guard.middleware.base import ActorGuard, GuardMiddleware, execution_state, fail_open
from dramatiq_guard.middleware.confirmer import Confirmer
from dramatiq_guard.middleware.sweep import Sweeper, join_sweep, leave_sweep
from dramatiq_guard.policies import DedupPolicy, duration_ms
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

#: The prefix of every deduplication guard key.
PREFIX = "dedup:"
#: Message option: a dedup key given at send time, overriding the policy's.
KEY_OPTION = "dedup_key"
#: Message option (written): the guard key a holder holds; its message id is the holder.
LOCK_OPTION = "dedup_lock"
#: Message option (written): why a message was enqueued without deduplication.
EXEMPT_OPTION = "dedup_exempt"
#: Message option (written on the returned message of a deduplicated send): the holder's id.
BY_OPTION = "deduplicated_by"
#: Message option (written on the returned message of a rescheduled duplicate): the rerun's id.
RERUN_OPTION = "dedup_rerun"

_RERUN_NAMESPACE = uuid.UUID("6c1f8f0e-3a0e-4e55-9d3f-2f4f1c6a9b51")
#: A lock's ttl when the message's actor is not declared in this process.
_FALLBACK_TTL_MS = 3_600_000


def deduplicated_by(message: Message[Any]) -> str | None:
    """The message id of the holder that deduplicated ``message``, or None if it was enqueued.

    Parameters:
      message(Message): What ``send()`` (or ``broker.enqueue``) returned.
    """
    value = message.options.get(BY_OPTION)
    return value if isinstance(value, str) else None


def rerun_id(holder: str) -> str:
    """The message id of the ``reschedule_once`` rerun of ``holder`` (a UUID derived from it)."""
    return str(uuid.uuid5(_RERUN_NAMESPACE, holder))


class Deduplication(GuardMiddleware[DedupPolicy]):
    """Enqueue-time deduplication for actors declared with ``dedup=``.

    See the module docstring for the semantics. Place it before Retries
    (:func:`dramatiq_guard.install` does), after the mutex and concurrency
    middlewares.

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

    policy_class = DedupPolicy
    #: Deduplication decides before the slots middlewares park (20).
    gate_priority = 10

    def __init__(
        self,
        *,
        redis: Any = None,
        pending_ttl: int | datetime.timedelta = 10_000,
        sweep_interval: int | datetime.timedelta = 1_000,
    ) -> None:
        super().__init__(redis=redis)
        pending = duration_ms(pending_ttl, what="pending_ttl")
        if not pending:
            raise GuardOptionError(f"Deduplication: pending_ttl must be positive, not {pending_ttl!r}")
        self.pending_ttl_ms: int = pending
        self._confirmer = Confirmer(linger=min(0.05, pending / 10_000))
        self._local = threading.local()
        self._retries: dict[int, bool] = {}
        self._couriers: dict[int, Courier] = {}
        interval = duration_ms(sweep_interval, what="sweep_interval")
        if not interval:
            raise GuardOptionError(f"Deduplication: sweep_interval must be positive, not {sweep_interval!r}")
        self.sweep_interval_ms: int = interval
        self._sweeper: Sweeper | None = None

    @property
    def actor_options(self) -> set[str]:
        return {self.option}

    def flush(self) -> None:
        """Confirm now every pending lock whose push succeeded (normally done in the background)."""
        self._confirmer.flush()

    # --- enqueue time -----------------------------------------------------------------------

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> _LockTicket | None:
        """Take the dedup lock for ``message``, or divert it as a duplicate (see the module docstring)."""
        options = message.options
        if LOCK_OPTION in options or EXEMPT_OPTION in options:
            # A holder's own re-enqueue (Retries, delay-queue move, slots
            # hand-off, rerun) or a message already let through unguarded.
            return None
        guard = self.guard_of(message)
        if guard is None:
            return None
        policy = guard.policy
        reason = self._exemption(message, delay, policy)
        if reason is not None:
            options[EXEMPT_OPTION] = reason
            return None

        key = PREFIX + self._key(guard, message)
        backend = self.backend(broker)
        claim = Claim(
            key, message.message_id, 1, self.pending_ttl_ms, info=message.actor_name, backend=backend
        )
        try:
            result = self._try_lock(broker, claim)
            self._deliver(broker, result.handoffs)
            if result.acquired:
                options[LOCK_OPTION] = key
                ttl = policy.ttl_ms + ((delay or 0) if policy.including_scheduled else 0)
                return _LockTicket(self, broker, claim, message, ttl)
            holder = result.holders[0] if result.holders else ""
            events.deduplicated(message.actor_name)
            logger.info("Deduplicated %s: %r is held by %s.", message, key, holder or "nobody")
            if policy.on_duplicate == "raise":
                raise DuplicateMessage(message.message_id, holder, key)
            marks: dict[str, Any] = {BY_OPTION: holder}
            if policy.on_duplicate == "reschedule_once":
                marks = self._reschedule(broker, backend, key, message, holder, policy)
        except BackendUnavailable as e:
            fail_open(policy.fail_open, e, f"{message} is enqueued without deduplication")
            options.pop(LOCK_OPTION, None)
            options[EXEMPT_OPTION] = "backend_unavailable"
            return None
        raise Diverted(message.copy(options=marks), Outcome.DROPPED)

    def _try_lock(self, broker: Broker, claim: Claim) -> AcquireResult:
        """Take the pending lock of a new holder; one that raised is taken back first.

        Raises:
          BackendUnavailable: The backend could not be reached, or no replica acknowledged the lock
            (:class:`~dramatiq_guard.errors.ReplicasBehind`): whatever it did was taken back
            (:meth:`~GuardBackend.take_back`), so the caller's retry is not a duplicate of it.
        """
        try:
            return claim.try_lock()
        except BackendUnavailable:
            undone = claim.take_back()
            if undone is not None:
                self._deliver(broker, undone.handoffs)
            raise

    def _exemption(self, message: Message[Any], delay: int | None, policy: DedupPolicy) -> str | None:
        options = message.options
        if delay and not policy.including_scheduled:
            return "scheduled"
        if "pipe_target" in options or message.message_id == getattr(self._local, "pipe_next", None):
            return "pipeline"
        if options.get("group_completion_uuid"):
            return "group"
        return None

    def _key(self, guard: ActorGuard[DedupPolicy], message: Message[Any]) -> str:
        override = message.options.get(KEY_OPTION)
        if override is None:
            return guard.key_of(message)
        if not isinstance(override, str) or not override or lone_surrogate(override):
            raise GuardOptionError(
                f"actor {guard.actor_name!r}: message option {KEY_OPTION}={override!r} is not valid: "
                f"it must be a non-empty str of valid Unicode (no lone surrogates)"
            )
        return override

    def _reschedule(
        self,
        broker: Broker,
        backend: GuardBackend,
        key: str,
        message: Message[Any],
        holder: str,
        policy: DedupPolicy,
    ) -> dict[str, Any]:
        """Park (or refresh) the single rerun of ``holder`` in the lock's waiter queue.

        ``limit=0`` makes the acquire park the rerun even if the lock was freed
        since the holder was seen; it only "acquires" if the rerun already holds
        the lock (it was handed it meanwhile), which leaves it as it is.
        """
        rerun = rerun_id(holder)
        copy = message.copy(message_id=rerun, options={LOCK_OPTION: key})
        for name in (KEY_OPTION, BY_OPTION, RERUN_OPTION, EXEMPT_OPTION):
            copy.options.pop(name, None)
        result = backend.acquire(Stake(key, rerun, 0, policy.ttl_ms), Waiter(payload=copy.encode()))
        self._deliver(broker, result.handoffs)
        if result.parked and not result.holders:
            # The holder finished between the two calls: nobody will hand the
            # lock on, so hand it to the rerun now.
            swept = backend.sweep(key, limit=1)
            self._deliver(broker, swept.handoffs)
        return {BY_OPTION: holder, RERUN_OPTION: rerun}

    def claims(self, key: str) -> bool:
        """Whether ``key`` is a dedup guard key."""
        return key.startswith(PREFIX)

    def courier(self, broker: Broker) -> Courier:
        """How reruns handed the lock go back to ``broker``.

        Confirmed for their actor's ``ttl``; a rerun that a slots guard parks
        on its way keeps the lock (it has not run yet).
        """
        courier = self._couriers.get(id(broker))
        if courier is None:

            def ttl_ms(rerun: Message[Any]) -> int:
                guard = self.guard_of(rerun)
                return guard.policy.ttl_ms if guard is not None else _FALLBACK_TTL_MS

            courier = self._couriers[id(broker)] = Courier(
                broker,
                self.backend(broker),
                ttl_ms=ttl_ms,
                default_limit=lambda _key: 1,
                keep_when_parked=True,
            )
        return courier

    def _deliver(self, broker: Broker, handoffs: Sequence[Handoff]) -> None:
        """Re-enqueue the reruns that were just handed the lock, then confirm them."""
        if handoffs:
            self.courier(broker).deliver(handoffs)

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
        """Make the holder's lock its lease as it starts, counting its ``ttl`` from now.

        A first run (no generation) renews the lock its send took: 6 Redis
        commands (``renew.lua``) where a re-entrant acquire runs 14; a lock
        that lapsed while the message was queued is then the acquire's to
        reclaim and hand on. A ``reschedule_once`` holder cancels the rerun
        asked for before it started (its run covers them). A copy
        re-enqueued by a hand-off (a rerun) is acquired, checking its
        generation: a stale one (a newer hand-off of it exists) is skipped.

        Returns:
          (held, valid_from): whether it holds the lock (False: it starts
          without it), and ``time.monotonic()`` just before the request that
          extended it was sent (the lease's start for the renewer).

        Raises:
          SkipMessage: The message is a stale copy of a rerun.
        """
        holder = message.message_id
        generation = generation_of(message, key)
        if generation is None:
            sent = time.monotonic()
            if backend.renew(key, holder, ttl_ms=policy.ttl_ms):
                self._cancel_covered_rerun(broker, backend, key, holder, policy)
                return True, sent
            if policy.on_duplicate == "reschedule_once":
                # Its rerun stays queued behind the lapsed lock (a sweep hands it on): this
                # run covers it all the same.
                self._cancel_covered_rerun(broker, backend, key, holder, policy)
                _started_without_lock(holder, key, None)
                return False, None
        result = backend.acquire(
            Stake(
                key,
                holder,
                1,
                policy.ttl_ms,
                info=message.actor_name,
                generation=generation,
                fenced=False,  # a dedup lock fences nothing: no token kept per key
            )
        )
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
            # Pipelines (after this middleware in the after-hooks) enqueues
            # this next step from this thread: let it through.
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
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            leave_sweep(self, sweeper)
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
        backend = self.backend(broker)
        try:
            released = backend.release(key, message.message_id, limit=1)
        except BackendUnavailable:
            logger.error(
                "Could not release dedup lock %r of %s: it lapses at its ttl.",
                key,
                message.message_id,
                exc_info=True,
            )
            return
        if not released.released:
            logger.debug("Dedup lock %r of %s had lapsed before its release.", key, message.message_id)
        self._deliver(broker, released.handoffs)

    def _has_retries(self, broker: Broker) -> bool:
        known = self._retries.get(id(broker))
        if known is None:
            known = self._retries[id(broker)] = any(isinstance(m, Retries) for m in broker.middleware)
        return known


class _LockTicket:
    """The pending lock of one send: confirmed in the background once pushed, released if not."""

    __slots__ = ("broker", "claim", "message", "middleware", "ttl_ms")

    def __init__(
        self, middleware: Deduplication, broker: Broker, claim: Claim, message: Message[Any], ttl_ms: int
    ) -> None:
        self.middleware = middleware
        self.broker = broker
        self.claim = claim
        self.message = message
        self.ttl_ms = ttl_ms

    def pushed(self) -> None:
        lapses_at = time.monotonic() + self.middleware.pending_ttl_ms / 1000
        claim = self.claim
        self.middleware._confirmer.add_pending(claim.backend, claim.key, claim.holder, self.ttl_ms, lapses_at)

    def parked(self) -> None:
        """A slots guard parked it: it will run, so it keeps the lock, as if pushed."""
        self.pushed()

    def failed(self) -> None:
        self.message.options.pop(LOCK_OPTION, None)
        self.middleware._deliver(self.broker, self.claim.release().handoffs)


def _started_without_lock(holder: str, key: str, holders: Sequence[str] | None) -> None:
    """Log that ``holder`` runs without its lock (``holders``: who holds it now, None: not asked)."""
    now = "" if holders is None else f" and {', '.join(holders) or 'nobody'} holds it now"
    logger.warning("Message %s starts without its dedup lock %r: it lapsed%s.", holder, key, now)
