"""Enqueue time: a message that finds a free slot reserves it; one that finds the key full parks.

Reserving at enqueue lets a burst of sends fill the limit exactly while the
rest park without costing a broker pickup (docs/slots.md, "Parking"). The
reservation lasts ``pickup_ttl``; a failed push gives it back, and so does a
later guard that parks the message elsewhere.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dramatiq import Broker, Message

from dramatiq_guard import events
from dramatiq_guard.backends.base import Waiter
from dramatiq_guard.delivery import generation_of
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.gate import Diverted, Outcome
from dramatiq_guard.middleware.base import fail_open

if TYPE_CHECKING:
    from dramatiq_guard.middleware.base import ActorGuard
    from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware

__all__ = ["ReservationTicket", "reserve_or_park"]

logger = logging.getLogger(__name__)


class ReservationTicket:
    """A slot reserved at enqueue, given back unless the message reaches the broker."""

    def __init__(
        self, middleware: SlotsMiddleware[Any], broker: Broker, key: str, message_id: str, limit: int
    ) -> None:
        self.middleware = middleware
        self.broker = broker
        self.key = key
        self.message_id = message_id
        self.limit = limit

    def pushed(self) -> None:
        """It is on the broker: the slot waits for it to start."""

    def parked(self) -> None:
        """Another slot guard parked it: it must not keep this slot meanwhile."""
        self.failed()

    def failed(self) -> None:
        result = self.middleware.backend(self.broker).release(self.key, self.message_id, limit=self.limit)
        self.middleware.deliver(self.broker, result.handoffs)


def reserve_or_park(
    middleware: SlotsMiddleware[Any], broker: Broker, guard: ActorGuard[Any], message: Message[Any]
) -> ReservationTicket | None:
    """Reserve a slot of ``message``'s key for it, or park it if the key is full.

    Raises:
      Diverted: The message was parked (``Outcome.PARKED``): ``send()`` returns it; or it is a
        stale copy of a hand-off of this key (``Outcome.DROPPED``): a newer copy runs instead.
      GuardKeyError: The key could not be computed.
      GuardError: The backend is unavailable (unless ``fail_open``).
    """
    backend = middleware.backend(broker)
    key = middleware.guard_key_of(guard, message)
    limit = middleware.default_limit(guard)
    # A copy of a hand-off of this key (back from another guard that parked it on its way) is
    # judged as a worker's copy is: a stale one never starts (contract, *generations*).
    generation = generation_of(message, key)
    try:
        result = backend.acquire(
            key,
            message.message_id,
            limit=limit,
            ttl_ms=middleware.pickup_ttl_ms,
            wait=Waiter(payload=message.encode()),
            info=message.actor_name,
            generation=generation,
        )
    except BackendUnavailable as e:
        if generation is None:
            # A message being sent had nothing in the key: what the acquire may have done (a
            # reservation, a park) is taken back, so neither the caller's retry (fail closed) nor
            # the unguarded push (fail open) runs beside a parked copy. A copy of a hand-off keeps
            # its entry: it may be its only place.
            undone = backend.take_back(key, message.message_id, limit=limit)
            if undone is not None:
                middleware.deliver(broker, undone.handoffs)
        fail_open(guard.policy.fail_open, e, f"{message} is enqueued unguarded")
        return None
    middleware.deliver(broker, result.handoffs)
    if result.running:
        # Another copy of the message holds the key (it runs): this one goes to the broker without
        # a slot, and its worker defers it until that copy is done.
        return None
    if result.stale:
        logger.info(
            "Dropped %s at enqueue: a stale copy (a newer hand-off of %r runs instead).", message, key
        )
        raise Diverted(message, Outcome.DROPPED)
    if result.acquired:
        return ReservationTicket(middleware, broker, key, message.message_id, limit)
    if result.parked:
        logger.debug("Parked %s at enqueue: %r is full (limit %d).", message, key, result.limit)
        events.parked(message.actor_name)
        events.lockwait_changed()
        raise Diverted(message, Outcome.PARKED)
    return None
