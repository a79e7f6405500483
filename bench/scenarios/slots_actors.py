"""Worker-side actors of the slots and mutex bench (``python -m dramatiq bench.scenarios.slots_actors``).

Inert unless ``BENCH_SLOTS`` is set (the scenario loader imports every module here). A first
middleware counts broker pickups (every message a worker takes, run or parked after pickup), and
counts the slot drain's completions after the guard released the slot (its after hook runs last):
the bench's own bookkeeping stays out of the slot, as it stays out of the ConcurrentRateLimiter's
limited section in ``crl_job``. The hand-off actors' spans are written by that hook too, after the
mutex was released: the gap measured from one holder's end to the next one's start holds the guard's
release and hand-off, not the bench's own round trips.

With ``BENCH_SLOTS_SPANS`` set to a directory, every process also appends to a file of its own
there each pickup of the slot drain's and the floor's messages (``P <time> <message id>``) and
each of their jobs (``J <start> <end> <run id> <message id>``): what
:func:`bench.scenarios.slots.handoff_gaps` reads.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dramatiq

if os.environ.get("BENCH_SLOTS"):
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware import AgeLimit, Retries
    from dramatiq.rate_limits import ConcurrentRateLimiter
    from dramatiq.rate_limits.backends import RedisBackend as RateLimiterBackend

    from bench.actors import cross_finish_line, redis_url
    from dramatiq_guard.middleware.slots import Concurrency, Mutex

    class PickupCounter(dramatiq.Middleware):
        """Counts every message a worker takes off the broker, per actor, and slot_job completions."""

        def before_process_message(self, broker: Any, message: Any) -> None:
            broker.client.incr(f"bench:pickups:{message.actor_name}")
            if message.actor_name in ("slot_job", "floor_job"):
                _spans.message_id = message.message_id
                _record(f"P {time.time()!r} {message.message_id}")

        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            span = getattr(_spans, "span", None)
            _spans.span = None
            if exception is not None:
                return
            if message.actor_name == "slot_job":
                cross_finish_line(broker.client, *message.args)
            elif span is not None:  # a hand-off actor ran (and released its lock) on this thread
                run_id, total = message.args
                broker.client.rpush(f"bench:spans:{run_id}", f"{span[0]!r},{span[1]!r}")
                cross_finish_line(broker.client, run_id, total)

    #: The span (start, end) of the hand-off actor that last ran on this thread, for PickupCounter;
    #: and the message id of the drain's message it last picked up, for _drain_job.
    _spans = threading.local()

    _SPANS_DIR = os.environ.get("BENCH_SLOTS_SPANS")
    _span_file: Any = None
    _span_lock = threading.Lock()

    def _record(line: str) -> None:
        """Append a line to this process's span file (``BENCH_SLOTS_SPANS``), if there is one."""
        global _span_file
        if not _SPANS_DIR:
            return
        with _span_lock:
            if _span_file is None:
                _span_file = open(os.path.join(_SPANS_DIR, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
            _span_file.write(line + "\n")

    def _drain_job(run_id: str) -> None:
        """The drain's 10 ms of work, and its span for the hand-off gaps."""
        start = time.time()
        time.sleep(0.01)
        _record(f"J {start!r} {time.time()!r} {run_id} {getattr(_spans, 'message_id', '-')}")

    broker = RedisBroker(url=redis_url())
    broker.add_middleware(PickupCounter(), before=AgeLimit)
    # BENCH_SLOTS_LOOKAHEAD=0: no standbys (how slots drained before them), for the side-by-side figure.
    lookahead = int(os.environ["BENCH_SLOTS_LOOKAHEAD"]) if os.environ.get("BENCH_SLOTS_LOOKAHEAD") else None
    broker.add_middleware(Mutex(lookahead=lookahead), before=Retries)
    broker.add_middleware(Concurrency(lookahead=lookahead), before=Retries)
    dramatiq.set_broker(broker)
    limiter_backend = RateLimiterBackend(client=broker.client)
    drain_limiter = ConcurrentRateLimiter(limiter_backend, "bench-drain", limit=8, ttl=60_000)

    @dramatiq.actor(
        concurrency={"limit": 8, "key": lambda *a: "drain"}, queue_name="bench_slots", max_retries=0
    )
    def slot_job(run_id: str, total: int) -> None:
        _drain_job(run_id)  # the job's 10 ms of work; PickupCounter counts its completion

    # The floor: the same jobs with no guard at all, on a worker of exactly 8 threads (1 x 8), so
    # that 8 run at a time because there are 8 threads. What this machine allows, guard or not.
    @dramatiq.actor(queue_name="bench_floor", max_retries=0)
    def floor_job(run_id: str, total: int) -> None:
        _drain_job(run_id)
        cross_finish_line(broker.client, run_id, total)

    # The way users limit concurrency with Dramatiq alone: RateLimitExceeded, retried with backoff
    # (tuned down from Dramatiq's 15 s default minimum, as users of this pattern do).
    @dramatiq.actor(queue_name="bench_slots", max_retries=100_000, min_backoff=100, max_backoff=2_000)
    def crl_job(run_id: str, total: int) -> None:
        with drain_limiter.acquire():
            time.sleep(0.01)
        cross_finish_line(broker.client, run_id, total)

    def _timed(run_id: str, total: int) -> None:
        start = time.time()
        time.sleep(0.002)
        _spans.span = (start, time.time())  # written by PickupCounter once the lock is released

    @dramatiq.actor(
        mutex={"key": lambda *a: "handoff", "on_busy": "wait", "wait": 600_000}, queue_name="bench_slots"
    )
    def handoff_wait(run_id: str, total: int) -> None:
        _timed(run_id, total)

    @dramatiq.actor(mutex={"key": lambda *a: "handoff", "on_busy": "park"}, queue_name="bench_slots")
    def handoff_park(run_id: str, total: int) -> None:
        _timed(run_id, total)

    @dramatiq.actor(queue_name="bench_slots", max_retries=0)
    def handoff_redispy(run_id: str, total: int) -> None:
        # redis-py's Lock: a waiter polls every `sleep` (0.1 s, its default).
        with broker.client.lock("bench-redispy", timeout=30, sleep=0.1, blocking_timeout=600):
            _timed(run_id, total)
