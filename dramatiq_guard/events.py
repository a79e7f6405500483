"""Guard events: what the guard middlewares report at each decision, for metrics; each costs a call
and does nothing until a sink is set (:class:`~dramatiq_guard.metrics.GuardMetrics` sets one)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol


class EventSink(Protocol):
    """What receives guard events (see :class:`dramatiq_guard.metrics.GuardMetrics`)."""

    def count(self, event: str, actor: str) -> None:
        """Count one ``event`` (a function's name) of ``actor`` (for ``redis_state_lost``: the reason)."""

    def holders(self, actor: str, delta: int) -> None:
        """Add ``delta`` to the holders gauge."""

    def waiters(self, actor: str, delta: int) -> None:
        """Add ``delta`` to the gauge of threads blocked waiting for a lock."""

    def lock_waited(self, actor: str, duration_ms: float) -> None:
        """Count one finished lock wait and observe its duration."""


_sink: EventSink | None = None


def set_sink(sink: EventSink | None) -> EventSink | None:
    """Send events to ``sink`` (None: drop them); returns the previous sink."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def get_sink() -> EventSink | None:
    """The current sink, or None."""
    return _sink


def _count(event: str, actor: str) -> None:
    sink = _sink
    if sink is not None:
        sink.count(event, actor)


# Counted events (``sink.count(name, actor)``): for ``redis_state_lost`` the actor is the reason
# (``"restart"``, ``"flush"`` or ``"vanished"``); docs/metrics.md says what each one counts.
deduplicated = functools.partial(_count, "deduplicated")
parked = functools.partial(_count, "parked")
debounced = functools.partial(_count, "debounced")
handed_off = functools.partial(_count, "handed_off")
lease_lost = functools.partial(_count, "lease_lost")
ledger_hit = functools.partial(_count, "ledger_hit")
redis_state_lost = functools.partial(_count, "redis_state_lost")


def _report(event: str, *args: Any) -> None:
    """Pass ``event`` to the sink's method of that name, if it has one."""
    report = getattr(_sink, event, None)
    if report is not None:
        report(*args)


#: ``(evicting, persistent)``: the guard's Redis evicts, persists keys (each None: unknown).
redis_settings = functools.partial(_report, "redis_settings")
#: ``(actor, starts, opens_at_ms)``: a throttle key was read, its starts in the window, when a place opens.
throttle_window = functools.partial(_report, "throttle_window")


def acquired(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` here started holding ``key`` (also to a sink's ``key_holders``, if any)."""
    if _sink is not None:  # (every guarded message passes here: with no sink, nothing more is called)
        _holders(actor, key, 1)


def released(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` here stopped holding ``key`` (released or lost): once per :func:`acquired`."""
    if _sink is not None:
        _holders(actor, key, -1)


def _holders(actor: str, key: str | None, delta: int) -> None:
    sink = _sink
    if sink is None:
        return
    sink.holders(actor, delta)
    per_key = getattr(sink, "key_holders", None) if key is not None else None
    if per_key is not None:
        per_key(key, delta)


@contextlib.contextmanager
def lock_wait(actor: str) -> Iterator[None]:
    """Around a worker thread blocking for a lock: a waiter while inside, counted and timed when it ends."""
    sink = _sink
    if sink is None:
        yield
        return
    start = time.monotonic()
    sink.waiters(actor, 1)
    try:
        yield
    finally:
        sink.waiters(actor, -1)
        sink.lock_waited(actor, (time.monotonic() - start) * 1000)


_lockwait = threading.Condition()


def lockwait_changed() -> None:
    """This process changed the lockwait area (parked, handed a slot on, sent standbys, swept a key)."""
    with _lockwait:
        _lockwait.notify_all()


def lockwait_condition() -> threading.Condition:
    """The condition notified by :func:`lockwait_changed`, to wait for the next change."""
    return _lockwait
