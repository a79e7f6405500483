"""Confirming sends' pending dedup locks off the send path, in batches (docs/dedup.md, "The lock's life").

``send()`` takes the dedup lock for ``pending_ttl`` in one round trip; once the
push succeeded, the lock is extended to its ``ttl`` here: a background thread
of the producer batches the confirmations of every send of the last few
milliseconds into one pipelined ``renew_many``. It is flushed at interpreter
exit and when a worker shuts down.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

from dramatiq_guard.backends.base import GuardBackend

__all__ = ["RETRY_S", "Confirmer"]

logger = logging.getLogger("dramatiq_guard.dedup")

#: How long the confirmation thread waits before trying an unreachable backend again.
RETRY_S = 0.5

_confirmers: weakref.WeakSet[Confirmer] = weakref.WeakSet()


class Confirmer:
    """Confirms pushed sends (pending lock -> ``ttl``) in batches, from one daemon thread.

    Each flush is one :meth:`~GuardBackend.renew_many` per backend: one
    round trip on Redis, however many sends it confirms. A flush starts
    ``linger`` seconds after the first unconfirmed send (or at once when
    ``batch`` sends are waiting), so a burst shares one round trip.
    """

    def __init__(self, *, linger: float, batch: int = 1000) -> None:
        self.linger = linger
        self.batch = batch
        self._start()
        _confirmers.add(self)

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        # (backend, key, holder, ttl_ms, monotonic time its pending lock lapses)
        self._items: list[tuple[GuardBackend, str, str, int, float]] = []
        self._busy = 0
        self._thread: threading.Thread | None = None

    def add(self, backend: GuardBackend, key: str, holder: str, ttl_ms: int, lapses_at: float) -> None:
        if os.getpid() != self._pid:  # forked: the parent's thread and lock are not ours
            self._start()
        with self._cond:
            self._items.append((backend, key, holder, ttl_ms, lapses_at))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dramatiq-guard-dedup", daemon=True)
                self._thread.start()
            if len(self._items) == 1 or len(self._items) >= self.batch:
                self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> None:
        """Confirm everything added so far, and wait for a flush in progress."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            items, self._items = self._items, []
            self._busy += 1
        try:
            self._send(items)
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._busy == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items))
                self._cond.wait_for(lambda: len(self._items) >= self.batch, self.linger)
                items, self._items = self._items, []
                self._busy += 1
            failed = True
            try:
                failed = not self._send(items)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
                    if failed:  # the backend is unreachable: do not hammer it
                        self._cond.wait(RETRY_S)

    def _send(self, items: list[tuple[GuardBackend, str, str, int, float]]) -> bool:
        """Confirm ``items``; False if a backend was unreachable (the still-pending ones are kept)."""
        ok = True
        groups: dict[int, list[tuple[GuardBackend, str, str, int, float]]] = {}
        for item in items:
            groups.setdefault(id(item[0]), []).append(item)
        for group in groups.values():
            try:
                renewed = group[0][0].renew_many([(key, holder, ttl) for _, key, holder, ttl, _ in group])
            except Exception:
                ok = False
                now = time.monotonic()
                retry = [item for item in group if item[4] > now]
                logger.warning(
                    "Could not confirm %d dedup lock(s); retrying %d before they lapse.",
                    len(group),
                    len(retry),
                    exc_info=True,
                )
                if retry:
                    with self._cond:
                        self._items.extend(retry)
                continue
            for (_, key, holder, _, _), confirmed in zip(group, renewed, strict=True):
                if not confirmed:
                    # Released already (an until_executing holder that started at
                    # once, a holder that finished) or lapsed before confirmation.
                    logger.debug("Dedup lock %r of %r was gone when confirmed.", key, holder)
        return ok


@atexit.register
def _flush_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for confirmer in list(_confirmers):
        try:
            confirmer.flush(timeout=5.0)
        except Exception:
            logger.exception("Could not confirm dedup locks at exit.")
