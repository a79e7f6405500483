"""Enqueue time: a message that finds a free slot reserves it; one that finds the key full parks.

Reserving at enqueue lets a burst of sends fill the limit exactly while the
rest park without costing a broker pickup (docs/slots.md, "Parking"). The
reservation lasts ``pickup_ttl``; a failed push gives it back, and so does a
later guard that parks the message elsewhere.
"""

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

    ``claim``'s lease is the pickup's (``pickup_ttl``) and its generation the copy's: a copy of a
    hand-off of this key (back from another guard that parked it on its way) is judged as a
    worker's copy is, so a stale one never starts (contract, *generations*). ``fail_open_allowed``:
    the actor's ``fail_open``.

    Raises:
      Diverted: The message was parked (``Outcome.PARKED``): ``send()`` returns it; or it is a
        stale copy of a hand-off of this key (``Outcome.DROPPED``): a newer copy runs instead.
      GuardError: The backend is unavailable (unless ``fail_open``).
    """
    try:
        result = claim.acquire(Waiter(payload=message.encode()))
    except BackendUnavailable as e:
        if claim.generation is None:
            # A message being sent had nothing in the key: what the acquire may have done (a
            # reservation, a park) is taken back, so neither the caller's retry (fail closed) nor
            # the unguarded push (fail open) runs beside a parked copy. A copy of a hand-off keeps
            # its entry: it may be its only place.
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
