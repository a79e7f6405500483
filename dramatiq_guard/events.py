"""Guard events: what the guard middlewares report at each decision, for metrics.

Each function costs a call and does nothing until a sink is set
(:class:`dramatiq_guard.metrics.GuardMetrics` sets one; docs/metrics.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol


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


def deduplicated(actor: str) -> None:
    """A message of ``actor`` was not enqueued, or not run, because an identical one held the lock."""
    _count("deduplicated", actor)


def parked(actor: str) -> None:
    """A message of ``actor`` went to the lockwait area."""
    _count("parked", actor)


def debounced(actor: str) -> None:
    """A message of ``actor`` was superseded by a later send of its debounce key: it will not run."""
    _count("debounced", actor)


def handed_off(actor: str) -> None:
    """A waiting message of ``actor`` was given a freed slot."""
    _count("handed_off", actor)


def lease_lost(actor: str) -> None:
    """A running message of ``actor`` lost its lease."""
    _count("lease_lost", actor)


def ledger_hit(actor: str) -> None:
    """A message of ``actor`` found its idempotency key completed and did not run."""
    _count("ledger_hit", actor)


def redis_state_lost(reason: str) -> None:
    """The guard's Redis lost state: ``reason`` is ``"restart"``, ``"flush"`` or ``"vanished"``."""
    _count("redis_state_lost", reason)


def redis_settings(evicting: bool | None, persistent: bool | None) -> None:
    """The guard's Redis was checked: whether it evicts and persists keys (None: unknown)."""
    report = getattr(_sink, "redis_settings", None)
    if report is not None:
        report(evicting, persistent)


def throttle_window(actor: str, starts: int, opens_at_ms: int | None) -> None:
    """A throttle key of ``actor`` was read: its starts in the window, when its next place opens."""
    report = getattr(_sink, "throttle_window", None)
    if report is not None:
        report(actor, starts, opens_at_ms)


def acquired(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` here started holding ``key`` (also to a sink's ``key_holders``, if any)."""
    _holders(actor, key, 1)


def released(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` here stopped holding ``key`` (released or lost): once per :func:`acquired`."""
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
