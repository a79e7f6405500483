"""One execution of a guarded message: the lease it holds, or why it did not run (its state is on
the message proxy, never in ``message.options``, which Retries re-enqueues as they are)."""

from __future__ import annotations

import dataclasses
import logging
from contextvars import Token
from typing import Any, Literal, NoReturn

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from dramatiq_guard import events
from dramatiq_guard.context import current_lease_var
from dramatiq_guard.delivery import GENERATIONS_OPTION
from dramatiq_guard.errors import GuardError
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.base import ExecutionState

logger = logging.getLogger("dramatiq_guard.middleware.slots")

#: The first deferral of a hand-off's copy refused as running (doubled per deferral in a row), and
#: what is added to the time until the entry in the way of another copy lapses (on a server clock a
#: little ahead, it has lapsed by the time the copy asks again).
DEFERRAL_MARGIN_MS = 100
#: Message option: how many times in a row a hand-off's copy was deferred (see :func:`defer_second_copy`).
DEFERRALS_OPTION = "guard_deferrals"


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


def hold(message: Message[Any] | MessageProxy, state: ExecutionState, option: str, lease: Lease) -> None:
    """Record that this execution of ``message`` (or of the proxy's message) holds ``lease``, and
    expose it as ``current_lease()``."""
    state.data[option] = Held(lease, current_lease_var.set(lease))
    options = message.options
    if DEFERRALS_OPTION in options:
        del options[DEFERRALS_OPTION]
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


def skip_stale(
    message: MessageProxy, state: ExecutionState, option: str, key: str, *, log: logging.Logger = logger
) -> NoReturn:
    """Skip the message: a stale copy of a hand-off (not a terminal event: a newer copy runs), logged
    on ``log`` (its capability's logger)."""
    _not_terminal(message, state, option, NotRun("stale", key))
    log.info("Skipped %s: a stale copy (a newer hand-off of %r runs instead).", message, key)
    raise SkipMessage(f"stale copy of a hand-off of {key!r}")


def defer_second_copy(
    broker: Broker, message: MessageProxy, state: ExecutionState, option: str, key: str, *, lapse_ms: int
) -> NoReturn:
    """Skip this copy and send the message again: another copy of it holds ``key`` (docs/slots.md,
    "Execution"). No retry is consumed and no result stored. It comes back in ``lapse_ms`` (when the
    entry in its way lapses), but a hand-off's copy (it carries the generation of another key) sooner:
    the copy in its way was parked at pickup by a later guard and is letting go of ``key`` (or died),
    so it comes back in ``DEFERRAL_MARGIN_MS``, doubled per deferral in a row, at most ``lapse_ms``.

    Raises:
      SkipMessage: The message was sent again.
      GuardError: The push failed (a MiddlewareError, so the actor does not run: Retries
        retries this copy, as any failure).
    """
    delay_ms, generations = lapse_ms, message.options.get(GENERATIONS_OPTION)
    if isinstance(generations, dict) and set(generations) - {key}:
        deferrals = message.options.get(DEFERRALS_OPTION)
        deferrals = min(deferrals, 16) if isinstance(deferrals, int) and deferrals > 0 else 0
        delay_ms = min(lapse_ms, DEFERRAL_MARGIN_MS << deferrals)
        message.options[DEFERRALS_OPTION] = deferrals + 1
    try:
        broker.enqueue(message, delay=delay_ms)  # type: ignore[arg-type]  # the proxy, as Retries does
    except Exception as e:
        raise GuardError(
            f"{message}: another copy of it holds {key!r}, and sending this one again failed: {e}"
        ) from e
    _not_terminal(message, state, option, NotRun("deferred", key))
    logger.warning(
        "Deferred %s by %d ms: another copy of it holds %r (the broker delivered it again while it "
        "runs, or after its worker died and before its lease lapsed, or it lets go after a park).",
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
