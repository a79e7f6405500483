"""The enqueue gate: a wrapper of ``broker.enqueue`` where guards decide whether a message is pushed.

Why a wrapper and not ``before_enqueue``: docs/design.md. The gate asks its guards in
``gate_priority`` order; a guard's ``before_push`` lets the message through (None, or a
:class:`PushTicket` settled once the outcome is known), diverts it (:class:`Diverted`: not pushed,
``send()`` returns normally), or refuses it (a :class:`~dramatiq_guard.errors.GuardError`, after
earlier tickets failed). A hand-off going back is admitted with ``holds=<its key>``, so the guard of
that key lets it through. Anything that is not a :class:`dramatiq.Message` goes to the broker untouched.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from dramatiq import Broker, Message

logger = logging.getLogger("dramatiq_guard.gate")


class Outcome(enum.Enum):
    """What became of one enqueue."""

    #: The message is on the broker.
    PUSHED = "pushed"
    #: A guard parked it in its lockwait area: not on the broker, but it will run.
    PARKED = "parked"
    #: A guard dropped it (a duplicate): it will not run.
    DROPPED = "dropped"


@dataclasses.dataclass(frozen=True)
class Admission:
    """The outcome of :meth:`EnqueueGate.admit`: the message ``send()`` returns, and what became of it."""

    message: Message[Any]
    outcome: Outcome


class PushTicket(Protocol):
    """What a guard did for one enqueue, to be settled once the outcome is known."""

    def pushed(self) -> None:
        """The message reached the broker."""

    def parked(self) -> None:
        """A later guard parked the message: it is not on the broker, but it will run."""

    def failed(self) -> None:
        """The message will not be sent (dropped, refused, or the push failed): undo."""


class OneStepPush(Protocol):
    """What takes over the broker's push of one message: a decision and the push in one step (a
    guard's ticket that has :meth:`enqueue`, or the caller's ``push`` of :meth:`EnqueueGate.admit`).

    The gate routes the broker's ``do_enqueue`` (a RedisBroker's) to :meth:`enqueue` for this
    message, after every other middleware's ``before_enqueue``; a :class:`Diverted` raised there
    comes back as from ``before_push`` (no ``after_enqueue`` fires, as for a failed push).
    """

    def enqueue(
        self, queue_name: str, message_id: str, data: bytes, push: Callable[[str, str, bytes], Any]
    ) -> None:
        """Push ``data`` (with ``push``, the broker's own, or in one step with the decision), or raise."""


class EnqueueGuard(Protocol):
    """A middleware that takes part in enqueue decisions."""

    gate_priority: int

    def guards_actor(self, actor_name: str) -> bool:
        """Whether it may act on this actor's messages: the gate skips it for the others."""

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None
    ) -> PushTicket | None:
        """Decide about ``message`` (see the module docstring); ``holds``: the guard key it holds, if any."""


class Diverted(Exception):
    """Raised by a guard's ``before_push``: do not push, return ``message`` to the caller; ``outcome``
    is ``PARKED`` (earlier tickets are told so) or ``DROPPED`` (earlier tickets are undone).

    ``then``: what to do once every ticket is settled (a parking acquire's hand-offs are delivered
    only after the message gave back what it reserved of the other guards: before, a message handed
    a place could find one of them held by it, park there, and hand its place on to this message,
    whose give-back would then take the reservations of its own copy on the broker).
    """

    def __init__(
        self, message: Message[Any], outcome: Outcome, then: Callable[[], None] | None = None
    ) -> None:
        super().__init__(message.message_id)
        self.message = message
        self.outcome = outcome
        self.then = then

    def settled(self) -> None:
        """Every ticket is settled: do what was left for then."""
        if self.then is not None:
            then, self.then = self.then, None
            then()


def copy_with(message: Message[Any], options: dict[str, Any]) -> Message[Any]:
    """A copy of ``message`` whose options are ``options`` (e.g. the message a diverted send returns),
    made as :meth:`Message.copy` makes it, without the cost of ``dataclasses.replace`` for a Message."""
    if type(message) is not Message:  # a subclass may have fields of its own
        copy = message.copy()
        copy.options.clear()
        copy.options.update(options)
        return copy
    return Message(
        message.queue_name,
        message.actor_name,
        message.args,
        message.kwargs,
        options,
        message.message_id,
        message.message_timestamp,
    )


