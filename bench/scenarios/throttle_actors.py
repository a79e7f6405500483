"""Worker-side actors of the throttle bench (``python -m dramatiq bench.scenarios.throttle_actors``).

Inert unless ``BENCH_THROTTLE`` is set to ``"<limit>,<period ms>"`` (the scenario loader imports every
module here). Each drain has a key of its own (its run id), so one drain's window never holds the
next one's places. A first middleware counts every message a worker takes off the broker, per actor,
notes when its thread took it, and after a run pushes the retries it took to ``bench:retries:<run id>``
and crosses the finish line. A job pushes ``"<start> <pickup>"`` (``time.time()`` on entry, and when
its message was taken) to ``bench:starts:<run id>``; the unguarded ``paced_job`` pushes how long after
its send it started (ms) to ``bench:paced:<run id>``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dramatiq

if os.environ.get("BENCH_THROTTLE"):
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware import AgeLimit, Retries
    from dramatiq.rate_limits import WindowRateLimiter
    from dramatiq.rate_limits.backends import RedisBackend as RateLimiterBackend

    from bench.actors import cross_finish_line, redis_url
    from dramatiq_guard.middleware.slots import Throttle

    LIMIT, PERIOD_MS = map(int, os.environ["BENCH_THROTTLE"].split(","))
    JOB_S = 0.010

    class RunCounter(dramatiq.Middleware):
        """Counts pickups per actor; after a run, its retries and its completion."""

        def before_process_message(self, broker: Any, message: Any) -> None:
            _picked.at = time.time()
            broker.client.incr(f"bench:pickups:{message.actor_name}")

        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            if exception is None:
                run_id, total = message.args[:2]
                broker.client.rpush(f"bench:retries:{run_id}", message.options.get("retries", 0))
                cross_finish_line(broker.client, run_id, total)

    broker = RedisBroker(url=redis_url())
    broker.add_middleware(RunCounter(), before=AgeLimit)
    broker.add_middleware(Throttle(), before=Retries)
    dramatiq.set_broker(broker)
    limiter_backend = RateLimiterBackend(client=broker.client)
    _limiters: dict[str, WindowRateLimiter] = {}
    _picked = threading.local()  # when this thread took its message off the broker

    def _job(run_id: str) -> None:
        broker.client.rpush(f"bench:starts:{run_id}", f"{time.time()!r} {_picked.at!r}")
        time.sleep(JOB_S)

    @dramatiq.actor(
        throttle={"limit": LIMIT, "period": PERIOD_MS, "key": lambda run_id, total: run_id},
        queue_name="bench_throttle",
        max_retries=0,
    )
    def throttled_job(run_id: str, total: int) -> None:
        _job(run_id)

    # The floor of a start delay: no guard, each message sent by the producer when its place opens
    # (the producer paces them); it records how long after its send it started.
    @dramatiq.actor(queue_name="bench_throttle", max_retries=0)
    def paced_job(run_id: str, total: int, sent_at: float) -> None:
        broker.client.rpush(f"bench:paced:{run_id}", repr((time.time() - sent_at) * 1000))
        time.sleep(JOB_S)

    # The way users throttle with Dramatiq alone: WindowRateLimiter raises RateLimitExceeded, Retries
    # retries with backoff (tuned down from Dramatiq's 15 s minimum, as in the slots bench's crl_job;
    # max_retries raised from its 20 so that no message dies: the figure is the retries burned).
    @dramatiq.actor(queue_name="bench_throttle", max_retries=100_000, min_backoff=100, max_backoff=2_000)
    def window_job(run_id: str, total: int) -> None:
        if run_id not in _limiters:
            window = max(1, PERIOD_MS // 1000)  # whole seconds only
            _limiters[run_id] = WindowRateLimiter(limiter_backend, run_id, limit=LIMIT, window=window)
        with _limiters[run_id].acquire():
            _job(run_id)
