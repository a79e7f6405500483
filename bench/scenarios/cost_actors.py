"""Worker-side actors of the per-guard cost table (``python -m dramatiq bench.scenarios.cost_actors``).

Inert unless ``BENCH_COST`` is set (the scenario loader imports every module here). With
``BENCH_COST_GUARD`` set too, every guard middleware is installed (``dramatiq_guard.install``)
and the guarded actors are declared; without it the broker is plain Dramatiq. Every actor does
the same work: one INCR to count its completion (:func:`bench.actors.cross_finish_line`).
The two kinds use queues of their own, so a plain and a guarded worker can run side by side
and the bench can interleave their drains.
"""

from __future__ import annotations

import os

import dramatiq

#: The key of the concurrency row's one key, and its limit.
WIDE_LIMIT = 1000

if os.environ.get("BENCH_COST"):
    from dramatiq.brokers.redis import RedisBroker

    from bench.actors import cross_finish_line, redis_url

    broker = RedisBroker(url=redis_url())
    QUEUE = "bench_cost_guard" if os.environ.get("BENCH_COST_GUARD") else "bench_cost"
    if os.environ.get("BENCH_COST_GUARD"):
        import dramatiq_guard

        dramatiq_guard.install(broker)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=QUEUE, max_retries=0)
    def tick(run_id: str, total: int, i: int) -> None:
        """No guard option (on the guarded broker: installed, not opted into)."""
        cross_finish_line(broker.client, run_id, total)

    noop = broker.client.register_script("return 1")

    @dramatiq.actor(queue_name=QUEUE, max_retries=0)
    def floor_tick(run_id: str, total: int, i: int) -> None:
        """No guard, but the guard's two round trips: a no-op script before the work and one after."""
        noop()
        cross_finish_line(broker.client, run_id, total)
        noop()

    if os.environ.get("BENCH_COST_GUARD"):

        @dramatiq.actor(queue_name=QUEUE, max_retries=0, dedup="until_executed")
        def dedup_tick(run_id: str, total: int, i: int) -> None:
            """A new dedup key per message (its arguments differ)."""
            cross_finish_line(broker.client, run_id, total)

        @dramatiq.actor(queue_name=QUEUE, max_retries=0, mutex=True)
        def mutex_tick(run_id: str, total: int, i: int) -> None:
            """A mutex key per message (its arguments), never busy."""
            cross_finish_line(broker.client, run_id, total)

        @dramatiq.actor(
            queue_name=QUEUE,
            max_retries=0,
            concurrency={"limit": WIDE_LIMIT, "key": lambda *args: "wide"},
        )
        def wide_tick(run_id: str, total: int, i: int) -> None:
            """Every message on one key with a limit of 1,000."""
            cross_finish_line(broker.client, run_id, total)
