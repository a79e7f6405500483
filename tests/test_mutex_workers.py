"""The mutex with real Redis and real ``dramatiq`` worker processes (2 processes x 8 threads)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from harness import (
    DramatiqWorker,
    Recorder,
    guard_leftovers,
    pid_alive,
    wait_for_redis_broker_drain,
    wait_until,
)

from dramatiq_guard.backends import Stake
from dramatiq_guard.backends.redis import RedisBackend

SOURCE = """
import dramatiq
from dramatiq.middleware import Retries
from harness import Gate, Recorder, broker_from_env

from dramatiq_guard.middleware.slots import Concurrency, Mutex

broker = broker_from_env()
broker.add_middleware(Mutex(lease_ttl=2_000, sweep_interval=200), before=Retries)
broker.add_middleware(Concurrency(lease_ttl=2_000, sweep_interval=200), before=Retries)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


def run(n):
    with rec.track("one") as running:
        rec.record(n=n, running=running, token=dramatiq_guard.current_lease().token)


import dramatiq_guard


@dramatiq.actor(mutex={"on_busy": "wait", "wait": 60_000, "key": lambda n: "one"}, max_retries=0)
def waiting(n):
    run(n)


@dramatiq.actor(mutex={"on_busy": "park", "key": lambda n: "one"}, max_retries=0)
def parking(n):
    run(n)


@dramatiq.actor(mutex={"key": lambda n: "one"}, max_retries=0)
def dropping(n):
    if n == 0:
        rec.record(n=0, holding=True)
        Gate.from_env("hold").wait(timeout=60)
    run(n)


@dramatiq.actor(
    mutex={"on_busy": "wait", "wait": 300, "key": lambda n: "timed"}, min_backoff=50, max_backoff=100
)
def timed(n):
    rec.record(n=n, started=True)
    if n == 0:
        Gate.from_env("timed").wait(timeout=60)
    rec.record(n=n, done=True)


@dramatiq.actor(mutex={"key": lambda: "patient"}, max_retries=0)
def hold_patient():
    rec.record(holding=True)
    Gate.from_env("patient").wait(timeout=60)


@dramatiq.actor(
    mutex={"on_busy": "wait", "wait": 60_000, "key": lambda: "patient"}, max_retries=0, time_limit=500
)
def patient():
    rec.record(patient=True)


@dramatiq.actor(mutex={"key": lambda: "killed"}, max_retries=0)
def hold_forever():
    rec.record(holding=True, pid=__import__("os").getpid())
    Gate.from_env("never").wait(timeout=600)
"""

Start = Callable[..., DramatiqWorker]


@pytest.mark.parametrize("actor", ["waiting", "parking"])
def test_two_hundred_messages_on_one_key_never_run_two_at_once(
    actor: str,
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
) -> None:
    module = actor_module(SOURCE)
    dramatiq_worker("actors", processes=2, threads=8)
    for n in range(200):
        getattr(module, actor).send(n)
    records = recorder.take(200, timeout=90)
    assert sorted(r["n"] for r in records) == list(range(200))
    assert recorder.max_concurrency("one") == 1
    tokens = [r["token"] for r in records]
    assert tokens == sorted(tokens)  # each holder's fencing token is above the one before
    wait_for_redis_broker_drain(redisdb)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


def test_drop_runs_the_holder_only(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: Any
) -> None:
    module = actor_module(SOURCE)
    worker = dramatiq_worker("actors", processes=2, threads=8)
    module.dropping.send(0)
    assert recorder.take_one()["holding"]
    for n in range(1, 200):
        module.dropping.send(n)
    wait_until(lambda: worker.log.count("Dropped") == 199, timeout=60, what="199 drops")
    recorder.gate("hold").open()
    assert recorder.take_one()["n"] == 0
    wait_for_redis_broker_drain(redisdb)
    assert recorder.pending() == 0
    assert recorder.max_concurrency("one") == 1
    # The holder's release may land just after its ack (the release thread's): wait for it.
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


def test_a_sigkilled_holders_lock_is_free_within_one_lease(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: Any
) -> None:
    module = actor_module(SOURCE)
    dramatiq_worker("actors", processes=1, threads=2)
    module.hold_forever.send()
    holder = recorder.take_one()
    backend = RedisBackend(redisdb)
    state = backend.inspect("mutex:killed")
    ((_holder_id, deadline_ms),) = state.holders
    os.kill(holder["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(holder["pid"]), what="the holder's process to die")
    # Renewals stopped: the lease ends at its last deadline, at most one lease (2 s) after the kill.
    state = backend.inspect("mutex:killed")
    assert state.holders == () or state.holders[0][1] <= deadline_ms + 2_000
    probe = wait_until(
        lambda: (r := backend.acquire(Stake("mutex:killed", "probe", limit=1, ttl_ms=1_000))).acquired and r,
        timeout=30,
        what="the dead holder's lease to lapse",
    )
    assert probe.token is not None and state.token is not None and probe.token > state.token


def test_a_wait_that_times_out_raises_mutex_wait_timeout_and_retries_retry_it(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: Any
) -> None:
    module = actor_module(SOURCE)
    worker = dramatiq_worker("actors", processes=2, threads=2)
    module.timed.send(0)
    assert recorder.take_one()["started"]
    module.timed.send(1)  # waits 300 ms, times out, is retried, waits again...
    wait_until(lambda: worker.log.count("Retrying message") >= 2, timeout=60, what="two retried waits")
    assert "MutexWaitTimeout" in worker.log
    assert recorder.pending() == 0  # 1 never started while 0 held the lock
    recorder.gate("timed").open()
    records = [(r["n"], "done" if r.get("done") else "started") for r in recorder.take(3, timeout=60)]
    assert records == [(0, "done"), (1, "started"), (1, "done")]
    wait_for_redis_broker_drain(redisdb)
    # The last run's release may land just after its ack (the release thread's): wait for it.
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


def test_a_wait_for_the_mutex_does_not_eat_the_actors_time_limit(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: Any
) -> None:
    # A thread blocked for the mutex has its TimeLimit timer paused: an actor whose time_limit
    # (500 ms) is shorter than its wait is not killed while it waits, and runs once it holds.
    module = actor_module(SOURCE)
    worker = dramatiq_worker("actors", processes=1, threads=2)
    module.hold_patient.send()
    assert recorder.take_one()["holding"]
    module.patient.send()
    backend = RedisBackend(redisdb)
    wait_until(lambda: backend.inspect("mutex:patient").waiters, what="the patient message blocking")
    # Time itself is what this waits on: three times the time limit, blocked on the mutex.
    time.sleep(1.5)
    assert backend.inspect("mutex:patient").waiters  # still blocked, not failed
    recorder.gate("patient").open()
    assert recorder.take_one()["patient"]
    wait_for_redis_broker_drain(redisdb)
    assert "TimeLimitExceeded" not in worker.log
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)
