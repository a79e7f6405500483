"""Guard events: what the guard middlewares report, for metrics.

The middlewares call the functions below at each decision. They cost a
function call and do nothing until a sink is set; :class:`dramatiq_guard.metrics.GuardMetrics`
sets one that feeds Prometheus (with the ``prometheus`` extra). Without
prometheus-client installed nothing here imports it, so every function stays
a no-op. Each takes the actor's name first (the ``actor_name`` label)::

    from dramatiq_guard import events

    events.deduplicated(message.actor_name)

Counters
  :func:`deduplicated`
    A message was not enqueued, or not run, because an identical one held
    the lock (``dedup``, and ``mutex`` with ``on_busy="drop"``).
  :func:`parked`
    A message went to the lockwait area (at enqueue or after pickup).
  :func:`handed_off`
    A waiter (parked or blocking) was given a slot that was freed.
  :func:`lock_wait`
    A context manager around a worker thread blocking for a lock
    (``on_busy="wait"``): counts the wait, observes its duration, and counts
    the thread in the waiters gauge while it waits.
  :func:`lease_lost`
    A holder's lease lapsed, was released by force, or passed its known-valid time while it ran.
  :func:`ledger_hit`
    An idempotency key was found completed: the stored result was returned
    and the actor did not run.
  :func:`redis_state_lost`
    The guard's Redis lost state while workers ran: it restarted, was
    flushed, or a waiting key vanished (evicted or deleted). Counted by
    *reason* (``"restart"``, ``"flush"``, ``"vanished"``), not by actor: the
    lost messages' actors are not known any more. See
    :mod:`dramatiq_guard.backends.redis_health`.

Changes of the lockwait area
  :func:`lockwait_changed`
    This process parked a message, handed a slot on (a release or a sweep
    that moved a waiter), sent standbys or swept a slot key. It feeds
    no metric: :func:`dramatiq_guard.testing.join` waits on
    :func:`lockwait_condition` instead of polling.

Gauges
  :func:`acquired` / :func:`released`
    A message of this process started / stopped holding a slot or lock (the
    holders gauge). Call ``released`` exactly once for each ``acquired``,
    whether the release succeeded or the lease was found lost. Both name the
    guard key too: a sink that defines ``key_holders(key, delta)`` gets the
    holders per key (the pytest plugin's ``guard_limits`` peaks).
  :func:`redis_settings`
    What the guard's Redis was found to do when it was checked: whether its
    ``maxmemory-policy`` evicts, whether it persists. Passed to a sink's
    ``redis_settings`` method if it has one (older sinks need not).

Logging conventions (every guard module follows them)
  * Loggers are named under ``dramatiq_guard`` (``logging.getLogger(__name__)``
    in each module), so ``dramatiq_guard`` silences or raises them all, and
    they appear in the ``dramatiq`` CLI's output with their names.
  * One INFO line per decision that changes what runs: a message
    deduplicated, dropped, parked, handed a slot, a key released by force, a
    limit changed, a lease lost (that one is an ERROR when the holder was
    still running: its work may overlap another's). The line names the
    actor, the message id and the guard key.
  * DEBUG for everything else: acquisitions, renewals, releases, sweeps
    that found nothing, confirmations.
  * WARNING when a step failed but nothing is lost (a re-enqueue that will
    be retried by a sweep, a backend hiccup the Retries middleware absorbs).
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
        """Count one ``event`` (the name of one of the counting functions of this module).

        ``actor`` is the actor's name, except for ``redis_state_lost``, where
        it is the reason.
        """

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
    """The guard's Redis was checked: whether it evicts keys and persists them (None: unknown).

    Given to the sink's ``redis_settings(evicting, persistent)`` if it defines one.
    """
    report = getattr(_sink, "redis_settings", None)
    if report is not None:
        report(evicting, persistent)


def acquired(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` in this process started holding a slot or lock of guard ``key``.

    Given to the sink's ``holders(actor, 1)``, and to its ``key_holders(key, 1)`` if it defines one.
    """
    _holders(actor, key, 1)


def released(actor: str, key: str | None = None) -> None:
    """A message of ``actor`` in this process stopped holding a slot or lock of ``key`` (released or lost).

    Given to the sink's ``holders(actor, -1)``, and to its ``key_holders(key, -1)`` if it defines one.
    """
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
    """Around a worker thread blocking for a lock of ``actor``: the wait is counted and timed.

    The thread counts in the waiters gauge while inside; the wait is counted
    (and its duration observed) when it ends, whether it got the lock, timed
    out or raised.
    """
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
