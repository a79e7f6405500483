"""The ``throttle`` actor option: at most N starts per key in any window of a period (docs/throttle.md).

A throttle is a slot key whose lease is the window: a start holds a place until ``start + period``,
is never released by the job's end and never renewed, so "at most N holders" is "at most N starts
in any window" (docs/flow-control-design.md). A retry is a new start: its holder id carries its
retry count. Over the limit a message parks, as with ``concurrency``; a place that opens is handed
to the oldest waiter by the next operation on the key, or by a worker's sweep thread, which looks
at a key with starts at the moment its oldest start lapses (:meth:`.Sweeper.at`), and at every
key that is due each pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.gate import Diverted, Outcome
from dramatiq_guard.middleware.base import ActorGuard, ExecutionState, execution_state
from dramatiq_guard.middleware.slots.execution import NotRun
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.middleware.slots.reservation import OneStepReservation, ReservationTicket
from dramatiq_guard.policies import OnBusy, ThrottlePolicy

logger = logging.getLogger("dramatiq_guard.middleware.slots")


@dataclasses.dataclass(frozen=True)
class Started:
    """A start this execution counted on ``key`` (given back if the message does not run)."""

    key: str


class Throttle(SlotsMiddleware[ThrottlePolicy]):
    """At most N starts per key in any window of ``period``; the rest park (the ``throttle`` option).

    ``throttle={"limit": 3, "period": 1_000, "key": ...}`` or a
    :class:`~dramatiq_guard.ThrottlePolicy`. A start counts from the moment its message acquires,
    whatever the job's length or outcome; a retry is a new start. See ``docs/throttle.md``, and
    :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware` for the parameters.
    """

    policy_class = ThrottlePolicy
    prefix = "throttle"
    #: A park at send arms the key's timer in a worker (:meth:`before_push`): sends take two steps.
    one_step_sends = False

    def on_busy(self, policy: ThrottlePolicy) -> OnBusy:
        return "park"

    def default_limit(self, guard: ActorGuard[ThrottlePolicy]) -> int:
        return guard.policy.limit

    def holder_of(self, message: Message[Any] | MessageProxy) -> str:
        """The message id and its retry count: each attempt is a start of its own."""
        return f"{message.message_id}:{message.options.get('retries', 0)}"

    def _lease_ttl(self, guard: ActorGuard[ThrottlePolicy]) -> int:
        return guard.policy.period_ms

    def _hold(
        self,
        message: MessageProxy,
        state: ExecutionState,
        guard: ActorGuard[ThrottlePolicy],
        key: str,
        limit: int,
        result: AcquireResult,
    ) -> None:
        # The start holds its place until it lapses: no lease to renew or release (but if the message
        # does not run after all: after_skip_message). The key's timer looks at it half a period on
        # (sending the next waiters ahead), then when the start lapses.
        state.data[self.slot_of(guard)] = Started(key)
        self._remember(message)
        broker = self._broker_or(None)
        if result.reserved_ms is not None:  # woken with a hand-off's reservation: it starts now
            try:
                self.backend(broker).renew(key, self.holder_of(message), ttl_ms=guard.policy.period_ms)
            except BackendUnavailable:
                logger.warning(
                    "Could not count %s's start on %r from now; it counts from its hand-off.", message, key
                )
        self._arm(broker, key, guard.policy.period_ms / 2000)  # early: standbys go ahead

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """The message did not run after all (a later guard parked it, or a later middleware skipped
        it): the places it took leave their windows and go to the keys' next waiters."""
        super().after_skip_message(broker, message)
        state = execution_state(message)
        for guard in self.guards_of(message):
            started = state.data.pop(self.slot_of(guard), None)
            if isinstance(started, Started):
                self.give_back(broker, message, guard, started.key, started=True)

    def _reserve(
        self,
        broker: Broker,
        message: Message[Any],
        guard: ActorGuard[ThrottlePolicy],
        key: str,
        *,
        one_step: bool,
    ) -> ReservationTicket | OneStepReservation | None:
        """Reserve a place in the window for ``message``, or park it (in a worker process, arming the
        key's timer: a producer leaves the hand-offs to the workers, whose pickups are prompt)."""
        try:
            return super()._reserve(broker, message, guard, key, one_step=one_step)
        except Diverted as diverted:
            if diverted.outcome is Outcome.PARKED and self._sweeper is not None:
                self._arm(broker, key, self._opens_in(broker, guard, key))
            raise

    def _take(
        self, broker: Broker, message: MessageProxy, guard: ActorGuard[ThrottlePolicy], key: str
    ) -> None:
        """Take a place in the window, or park until one opens (and arm the key's timer)."""
        try:
            super()._take(broker, message, guard, key)
        except SkipMessage:
            not_run = execution_state(message).data.get(self.slot_of(guard))
            if isinstance(not_run, NotRun) and not_run.reason == "parked":
                self._arm(broker, key, self._opens_in(broker, guard, key))
            raise

    def _opens_in(self, broker: Broker, guard: ActorGuard[ThrottlePolicy], key: str) -> float | None:
        """In how many seconds a place of ``key`` opens (None: unknown, the sweep will see)."""
        try:
            return self._next_place(broker, key, guard)
        except BackendUnavailable:
            return None

    def _next_place(self, broker: Broker, key: str, guard: ActorGuard[ThrottlePolicy]) -> float | None:
        """When the key's oldest start lapses (a start lapses within a period; a reservation for a
        message not started yet later, so a key held only by those is looked at again in a quarter
        period); 0 if a place is free; None if nobody waits. Reports the key's window (metrics)."""
        backend, period_ms = self.backend(broker), guard.policy.period_ms
        state = backend.inspect(key, waiters=1)
        events.throttle_window(guard.actor_name, *state.window())
        if not state.waiters:
            return None
        now = backend.now_ms()
        starts = [deadline for _, deadline in state.holders if deadline - now <= period_ms]
        if not starts:
            return period_ms / 4000 if state.holders else 0.0
        return max(0.001, (min(starts) - now) / 1000)

    def _sweep_key(self, broker: Broker, key: str) -> float | None:
        """Hand the places that opened on ``key`` to its waiters, send the next ones ahead; when the
        next place opens, or None."""
        guard = self.keys.guard_of(key)
        if guard is None:
            return None
        try:
            if self._next_place(broker, key, guard) is None:  # one read: nobody waits, nothing to do
                return None
            backend, limit = self.backend(broker), self.default_limit(guard)
            self.swept(broker, key, backend.sweep(key, limit=limit))
            # The next waiters go to the broker ahead, as standbys: a worker thread that picks one
            # up blocks for its place, which the next sweep hands it by a push (no broker pickup).
            ahead = min(limit, max(1, self.standbys.seats.seats))  # as many as can block here
            handoffs, standbys = backend.send_standbys(key, limit=limit, count=ahead)
            self.deliver(broker, handoffs)
            self.courier(broker).send_ahead(standbys)
            return self._next_place(broker, key, guard)
        except BackendUnavailable:
            return None

    def _arm(self, broker: Broker, key: str, in_s: float | None) -> None:
        """Have this worker's sweep thread look at ``key`` in ``in_s`` seconds (not elsewhere)."""
        if self._sweeper is not None:
            self._sweeper.at(key, in_s, functools.partial(self._sweep_key, broker, key))
