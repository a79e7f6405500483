"""What a slots middleware does outside a message's run (docs/slots.md).

Its settings, its keys and their limits, the enqueue gate (reserve a slot or park), and the
delivery of what its key operations hand on; the worker hooks are in :mod:`.middleware`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

import dramatiq
from dramatiq import Broker, Message, Worker
from dramatiq.broker import MessageProxy

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, ReleaseResult
from dramatiq_guard.backends.checks import check_count
from dramatiq_guard.claim import Claim, Deliver
from dramatiq_guard.delivery import GENERATIONS_OPTION, Courier, generation_of, keep_polling
from dramatiq_guard.errors import BackendUnavailable, GuardKeyError
from dramatiq_guard.gate import Diverted, PushTicket, TicketGroup
from dramatiq_guard.middleware.base import ActorGuard, GuardMiddleware
from dramatiq_guard.middleware.slots.limits import KeyDirectory
from dramatiq_guard.middleware.slots.releases import ContendedKeys, Releaser
from dramatiq_guard.middleware.slots.reservation import OneStepReservation, ReservationTicket, reserve_or_park
from dramatiq_guard.middleware.slots.standbys import Standbys
from dramatiq_guard.middleware.sweep import Sweeper
from dramatiq_guard.policies import (
    ConcurrencyPolicy,
    DebouncePolicy,
    MutexPolicy,
    OnBusy,
    ThrottlePolicy,
    duration_ms,
)

P = TypeVar("P", ConcurrencyPolicy, MutexPolicy, ThrottlePolicy, DebouncePolicy)


class SlotsBase(GuardMiddleware[P], Generic[P]):
    """The base of :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware` (its parameters)."""

    #: The guard key prefix (``"mutex"`` or ``"concurrency"``).
    prefix: ClassVar[str]
    #: The prefix of its keys the sweep wakes for when they come due (see ``Sweepable``), or None.
    prompt_prefix: str | None = None
    #: Slots decide after deduplication (10) in the enqueue gate.
    gate_priority = 20
    #: Whether a send may reserve (or park) and push in one step (:class:`.OneStepReservation`).
    one_step_sends: ClassVar[bool] = True
    #: Whether a hand-off that another guard parks on its way is confirmed (else given back).
    keeps_when_parked: ClassVar[bool] = False
    #: Whether its guards decide with the actor's other slots guards (:func:`composed`).
    composes: ClassVar[bool] = True

    def __init__(  # `redis` goes on to GuardMiddleware in **kwargs
        self,
        *,
        lease_ttl: Any = 30_000,
        pickup_ttl: Any = 60_000,
        sweep_interval: Any = 1_000,
        limit_cache: Any = 1_000,
        lookahead: int | None = None,
        standby_wait: Any = 5_000,
        standby_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lease_ttl_ms = _ms(lease_ttl, "lease_ttl")
        self.pickup_ttl_ms = _ms(pickup_ttl, "pickup_ttl")
        self.sweep_interval_ms = _ms(sweep_interval, "sweep_interval")
        self.limit_cache_ms = _ms(limit_cache, "limit_cache", minimum=0)
        check_count(lookahead, "lookahead")
        check_count(standby_threads, "standby_threads")
        self.standby_threads = standby_threads
        self.standbys = Standbys(lookahead, standby_threads or 0, _ms(standby_wait, "standby_wait"))
        self.broker: Broker | None = None
        self.keys: KeyDirectory[P] = KeyDirectory(self.prefix, self.guard_lists)
        # Messages holding a slot here (Retries' re-enqueue passes): added by _remember, discarded as
        # the message ends (after_process_message); one set operation at a time needs no lock of its
        # own (each is atomic).
        self._inflight: set[str] = set()
        self._sweeper: Sweeper | None = None
        self._releaser: Releaser | None = None
        self._worker: Worker | None = None  # this process's, once it boots (see keep_polling)
        self._contended = ContendedKeys()

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Parse the actor's option; the actor's slots middlewares (:func:`composed`) are found anew."""
        try:
            super().before_declare_actor(broker, actor)
        finally:
            for m in [self, *broker.middleware]:
                if isinstance(m, SlotsBase):
                    m._plans.pop(actor.actor_name, None)

    @abc.abstractmethod
    def on_busy(self, policy: P) -> OnBusy:
        """What a message that finds the key full does."""

    @abc.abstractmethod
    def default_limit(self, guard: ActorGuard[P]) -> int:
        """The default limit of the actor's keys (a per-key run-time limit overrides it)."""

    def wait_ms(self, policy: P) -> int:
        """How long ``on_busy="wait"`` blocks."""
        return 0

    def holder_of(self, message: Message[Any] | MessageProxy) -> str:
        """The holder (and waiter) id of ``message`` in its key: its message id."""
        return message.message_id

    def _remember(self, message: Message[Any] | MessageProxy) -> None:
        """``message`` holds a slot here now."""
        self._inflight.add(message.message_id)

    def count_drop(self) -> None:
        """Count a message dropped because its key was held (:class:`~dramatiq_guard.Mutex`)."""

    # -- keys -----------------------------------------------------------------

    def slot_of(self, guard: ActorGuard[P]) -> str:
        """Where the state of ``guard`` lives on a message (:class:`.ExecutionState`): the option's
        name, ``#<index>`` added for a later guard of a list (:attr:`ActorGuard.slot`)."""
        return guard.slot

    def guard_keys_of(
        self, guards: Sequence[ActorGuard[P]], message: Message[Any] | MessageProxy
    ) -> list[tuple[ActorGuard[P], str]]:
        """Each guard of ``message`` with its key; :class:`GuardKeyError` if a key cannot be computed,
        or two guards of the list give one key."""
        keyed = [(guard, self.guard_key_of(guard, message)) for guard in guards]
        if len(keyed) > 1 and len({key for _, key in keyed}) < len(keyed):
            raise GuardKeyError(
                message.actor_name,
                self.option,
                f"two guards of its list give one key ({', '.join(repr(key) for _, key in keyed)})",
                "Give each guard of a list a key of its own",
            )
        return keyed

    def claims(self, key: str) -> bool:
        """Whether ``key`` is a guard key of this capability."""
        return key.startswith(self.prefix + ":")

    def guard_key_of(self, guard: ActorGuard[P], message: Message[Any] | MessageProxy) -> str:
        """The guard key of ``message`` (with this capability's prefix); :class:`GuardKeyError` if it
        cannot be computed."""
        key = f"{self.prefix}:{guard.key_of(message)}"
        if guard.keyed_by_callable:  # a digested key names its actor (KeyDirectory.guard_of)
            self.keys.remember(key, guard.scope)
        return key

    def key_for(self, actor: dramatiq.Actor[Any, Any] | str, *args: Any, **kwargs: Any) -> str:
        """The key (without prefix) a message of ``actor`` with these arguments would use;
        :class:`ValueError` if ``actor`` is not guarded by this middleware."""
        name = actor if isinstance(actor, str) else actor.actor_name
        guards = self.guard_lists.get(name)
        if not guards:
            raise ValueError(f"actor {name!r} has no {self.option}= option")
        return guards[0].resolve_key(args, kwargs)

    def sweep_limit(self, key: str) -> int | None:
        """The default limit of ``key``'s actor (a sweep or a release hands the key on with it), or
        None if this process cannot tell which it is (the backend then uses the limit recorded with
        the key's waiters: it never guesses)."""
        guard = self.keys.guard_of(key)
        return self.default_limit(guard) if guard is not None else None

    # -- enqueue --------------------------------------------------------------

    def attach(self, broker: Broker) -> None:
        """Remember ``broker`` and join its enqueue gate."""
        self.broker = broker
        super().attach(broker)

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> PushTicket | None:
        """Reserve a slot of each guard of ``message`` of every slots middleware that guards its actor,
        in the broker's order (the first of them does it for all), or park it on the first whose key
        is full, giving back the slots reserved before it (see :mod:`.reservation`).

        They try all their slots in one round trip first (:func:`acquire_all`), then in turn.
        """
        if (
            self.one_step_sends
            and delay is None
            and holds is None
            and message.message_id not in self._inflight
            and GENERATIONS_OPTION not in message.options  # a hand-off's copy decides in two steps
        ):
            plan = self._solo_plan(broker, message)
            if plan.solo is not None:  # the common send: one guard that reserves and pushes in one step
                guard, backend = plan.solo
                key = self.guard_key_of(guard, message)
                claim = Claim(
                    key, self.holder_of(message), self.default_limit(guard), self.pickup_ttl_ms,
                    info=message.actor_name, priority=guard.priority, backend=backend,
                )  # fmt: skip
                return OneStepReservation(broker, claim, message, plan.deliver)
        group = composed(broker, message.actor_name, self)
        if group[0] is not self:
            return None  # the first slots middleware of the actor decided for this one
        keyed = [
            (member, guard, key)
            for member in group
            for guard, key in member._to_reserve(message, delay, holds)
        ]
        if not keyed:
            return None
        if len(keyed) == 1:
            member, guard, key = keyed[0]
            return member._reserve(broker, message, guard, key, one_step=holds is None)
        claims = [(member, member._send_claim(broker, message, guard, key)) for member, guard, key in keyed]
        if acquire_all(broker, claims) is not None:  # every slot reserved, in one round trip
            return TicketGroup(
                [ReservationTicket(claim, functools.partial(m.deliver, broker)) for m, claim in claims]
            )
        tickets = TicketGroup()
        try:
            for member, guard, key in keyed:
                tickets.add(member._reserve(broker, message, guard, key, one_step=False))
        except Diverted as diverted:
            tickets.settle(diverted.outcome)
            raise
        except BaseException:
            tickets.failed()
            raise
        return tickets

    def _solo_plan(self, broker: Broker, message: Message[Any]) -> _SoloPlan:
        """The plan of the sends of ``message``'s actor that are new messages (not delayed, no hand-off
        going back, not held here): made at the first, kept with the actor's :meth:`plan`."""
        actor = self.plan(broker, message.actor_name)
        plan: _SoloPlan | None = actor.send
        if plan is None:
            guards = self.guards_of(message)
            solo = None
            if (
                len(guards) == 1
                and self.one_step_sends
                and self.on_busy(guards[0].policy) == "park"
                and not guards[0].policy.fail_open
                and composed(broker, message.actor_name, self) == [self]
                and self.enqueues_alone(broker, message.actor_name, self.backend(broker))
            ):
                solo = (guards[0], self.backend(broker))
            plan = actor.send = _SoloPlan(solo, functools.partial(self.deliver, broker))
        return plan

    def _to_reserve(
        self, message: Message[Any], delay: int | None, holds: str | None
    ) -> list[tuple[ActorGuard[P], str]]:
        """The guards of ``message`` that reserve a slot at its send, with their keys: none for a
        delayed message (decided when it comes due), a hand-off going back (``holds`` a key of this
        capability), a message holding a slot here (its re-enqueue by Retries), or a guard that does
        not park (raises :class:`GuardKeyError` as :meth:`guard_keys_of`)."""
        guards = self.guards_of(message)
        if not guards or delay is not None or self.on_busy(guards[0].policy) != "park":
            return []
        if holds is not None and self.claims(holds):
            return []
        if message.message_id in self._inflight:
            return []
        return self.guard_keys_of(guards, message)

    def _reserve(
        self, broker: Broker, message: Message[Any], guard: ActorGuard[P], key: str, *, one_step: bool
    ) -> ReservationTicket | OneStepReservation | None:
        """Reserve a slot of one guard's ``key`` for ``message`` (with its push, if ``one_step`` and
        it can), or park it there (raises :class:`Diverted`)."""
        claim = self._send_claim(broker, message, guard, key)
        deliver = functools.partial(self.deliver, broker)
        if one_step and self._in_one_step(broker, claim, guard):
            return OneStepReservation(broker, claim, message, deliver)
        return reserve_or_park(claim, message, deliver, fail_open_allowed=guard.policy.fail_open)

    def _send_claim(self, broker: Broker, message: Message[Any], guard: ActorGuard[P], key: str) -> Claim:
        """The claim of a send (or of a hand-off's copy going back) on ``key``: a reservation for
        ``pickup_ttl``, by no runner."""
        return Claim(
            key, self.holder_of(message), self.default_limit(guard), self.pickup_ttl_ms,
            info=message.actor_name, generation=generation_of(message, key), priority=guard.priority,
            backend=self.backend(broker),
        )  # fmt: skip

    def _in_one_step(self, broker: Broker, claim: Claim, guard: ActorGuard[P]) -> bool:
        """Whether the reservation (or park) of a new message and its push go in one step: this kind of
        guard sends so, its policy fails closed, the backend can, and no other guard decides about the
        actor's sends (a copy of a hand-off, with its generation, takes two)."""
        if not self.one_step_sends or claim.generation is not None or guard.policy.fail_open:
            return False
        return self.enqueues_alone(broker, guard.actor_name, claim.backend)

    # -- hand-offs ------------------------------------------------------------

    def make_courier(self, broker: Broker) -> Courier:
        """Hand-offs go back to ``broker`` confirmed for ``pickup_ttl``; a slot handed to a message
        that another guard parks on its way is given back."""
        return Courier(
            broker,
            self.backend(broker),
            ttl_ms=lambda _message: self.handoff_hold_ms,
            default_limit=self.sweep_limit,
            keep_when_parked=self.keeps_when_parked,
            counts_handoffs=True,
            after_push=lambda message: keep_polling(self._worker, message.queue_name),
        )

    @property
    def handoff_hold_ms(self) -> int:
        """How long a confirmed hand-off holds its slot for its message to start: ``pickup_ttl``."""
        return self.pickup_ttl_ms

    def deliver(self, broker: Broker, handoffs: Sequence[Handoff]) -> None:
        """Deliver the parked messages handed a slot, counting every hand-off (a woken blocking
        waiter's under the key's actor, when this process can tell it)."""
        if not handoffs:
            return
        for handoff in handoffs:
            if handoff.payload is None:
                guard = self.keys.guard_of(handoff.key)
                if guard is not None:
                    events.handed_off(guard.actor_name)
        self.courier(broker).deliver(handoffs)

    def swept(self, broker: Broker, key: str, result: ReleaseResult) -> None:
        """Re-enqueue what the sweep of ``key`` handed on."""
        self.deliver(broker, result.handoffs)
        if result.released or result.handoffs:
            events.lockwait_changed()

    # -- run-time limits ------------------------------------------------------

    def set_limit(self, key: str, limit: int | None, *, broker: Broker | None = None) -> ReleaseResult:
        """Set (or with None, clear) the run-time limit of ``key`` (as :meth:`key_for` gives it,
        without prefix); 0 halts it. Raising it re-enqueues the key's waiters on ``broker``
        (default: this middleware's) at once. The limit stays in the backend until cleared."""
        broker = self._broker_or(broker)
        guard_key = f"{self.prefix}:{key}"
        result = self.backend(broker).set_limit(guard_key, limit, default=self.sweep_limit(guard_key))
        self.deliver(broker, result.handoffs)
        events.lockwait_changed()
        return result

    def get_limit(self, key: str, *, broker: Broker | None = None) -> int | None:
        """The run-time limit of a key (without the capability prefix), or None."""
        return self.backend(self._broker_or(broker)).get_limit(f"{self.prefix}:{key}")

    def _broker_or(self, broker: Broker | None) -> Broker:
        return broker or self.broker or dramatiq.get_broker()


def composed(broker: Broker, actor_name: str, member: SlotsBase[Any]) -> list[SlotsBase[Any]]:
    """The slots middlewares of ``broker`` that guard ``actor_name`` and decide together, in the broker's
    order (``member`` alone if it is not on the broker): the first tries the slots of all of them in one
    round trip, at send and at pickup (docs/flow-control-design.md, "Composed guards").

    Kept in ``member``'s :meth:`~.GuardMiddleware.plan` of the actor: made anew once
    ``broker.middleware`` changes or a slots middleware of the broker declares the actor again
    (:meth:`SlotsBase.before_declare_actor`).
    """
    plan = member.plan(broker, actor_name)
    group: list[SlotsBase[Any]] | None = plan.group
    if group is None:
        group = [
            m
            for m in plan.middleware
            if isinstance(m, SlotsBase) and m.composes and m.guards_actor(actor_name)
        ]
        group = plan.group = group if member in group else [member]
    return group


def acquire_all(broker: Broker, claims: Sequence[tuple[SlotsBase[Any], Claim]]) -> list[AcquireResult] | None:
    """Acquire every claim (each of the middleware beside it) in one round trip
    (:meth:`GuardBackend.acquire_many`), if they share a backend and none of their keys refused or had
    waiters lately: the results if all were acquired; else None, what was acquired given back (the
    guards then decide in turn, and the first that refuses parks)."""
    backend = claims[0][1].backend
    if any(claim.backend is not backend or claim.key in m._contended for m, claim in claims):
        return None
    try:
        results = backend.acquire_many([claim for _, claim in claims])
    except BackendUnavailable:
        return None  # in turn, each acquire of what this holder may hold already is its own again
    for (member, _), result in zip(claims, results, strict=True):
        member.deliver(broker, result.handoffs)
    if all(result.acquired for result in results):
        return results
    for (member, claim), result in zip(claims, results, strict=True):
        if not result.acquired:
            member._contended.mark(claim.key)
    taken = [(m, c) for (m, c), r in zip(claims, results, strict=True) if r.acquired]
    with contextlib.suppress(BackendUnavailable):  # if not: in turn, its acquires find them its own
        released = backend.release_many([(c.key, c.holder, c.limit, 0) for _, c in taken])
        for (member, _), done in zip(taken, released, strict=True):
            member.deliver(broker, done.handoffs)
    return None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _SoloPlan:
    """What :meth:`SlotsBase._solo_plan` keeps per actor (its :class:`~.base.ActorPlan`'s ``send``):
    ``solo``, the actor's one guard and the backend, if it is the actor's only enqueue-time guard, it
    parks and fails closed, and its reservation goes with the push in one step (else None);
    ``deliver``, what delivers its hand-offs."""

    solo: tuple[ActorGuard[Any], GuardBackend] | None
    deliver: Deliver


def _ms(value: Any, what: str, *, minimum: int = 1) -> int:
    return cast(int, duration_ms(value, what=what, minimum=minimum))
