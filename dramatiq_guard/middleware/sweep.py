"""Each worker process's sweep: waiters are never stranded when every holder died.

One thread per process and backend, shared by the guard middlewares that join it (docs/slots.md,
"Waiters are never stranded"); each key it hands on is delivered by the middleware that claims it.
Between passes it runs the timers of single keys (:meth:`Sweeper.at`: a throttle's window opening),
and one more pass when a prompt key comes due (:meth:`Sweeper.soon`: a debounced run).
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dramatiq import Broker

from dramatiq_guard.backends.base import GuardBackend, ReleaseResult

logger = logging.getLogger(__name__)


class Sweepable(Protocol):
    """A guard middleware whose keys the sweep covers."""

    @property
    def prompt_prefix(self) -> str | None:
        """The prefix of its keys the sweep wakes for when they come due, not only every interval (a
        debounce's: a deadline starts its runs, not a release), or None."""

    def backend(self, broker: Broker) -> GuardBackend:
        """Its guard backend."""

    def claims(self, key: str) -> bool:
        """Whether ``key`` is one of its guard keys."""

    def sweep_limit(self, key: str) -> int | None:
        """The default limit it sweeps ``key`` with (None: the one recorded with the key's waiters)."""

    def swept(self, broker: Broker, key: str, result: ReleaseResult) -> None:
        """Deliver what the sweep of ``key`` handed on."""


Member = tuple[Sweepable, Broker]
#: A key's timer: run on the sweep thread; answers in how many seconds to run again, or None.
Fire = Callable[[], float | None]
#: The timer of the pass when a prompt key comes due (:meth:`Sweeper.soon`), beside the keys'.
PROMPT_PASS = "\0prompt"


class Sweeper:
    """The sweep thread of one backend in this process, shared by the guard middlewares using it."""

    def __init__(self, backend: GuardBackend, interval_s: float) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self.members: dict[int, Member] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dramatiq-guard-sweep", daemon=True)
        self._timers: list[tuple[float, str, Fire]] = []
        self._armed: dict[str, float] = {}  # each key's earliest timer
        self._lock = threading.Lock()
        self._poke = threading.Event()

    def at(self, key: str, in_s: float | None, fire: Fire) -> None:
        """Run ``fire`` for ``key`` in ``in_s`` seconds (None: not), and again when it answers;
        a key has one timer, the earliest asked."""
        if in_s is None:
            return
        when = time.monotonic() + in_s
        with self._lock:
            if self._armed.get(key, float("inf")) <= when:
                return
            self._armed[key] = when
            heapq.heappush(self._timers, (when, key, fire))
        self._poke.set()

    def soon(self, in_s: float | None) -> None:
        """Sweep the due keys in ``in_s`` seconds (None: not before the next pass), as well as each
        interval."""
        self.at(PROMPT_PASS, in_s, functools.partial(self._pass, prompt_only=True))

    def stop(self) -> None:
        self.stop_event.set()
        self._poke.set()

    def _run(self) -> None:
        next_pass = time.monotonic() + self.interval_s
        while not self.stop_event.is_set():
            if time.monotonic() >= next_pass:
                self.soon(self._pass())
                # State the store lost since the last pass (docs/failure-model.md).
                self.backend.watch(self.interval_s)
                next_pass = time.monotonic() + self.interval_s
            for key, fire in self._due():
                self._fire(key, fire)
            with self._lock:
                wake = min(next_pass, self._timers[0][0]) if self._timers else next_pass
            self._poke.wait(max(0.0, wake - time.monotonic()))
            self._poke.clear()
        self.backend.stop_watching()  # again, if a pass ran after leave_sweep's

    def _pass(self, *, prompt_only: bool = False) -> float | None:
        """Sweep the due keys (``prompt_only``: of the members with a ``prompt_prefix``); in how many
        seconds a prompt key is due, if before the next pass."""
        members = [m for m in self.members.values() if m[0].prompt_prefix or not prompt_only]
        prompt_in_ms = sweep_all(self.backend, members, within_ms=round(self.interval_s * 1000))
        return None if prompt_in_ms is None else max(0.001, prompt_in_ms / 1000)

    def _due(self) -> list[tuple[str, Fire]]:
        now, due = time.monotonic(), []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                when, key, fire = heapq.heappop(self._timers)
                if self._armed.get(key) == when:  # else re-armed earlier since
                    del self._armed[key]
                    due.append((key, fire))
        return due

    def _fire(self, key: str, fire: Fire) -> None:
        try:
            again = fire()
        except Exception:
            logger.warning("The timer of %r failed; the sweep hands its key on.", key, exc_info=True)
            return
        self.at(key, again, fire)


def sweep_all(
    backend: GuardBackend, members: list[Member], *, waiting: bool = False, within_ms: int = 0
) -> int | None:
    """Sweep every due key (:meth:`GuardBackend.due_keys`) of ``members``, one
    :meth:`GuardBackend.sweep_many` per middleware; what failed is logged, and due again next pass.

    ``waiting``: sweep every waiting key, due or not (after a change no deadline tells of, such as
    an actor's default limit raised).

    Returns:
      int|None: In how many ms the first key of a member's ``prompt_prefix`` is due, if within
      ``within_ms`` (None: none is, or the backend cannot tell).
    """
    prompt = [prefix for m, _ in members if (prefix := m.prompt_prefix)] if within_ms else []
    try:
        keys, prompt_in_ms = (
            (backend.waiting_keys(), None) if waiting else backend.due_keys(prompt, within_ms=within_ms)
        )
    except Exception:
        logger.warning("The sweep could not list the due keys; retrying.", exc_info=True)
        return None
    for middleware, broker in members:
        mine = [(key, middleware.sweep_limit(key)) for key in keys if middleware.claims(key)]
        if not mine:
            continue
        try:
            results = backend.sweep_many(mine)
        except Exception:
            logger.warning("The sweep of %d key(s) failed; retrying.", len(mine), exc_info=True)
            continue
        for (key, _), result in zip(mine, results, strict=True):
            try:
                middleware.swept(broker, key, result)
            except Exception:
                logger.warning("Delivering what the sweep of %r handed on failed.", key, exc_info=True)
    return prompt_in_ms


_sweepers: dict[int, Sweeper] = {}
_sweepers_lock = threading.Lock()


def join_sweep(middleware: Sweepable, broker: Broker, interval_ms: int) -> Sweeper:
    """Add ``middleware`` to its backend's sweep in this process (started on first use)."""
    backend = middleware.backend(broker)
    with _sweepers_lock:
        sweeper = _sweepers.get(id(backend))
        if sweeper is None or not sweeper.thread.is_alive():
            sweeper = _sweepers[id(backend)] = Sweeper(backend, interval_ms / 1000)
            sweeper.thread.start()
        sweeper.members[id(middleware)] = (middleware, broker)
        return sweeper


def leave_sweep(middleware: Sweepable, sweeper: Sweeper | None) -> None:
    """Remove ``middleware`` from ``sweeper`` (if it joined one); the last one out stops it.

    The last one also withdraws what the backend's watch recorded of this process
    (:meth:`GuardBackend.stop_watching`): here, as the daemon thread may not get to it before exit.
    """
    if sweeper is None:
        return
    with _sweepers_lock:
        sweeper.members.pop(id(middleware), None)
        stopped = not sweeper.members
        if stopped:
            sweeper.stop()
            if _sweepers.get(id(sweeper.backend)) is sweeper:
                del _sweepers[id(sweeper.backend)]
    if stopped:
        sweeper.backend.stop_watching()
