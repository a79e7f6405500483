"""Enqueue time: a message that finds a free slot reserves it for ``pickup_ttl``; one that finds
the key full parks (docs/slots.md, "Parking")."""

from __future__ import annotations

import logging
from typing import Any

from dramatiq import Message

from dramatiq_guard import events
from dramatiq_guard.backends.base import Waiter
from dramatiq_guard.backends.values import AcquireOutcome
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
    claim: Claim, message: Message[Any], deliver: Deliver, *, fail_open_allowed: bool
) -> ReservationTicket | None:
    """Reserve a slot of the claimed key for ``message``, or park it if the key is full.

    ``claim`` carries the copy's generation: a stale copy of a hand-off never starts.

    Raises:
      Diverted: The message was parked (``Outcome.PARKED``): ``send()`` returns it; or it is a
        stale copy of a hand-off of this key (``Outcome.DROPPED``): a newer copy runs instead.
      GuardError: The backend is unavailable (unless ``fail_open``).
    """
    try:
        result = claim.acquire(Waiter(payload=message.encode()))
    except BackendUnavailable as e:
        if claim.generation is None:
            # What the acquire may have done is taken back, so no retry or unguarded push runs
            # beside a parked copy; a copy of a hand-off keeps its entry (it may be its only place).
            undone = claim.take_back()
            if undone is not None:
                deliver(undone.handoffs)
        fail_open(fail_open_allowed, e, f"{message} is enqueued unguarded")
        return None
    deliver(result.handoffs)
    match result.outcome:
        case AcquireOutcome.ACQUIRED:
            return ReservationTicket(claim, deliver)
        case AcquireOutcome.QUEUED | AcquireOutcome.STANDBY:
            logger.debug("Parked %s at enqueue: %r is full (limit %d).", message, claim.key, result.limit)
            events.parked(message.actor_name)
            events.lockwait_changed()
            raise Diverted(message, Outcome.PARKED)
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
            return None
