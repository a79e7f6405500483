"""Enqueue-time deduplication: the ``dedup`` actor option (docs/dedup.md).

``send()`` takes a limit-1 lease per dedup key, held by the message's id; while it holds, an
identical message is diverted at the enqueue gate. Where the backend can (a RedisBroker on the
guard's Redis), the lock and the broker's push are one script (:class:`_OneStepTicket`); elsewhere a
pending lock, confirmed in the background once pushed (:class:`_LockTicket`). The lock is released
at the holder's terminal event for its strategy.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Retries

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, ReleaseResult, Stake, Waiter
from dramatiq_guard.backends.values import Enqueue
from dramatiq_guard.claim import Claim
from dramatiq_guard.delivery import GENERATIONS_OPTION, Courier, generation_of
from dramatiq_guard.errors import BackendUnavailable, DuplicateMessage, GuardOptionError
from dramatiq_guard.gate import Diverted, Outcome, copy_with
from dramatiq_guard.keys import MESSAGE_KEY_RULE, is_message_key
from dramatiq_guard.middleware.base import (
    STATE_ATTRIBUTE,
    ActorGuard,
    ExecutionState,
    GuardMiddleware,
    execution_state,
    fail_open,
)
from dramatiq_guard.middleware.confirmer import Confirmer
from dramatiq_guard.middleware.slots.execution import skip_stale
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
    """The message id of the holder that deduplicated ``message`` (what ``send()`` or
    ``broker.enqueue`` returned), or None if it was enqueued."""
    value = message.options.get(BY_OPTION)
    return value if isinstance(value, str) else None


def rerun_id(holder: str) -> str:
    """The message id of the ``reschedule_once`` rerun of ``holder`` (a UUID derived from it)."""
    return str(uuid.uuid5(_RERUN_NAMESPACE, holder))


class Deduplication(GuardMiddleware[DedupPolicy]):
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
        self.pending_ttl_ms = cast(int, duration_ms(pending_ttl, what="pending_ttl", minimum=1))
        self.sweep_interval_ms = cast(int, duration_ms(sweep_interval, what="sweep_interval", minimum=1))
        self._confirmer = Confirmer(linger=min(0.05, self.pending_ttl_ms / 10_000))
        self._local = _ThreadState()
        self._sweeper: Sweeper | None = None

    def flush(self) -> None:
        """Confirm now every pending lock whose push succeeded (normally done in the background)."""
        self._confirmer.flush()

    # --- enqueue time -----------------------------------------------------------------------

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> _LockTicket | None:
        """Take the dedup lock for ``message`` (with its push, where one step can), or divert a duplicate."""
        options = message.options
        if LOCK_OPTION in options or EXEMPT_OPTION in options:
            # A holder's own re-enqueue (Retries, delay queue, hand-off, rerun), or let through already.
            return None
        plan = self.plan(broker, message.actor_name)
        guard: ActorGuard[DedupPolicy] | None = plan.send  # the actor's guard, kept with its plan
        if guard is None:
            guards = self.guard_lists.get(message.actor_name)
            if not guards:
                return None
            guard = plan.send = guards[0]
        policy = guard.policy
        reason = self._exemption(message, delay, policy)
        if reason is not None:
            options[EXEMPT_OPTION] = reason
            return None
        key = PREFIX + self._key(guard, message)
        backend = self._backend or self.backend(broker)
        ttl = policy.ttl_ms + (delay if delay and policy.including_scheduled else 0)
        one_step = holds is None and not policy.fail_open
        alone = plan.alone
        if one_step and alone is None:  # asked once, kept in the plan (BackendUnavailable: at the next send)
            alone = self.enqueues_alone(broker, message.actor_name, backend)
        if one_step and alone:
            options[LOCK_OPTION] = key  # encoded with the message: the push takes the lock
            claim = Claim(key, message.message_id, 1, ttl, info=message.actor_name, backend=backend)
            return _OneStepTicket(self, broker, claim, message, policy, ttl, pending=False)
        claim = Claim(
            key, message.message_id, 1, self.pending_ttl_ms, info=message.actor_name, backend=backend
        )
        try:
            self._lock(broker, claim, message, policy)
        except BackendUnavailable as e:
            fail_open(policy.fail_open, e, f"{message} is enqueued without deduplication")
            options[EXEMPT_OPTION] = "backend_unavailable"
            return None
        options[LOCK_OPTION] = key
        return _LockTicket(self, broker, claim, message, policy, ttl)

    def _lock(self, broker: Broker, claim: Claim, message: Message[Any], policy: DedupPolicy) -> None:
        """Take the pending lock of a new holder, or divert (or refuse) a duplicate. If the backend is
        unavailable (or no replica acknowledged the lock), whatever it did is taken back before
        BackendUnavailable is raised, so the caller's retry is no duplicate of it."""
        try:
            result = claim.backend.try_lock(claim.key, claim.holder, ttl_ms=claim.ttl_ms, info=claim.info)
        except BackendUnavailable:
            undone = claim.take_back()
            if undone is not None:
                self._deliver(broker, undone.handoffs)
            raise
        self._deliver(broker, result.handoffs)
        if not result.acquired:
            self._refused(broker, message, claim, result, policy)

    def _refused(
        self, broker: Broker, message: Message[Any], claim: Claim, result: AcquireResult, policy: DedupPolicy
    ) -> NoReturn:
        """A duplicate of the lock's holder: raise, or divert it as dropped (or rescheduled once)."""
        holder, key = (result.holders[0] if result.holders else ""), claim.key
        events.deduplicated(message.actor_name)
        # DEBUG, as Dramatiq's own enqueue: a duplicate is an expected outcome of a send (and counted).
        logger.debug("Deduplicated %s: %r is held by %s.", message, key, holder or "nobody")
        if policy.on_duplicate == "raise":
            raise DuplicateMessage(message.message_id, holder, key)
        marks: dict[str, Any] = {BY_OPTION: holder}
        if policy.on_duplicate == "reschedule_once":
            marks = self._reschedule(broker, claim, message, holder, policy)
        options = {**message.options, **marks}
        options.pop(LOCK_OPTION, None)
        raise Diverted(copy_with(message, options), Outcome.DROPPED)

    def _exemption(self, message: Message[Any], delay: int | None, policy: DedupPolicy) -> str | None:
        """Why ``message`` goes without deduplication (a delay, a pipeline's or group's step), or None."""
        options = message.options
        if delay and not policy.including_scheduled:
            return "scheduled"
        if "pipe_target" in options or message.message_id == self._local.pipe_next:
            return "pipeline"
        return "group" if options.get("group_completion_uuid") else None

    def _key(self, guard: ActorGuard[DedupPolicy], message: Message[Any]) -> str:
        """The dedup key of ``message`` (before the prefix): the one it carries, else its guard's."""
        override = message.options.get(KEY_OPTION)
        if override is None:
            return guard.resolve_key(message.args, message.kwargs)  # guard.key_of(message)
        if not is_message_key(override):
            raise GuardOptionError(
                f"actor {guard.actor_name!r}: message option {KEY_OPTION}={override!r} is not valid: "
                f"it {MESSAGE_KEY_RULE}"
            )
        return override

    def _reschedule(
        self, broker: Broker, claim: Claim, message: Message[Any], holder: str, policy: DedupPolicy
    ) -> dict[str, Any]:
        """Park (or refresh) the single rerun of ``holder`` in the lock's waiter queue.

        ``limit=0`` parks it even if the lock was freed meanwhile (it "acquires" only if the rerun
        already holds the lock, which leaves it as it is).
        """
        rerun, backend, key = rerun_id(holder), claim.backend, claim.key
        copy = message.copy(message_id=rerun, options={LOCK_OPTION: key})
        for name in (KEY_OPTION, BY_OPTION, RERUN_OPTION, EXEMPT_OPTION):
            copy.options.pop(name, None)
        result = backend.acquire(Stake(key, rerun, 0, policy.ttl_ms), Waiter(payload=copy.encode()))
        self._deliver(broker, result.handoffs)
        if result.parked and not result.holders:
            # The holder finished between the two calls: nobody will hand the lock on, so do it now.
            swept = backend.sweep(key, limit=1)
            self._deliver(broker, swept.handoffs)
        return {BY_OPTION: holder, RERUN_OPTION: rerun}

    def claims(self, key: str) -> bool:
        """Whether ``key`` is a dedup guard key."""
        return key.startswith(PREFIX)

    def make_courier(self, broker: Broker) -> Courier:
        """Reruns handed the lock go back to ``broker`` confirmed for their actor's ``ttl``; a rerun
        that a slots guard parks on its way keeps the lock (it has not run yet)."""

        def ttl_ms(rerun: Message[Any]) -> int:
            guard = self.guard_of(rerun)
            return guard.policy.ttl_ms if guard is not None else _FALLBACK_TTL_MS

        return Courier(broker, self.backend(broker), ttl_ms=ttl_ms, default_limit=lambda _key: 1)

    def _deliver(self, broker: Broker, handoffs: Sequence[Handoff]) -> None:
        """Re-enqueue the reruns that were just handed the lock, then confirm them."""
        if handoffs:
            self.courier(broker).deliver(handoffs)

    # --- execution time ---------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        msg = message._message  # its fields, read without the proxy's __getattr__ (a call each)
        options = msg.options
        self._local.pipe_next = None
        if LOCK_OPTION not in options:
            return  # not a holder: nothing to do (nor for any actor that opts into nothing)
        key = options[LOCK_OPTION]
        if not isinstance(key, str):
            return
        guards = self.guard_lists.get(msg.actor_name)
        guard = guards[0] if guards else None
        if guard is not None and guard.policy.strategy == "until_expired":
            return
        backend = self._backend or self.backend(broker)
        holder = msg.message_id
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
            lease = get_renewer().register(backend, key, holder, policy.ttl_ms, valid_from=valid_from)
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
        msg = message._message
        holder = msg.message_id
        generation = generation_of(msg, key) if GENERATIONS_OPTION in msg.options else None
        if generation is None:
            sent = time.monotonic()
            if backend.renew(key, holder, ttl_ms=policy.ttl_ms):
                if policy.on_duplicate == "reschedule_once":
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
            skip_stale(message, execution_state(message), self.option, key, log=logger)
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
        self, broker: Broker, message: MessageProxy, *, exception: BaseException | None = None, **_: Any
    ) -> None:
        options = message._message.options
        if "pipe_target" in options:
            target = options["pipe_target"]
            if isinstance(target, dict) and exception is None and not message.failed:
                # Pipelines (after this middleware) enqueues this next step from this thread: let it through.
                self._local.pipe_next = target.get("message_id")
        if LOCK_OPTION not in options:
            return  # not a holder (its lock and lease exist only with the option): nothing to release
        will_retry = (
            exception is not None
            and not message.failed
            and any(isinstance(m, Retries) for m in broker.middleware)
        )
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

    #: No key of its is swept when it comes due, only each interval.
    prompt_prefix = None

    def sweep_limit(self, key: str) -> int:
        """A dedup lock's limit: 1 (the sweep reclaims a lapsed lock or rerun reservation)."""
        return 1

    def swept(self, broker: Broker, key: str, result: ReleaseResult) -> None:
        """Re-enqueue the rerun the sweep of ``key`` handed the lock to."""
        self._deliver(broker, result.handoffs)

    def _finish(self, broker: Broker, message: MessageProxy, *, terminal: bool) -> None:
        state: ExecutionState | None = message.__dict__.get(STATE_ATTRIBUTE)  # (None: no guard made one)
        lease = None if state is None else state.data.pop(self.option, None)
        if isinstance(lease, LeaseHandle):
            lease.unregister()
        msg = message._message
        key = msg.options.get(LOCK_OPTION)
        if not terminal or not isinstance(key, str):
            return
        guards = self.guard_lists.get(msg.actor_name)
        if guards and guards[0].policy.strategy == "until_expired":
            return
        holder = msg.message_id
        try:
            released = (self._backend or self.backend(broker)).release(key, holder, limit=1)
        except BackendUnavailable:
            logger.error(
                "Could not release dedup lock %r of %s: it lapses at its ttl.", key, holder, exc_info=True
            )
            return
        if not released.released:
            logger.debug("Dedup lock %r of %s had lapsed before its release.", key, holder)
        if released.handoffs:
            self._deliver(broker, released.handoffs)


