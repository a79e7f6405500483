"""Test helpers for users of dramatiq-guard with Dramatiq's StubBroker (docs/testing.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from dramatiq import Broker

from dramatiq_guard import events
from dramatiq_guard.events import EventSink, lockwait_condition
from dramatiq_guard.middleware.slots import Concurrency, Mutex, SlotsMiddleware

__all__ = ["GuardLimits", "join", "parked_count"]


def parked_count(broker: Broker) -> int:
    """How many messages (parked, or handed off and not yet confirmed) wait in ``broker``'s slot keys."""
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

    Releases still waiting for a release thread are made first, so every
    finished message's slot is free when this returns.

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
            # A handed-off message re-enters the queue before it is confirmed: both must be empty.
            if parked_count(broker) == 0 and _queue_empty(broker, queue_name):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)  # type: ignore[no-untyped-call]
            # Wake on the next change of the lockwait area in this process; the bound is a backstop.
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


#: The events a sink may take (:mod:`dramatiq_guard.events`), which GuardLimits passes on.
_EVENTS = ("count", "holders", "key_holders", "waiters", "lock_waited", "redis_settings", "throttle_window")


class GuardLimits:
    """The most messages that held each guard key at once, recorded from the guard's events.

    While it records it is the event sink, passing every event on to the sink
    it replaced. A message holds its key while the actor's own code may run;
    only this process's holders are seen. Keys are as ``dramatiq-guard
    inspect`` shows them (``"concurrency:webhooks:42"``) or as a ``key``
    callable returned them (``"webhooks:42"``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holding: dict[str, int] = {}
        self._peaks: dict[str, int] = {}
        self._previous: EventSink | None = None
        self._recording = False
        self._replaced_by: EventSink | None = None

    def start(self) -> GuardLimits:
        """Become the event sink and start recording; returns itself."""
        if not self._recording:
            self._previous = events.set_sink(self)
            self._recording = True
        return self

    def stop(self) -> None:
        """Stop recording and put back the sink that was there before (if nothing replaced this one)."""
        if not self._recording:
            return
        self._recording = False
        current = events.get_sink()
        if current is self:
            events.set_sink(self._previous)
        else:
            self._replaced_by = current

    def __enter__(self) -> GuardLimits:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def peaks(self) -> dict[str, int]:
        """The peak number of holders of every guard key held while recording."""
        self._check_sink()
        with self._lock:
            return dict(self._peaks)

    def peak(self, key: str) -> int:
        """The most messages that held ``key`` at once (0: it was never held)."""
        peaks = self.peaks
        return max((peaks[name] for name in _names_of(key) if name in peaks), default=0)

    def assert_held(self, key: str, limit: int) -> None:
        """Assert that ``key`` was held, and by at most ``limit`` messages at once.

        Raises:
          AssertionError: Naming the key, its peak and the limit; or, if no
            message held the key while recording (a mistyped key would pass
            unseen otherwise), naming the keys that were held.
        """
        peaks = self.peaks
        held = [name for name in _names_of(key) if name in peaks]
        assert held, (
            f"no message held the guard key {key!r} while holders were recorded; "
            f"the keys held were: {', '.join(sorted(peaks)) or 'none'}"
        )
        for name in held:
            assert peaks[name] <= limit, (
                f"the limit of guard key {name!r} did not hold: "
                f"peak {peaks[name]} holders at once, over its limit of {limit}"
            )

    def _check_sink(self) -> None:
        replaced = self._replaced_by
        if replaced is None and self._recording and events.get_sink() is not self:
            replaced = events.get_sink()
        if replaced is not None:
            raise RuntimeError(
                f"the guard's event sink was replaced while GuardLimits recorded (by {replaced!r}, e.g. "
                f"GuardMetrics.setup()): holders after that were not seen, so peaks may be too low"
            )

    # The event sink (dramatiq_guard.events.EventSink): holders per key, every event passed on.

    def key_holders(self, key: str, delta: int) -> None:
        with self._lock:
            holding = self._holding[key] = self._holding.get(key, 0) + delta
            if holding > self._peaks.get(key, 0):
                self._peaks[key] = holding
        self.__getattr__("key_holders")(key, delta)

    def __getattr__(self, event: str) -> Callable[..., None]:
        """An event: passed on to the sink this one replaced, if it takes it (a typo is no event)."""
        if event not in _EVENTS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {event!r}")
        forward: Callable[..., None] | None = getattr(self._previous, event, None)
        return forward or (lambda *args: None)


def _names_of(key: str) -> list[str]:
    """The guard keys ``key`` may stand for: itself, and the key a callable returned under each prefix."""
    return [key, *(f"{prefix}:{key}" for prefix in (Mutex.prefix, Concurrency.prefix))]
