"""A worker thread blocked for a slot: a mutex's ``on_busy="wait"``, and a standby picked up.

Both wait through :func:`dramatiq_guard.waiting.wait_for_slot` (woken by a
push, re-checking every backstop). What is Dramatiq policy is here: the
TimeLimit timer is paused while the thread waits (waiting does not eat the
actor's ``time_limit``), and a process lets at most ``standby_threads``
threads block as standbys (docs/slots.md, "Standbys").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import TimeLimit

from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, Waiter
from dramatiq_guard.waiting import wait_for_slot

__all__ = ["StandbySeats", "time_limit_paused", "wait_as_standby", "wait_for_mutex"]


@contextmanager
def time_limit_paused(broker: Broker, message: MessageProxy) -> Iterator[Callable[[], None]]:
    """Pause this thread's TimeLimit timer while it waits for a slot.

    Yields the call that re-arms it with the message's full time limit, once the slot is held.
    """
    time_limit = next((m for m in broker.middleware if isinstance(m, TimeLimit)), None)
    manager: Any = time_limit.manager if time_limit is not None else None
    thread_id = threading.get_ident()
    if manager is not None:
        manager.remove_timeout(thread_id)

    def rearm() -> None:
        if time_limit is not None:
            actor = broker.get_actor(message.actor_name)
            limit_ms = message.options.get("time_limit") or actor.options.get(
                "time_limit", time_limit.time_limit
            )
            manager.add_timeout(thread_id, limit_ms)

    yield rearm


class StandbySeats:
    """How many threads of this process may block as standbys at once (``standby_threads``)."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self._taken = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Take a seat for this thread, unless all are taken."""
        with self._lock:
            if self._taken >= self.seats:
                return False
            self._taken += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._taken -= 1


def wait_for_mutex(
    broker: Broker,
    backend: GuardBackend,
    message: MessageProxy,
    key: str,
    *,
    limit: int,
    ttl_ms: int,
    wait_ms: int,
    deliver: Callable[[Sequence[Handoff]], None],
) -> AcquireResult:
    """Block as a waiter of ``key`` up to ``wait_ms``, the TimeLimit timer paused.

    A waiter not served in time leaves the queue.
    """
    with time_limit_paused(broker, message) as rearm:
        result = wait_for_slot(
            backend,
            key,
            message.message_id,
            limit=limit,
            ttl_ms=ttl_ms,
            deadline=time.monotonic() + wait_ms / 1000,
            deliver=deliver,
            info=message.actor_name,
        )
        if result.acquired:
            rearm()
        return result


def wait_as_standby(
    broker: Broker,
    backend: GuardBackend,
    message: MessageProxy,
    key: str,
    payload: bytes,
    seats: StandbySeats,
    *,
    limit: int,
    ttl_ms: int,
    wait_ms: int,
    deliver: Callable[[Sequence[Handoff]], None],
) -> AcquireResult:
    """Block as a standby until a slot is handed to the message, up to ``wait_ms``.

    Returns the acquired result, or a parked one: the standby parks again in
    its place when ``wait_ms`` passes, when its entry lapsed meanwhile (it
    parks at the back), or at once when every seat is taken.
    """
    holder = message.message_id
    if not seats.take():
        result = backend.acquire(key, holder, limit=limit, ttl_ms=ttl_ms, wait=Waiter(payload=payload))
        deliver(result.handoffs)
        return result
    try:
        with time_limit_paused(broker, message) as rearm:
            result = wait_for_slot(
                backend,
                key,
                holder,
                limit=limit,
                ttl_ms=ttl_ms,
                deadline=time.monotonic() + wait_ms / 1000,
                deliver=deliver,
                payload=payload,
                info=message.actor_name,
            )
            if result.acquired:
                rearm()
            return result
    finally:
        seats.give_back()