class EnqueueGate:
    """Wraps ``broker.enqueue`` (see the module docstring)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.guards: list[EnqueueGuard] = []
        self.original: Callable[..., Message[Any]] = broker.enqueue
        broker.enqueue = self.enqueue  # type: ignore[method-assign]
        self._push_original: Callable[[str, str, bytes], Any] | None = None
        self._local = _Sending()
        # Per actor name: the guards that guard its messages (guarding()); emptied by add() and changed().
        self._guarding: dict[str, list[EnqueueGuard]] = {}

    def sole_guard(self, actor_name: str, guard: EnqueueGuard) -> bool:
        """Whether ``guard`` is the only guard of this gate that guards ``actor_name``'s messages."""
        return self.guarding(actor_name) == [guard]

    def guarding(self, actor_name: str) -> list[EnqueueGuard]:
        """The guards that guard ``actor_name``'s messages, in ``gate_priority`` order (asked once per
        actor until a guard is added or says its actors :meth:`changed`)."""
        guards = self._guarding.get(actor_name)
        if guards is None:
            guards = self._guarding[actor_name] = [g for g in self.guards if g.guards_actor(actor_name)]
        return guards

    def changed(self) -> None:
        """A guard's answer to ``guards_actor`` may have changed (an actor declared again): ask again."""
        self._guarding = {}

    def add(self, guard: EnqueueGuard) -> None:
        """Add ``guard`` (once), keeping the guards in ``gate_priority`` order; the guards' actors are
        asked again (a guard is added again for each actor it comes to guard)."""
        if not any(g is guard for g in self.guards):
            self.guards.append(guard)
            self.guards.sort(key=lambda g: g.gate_priority)
        self.changed()

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """The wrapped ``broker.enqueue``."""
        local = self._local
        local.depth += 1  # a hook may enqueue inside this one
        try:
            if type(message) is Message or isinstance(message, Message):
                # A dict lookup per send (guarding() fills it on an actor's first send).
                guards = self._guarding.get(message.actor_name)
                if guards is None:
                    guards = self.guarding(message.actor_name)
                if guards:
                    return self._admit(message, delay, None, None, guards).message
            # Not a message any guard here guards: the plain push.
            return self.original(message, delay=delay)
        finally:
            local.depth -= 1

    def admit(
        self,
        message: Message[Any],
        *,
        delay: int | None = None,
        holds: str | None = None,
        push: OneStepPush | None = None,
    ) -> Admission:
        """Let the guards decide about ``message``, push it unless diverted, and say what happened; a
        guard's refusal (a GuardError) or the push's failure is raised. ``holds``: the guard key the
        message already holds (a hand-off going back): its guard lets it pass. ``push``: the caller's
        own one-step push (a hand-off's copy and its confirmation), unless a guard's ticket takes it."""
        return self._admit(message, delay, holds, push, self.guarding(message.actor_name))

    def _admit(
        self,
        message: Message[Any],
        delay: int | None,
        holds: str | None,
        push: OneStepPush | None,
        guards: list[EnqueueGuard],
    ) -> Admission:
        """:meth:`admit` by ``guards``."""
        local = self._local
        outer = local.ticket  # an enqueue this one runs inside of
        tickets: list[PushTicket] = []
        try:
            step: OneStepPush | None = None  # the first ticket's that pushes in one step, else ``push``
            for guard in guards:
                ticket = guard.before_push(self.broker, message, delay, holds=holds)
                if ticket is not None:
                    tickets.append(ticket)
                    if step is None and hasattr(ticket, "enqueue"):
                        step = ticket  # type: ignore[assignment]  # a OneStepPush (cast() costs a call)
            if step is None:
                step = push
            if step is not None:
                if self._push_original is None:
                    self._take_pushes()
                local.ticket = (local.depth, step)
            enqueued = self.original(message, delay=delay)
        except Diverted as diverted:  # raised by a guard's before_push, or a one-step ticket's push
            settle(tickets, diverted.outcome)
            diverted.settled()
            return Admission(diverted.message, diverted.outcome)
        except BaseException:
            settle(tickets, Outcome.DROPPED)
            raise
        finally:
            local.ticket = outer
        settle(tickets, Outcome.PUSHED)
        return Admission(enqueued, Outcome.PUSHED)

    def _take_pushes(self) -> None:
        """Route the broker's ``do_enqueue`` (a RedisBroker's push) through :meth:`_push`, once."""
        if self._push_original is None:
            self._push_original = self.broker.do_enqueue  # type: ignore[attr-defined]
            self.broker.do_enqueue = self._push  # type: ignore[attr-defined]

    def _push(self, queue_name: str, message_id: str, data: bytes) -> Any:
        """The broker's push: a one-step ticket's, if this thread's enqueue has one, else its own."""
        local = self._local
        held = local.ticket
        assert self._push_original is not None
        # The ticket's own enqueue only: a message a hook sends inside it (one level deeper) pushes as usual.
        if held is None or held[0] != local.depth:
            return self._push_original(queue_name, message_id, data)
        local.ticket = None
        return held[1].enqueue(queue_name, message_id, data, self._push_original)


class _Sending(threading.local):
    """A thread's enqueues under way: how deep it is in them (a hook may enqueue inside an enqueue),
    and the one-step push of a guarded one with the depth it was taken at (see :meth:`EnqueueGate._push`)."""

    depth = 0
    ticket: tuple[int, OneStepPush] | None = None


def settle(tickets: list[PushTicket], outcome: Outcome) -> None:
    """Settle every ticket with ``outcome``, the last first (a ticket that raises is logged)."""
    for ticket in reversed(tickets):
        try:
            if outcome is Outcome.PUSHED:
                ticket.pushed()
            elif outcome is Outcome.PARKED:
                ticket.parked()
            else:
                ticket.failed()
        except Exception:
            logger.exception("Failed to settle an enqueue ticket (%s).", outcome.value)


class TicketGroup:
    """Several tickets settled as one: the gate's for one enqueue, or the slots guards' of one actor."""

    def __init__(self, tickets: list[PushTicket] | None = None) -> None:
        self.tickets: list[PushTicket] = tickets or []

    def add(self, ticket: PushTicket | None) -> None:
        if ticket is not None:
            self.tickets.append(ticket)

    def settle(self, outcome: Outcome) -> None:
        """Settle every ticket with ``outcome`` (:func:`settle`)."""
        settle(self.tickets, outcome)

    def pushed(self) -> None:
        self.settle(Outcome.PUSHED)

    def parked(self) -> None:
        self.settle(Outcome.PARKED)

    def failed(self) -> None:
        self.settle(Outcome.DROPPED)


_lock = threading.Lock()


def gate_for(broker: Broker) -> EnqueueGate:
    """The broker's enqueue gate, installed on first use."""
    with _lock:
        gate = getattr(broker.enqueue, "__self__", None)
        if isinstance(gate, EnqueueGate) and gate.broker is broker:
            return gate
        return EnqueueGate(broker)
