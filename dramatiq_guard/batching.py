"""A daemon thread that sends what callers hand it in batches (the dedup confirmations, the releases);
what arrives while a batch is sent makes up the next one, and what is left is sent at exit."""

from __future__ import annotations

import abc
import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

logger = logging.getLogger("dramatiq_guard")

#: How long the thread waits before trying an unreachable backend again.
RETRY_S = 0.5

T = TypeVar("T")
B = TypeVar("B")

_batchers: weakref.WeakSet[Batcher[Any]] = weakref.WeakSet()


class Batcher(abc.ABC, Generic[T]):
    """Sends the items added to it in batches, from one daemon thread (started on first use): a batch
    starts ``linger`` seconds after the first waiting item (0: at once), or when ``batch`` are waiting."""

    #: The name of the thread.
    thread_name: ClassVar[str]

    def __init__(self, *, linger: float = 0.0, batch: int = 1000) -> None:
        self.linger = linger
        self.batch = batch
        self._start()
        _batchers.add(self)

    def _start(self) -> None:
        self._pid = os.getpid()
        # The condition's lock, taken bare by add() (once per item: no call of the condition's).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: list[T] = []
        self._busy = 0
        # The thread, until it ends (it says so itself: add() asks nothing of it per item).
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def send(self, items: list[T]) -> bool:
        """Send one batch (on the thread, or on the caller of :meth:`flush`); False if the backend was
        unreachable: the thread then waits :data:`RETRY_S` (what to try again was :meth:`requeue`-d)."""

    def add(self, item: T) -> None:
        """Hand ``item`` to the thread."""
        with self._lock:
            items = self._items
            items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread.start()
            waiting = len(items)
            if waiting == 1 or waiting >= self.batch:
                self._cond.notify_all()

    def requeue(self, items: list[T]) -> None:
        """Give items of a failed batch back, for the next one."""
        with self._cond:
            self._items.extend(items)

    def flush(self, timeout: float = 10.0) -> None:
        """Send everything added so far, and wait (up to ``timeout`` s) for a batch in progress."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            items, self._items = self._items, []
            self._busy += 1
        try:
            if items:
                self.send(items)
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._busy == 0, timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # (it never returns; if it dies all the same, the next add starts another)
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items))
                if self.linger:
                    self._cond.wait_for(lambda: len(self._items) >= self.batch, self.linger)
                items, self._items = self._items, []
                self._busy += 1
            failed = True
            try:
                failed = not self.send(items)
            except Exception:  # a bug in send must not end the thread (and strand what follows)
                logger.exception("%s: a batch of %d failed.", self.thread_name, len(items))
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
                    if failed:  # the backend is unreachable: do not hammer it
                        self._cond.wait(RETRY_S)


def by_backend(items: list[T], backend_of: Callable[[T], B]) -> list[tuple[B, list[T]]]:
    """``items`` grouped by their backend (the same object), each group with it, in the order first seen:
    a batch makes one call per backend."""
    groups: dict[int, tuple[B, list[T]]] = {}
    for item in items:
        backend = backend_of(item)
        groups.setdefault(id(backend), (backend, []))[1].append(item)
    return list(groups.values())


def _start_in_child() -> None:
    """A forked child starts every batcher anew: the parent's threads and locks are not its own."""
    for batcher in list(_batchers):
        batcher._start()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere no process is forked
    os.register_at_fork(after_in_child=_start_in_child)


@atexit.register
def _flush_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for batcher in list(_batchers):
        try:
            batcher.flush(timeout=5.0)
        except Exception:
            logger.exception("%s: could not send what was left at exit.", batcher.thread_name)