class _ThreadState(threading.local):
    """Per thread: the id of the next step of the pipeline whose step this thread just ran."""

    pipe_next: str | None = None


def _started_without_lock(holder: str, key: str, holders: Sequence[str] | None) -> None:
    """Log that ``holder`` runs without its lock (``holders``: who holds it now, None: not asked)."""
    now = "" if holders is None else f" and {', '.join(holders) or 'nobody'} holds it now"
    logger.warning("Message %s starts without its dedup lock %r: it lapsed%s.", holder, key, now)


@dataclasses.dataclass(slots=True, eq=False)
class _LockTicket:
    """The lock of one send: a pending lock (``claim``), confirmed in the background once pushed (or
    parked by a slots guard: it will run), released if not."""

    middleware: Deduplication
    broker: Broker
    claim: Claim
    message: Message[Any]
    policy: DedupPolicy
    ttl_ms: int
    pending: bool = True

    def pushed(self) -> None:
        if self.pending:
            lapses_at = time.monotonic() + self.middleware.pending_ttl_ms / 1000
            claim = self.claim
            self.middleware._confirmer.add((claim.backend, claim.key, claim.holder, self.ttl_ms, lapses_at))

    parked = pushed

    def failed(self) -> None:
        self.message.options.pop(LOCK_OPTION, None)
        if self.pending:
            self.middleware._deliver(self.broker, self.claim.release().handoffs)


class _OneStepTicket(_LockTicket):
    """The lock taken with the broker's push in one step (:meth:`GuardBackend.lock_and_enqueue`); where
    the backend cannot decide in one step, a pending lock and the broker's own push."""

    __slots__ = ()

    def enqueue(
        self, queue_name: str, message_id: str, data: bytes, push: Callable[[str, str, bytes], Any]
    ) -> None:
        """Lock and push ``data`` (the broker's own ``push`` if it takes two steps), or divert a duplicate."""
        claim = self.claim
        one = Enqueue(self.broker, queue_name, message_id, data)
        result = claim.backend.lock_and_enqueue(
            claim.key, claim.holder, ttl_ms=claim.ttl_ms, info=self.message.actor_name, push=one
        )
        if result is None:
            self.claim = dataclasses.replace(claim, ttl_ms=self.middleware.pending_ttl_ms)
            self.middleware._lock(self.broker, self.claim, self.message, self.policy)
            self.pending = True
            push(queue_name, message_id, data)
        elif not result.acquired:
            self.middleware._refused(self.broker, self.message, claim, result, self.policy)
