"""Worker-side actors of the composition bench (``python -m dramatiq bench.scenarios.compose_actors``).

Inert unless ``BENCH_COMPOSE`` is set (the scenario loader imports every module here). One actor per
row of :data:`GUARDS`, each doing the same work (one INCR to count its completion), with guards whose
limits never bind: a message never parks, so what a row costs over another is what its guards cost
on their happy path. The guard has a client of its own (:func:`bench.actors.traffic.counted_client`),
whose requests each worker process publishes (:class:`bench.actors.traffic.PublishTraffic`).
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq

QUEUE = "bench_compose"
#: A limit no drain reaches: every key admits every message of every drain.
NEVER = 1_000_000


def _one_key(run_id: str, total: int, i: int) -> str:
    return "compose"


def _per_message(run_id: str, total: int, i: int) -> str:
    return f"compose:{run_id}:{i}"


#: A limit on one key for every message, and one on a key of each message's own.
ONE_KEY: dict[str, Any] = {"limit": NEVER, "key": _one_key}
PER_MESSAGE: dict[str, Any] = {"limit": NEVER, "key": _per_message}

#: The rows: each actor's label and guards (the actor ``compose_<row>``); a row is one line.
GUARDS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("no guard (installed)", {}),
    "one": ("concurrency (one guard)", {"concurrency": ONE_KEY}),
    "throttle": ("concurrency + throttle", {"concurrency": ONE_KEY, "throttle": {**ONE_KEY, "period": 1000}}),
    "mutex": ("mutex + concurrency", {"mutex": {"key": _per_message}, "concurrency": ONE_KEY}),
    "list": ("concurrency=[two limits]", {"concurrency": [ONE_KEY, PER_MESSAGE]}),
}


def guard_count(options: dict[str, Any]) -> int:
    """How many guards ``options`` puts on an actor (a list of limits is one guard per item)."""
    return sum(len(value) if isinstance(value, list) else 1 for value in options.values())


if os.environ.get("BENCH_COMPOSE"):
    from dramatiq.brokers.redis import RedisBroker

    import dramatiq_guard
    from bench.actors import cross_finish_line, redis_url
    from bench.actors.traffic import PublishTraffic, counted_client

    broker = RedisBroker(url=redis_url())
    dramatiq_guard.install(broker, redis=counted_client(redis_url()))
    broker.add_middleware(PublishTraffic())
    dramatiq.set_broker(broker)

    def _job(run_id: str, total: int, i: int) -> None:
        cross_finish_line(broker.client, run_id, total)

    #: The actor of each row of GUARDS.
    ACTORS = {
        row: dramatiq.actor(actor_name=f"compose_{row}", queue_name=QUEUE, max_retries=0, **options)(_job)
        for row, (_, options) in GUARDS.items()
    }
