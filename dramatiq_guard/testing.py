"""Test helpers for users of dramatiq-guard with Dramatiq's StubBroker.

``StubBroker.join(queue_name)`` returns once the queue and its delay queue
are empty, but a message parked by a ``concurrency`` limit or a
``mutex(on_busy="park")`` has left the queue: it waits in the guard's
lockwait area and comes back when a slot frees. :func:`join` waits for those
too::

    from dramatiq_guard.testing import join

    for n in range(10):
        deliver_webhook.send(customer_id, n)
    join(stub_broker, deliver_webhook.queue_name)
    worker.join()
"""

from __future__ import annotations

import time
from typing import Any

from dramatiq import Broker

from dramatiq_guard.events import lockwait_condition
from dramatiq_guard.middleware.slots import SlotsMiddleware

__all__ = ["join", "parked_count"]


def parked_count(broker: Broker) -> int:
    """How many messages wait in the lockwait areas of ``broker``'s slot keys.

    Parked messages and hand-offs not yet confirmed count, over every key of
    every :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware` on the
    broker (the lockwait area does not record queues).
    """
    total = 0
    for middleware in broker.middleware:
        if not isinstance(middleware, SlotsMiddleware):
            continue
        backend = middleware.backend(broker)
        for key in backend.waiting_keys():
            if key.startswith(middleware.prefix + ":"):
                state = backend.inspect(key)
                total += sum(1 for _, _, parked in state.waiters if parked) + len(state.reserved)
    return total


def join(broker: Broker, queue_name: str, *, timeout: int | None = None, **join_options: Any) -> None:
    """Wait until ``queue_name`` is drained *and* no message is parked in any slot key.

    On a broker whose worker releases leases on a thread of its own (any but
    a StubBroker: see ``docs/slots.md``, Execution), the releases still
    waiting for that thread are made first, so every finished message's slot
    is free when this returns.

    Parameters:
      broker(Broker): A StubBroker (any broker with ``join``) with a worker running.
      queue_name(str): The queue to join.
      timeout(int|None): The most to wait, in milliseconds (None: forever).
      **join_options: Passed to ``broker.join`` (e.g. ``fail_fast=True``).

    Raises:
      QueueJoinTimeout: The queue (or the parked messages) did not drain in time.
    """
    from dramatiq.errors import QueueJoinTimeout

    deadline = None if timeout is None else time.monotonic() + timeout / 1000
    activity = lockwait_condition()
    while True:
        remaining = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        broker.join(queue_name, timeout=remaining, **join_options)
        for middleware in broker.middleware:
            if isinstance(middleware, SlotsMiddleware):
                middleware.flush_releases()
        with activity:
            # A handed-off message re-enters the queue before its hand-off is
            # confirmed, so "nothing parked" is only final with an empty queue.
            if parked_count(broker) == 0 and _queue_empty(broker, queue_name):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)  # type: ignore[no-untyped-call]
            # Wake on the next park or hand-off in this process (the
            # only places the lockwait area changes); the bound is a backstop.
            bound = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            activity.wait(bound)


def _queue_empty(broker: Broker, queue_name: str) -> bool:
    queues: dict[str, Any] | None = getattr(broker, "queues", None)
    if not isinstance(queues, dict):
        return True
    from dramatiq.common import dq_name

    for name in (queue_name, dq_name(queue_name)):
        queue = queues.get(name)
        if queue is not None and int(getattr(queue, "unfinished_tasks", 0)):
            return False
    return True
