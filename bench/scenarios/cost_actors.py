"""Worker-side actors of the per-guard cost table (``python -m dramatiq bench.scenarios.cost_actors``).

Inert unless ``BENCH_COST`` is set (the scenario loader imports every module here). With
``BENCH_COST_GUARD`` set too, every guard middleware is installed (``dramatiq_guard.install``)
and the guarded actors are declared; without it the broker is plain Dramatiq. Every actor does
the same work: one INCR to count its completion (:func:`bench.actors.cross_finish_line`).
The two kinds use queues of their own, so a plain and a guarded worker can run side by side
and the bench can interleave their drains; ``BENCH_COST_QUEUE`` names another queue, for a
worker of its own (the guard installed, and only its unguarded actor drained there).
"""

from __future__ import annotations

import os

import dramatiq

#: The key of the concurrency row's one key, and its limit.
WIDE_LIMIT = 1000

if os.environ.get("BENCH_COST"):
    from dramatiq import Message
    from dramatiq.brokers.redis import RedisBroker

    from bench.actors import cross_finish_line, redis_url

    broker = RedisBroker(url=redis_url())
    QUEUE = os.environ.get("BENCH_COST_QUEUE") or (
        "bench_cost_guard" if os.environ.get("BENCH_COST_GUARD") else "bench_cost"
    )
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

    #: The backlog floor's messages beyond the first WIDE_LIMIT of a run, and those being pushed.
    BACKLOG, PUSHING = "bench:cost:backlog", "bench:cost:pushing"
    take_parked = broker.client.register_script(
        "return redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')"
    )
    confirm_pushed = broker.client.register_script("return redis.call('LREM', KEYS[1], 1, ARGV[1])")

    @dramatiq.actor(queue_name=QUEUE, max_retries=0)
    def backlog_floor_tick(run_id: str, total: int, i: int) -> None:
        """The least a backlog held in Redis costs: the floor's two round trips, and a parked message moved.

        The round trip after the work takes the oldest parked message (if any) into a list of
        messages being pushed; the job pushes it to the broker and confirms the push (a third
        round trip), so that a worker killed between the two loses nothing.
        """
        noop()
        cross_finish_line(broker.client, run_id, total)
        parked = take_parked(keys=[BACKLOG, PUSHING])
        if parked is not None:
            broker.enqueue(Message.decode(parked))
            confirm_pushed(keys=[PUSHING], args=[parked])

    class BacklogFloor:
        """Sends ``backlog_floor_tick`` as a limit of WIDE_LIMIT would: the rest of a run parks in Redis."""

        def __init__(self) -> None:
            self._sent: dict[str, int] = {}
            # This module's actor and broker now: the bench reloads the module with the guard on.
            self._actor, self._client = backlog_floor_tick, broker.client

        def send(self, run_id: str, total: int, i: int) -> None:
            sent = self._sent[run_id] = self._sent.get(run_id, 0) + 1
            if sent <= WIDE_LIMIT:
                self._actor.send(run_id, total, i)
            else:
                self._client.rpush(BACKLOG, self._actor.message(run_id, total, i).encode())

    backlog_floor = BacklogFloor()

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
