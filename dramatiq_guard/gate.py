"""The enqueue gate: the one place where guards decide whether a message is pushed.

Dramatiq offers no hook that can cancel an enqueue silently: only a
``MiddlewareError`` raised in ``before_enqueue`` stops a push, and it reaches
the caller of ``send()``. A deduplicated message must not reach the broker
*and* ``send()`` must return normally; a message over a concurrency limit is
parked instead of pushed. So the guard middlewares do their enqueue-time work
in a wrapper around the broker's ``enqueue`` method, installed once per broker
when the first guarded actor is declared (or by :func:`dramatiq_guard.install`).

Every path that enqueues goes through ``broker.enqueue``: ``actor.send``,
``send_with_options``, ``group.run``, ``pipeline.run``, the Retries middleware
and the worker's delay-queue mover. The wrapper runs once per call to
``enqueue`` (not once per attempt of the RabbitMQ broker's own retry loop).

For each enqueue the gate asks its guards in order of ``gate_priority``
(deduplication before parking). A guard may:

* let it through, returning None or a :class:`PushTicket` whose ``pushed`` or
  ``failed`` is called once the push succeeded or failed (a failed push emits
  no Dramatiq after-hook, so this is how a guard undoes what it did);
* divert it, raising :class:`Diverted` with the message ``send()`` returns:
  the message is not pushed. ``accepted=True`` means it was taken care of
  elsewhere (parked: earlier tickets count it as pushed); ``accepted=False``
  means it was dropped (earlier tickets are undone);
* refuse it, raising a :class:`~dramatiq_guard.errors.GuardError`, which
  reaches the caller of ``send()`` after earlier tickets are undone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from dramatiq import Broker, Message

logger = logging.getLogger("dramatiq_guard.gate")


class PushTicket(Protocol):
    """What a guard did for one enqueue, to be confirmed or undone."""

    def pushed(self) -> None:
        """The message reached the broker (or was accepted by a later guard)."""

    def failed(self) -> None:
        """The message did not reach the broker: undo."""


class EnqueueGuard(Protocol):
    """A middleware that takes part in enqueue decisions."""

    gate_priority: int

    def before_push(self, broker: Broker, message: Message[Any], delay: int | None) -> PushTicket | None:
        """Decide about ``message``; see the module docstring."""


class Diverted(Exception):
    """Raised by a guard's ``before_push``: do not push, return ``message`` to the caller.

    Parameters:
      message(Message): What ``broker.enqueue`` (and so ``send()``) returns.
      accepted(bool): True if the message was taken care of (parked), False
        if it was dropped.
    """

    def __init__(self, message: Message[Any], *, accepted: bool) -> None:
        super().__init__(message.message_id)
        self.message = message
        self.accepted = accepted


EnqueueFn = Callable[..., Message[Any]]


class EnqueueGate:
    """Wraps one broker's ``enqueue``; see the module docstring.

    Parameters:
      broker(Broker): The broker whose ``enqueue`` is wrapped.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.guards: list[EnqueueGuard] = []
        self.original: EnqueueFn = broker.enqueue
        broker.enqueue = self.enqueue  # type: ignore[method-assign]

    def add(self, guard: EnqueueGuard) -> None:
        """Add ``guard`` (once), keeping the guards in ``gate_priority`` order."""
        if not any(g is guard for g in self.guards):
            self.guards.append(guard)
            self.guards.sort(key=lambda g: g.gate_priority)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """The wrapped ``broker.enqueue``."""
        tickets: list[PushTicket] = []
        try:
            for guard in self.guards:
                ticket = guard.before_push(self.broker, message, delay)
                if ticket is not None:
                    tickets.append(ticket)
        except Diverted as diverted:
            _settle(tickets, pushed=diverted.accepted)
            return diverted.message
        except BaseException:
            _settle(tickets, pushed=False)
            raise

        try:
            enqueued = self.original(message, delay=delay)
        except BaseException:
            _settle(tickets, pushed=False)
            raise
        _settle(tickets, pushed=True)
        return enqueued


def _settle(tickets: list[PushTicket], *, pushed: bool) -> None:
    for ticket in reversed(tickets):
        try:
            ticket.pushed() if pushed else ticket.failed()
        except Exception:
            logger.exception("Failed to settle an enqueue ticket (%s).", "pushed" if pushed else "failed")


_lock = threading.Lock()


def gate_for(broker: Broker) -> EnqueueGate:
    """The broker's enqueue gate, installed on first use."""
    with _lock:
        gate = getattr(broker.enqueue, "__self__", None)
        if isinstance(gate, EnqueueGate) and gate.broker is broker:
            return gate
        return EnqueueGate(broker)
