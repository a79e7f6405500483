"""Sends' pending dedup locks confirmed off the send path, in batches (docs/dedup.md, "The lock's life")."""

from __future__ import annotations

import logging
import operator
import time

from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.batching import Batcher, by_backend

logger = logging.getLogger("dramatiq_guard.dedup")

#: A pending lock to confirm: (backend, key, holder, ttl_ms, monotonic time it lapses).
Pending = tuple[GuardBackend, str, str, int, float]


class Confirmer(Batcher[Pending]):
    """Confirms pushed sends (pending lock -> ``ttl``) in batches: one :meth:`~GuardBackend.renew_many`
    per backend each."""

    thread_name = "dramatiq-guard-dedup"

    def send(self, items: list[Pending]) -> bool:
        """Confirm ``items``; False if a backend was unreachable (the still-pending ones are kept)."""
        ok = True
        for backend, group in by_backend(items, operator.itemgetter(0)):
            try:
                renewed = backend.renew_many([(key, holder, ttl) for _, key, holder, ttl, _ in group])
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
                    self.requeue(retry)
                continue
            for (_, key, holder, _, _), confirmed in zip(group, renewed, strict=True):
                if not confirmed:  # released already (its holder started or finished), or lapsed
                    logger.debug("Dedup lock %r of %r was gone when confirmed.", key, holder)
        return ok
