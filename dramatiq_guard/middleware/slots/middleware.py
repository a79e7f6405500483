"""The worker hooks of mutexes and concurrency slots (docs/slots.md, "Execution").

Before a guarded message runs it acquires its slot (parks, is dropped or waits if the key is full,
by ``on_busy``); after it, the lease is released and what the release hands on is delivered.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any, Generic, cast

from dramatiq import Broker, Message, Worker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, ReleaseResult, Waiter
from dramatiq_guard.backends.values import AcquireOutcome
from dramatiq_guard.claim import Claim, entry_ms
from dramatiq_guard.delivery import acks_are_final, copy_generation
from dramatiq_guard.errors import BackendUnavailable, MutexWaitTimeout
from dramatiq_guard.lease import Lease, runner_id
from dramatiq_guard.middleware.base import (
    STATE_ATTRIBUTE,
    ActorGuard,
    ExecutionState,
    execution_state,
    fail_open,
)
from dramatiq_guard.middleware.slots.base import P, SlotsBase, acquire_all, composed
from dramatiq_guard.middleware.slots.execution import (
    DEFERRAL_MARGIN_MS,
    NotRun,
    defer_second_copy,
    hold,
    skip_dropped,
    skip_parked,
    skip_stale,
    take_held,
)
from dramatiq_guard.middleware.slots.releases import Releaser, starts_follow_ups
from dramatiq_guard.middleware.slots.standbys import wait_as_standby
from dramatiq_guard.middleware.slots.waits import block_for_slot
from dramatiq_guard.middleware.sweep import join_sweep, leave_sweep
from dramatiq_guard.policies import OnBusy

logger = logging.getLogger("dramatiq_guard.middleware.slots")


class SlotsMiddleware(SlotsBase[P], Generic[P]):
    """What :class:`~dramatiq_guard.Mutex` and :class:`~dramatiq_guard.Concurrency` share (docs/slots.md).

    Its keywords (``redis``, ``lease_ttl``, ``pickup_ttl``, ``sweep_interval``, ``limit_cache``,
    ``lookahead``, ``standby_wait``, ``standby_threads``), their defaults and units are in the
    table of docs/slots.md, "Parameters".
    """

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Start this process's sweep of keys with waiters, and (but on a StubBroker) its release thread."""
        self.broker = broker
        self._worker = worker
        if self.standby_threads is None:
            self.standbys.seats.seats = int(getattr(worker, "worker_threads", 0)) // 2
        if not isinstance(broker, StubBroker) and self._releaser is None:
            self._releaser = Releaser.shared()
        self._sweeper = join_sweep(self, broker, self.sweep_interval_ms)

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the sweep when the last middleware using it shuts down."""
        leave_sweep(self, self._sweeper)
        self._sweeper = None

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Release what the release thread still holds (the worker threads have stopped)."""
        self.flush_releases()
        self._worker = None

    def flush_releases(self) -> None:
        """Release now every lease of a finished message still waiting for the release thread."""
        if self._releaser is not None:
            self._releaser.flush()

    # -- execution ------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Acquire a slot of each of the message's guards, in its option's order (the actor's first
        slots middleware tries those of all of them in one round trip first); park, drop or wait
        when a key is full (the slots taken before it are released by ``after_skip_message``).

        Raises:
          SkipMessage: The message was parked or dropped, or is a stale copy; or
            another copy of it holds its slot (:func:`.execution.defer_second_copy`).
          MutexWaitTimeout: ``on_busy="wait"`` gave up (Retries retries it).
          BackendUnavailable: The backend could not be reached (unless ``fail_open``).
          GuardKeyError: The key could not be computed.
        """
        # Every hook of every middleware hears every message: one not guarded here costs no call. The
        # proxy's message is read as it is (its fields, without the proxy's __getattr__: a call each).
        msg = message._message
        name = msg.actor_name
        if name not in self.guard_lists or message.failed:
            return
        guards = self.guard_lists.get(name, ())
        group = composed(broker, name, self)
        if group[0] is not self:
            state = execution_state(message)
            if all(guard.slot in state.data for guard in guards):
                return  # the first slots middleware of the actor took this one's slots with its own
        elif (guards[1:] or group[1:]) and self._take_all_at_once(broker, message, group):
            return  # (more than one guard here, or a slots middleware beside this one)
        if not guards[1:]:  # one guard (the common case: no list of keys to make and compare)
            self._take(broker, message, guards[0], self.guard_key_of(guards[0], msg))
            return
        for guard, key in self.guard_keys_of(guards, msg):
            self._take(broker, message, guard, key)

    def _take_all_at_once(
        self, broker: Broker, message: MessageProxy, group: Sequence[SlotsBase[Any]]
    ) -> bool:
        """Acquire the slots of every guard of the actor's slots middlewares (``group``, this one first)
        in one round trip (:func:`acquire_all`): True if all were acquired (held now); else each
        middleware's guards decide in turn (:meth:`_take`)."""
        members = cast(Sequence[SlotsMiddleware[Any]], group)  # every slots middleware is one
        keyed = [
            (m, guard, key) for m in members for guard, key in m.guard_keys_of(m.guards_of(message), message)
        ]
        claims = [
            (m, m._claim(broker, message, guard, key, m.default_limit(guard))) for m, guard, key in keyed
        ]
        results = acquire_all(broker, claims)
        if results is None:
            return False
        state = execution_state(message)
        for (m, guard, key), (_, claim), result in zip(keyed, claims, results, strict=True):
            if result.reserved_ms is not None or result.handoffs:
                m._contended.mark(key)
            m._hold(message, state, guard, key, claim.limit, result)
        return True

    def _claim(
        self, broker: Broker, message: MessageProxy, guard: ActorGuard[P], key: str, limit: int
    ) -> Claim:
        """The claim of this copy of ``message`` on ``key``: a second copy, delivered while this one
        holds, is refused (its runner differs); a stale copy of a hand-off never starts."""
        msg = message._message
        return Claim(
            key, self.holder_of(msg), limit, self._lease_ttl(guard),
            backend=self._backend or self.backend(broker), info=msg.actor_name,
            generation=copy_generation(msg, key), priority=guard.priority, runner=runner_id(),
        )  # fmt: skip

    def _take(self, broker: Broker, message: MessageProxy, guard: ActorGuard[P], key: str) -> None:
        """Acquire the slot of one guard of the message (see :meth:`before_process_message`)."""
        limit = self.default_limit(guard)
        on_busy = self.on_busy(guard.policy)
        result = self._acquire(broker, message, guard, key, limit, on_busy)
        if result is None:
            return  # the backend is unavailable and the policy fails open
        state = execution_state(message)
        if result.outcome is AcquireOutcome.ACQUIRED:
            if result.reserved_ms is not None or result.handoffs:
                self._contended.mark(key)  # the key has waiters: its release stays on the worker thread
            self._hold(message, state, guard, key, limit, result)
            return
        slot = guard.slot
        if result.running:
            defer_second_copy(broker, message, state, slot, key, lapse_ms=self._deferral_ms(guard, result))
        self._contended.mark(key)
        if result.stale:
            skip_stale(message, state, slot, key)
        if on_busy == "drop":
            self.count_drop()
            skip_dropped(message, state, slot, key, result.holders)
        elif on_busy == "park":
            skip_parked(message, state, slot, key, result.limit)
        else:
            raise MutexWaitTimeout(key, message.message_id, self.wait_ms(guard.policy), result.holders)

    def _give_back_unreached(self, broker: Broker, message: MessageProxy, reached: set[str]) -> None:
        """A guard parked the message after pickup: what this copy holds reserved on this middleware's
        guards it did not reach (``reached``: the slots that held or refused it), from its send or a
        hand-off's way back, goes to the keys' next waiters now, not after ``pickup_ttl`` (unless
        ``keeps_when_parked``). Only a reservation (:meth:`GuardBackend.give_back`): never the lease
        of another copy of the message that runs. Only after a park: a copy refused as stale or
        running may share its reservations with a live copy."""
        data = execution_state(message).data
        if self.keeps_when_parked or not any(
            isinstance(not_run, NotRun) and not_run.reason == "parked" for not_run in data.values()
        ):
            return
        for guard in self.guards_of(message):
            if self.slot_of(guard) not in reached:
                self.give_back(broker, message, guard, self.guard_key_of(guard, message), started=False)

    def give_back(
        self, broker: Broker, message: MessageProxy, guard: ActorGuard[P], key: str, *, started: bool
    ) -> None:
        """Release what ``message`` holds of ``key`` and will not use: a reservation, or (``started``)
        a slot this copy took, such as a throttle's place; deliver what that hands on. If the backend
        is unreachable, it lapses on its own."""
        holder, limit, backend = self.holder_of(message), self.default_limit(guard), self.backend(broker)
        try:
            if started:
                result = backend.release(key, holder, limit=limit)
            else:
                result = backend.give_back(key, holder, limit=limit)
            self.deliver(broker, result.handoffs)
        except BackendUnavailable:
            logger.warning("Could not give back %s's place on %r; it lapses on its own.", message, key)

    def _acquire(
        self,
        broker: Broker,
        message: MessageProxy,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        on_busy: OnBusy,
    ) -> AcquireResult | None:
        """Acquire the slot, blocking for it where the message may: a standby, or a mutex ``wait``.

        Returns None if the backend is unavailable and the policy says ``fail_open``.
        """
        claim = self._claim(broker, message, guard, key, limit)
        wait = None
        if on_busy == "park":
            # A standby (sent ahead) may block for a slot instead of parking, if this process lets it
            # and this execution holds nothing meanwhile (a slot of an earlier guard of its actor).
            blocks = self.standbys.seats.seats > 0 and not execution_state(message).data
            block_ms = entry_ms(self.standbys.wait_ms) if blocks else 0
            wait = Waiter(payload=message._message.encode(), wait_ms=block_ms)
        elif on_busy == "wait":
            wait = Waiter(wait_ms=entry_ms(self.wait_ms(guard.policy)))
        try:
            result = claim.acquire(wait)
        except BackendUnavailable as e:
            fail_open(guard.policy.fail_open, e, f"{message} runs unguarded")
            return None
        if result.handoffs:
            self.deliver(broker, result.handoffs)
        if result.outcome is AcquireOutcome.ACQUIRED:
            return result
        deliver = functools.partial(self.deliver, broker)
        if result.standby:
            assert wait is not None and wait.payload is not None
            return wait_as_standby(
                broker, message, claim, wait.payload, self.standbys.seats, wait_ms=self.standbys.wait_ms,
                deliver=deliver,
            )  # fmt: skip
        if on_busy == "wait" and result.parked:
            with events.lock_wait(message.actor_name):
                return block_for_slot(
                    broker, message, claim, wait_ms=self.wait_ms(guard.policy), deliver=deliver
                )
        return result

    def _hold(
        self,
        message: MessageProxy,
        state: ExecutionState,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        result: AcquireResult,
    ) -> None:
        assert self._backend is not None
        msg = message._message
        lease = Lease(
            self._backend, key, msg.message_id, result, limit=limit, ttl_ms=self.lease_ttl_ms,
            cap_ms=guard.policy.ttl_ms,
        )  # fmt: skip
        hold(msg, state, guard.slot, lease)
        self._inflight.add(msg.message_id)  # (_remember, without its call)

    def _deferral_ms(self, guard: ActorGuard[P], result: AcquireResult) -> int:
        """How long a copy refused as running waits, at most, before it asks again: until the entry
        in its way would lapse (a dead runner's), and at most a lease's ttl (a live runner renews it)."""
        ttl = self._lease_ttl(guard)
        if result.lapses_in_ms is None:
            return ttl
        return max(DEFERRAL_MARGIN_MS, min(ttl, result.lapses_in_ms + DEFERRAL_MARGIN_MS))

    def _lease_ttl(self, guard: ActorGuard[P]) -> int:
        cap = guard.policy.ttl_ms
        return self.lease_ttl_ms if cap is None else max(1, min(self.lease_ttl_ms, cap))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        """Release the message's leases here (Retries has already decided about a failure); a
        throttle's starts stay in their windows."""
        msg = message._message  # (every message passes here: read with no call, as in before_process_message)
        if self._inflight:  # it holds no slot here any more (if none is held here, no id is read)
            self._inflight.discard(msg.message_id)
        attributes = message.__dict__
        if msg.actor_name not in self.guard_lists or STATE_ATTRIBUTE not in attributes:
            return  # not guarded here, or no guard took anything
        state: ExecutionState = attributes[STATE_ATTRIBUTE]
        for guard in self.guard_lists.get(msg.actor_name, ()):
            held = take_held(state, guard.slot)
            if held is not None:
                self._let_go(broker, msg, guard, held.lease)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """Release the leases this execution took if a guard (or another middleware) skipped the
        message after they were acquired; give back what hand-offs reserved for it, if it parked."""
        reached = set(execution_state(message).data)  # before the leases are forgotten
        # This class's own hook, named: a subclass's override of it hears the runs, not the skips
        # (and a message that opts into nothing still costs the hook no call of its own).
        SlotsMiddleware.after_process_message(self, broker, message)
        self._give_back_unreached(broker, message, reached)

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        """A copy that parked after pickup was acked: its generation record goes (contract,
        *generations*), on a broker whose ack is final; elsewhere it lapses after ``stale_ttl_ms``."""
        attributes = message.__dict__  # (every message is acked here: its state read with no call)
        if STATE_ATTRIBUTE not in attributes or not attributes[STATE_ATTRIBUTE].parked:
            return  # a copy that parked said so (execution._not_terminal)
        state: ExecutionState = attributes[STATE_ATTRIBUTE]
        guards = self.guards_of(message)
        if not guards or not acks_are_final(broker):
            return
        data = state.data
        for guard in guards:
            not_run = data.get(guard.slot)
            if not (isinstance(not_run, NotRun) and not_run.reason == "parked"):
                continue
            try:
                self.backend(broker).forget_parked_copy(not_run.key, self.holder_of(message))
            except BackendUnavailable:
                logger.debug("Could not forget the parked copy of %s; its record lapses on its own.", message)

    def _let_go(
        self, broker: Broker, message: Message[Any] | MessageProxy, guard: ActorGuard[P], lease: Lease
    ) -> None:
        """Release ``lease``, held by a message that ran (or was skipped after it acquired)."""
        # The release sends the key's next waiters ahead as standbys (Standbys.count_after).
        actor = message.actor_name
        send_ahead = 0
        if self.on_busy(guard.policy) == "park":
            held_ms = (time.time() - lease.acquired_at) * 1000
            send_ahead = self.standbys.count_after(held_ms, lease.limit)
        events.released(actor, lease.key)
        releaser = self._releaser
        if releaser is not None and lease.key not in self._contended and not starts_follow_ups(message):
            # What the release thread calls with the result: a partial, not a closure (a call fewer).
            report = functools.partial(self._report_release, broker, lease, actor=actor)
            releaser.add((lease, send_ahead, report))
            return
        self.release(broker, lease, send_ahead=send_ahead, actor=actor)

    def release(
        self, broker: Broker, lease: Lease, *, send_ahead: int = 0, actor: str | None = None
    ) -> ReleaseResult | None:
        """Release ``lease``, deliver the waiters it hands the slot to, and send ``send_ahead`` standbys;
        the result, or None if the backend was unreachable (the lease then lapses within ``lease_ttl``).
        A lost lease is logged as an error (and counted under ``actor``), even when the release fails."""
        try:
            result: ReleaseResult | None = lease.release(send_ahead=send_ahead)
        except BackendUnavailable:
            result = None
        self._report_release(broker, lease, result, actor)
        return result

    def _report_release(
        self, broker: Broker, lease: Lease, result: ReleaseResult | None, actor: str | None = None
    ) -> None:
        """Report the release of ``lease``, and deliver what it handed on (None: backend unreachable)."""
        lost = lease.lost  # read once: what is counted and what is logged agree
        if actor is not None and lost:
            events.lease_lost(actor)
        if result is None:
            logger.error("Could not release %r: the backend is unavailable; it lapses on its own.", lease)
            if lost:
                logger.error("%r was lost while the actor ran: another holder may have had the key.", lease)
            return
        if lost:
            logger.error("%r was lost while the actor ran, before its release: %r", lease, result)
        if not (result.handoffs or result.standbys):  # nothing parked moved: no one to tell
            self._contended.unmark(lease.key)
            return
        self._contended.mark(lease.key)
        self.deliver(broker, result.handoffs)
        self.courier(broker).send_ahead(result.standbys)
        events.lockwait_changed()
