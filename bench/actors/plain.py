"""Plain Dramatiq actors on a RedisBroker: the baseline every guarded scenario is compared to."""

from __future__ import annotations

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench.actors import cross_finish_line, redis_url

broker = RedisBroker(url=redis_url())
dramatiq.set_broker(broker)


@dramatiq.actor(broker=broker, queue_name="bench_plain", max_retries=0)
def noop(i: int) -> None:
    """Does nothing: the cost measured is the broker's."""


@dramatiq.actor(broker=broker, queue_name="bench_plain", max_retries=0)
def tick(run_id: str, total: int) -> None:
    """Does nothing but count its completion."""
    cross_finish_line(broker.client, run_id, total)
