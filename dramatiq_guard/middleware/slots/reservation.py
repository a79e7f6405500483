"""Enqueue time: a message that finds a free slot reserves it for ``pickup_ttl``; one that finds
the key full parks (docs/slots.md, "Parking").

Where the backend can (a RedisBroker on the guard's Redis) and the slots guard is the actor's
only enqueue-time guard, the reservation and the broker's push are one script
(:class:`OneStepReservation`); elsewhere the reservation, then the broker's push
(:func:`reserve_or_park`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from dramatiq import Broker, Message

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, Waiter
from dramatiq_guard.backends.values import AcquireOutcome, Enqueue
from dramatiq_guard.claim import Claim, Deliver
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.gate import Diverted, Outcome
from dramatiq_guard.middleware.base import fail_open

logger = logging.getLogger(__name__)


class ReservationTicket:
    """A slot reserved at enqueue, given back unless the message reaches the broker."""

    def __init__(self, claim: Claim, deliver: Deliver) -> None:
        self.claim = claim
        self.deliver = deliver

    def pushed(self) -> None:
        """It is on the broker: the slot waits for it to start."""

    def parked(self) -> None:
        """Another slot guard parked it: it must not keep this slot meanwhile."""
        self.failed()

    def failed(self) -> None:
        self.deliver(self.claim.release().handoffs)


def reserve_or_park(
    claim: Claim,
    message: Message[Any],
    deliver: Deliver,
    *,
    fail_open_allowed: bool,
    payload: bytes | None = None,
) -> ReservationTicket | None:
    """Reserve a slot of the claimed key for ``message``, or park it if the key is full.

    ``claim`` carries the copy's generation: a stale copy of a hand-off never starts.
    ``payload``: what parks (default: ``message`` encoded).

    Raises:
      Diverted: The message was parked (``Outcome.PARKED``): ``send()`` returns it; or it is a
        stale copy of a hand-off of this key (``Outcome.DROPPED``): a newer copy runs instead.
      GuardError: The backend is unavailable (unless ``fail_open``).
    """
    try:
        result = claim.acquire(Waiter(payload=message.encode() if payload is None else payload))
    except BackendUnavailable as e:
        _unavailable(claim, message, deliver, e, fail_open_allowed)
        return None
    return ReservationTicket(claim, deliver) if _reserved(claim, message, result, deliver) else None


def _unavailable(
    claim: Claim, message: Message[Any], deliver: Deliver, error: BackendUnavailable, allowed: bool
) -> None:
    """The acquire raised: take back what it may have done, then fail closed (or, if ``allowed``, open)."""
    if claim.generation is None:
        # What the acquire may have done is taken back, so no retry or unguarded push runs
        # beside a parked copy; a copy of a hand-off keeps its entry (it may be its only place).
        undone = claim.take_back()
        if undone is not None:
            deliver(undone.handoffs)
    fail_open(allowed, error, f"{message} is enqueued unguarded")


def _reserved(claim: Claim, message: Message[Any], result: AcquireResult, deliver: Deliver) -> bool:
    """Whether the acquire reserved a slot (False: another copy runs, this one goes without one);
    :class:`Diverted` if it parked, or is a stale copy (see :func:`reserve_or_park`)."""
    if result.outcome in (AcquireOutcome.QUEUED, AcquireOutcome.STANDBY):
        logger.debug("Parked %s at enqueue: %r is full (limit %d).", message, claim.key, result.limit)
        events.parked(message.actor_name)
        events.lockwait_changed()
        # Its hand-offs go once it gave back what it reserved of its other guards (Diverted.then).
        raise Diverted(message, Outcome.PARKED, then=lambda: deliver(result.handoffs))
    deliver(result.handoffs)
    match result.outcome:
        case AcquireOutcome.ACQUIRED:
            return True
        case AcquireOutcome.STALE:
            logger.info(
                "Dropped %s at enqueue: a stale copy (a newer hand-off of %r runs instead).",
                message,
                claim.key,
            )
            raise Diverted(message, Outcome.DROPPED)
        case _:  # RUNNING (BUSY does not happen: a refusal with a waiter queues)
            # Another copy of the message holds the key (it runs): this one goes to the
            # broker without a slot, and its worker defers it until that copy is done.
            return False


@dataclasses.dataclass(eq=False, slots=True)
class OneStepReservation:
    """A send's reservation taken with the broker's push in one step, or its park
    (:meth:`GuardBackend.reserve_and_enqueue`); where the backend cannot decide in one step,
    :func:`reserve_or_park` and the broker's own push. Only for a new message (no generation)
    whose policy fails closed."""

    broker: Broker
    claim: Claim
    message: Message[Any]
    deliver: Deliver
    two_steps: ReservationTicket | None = None

    def enqueue(
        self, queue_name: str, message_id: str, data: bytes, push: Callable[[str, str, bytes], Any]
    ) -> None:
        """Reserve and push ``data``, or park it (raises :class:`Diverted`); ``data`` is the park payload."""
        claim, message = self.claim, self.message
        try:
            one = Enqueue(self.broker, queue_name, message_id, data)
            result = claim.backend.reserve_and_enqueue(claim, one)
        except BackendUnavailable as e:
            _unavailable(claim, message, self.deliver, e, allowed=False)
            raise  # not reached: it fails closed
        if result is None:
            self.two_steps = reserve_or_park(
                claim, message, self.deliver, fail_open_allowed=False, payload=data
            )
            push(queue_name, message_id, data)
        elif result.outcome is AcquireOutcome.ACQUIRED and not result.handoffs:
            return  # reserved and pushed (what _reserved says, without its calls)
        elif not _reserved(claim, message, result, self.deliver):
            push(queue_name, message_id, data)  # another copy runs: pushed without a slot

    def pushed(self) -> None:
        """On the broker: the slot waits for it to start."""

    def parked(self) -> None:
        """Parked by its own enqueue (the only guard): nothing to undo."""

    def failed(self) -> None:
        """Not pushed: a slot reserved in two steps is given back. In one step, the reservation and
        the push happened together (or neither did), and stay together."""
        if self.two_steps is not None:
            self.two_steps.failed()
