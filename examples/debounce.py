"""A search index refreshed once per burst of edits: a debounce that runs the last save only.

Run a worker, then send (from the repository root)::

    .venv/bin/dramatiq examples.debounce --processes 2 --threads 4
    .venv/bin/python -m examples.debounce

A user edits two documents: thirty saves of document 1 a tenth of a second apart, and three of
document 2. Each ``send()`` returns at once; the worker reindexes each document once, a second
after its last save, with that save's version (document 1 at most five seconds after its first
save, however long the user goes on). The superseded saves are logged, and counted in
``dramatiq_guard_messages_debounced_total``. The pending runs are visible meanwhile::

    dramatiq-guard inspect debounce:doc:1

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before any actor is declared
dramatiq.set_broker(broker)


@dramatiq.actor(debounce={"wait": 1_000, "max_wait": 5_000, "key": lambda doc_id, version: f"doc:{doc_id}"})
def reindex_document(doc_id: int, version: int) -> None:
    print(f"{time.strftime('%H:%M:%S')} reindexed document {doc_id} at version {version}")


if __name__ == "__main__":
    for version in range(30):
        reindex_document.send(1, version)
        if version < 3:
            reindex_document.send(2, version)
        time.sleep(0.1)
