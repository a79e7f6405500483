"""Worker-side actors of the debounce bench (``python -m dramatiq bench.scenarios.debounce_actors``).

Inert unless ``BENCH_DEBOUNCE`` is set to the debounce wait in ms (the scenario loader imports every
module here). The guard is installed as a user would (``dramatiq_guard.install``, the sweep's
default interval). Each run of the debounced actor pushes ``"<start> <key> <i>"`` (``time.time()``
on entry, its key and the index of the send it carries) to ``bench:debounce:runs:<run id>``.
"""

from __future__ import annotations

import os
import time

import dramatiq

#: The queues of the debounced actor and of the plain one (which no worker consumes).
QUEUE, PLAIN_QUEUE = "bench_debounce", "bench_debounce_plain"


def runs_key(run_id: str) -> str:
    """The list the runs of burst ``run_id`` are pushed to."""
    return f"bench:debounce:runs:{run_id}"


if os.environ.get("BENCH_DEBOUNCE"):
    from dramatiq.brokers.redis import RedisBroker

    import dramatiq_guard
    from bench.actors import redis_url

    WAIT_MS = int(os.environ["BENCH_DEBOUNCE"])

    broker = RedisBroker(url=redis_url())
    dramatiq_guard.install(broker)
    dramatiq.set_broker(broker)

    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=0,
        debounce={"wait": WAIT_MS, "key": lambda run_id, key, i: f"{run_id}:{key}"},
    )
    def debounced(run_id: str, key: int, i: int) -> None:
        """A burst's run: one per key of the burst, with its last send's ``i``."""
        broker.client.rpush(runs_key(run_id), f"{time.time()!r} {key} {i}")

    @dramatiq.actor(queue_name=PLAIN_QUEUE, max_retries=0)
    def plain(run_id: str, key: int, i: int) -> None:
        """Never runs: no worker consumes its queue (the plain send the burst is read against)."""
