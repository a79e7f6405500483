"""Delivery: a parked message handed a slot goes back to its broker and queue, and is confirmed.

The message is enqueued through the enqueue gate with ``holds=<key>`` and its hand-off (or standby
send) is confirmed. Where the backend can push to the broker (a RedisBroker on the guard's Redis:
:meth:`GuardBackend.enqueue_and_confirm`), the push and the confirmation are one step; elsewhere the
confirmation follows the push. Until it, the payload stays stored, so a deliverer that dies in
between loses nothing (docs/contract.md, *hand-off* and *standbys*).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from dramatiq import Broker, Message
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard import events
from dramatiq_guard.backends.base import GuardBackend, Handoff
from dramatiq_guard.backends.values import ORIGINAL_GENERATION, Enqueue
from dramatiq_guard.gate import Outcome, gate_for

logger = logging.getLogger(__name__)

#: Message option (written on a re-enqueued copy): guard key -> the generation of the hand-off
#: (or standby send) it is a copy of, so a stale copy cannot start (backend contract, *generations*).
GENERATIONS_OPTION = "guard_generations"


def generation_of(message: Message[Any] | Any, key: str) -> int | None:
    """The generation of ``key``'s hand-off that ``message`` is a copy of, if it is one."""
    generations = message.options.get(GENERATIONS_OPTION)
    if generations is None:
        return None  # (not a copy: every message sent, on every send and pickup)
    value = generations.get(key) if isinstance(generations, dict) else None
    return value if isinstance(value, int) else None


def carry_generation(message: Message[Any], key: str, generation: int) -> None:
    """Write into ``message`` the generation of ``key``'s hand-off it is a copy of."""
    generations = dict(message.options.get(GENERATIONS_OPTION) or {})
    generations[key] = generation
    message.options[GENERATIONS_OPTION] = generations


def copy_generation(message: Message[Any] | Any, key: str) -> int:
    """The generation a worker acquires ``key`` with for the copy ``message`` it picked up: its
    hand-off's, or ``ORIGINAL_GENERATION`` (never None: a copy parked after pickup never starts again)."""
    generation = generation_of(message, key)
    return ORIGINAL_GENERATION if generation is None else generation


def acks_are_final(broker: Broker) -> bool:
    """Whether a message ``broker`` acked (``after_ack`` ran) can never be delivered again: a
    RedisBroker's and a StubBroker's; not RabbitMQ's (its ``basic_ack`` is not confirmed)."""
    return isinstance(broker, (RedisBroker, StubBroker))


