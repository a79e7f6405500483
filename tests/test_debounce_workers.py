"""The ``debounce`` option with real ``dramatiq`` worker processes (the standard CLI).

The test process is the producer: its sends write the key's pending run and return; the worker
processes' sweeps hand the run off when it is due. Invariant D is checked on what each side
saw: every send either ran or was counted superseded by the producer, never both, and each
burst's last send runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from harness import DramatiqWorker, Gate, Recorder, wait_for_redis_broker_drain, wait_until

from dramatiq_guard import events

SOURCE = """
import os

import dramatiq
from dramatiq.middleware import CurrentMessage
from harness import Gate, Recorder, broker_from_env

import dramatiq_guard

broker = broker_from_env()
dramatiq_guard.install(broker, sweep_interval=100)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)
debounce = next(m for m in broker.middleware if isinstance(m, dramatiq_guard.Debounce))
rec = Recorder.from_env()


@dramatiq.actor(debounce={"wait": 500, "key": lambda doc, version: doc}, max_retries=0, queue_name=QUEUE)
def save(doc, version):
    message_id = CurrentMessage.get_current_message().message_id
    rec.record(phase="start", doc=doc, version=version, id=message_id, pid=os.getpid())
    if doc == "slow":
        Gate.from_env(QUEUE).wait()
    rec.record(phase="end", doc=doc, version=version, id=message_id)
"""

Start = Callable[..., DramatiqWorker]


class Superseded:
    """Counts the sends the producer superseded (``messages_debounced_total`` in metrics)."""

    def __init__(self) -> None:
        self.sends = 0

    def count(self, event: str, actor: str) -> None:
        self.sends += event == "debounced"

    def holders(self, actor: str, delta: int) -> None: ...

    def waiters(self, actor: str, delta: int) -> None: ...

    def lock_waited(self, actor: str, duration_ms: float) -> None: ...


@pytest.fixture
def superseded() -> Iterator[Superseded]:
    sink = Superseded()
    previous = events.set_sink(sink)
    yield sink
    events.set_sink(previous)


def test_a_burst_from_a_producer_runs_once_on_two_worker_processes_with_its_last_send(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
    superseded: Superseded,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + SOURCE)
    dramatiq_worker("actors", processes=2, threads=2, queues=[queue])
    sent = [module.save.send("a", version) for version in range(10)]
    backend = module.debounce.backend(module.broker)
    wait_until(lambda: not backend.waiting_keys(), timeout=30, what="no pending run left")
    wait_for_redis_broker_drain(redisdb, [queue])  # and every run handed off has run
    ran = [r["id"] for r in recorder.take(recorder.pending()) if r["phase"] == "end"]
    assert ran[-1] == sent[-1].message_id  # the burst's last send ran, last (a pause over the wait
    # between two sends of a slow producer runs the burst so far, and starts a new one)
    assert len(set(ran)) == len(ran)  # each at most once
    assert len(ran) + superseded.sends == len(sent)  # every other send was superseded


def test_a_worker_killed_while_running_the_pending_run_loses_nothing(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + SOURCE, broker_url=rabbitmq_url)
    doomed = dramatiq_worker("actors", threads=2, broker_url=rabbitmq_url, queues=[queue])
    last = [module.save.send("slow", version) for version in range(5)][-1]
    [start] = recorder.take(1)  # the run was taken off the guard and started; it blocks at the gate
    assert (start["version"], start["id"]) == (4, last.message_id)
    doomed.kill_worker(doomed.worker_pids[0])  # RabbitMQ redelivers the unacked run
    dramatiq_worker("actors", threads=2, broker_url=rabbitmq_url, queues=[queue])
    [again] = recorder.take(1)
    assert (again["phase"], again["id"]) == ("start", last.message_id)  # the same run, not lost
    Gate(redisdb, queue).open(1)
    [end] = recorder.take(1)
    assert (end["phase"], end["version"], end["id"]) == ("end", 4, last.message_id)
    recorder.expect_no_more(within=1.0)
