"""One execution of a guarded message: the lease it holds, or why it did not run (its state is on
the message proxy, never in ``message.options``, which Retries re-enqueues as they are)."""

from __future__ import annotations

import dataclasses
import logging
from contextvars import Token
from typing import Any, Literal, NoReturn

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from dramatiq_guard import events
from dramatiq_guard.context import current_lease_var
from dramatiq_guard.errors import GuardError
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.base import ExecutionState

logger = logging.getLogger("dramatiq_guard.middleware.slots")


@dataclasses.dataclass
class Held:
    """A lease held by one execution of a message, and the ``current_lease()`` it set."""

    lease: Lease
    context: Token[Any] | None


@dataclasses.dataclass
class NotRun:
    """This execution did not run: why."""

    reason: Literal["parked", "dropped", "stale", "deferred"]
    key: str


def hold(message: MessageProxy, state: ExecutionState, option: str, lease: Lease) -> None:
    """Record that this execution holds ``lease``, and expose it as ``current_lease()``."""
    state.data[option] = Held(lease, current_lease_var.set(lease))
    events.acquired(message.actor_name, lease.key)


def take_held(state: ExecutionState, option: str) -> Held | None:
    """The lease this execution held, if any, forgotten (and ``current_lease()`` reset); a
    :class:`NotRun` stays, for ``after_ack``."""
    held = state.data.get(option)
    if not isinstance(held, Held):
        return None
    del state.data[option]
    if held.context is not None:
        try:
            current_lease_var.reset(held.context)
        except ValueError:
            current_lease_var.set(None)
    return held


def skip_dropped(
    message: MessageProxy, state: ExecutionState, option: str, key: str, holders: tuple[str, ...]
) -> NoReturn:
    """Skip the message: ``on_busy="drop"`` and the key is held (it counts as deduplicated)."""
    state.data[option] = NotRun("dropped", key)
    events.deduplicated(message.actor_name)
    logger.info("Dropped %s (deduplicated): %r is held by %s.", message, key, ", ".join(holders) or "nobody")
    raise SkipMessage(f"dropped: {key!r} is held")


def skip_parked(message: MessageProxy, state: ExecutionState, option: str, key: str, limit: int) -> NoReturn:
    """Skip the message: it was parked after pickup (its parked copy was encoded before the acquire)."""
    _not_terminal(message, state, option, NotRun("parked", key))
    logger.info("Parked %s after pickup: %r is full (limit %d).", message, key, limit)
    events.parked(message.actor_name)
    events.lockwait_changed()
    raise SkipMessage(f"parked: {key!r} is full")


def skip_stale(message: MessageProxy, state: ExecutionState, option: str, key: str) -> NoReturn:
    """Skip the message: a stale copy of a hand-off (not a terminal event: a newer copy runs)."""
    _not_terminal(message, state, option, NotRun("stale", key))
    logger.info("Skipped %s: a stale copy (a newer hand-off of %r runs instead).", message, key)
    raise SkipMessage(f"stale copy of a hand-off of {key!r}")


def defer_second_copy(
    broker: Broker, message: MessageProxy, state: ExecutionState, option: str, key: str, delay_ms: int
) -> NoReturn:
    """Skip this copy and send the message again in ``delay_ms``: another copy of it holds ``key``
    (docs/slots.md, "Execution"). No retry is consumed and no result stored.

    Raises:
      SkipMessage: The message was sent again.
      GuardError: The push failed (a MiddlewareError, so the actor does not run: Retries
        retries this copy, as any failure).
    """
    try:
        broker.enqueue(message, delay=delay_ms)  # type: ignore[arg-type]  # the proxy, as Retries does
    except Exception as e:
        raise GuardError(
            f"{message}: another copy of it holds {key!r}, and sending this one again failed: {e}"
        ) from e
    _not_terminal(message, state, option, NotRun("deferred", key))
    logger.warning(
        "Deferred %s by %d ms: another copy of it holds %r (the broker delivered it again while it "
        "runs, or after its worker died and before its lease lapsed).",
        message,
        delay_ms,
        key,
    )
    raise SkipMessage(f"another copy holds {key!r}")


def _not_terminal(message: MessageProxy, state: ExecutionState, option: str, not_run: NotRun) -> None:
    """Record why this copy does not run: not a terminal event of the message, and no result stored."""
    state.parked = True
    state.data[option] = not_run
    message.options["store_results"] = False