@dataclasses.dataclass(eq=False)
class Courier:
    """Delivers the hand-offs and standbys of one kind of guard key on one broker.

    ``ttl_ms(message)``: how long a confirmed hand-off waits for its message to start.
    ``default_limit(key)``: the key's default limit (to give a slot back), None if unknown here.
    ``keep_when_parked``: whether a message that another guard parks on its way keeps what it was
    handed (a dedup lock; the default), or gives it back at once (a slot must not stand idle meanwhile).
    ``after_push(message)``: called right after each push.
    """

    broker: Broker
    backend: GuardBackend
    _: dataclasses.KW_ONLY
    ttl_ms: Callable[[Message[Any]], int]
    default_limit: Callable[[str], int | None] = lambda _key: None
    keep_when_parked: bool = True
    counts_handoffs: bool = False
    after_push: Callable[[Message[Any]], None] | None = None

    def deliver(self, handoffs: Iterable[Handoff]) -> None:
        """Enqueue each handed-off parked message, then confirm its hand-off (blocking waiters were
        woken by the backend). A failure is logged: the reservation lapses, the waiter waits again."""
        parked = [h for h in handoffs if h.payload is not None]
        if parked:
            failure = "Could not re-enqueue %s handed a slot of %r; its reservation lapses, it waits again."
            self._each(parked, self._deliver_one, failure)
            events.lockwait_changed()

    def send_ahead(self, standbys: Iterable[Handoff]) -> None:
        """Enqueue each standby the backend chose, then confirm it (one that fails parks again)."""
        failure = "Could not send %s ahead as a standby of %r; it parks again on its own."
        self._each(standbys, self._send_one, failure)

    @staticmethod
    def _each(items: Iterable[Handoff], step: Callable[[Handoff], None], failure: str) -> None:
        """Run ``step`` on each item; a failure is logged (nothing is lost)."""
        for item in items:
            try:
                step(item)
            except Exception:
                logger.warning(failure, item.waiter_id, item.key, exc_info=True)

    def _admit(self, handoff: Handoff, *, standby: bool) -> tuple[Message[Any], Outcome, bool | None]:
        """Enqueue the copy of ``handoff`` (a standby's, with ``standby``) through the gate; with the
        answer of its confirmation if that went with the push (:class:`OneStepDelivery`), else None."""
        assert handoff.payload is not None
        message = Message.decode(handoff.payload)
        if handoff.generation is not None:
            carry_generation(message, handoff.key, handoff.generation)
        one_step = None
        if self.backend.enqueues_on(self.broker):
            one_step = OneStepDelivery(self, handoff, self.ttl_ms(message), standby=standby)
        admission = gate_for(self.broker).admit(message, holds=handoff.key, push=one_step)
        if admission.outcome is Outcome.PUSHED and self.after_push is not None:
            self.after_push(message)
        return message, admission.outcome, None if one_step is None else one_step.confirmed

    def _deliver_one(self, handoff: Handoff) -> None:
        """Deliver one hand-off (and those that giving its slot back makes)."""
        message, outcome, held = self._admit(handoff, standby=False)
        if self.counts_handoffs:
            events.handed_off(message.actor_name)
        if outcome is Outcome.PUSHED or (outcome is Outcome.PARKED and self.keep_when_parked):
            key, waiter = handoff.key, handoff.waiter_id
            if held is None:
                ttl_ms = self.ttl_ms(message)
                held = self.backend.confirm_handoff(key, waiter, ttl_ms=ttl_ms, generation=handoff.generation)
            if not held:
                logger.warning(
                    "The hand-off of %r to %s lapsed before it was confirmed; it runs.", key, waiter
                )
            return
        self._withdraw(handoff)  # another guard parked (or dropped) it on the way: it keeps no slot

    def _send_one(self, standby: Handoff) -> None:
        """Send one standby (and deliver the hand-offs that leaving its place makes)."""
        assert standby.payload is not None
        message, outcome, held = self._admit(standby, standby=True)
        if outcome is Outcome.PUSHED:
            if held is None:
                key, ttl_ms = standby.key, self.ttl_ms(message)
                held = self.backend.confirm_standby(
                    key, standby.waiter_id, standby.payload, ttl_ms=ttl_ms, generation=standby.generation
                )
            if not held:
                logger.debug("Standby %s of %r parked again before it was confirmed.", message, standby.key)
            return
        self._withdraw(standby)  # another guard parked it on the way: it waits there, not here

    def _withdraw(self, handoff: Handoff) -> None:
        """Withdraw only this hand-off (or send): from where it parked, the message may already be
        back here (parked again, or holding the slot), and that entry is its only place now."""
        limit = self.default_limit(handoff.key)
        withdrawn = self.backend.cancel_wait(
            handoff.key, handoff.waiter_id, limit=limit, generation=handoff.generation
        )
        self.deliver(withdrawn.handoffs)


@dataclasses.dataclass(eq=False)
class OneStepDelivery:
    """The broker's push of a hand-off's (or standby's) copy with its confirmation, in one step.

    The enqueue gate's push of the copy (:meth:`EnqueueGate.admit`), so every other middleware's
    ``before_enqueue`` and ``after_enqueue`` run once around it, as for any enqueue; ``confirmed``:
    the confirmation's answer once pushed, None while not done in one step (the backend could not:
    it is pushed as usual, and the courier confirms it then).
    """

    courier: Courier
    handoff: Handoff
    ttl_ms: int
    _: dataclasses.KW_ONLY
    standby: bool
    confirmed: bool | None = None

    def enqueue(
        self, queue_name: str, message_id: str, data: bytes, push: Callable[[str, str, bytes], Any]
    ) -> None:
        """Push ``data`` and confirm it in one step (:meth:`GuardBackend.enqueue_and_confirm`), else
        push it with ``push``, the broker's own."""
        one, backend = Enqueue(self.courier.broker, queue_name, message_id, data), self.courier.backend
        self.confirmed = backend.enqueue_and_confirm(
            self.handoff, one, ttl_ms=self.ttl_ms, standby=self.standby
        )
        if self.confirmed is None:
            push(queue_name, message_id, data)


def courier_for(broker: Broker, backend: GuardBackend, key: str) -> Courier:
    """The courier of the guard middleware on ``broker`` that ``claims(key)``, else a plain one (the
    backend's hand-off time, kept if the message parks elsewhere, the limit recorded in the backend)."""
    for middleware in broker.middleware:
        claims = getattr(middleware, "claims", None)
        make = getattr(middleware, "courier", None)
        if callable(claims) and callable(make) and claims(key):
            courier = make(broker)
            assert isinstance(courier, Courier)
            return courier
    return Courier(broker, backend, ttl_ms=lambda _message: backend.handoff_ttl_ms)


def keep_polling(worker: Any, queue_name: str) -> None:
    """Have ``worker``'s consumer of ``queue_name`` poll again soon after its next empty fetch.

    Resets the Redis consumer's count of empty fetches (its back-off), so it keeps polling while a
    key's hand-offs and standbys flow (docs/slots.md, "Standbys"); any other consumer is left alone.
    """
    thread = getattr(worker, "consumers", {}).get(queue_name)
    consumer: Any = getattr(thread, "consumer", None)
    if isinstance(getattr(consumer, "misses", None), int):
        consumer.misses = 0
