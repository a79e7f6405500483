"""A worker thread blocked for a slot (a mutex's ``on_busy="wait"``, a standby), its TimeLimit
timer paused so that waiting does not eat the actor's ``time_limit`` (docs/slots.md, ``on_busy``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import TimeLimit

from dramatiq_guard.backends.base import AcquireResult
from dramatiq_guard.claim import Claim, Deliver


def block_for_slot(
    broker: Broker, message: MessageProxy, claim: Claim, *, wait_ms: int, deliver: Deliver,
    payload: bytes | None = None,
) -> AcquireResult:  # fmt: skip
    """Block as the ready waiter of the claimed key (a standby with its ``payload``) up to ``wait_ms``,
    this thread's TimeLimit timer paused meanwhile and re-armed with the message's full time limit
    once the slot is held."""
    time_limit = next((m for m in broker.middleware if isinstance(m, TimeLimit)), None)
    manager: Any = time_limit.manager if time_limit is not None else None
    thread_id = threading.get_ident()
    if manager is not None:
        manager.remove_timeout(thread_id)
    result = claim.block(time.monotonic() + wait_ms / 1000, deliver, payload=payload)
    if result.acquired and time_limit is not None:
        actor = broker.get_actor(message.actor_name)
        limit_ms = message.options.get("time_limit") or actor.options.get("time_limit", time_limit.time_limit)
        manager.add_timeout(thread_id, limit_ms)
    return result
