"""The ``throttle`` option with real ``dramatiq`` worker processes on a RedisBroker.

The test process is the producer: its sends reserve places or park (no timer of its own), and two
worker processes hand the places on as the window opens (each one's timer per key, and the
sweep). Each run reads its start off the backend (``inspect().holder_info``: its holder's acquire
time, on Redis's clock) and records it, so the window is checked on the backend's own times.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

from harness import DramatiqWorker, Recorder, wait_for_redis_broker_drain, wait_until

LIMIT = 3
PERIOD_MS = 1_000

SOURCE = """
import os

import dramatiq
from dramatiq.middleware import CurrentMessage, Retries
from harness import Recorder, broker_from_env

from dramatiq_guard import Throttle

broker = broker_from_env()
broker.add_middleware(CurrentMessage())
throttle = Throttle()
broker.add_middleware(throttle, before=Retries)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


def record_start(key, **fields):
    message = CurrentMessage.get_current_message()
    holder = f"{message.message_id}:{message.options.get('retries', 0)}"
    state = throttle.backend(broker).inspect(f"throttle:{key}")
    [since] = [since for h, since, _ in state.holder_info if h == holder]
    rec.record(holder=holder, since=since, **fields)


@dramatiq.actor(throttle={"limit": 3, "period": 1_000, "key": lambda n: "partner"}, max_retries=0,
                queue_name=QUEUE)
def call_partner(n):
    record_start("partner", n=n)


@dramatiq.actor(throttle={"limit": 1, "period": 1_000, "key": lambda: "flaky"}, max_retries=1,
                min_backoff=1, max_backoff=1, queue_name=QUEUE)
def flaky():
    record_start("flaky")
    if CurrentMessage.get_current_message().options.get("retries", 0) == 0:
        raise RuntimeError("the first attempt fails")
"""

Start = Callable[..., DramatiqWorker]


def records_left(recorder: Recorder) -> list[dict[str, Any]]:
    """The records not taken yet (without waiting)."""
    return [json.loads(raw) for raw in recorder.client.lrange(recorder.key, 0, -1)]


def wait_until_nothing_is_left(module: ModuleType, redisdb: Any, queue: str) -> None:
    """Wait until no copy is on the broker (queued, delayed or unacked) and nothing waits parked or
    reserved in the guard: no run is still to come. (The keys of the lapsed starts themselves
    expire later, with the longest reservation they had.)"""
    wait_for_redis_broker_drain(redisdb, [queue])
    backend = module.throttle.backend(module.broker)
    wait_until(lambda: not backend.waiting_keys(), timeout=30, what="no key waiting", redis=redisdb)


def crowded_windows(starts: list[int], limit: int, period_ms: int) -> list[list[int]]:
    """Every ``limit + 1`` consecutive starts (sorted) that fall within ``period_ms``."""
    ordered = sorted(starts)
    return [
        ordered[i : i + limit + 1]
        for i in range(len(ordered) - limit)
        if ordered[i + limit] - ordered[i] < period_ms
    ]


def test_at_most_three_starts_in_any_second_across_two_worker_processes_and_each_runs_once(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + SOURCE)
    dramatiq_worker("actors", processes=2, threads=4, queues=[queue])
    for n in range(12):
        module.call_partner.send(n)  # 3 reserve a place, the rest park (workers hand places on)
    records = recorder.take(12, timeout=60)
    wait_until_nothing_is_left(module, redisdb, queue)
    assert records_left(recorder) == []  # no 13th run
    assert sorted(r["n"] for r in records) == list(range(12))  # each message ran exactly once
    assert len({r["holder"] for r in records}) == 12
    starts = [r["since"] for r in records]
    assert crowded_windows(starts, LIMIT, PERIOD_MS) == [], sorted(starts)


def test_a_retry_is_a_new_start_a_period_after_the_first_across_processes(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + SOURCE)
    dramatiq_worker("actors", processes=2, threads=4, queues=[queue])
    message = module.flaky.send()
    first, retry = recorder.take(2, timeout=60)
    assert (first["holder"], retry["holder"]) == (f"{message.message_id}:0", f"{message.message_id}:1")
    # Limit 1: the retry found the first attempt's place taken until a period after its start.
    assert retry["since"] - first["since"] >= PERIOD_MS, (first, retry)
    wait_until_nothing_is_left(module, redisdb, queue)
    assert records_left(recorder) == []  # no third attempt (max_retries=1), no second run of either
