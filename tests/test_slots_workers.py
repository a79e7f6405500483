"""Concurrency slots with real Redis / RabbitMQ and real ``dramatiq`` worker processes."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

from harness import (
    DramatiqWorker,
    Gate,
    Recorder,
    guard_leftovers,
    pid_alive,
    redis_broker_pending,
    wait_for_redis_broker_drain,
    wait_until,
)
from test_slots_stub import send_standbys

SOURCE = """
import os
import time

import dramatiq
from dramatiq.middleware import Retries
from harness import Gate, Recorder, broker_from_env

from dramatiq_guard.middleware.slots import Concurrency, Mutex

broker = broker_from_env()
concurrency = Concurrency(lease_ttl=2_000, sweep_interval=200)
broker.add_middleware(Mutex(lease_ttl=2_000, sweep_interval=200), before=Retries)
broker.add_middleware(concurrency, before=Retries)
dramatiq.set_broker(broker)
rec = Recorder.from_env()
LIMITS = {"k3": 3, "k5": 5}


@dramatiq.actor(concurrency={"limit": 3, "key": lambda key, n: key}, max_retries=0, queue_name=QUEUE)
def deliver(key, n):
    rec.record(phase="start", key=key, n=n, pid=os.getpid())
    with rec.track(key):
        time.sleep(0.02)  # the job's own work
    rec.record(phase="end", key=key, n=n, pid=os.getpid())


@dramatiq.actor(concurrency={"limit": 3, "key": lambda key, n: key}, max_retries=0, queue_name=QUEUE)
def deliver_gated(key, n):
    rec.record(phase="start", key=key, n=n, pid=os.getpid())
    with rec.track(key):
        Gate.from_env(QUEUE).wait(timeout=60)  # until the test has seen the limit reached
    rec.record(phase="end", key=key, n=n, pid=os.getpid())


@dramatiq.actor(concurrency={"limit": 5, "key": lambda key, n: key}, max_retries=0, queue_name=QUEUE)
def deliver5(key, n):
    deliver.fn(key, n)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "shared"}, max_retries=0, queue_name=QUEUE + "_a")
def hold(n):
    rec.record(phase="holding", n=n, pid=os.getpid())
    Gate.from_env("never").wait(timeout=600)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "shared"}, max_retries=0, queue_name=QUEUE + "_b")
def wait_for_slot(n):
    with rec.track("shared"):
        rec.record(phase="waiter", n=n)


RANKED = {"limit": 1, "key": lambda n: "ranked"}


@dramatiq.actor(concurrency=RANKED, max_retries=0, queue_name=QUEUE, priority=5)
def later(n):
    rec.record(phase="ranked", n=n)


@dramatiq.actor(concurrency=RANKED, max_retries=0, queue_name=QUEUE)
def sooner(n):
    rec.record(phase="ranked", n=n)
"""

Start = Callable[..., DramatiqWorker]


def source(queue: str) -> str:
    return f"QUEUE = {queue!r}\n" + SOURCE


def test_two_keys_never_exceed_their_limits_while_a_worker_is_sigkilled(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(source(queue), broker_url=rabbitmq_url)
    doomed = dramatiq_worker("actors", threads=8, broker_url=rabbitmq_url, queues=[queue])
    dramatiq_worker("actors", threads=8, broker_url=rabbitmq_url, queues=[queue])
    sent = 120
    for n in range(sent):
        if n % 2:
            module.deliver.send("k3", n)
        else:
            module.deliver5.send("k5", n)
    wait_until(
        lambda: sum(1 for r in _records(recorder) if r["phase"] == "end") >= 30, timeout=60, what="30 runs"
    )
    pid = doomed.worker_pids[0]
    killed_at = kill(pid)

    def all_ran() -> bool:
        return {r["n"] for r in _records(recorder) if r["phase"] == "end"} == set(range(sent))

    wait_until(all_ran, timeout=90, what="every message to run")
    records = _records(recorder)
    # Each run's [start, end] record lies inside its lease; the killed process's runs end at the kill.
    assert max_overlap(records, "k3", pid, killed_at) <= 3
    assert max_overlap(records, "k5", pid, killed_at) <= 5
    runs = Counter(r["n"] for r in records if r["phase"] == "start")
    started_on_killed = {r["n"] for r in records if r["phase"] == "start" and r["pid"] == pid}
    twice = {n for n, count in runs.items() if count > 1}
    assert twice <= started_on_killed  # only what the broker redelivered from the killed worker


def test_waiters_of_a_key_whose_holders_all_died_run_after_their_leases_lapse(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(source(queue))
    holders = dramatiq_worker("actors", threads=4, queues=[f"{queue}_a"])
    dramatiq_worker("actors", threads=4, queues=[f"{queue}_b"])
    module.hold.send(0)
    module.hold.send(1)
    assert {r["n"] for r in recorder.take(2)} == {0, 1}
    for n in range(5):
        module.wait_for_slot.send(n)
    assert len(module.concurrency.backend(module.broker).inspect("concurrency:shared").waiters) == 5
    kill(holders.worker_pids[0])
    # The other worker's sweep reclaims the dead leases and hands the slots on.
    assert sorted(r["n"] for r in recorder.take(5, timeout=30)) == list(range(5))
    assert recorder.max_concurrency("shared") <= 2
    wait_for_redis_broker_drain(redisdb, [f"{queue}_b"])
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


def test_limit_zero_parks_everything_and_four_drains_four_at_a_time(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(source(queue))
    dramatiq_worker("actors", processes=2, threads=8, queues=[queue])
    module.concurrency.set_limit("k3", 0)
    for n in range(40):
        module.deliver_gated.send("k3", n)
    assert redis_broker_pending(redisdb, [queue]) == 0  # everything parked, nothing on the broker
    module.concurrency.set_limit("k3", 4)
    # The first four run at once (they hold until the gate opens), and no fifth joins them.
    wait_until(lambda: recorder.concurrency("k3") == 4, timeout=60, what="4 runs at once")
    recorder.gate(queue).open(40)
    wait_until(
        lambda: sum(1 for r in _records(recorder) if r["phase"] == "end") == 40, timeout=60, what="40 runs"
    )
    assert recorder.max_concurrency("k3") == 4
    wait_for_redis_broker_drain(redisdb, [queue])
    # The last run's release may land just after its ack (the release thread's): wait for it.
    wait_until(
        lambda: not guard_leftovers(redisdb, keep_limits_index=True),
        what="no guard state left",
        redis=redisdb,
    )
    assert module.concurrency.get_limit("k3") == 4  # a configured limit stays until cleared
    module.concurrency.set_limit("k3", None)
    assert guard_leftovers(redisdb) == []  # its last fencing token stays, expiring by itself


def test_parked_messages_of_a_key_run_by_their_actors_priority_then_in_order(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, unique_name: str
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(source(queue))
    dramatiq_worker("actors", processes=2, threads=4, queues=[queue])
    module.concurrency.set_limit("ranked", 0)
    for n in range(12):  # interleaved: later (priority 5) 0, 2, ...; sooner (the default, 0) 1, 3, ...
        (module.sooner if n % 2 else module.later).send(n)
    module.concurrency.set_limit("ranked", 1)
    wait_until(lambda: len(_records(recorder)) == 12, timeout=60, what="12 runs")
    assert [r["n"] for r in _records(recorder)] == [1, 3, 5, 7, 9, 11, 0, 2, 4, 6, 8, 10]


def kill(pid: int) -> float:
    """SIGKILL a worker process and wait until it is gone; return when it was killed."""
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what=f"worker process {pid} to die")
    return killed_at


def max_overlap(records: list[dict[str, Any]], key: str, dead_pid: int, killed_at: float) -> int:
    """The most runs of ``key`` whose [start, end] records overlap (``dead_pid``'s end at the kill)."""
    starts: dict[tuple[int, int], float] = {}
    events: list[tuple[float, int]] = []
    for r in records:
        if r["key"] != key:
            continue
        if r["phase"] == "start":
            assert (r["pid"], r["n"]) not in starts, f"{key} {r['n']} started twice at once in {r['pid']}"
            starts[(r["pid"], r["n"])] = r["ts"]
        elif r["phase"] == "end":
            events += [(starts.pop((r["pid"], r["n"])), 1), (r["ts"], -1)]
    for (pid, _), ts in starts.items():
        assert pid == dead_pid, "a run that did not end on a live worker"
        events += [(ts, 1), (killed_at, -1)]
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        running += delta
        peak = max(peak, running)
    return peak


def _records(recorder: Recorder) -> list[dict[str, Any]]:
    return [json.loads(item) for item in recorder.client.lrange(recorder.key, 0, -1)]


STANDBY_SOURCE = """
import os

import dramatiq
from dramatiq.middleware import Retries
from harness import Gate, Recorder, WaitTimeout, broker_from_env

from dramatiq_guard.middleware.slots import Concurrency

broker = broker_from_env()
# lookahead=2: the key's standby window is the two waiters the test sends (a limit below 4 would
# otherwise keep 4 on the broker: a sweep could send waiters 2 and 3 ahead before 0 and 1 are
# picked up, and take the two seats the test counts on).
concurrency = Concurrency(
    lease_ttl=2_000, sweep_interval=200, standby_wait=60_000, standby_threads=2, lookahead=2
)
broker.add_middleware(concurrency, before=Retries)
rec = Recorder.from_env()


class PickedUp(dramatiq.Middleware):
    def before_process_message(self, broker, message):
        if message.actor_name == "standby_job":
            rec.record(phase="picked", n=message.args[0], pid=os.getpid())


broker.add_middleware(PickedUp(), before=Concurrency)
dramatiq.set_broker(broker)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "shared"}, max_retries=0, queue_name=QUEUE + "_a")
def hold(n):
    rec.record(phase="holding", n=n, pid=os.getpid())
    while True:  # each wait under redis-py's 5 s socket timeout
        try:
            Gate.from_env(QUEUE).wait(timeout=2)
            return
        except WaitTimeout:
            pass


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "shared"}, max_retries=0, queue_name=QUEUE + "_b")
def standby_job(n):
    with rec.track("shared"):
        rec.record(phase="ran", n=n, pid=os.getpid())
"""


def test_a_sigkilled_standby_loses_nothing_and_runs_once(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
) -> None:
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + STANDBY_SOURCE, broker_url=rabbitmq_url)
    dramatiq_worker("actors", threads=4, broker_url=rabbitmq_url, queues=[f"{queue}_a"])
    doomed = dramatiq_worker("actors", threads=4, broker_url=rabbitmq_url, queues=[f"{queue}_b"])
    module.hold.send(0)
    module.hold.send(1)
    assert {r["n"] for r in recorder.take(2)} == {0, 1}  # both slots held
    for n in range(5):
        module.standby_job.send(n)  # parked at enqueue
    # The next two waiters go to the broker ahead as standbys; the doomed worker picks them up,
    # and they block there for a slot.
    send_standbys(module.concurrency, module.broker, "concurrency:shared", 2)
    picked = recorder.take(2)
    assert {r["n"] for r in picked} == {0, 1} and {r["pid"] for r in picked} == {doomed.worker_pids[0]}
    kill(doomed.worker_pids[0])  # RabbitMQ redelivers the two unacked standbys
    dramatiq_worker("actors", threads=4, broker_url=rabbitmq_url, queues=[f"{queue}_b"])
    Gate(redisdb, queue).open(2)  # the holders finish: their slots go on

    def runs() -> Counter[int]:
        return Counter(r["n"] for r in _records(recorder) if r["phase"] == "ran")

    wait_until(lambda: sum(runs().values()) >= 5, timeout=60, what="every standby_job to run")
    assert runs() == Counter(range(5))  # each exactly once: the killed standbys never ran
    assert recorder.max_concurrency("shared") <= 2
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


LONG_JOB_SOURCE = """
import os
import time

import dramatiq
from dramatiq.middleware import AgeLimit, Retries
from harness import Recorder, broker_from_env

from dramatiq_guard.middleware.slots import Mutex

broker = broker_from_env()
rec = Recorder.from_env()


class PickedUp(dramatiq.Middleware):
    \"\"\"Records every message a worker takes off the broker (a standby that parks again included).\"\"\"

    def before_process_message(self, broker, message):
        rec.record(phase="picked", n=message.args[0])


broker.add_middleware(PickedUp(), before=AgeLimit)  # first: it sees what the guard skips
broker.add_middleware(Mutex(lease_ttl=2_000, sweep_interval=200, standby_wait=50), before=Retries)
dramatiq.set_broker(broker)


@dramatiq.actor(mutex={"on_busy": "park", "key": lambda n: "report"}, max_retries=0, queue_name=QUEUE)
def report(n):
    time.sleep(0.3)  # the job's own work: six times standby_wait
    rec.record(phase="ran", n=n)
"""


def test_jobs_longer_than_standby_wait_are_picked_up_once_each(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    unique_name: str,
) -> None:
    """Invariant: a broker pickup per message when a mutex's jobs outlast ``standby_wait``. A
    standby sent when such a job ends would block its thread ``standby_wait``, park again before
    the next slot frees, and be sent again by the next release (3.8 pickups per message, 1 s jobs
    and a 200 ms wait, before the release sent only the standbys expected to get a slot in time)."""
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + LONG_JOB_SOURCE)
    for n in range(6):
        module.report.send(n)  # the first reserves the mutex, the rest park
    dramatiq_worker("actors", threads=4, queues=[queue])
    records = recorder.take(12, timeout=60)
    assert [r["n"] for r in records if r["phase"] == "ran"] == list(range(6))  # FIFO, each once
    assert Counter(r["n"] for r in records if r["phase"] == "picked") == Counter(range(6))
    wait_for_redis_broker_drain(redisdb, [queue])
    assert _records(recorder) == []  # no pickup after those
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


PARK_KILL_SOURCE = """
import os
import signal

import dramatiq
from dramatiq.middleware import Retries
from harness import Gate, Recorder, broker_from_env

from dramatiq_guard.middleware.slots import Concurrency

broker = broker_from_env()
concurrency = Concurrency(lease_ttl=10_000, sweep_interval=200)
broker.add_middleware(concurrency, before=Retries)
rec = Recorder.from_env()


class SkippedThenDie(dramatiq.Middleware):
    # Records every skip; in a worker told to, then dies at once: after the park, before the ack.
    def after_skip_message(self, broker, message):
        rec.record(phase="skipped", n=message.args[0], pid=os.getpid())
        if os.environ.get("DIE_AFTER_PARK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)


broker.add_middleware(SkippedThenDie())
dramatiq.set_broker(broker)


@dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "one"}, max_retries=0, queue_name=QUEUE + "_hold")
def hold(n):
    rec.record(phase="holding", n=n)
    Gate.from_env(QUEUE).wait(timeout=60)


@dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "one"}, max_retries=0, queue_name=QUEUE)
def job(n):
    rec.record(phase="ran", n=n, pid=os.getpid())
"""


def test_a_worker_killed_after_a_park_before_the_ack_runs_the_message_once(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: Any,
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
) -> None:
    """Invariant: a message runs once, however many copies of it the broker and the lockwait hold.

    A worker picks up ``job(1)`` (sent without a reservation, as by a process without the guard),
    finds the key held, parks it and is SIGKILLed before the broker's ack: RabbitMQ delivers
    that copy again, and the holder's release hands the stored copy off. Both copies reach the
    next worker; the one delivered again is stale (skipped), the handed-off one runs, once.
    """
    queue = f"{unique_name}_q"
    module = actor_module(f"QUEUE = {queue!r}\n" + PARK_KILL_SOURCE, broker_url=rabbitmq_url)
    backend = module.concurrency.backend(module.broker)
    dramatiq_worker("actors", threads=2, broker_url=rabbitmq_url, queues=[f"{queue}_hold"])
    module.hold.send(0)
    wait_until(lambda: any(r["phase"] == "holding" for r in _records(recorder)), what="the key to be held")
    doomed = dramatiq_worker(
        "actors", threads=1, broker_url=rabbitmq_url, queues=[queue], env={"DIE_AFTER_PARK": "1"}
    )
    message = module.job.message(1)
    rabbitmq_broker.declare_queue(queue)
    rabbitmq_broker.enqueue(message)  # no reservation: decided at pickup
    wait_until(lambda: not pid_alive(doomed.worker_pids[0]), what="the worker to die after the park")
    assert [w for w, _, _ in backend.inspect("concurrency:one").waiters] == [message.message_id]
    Gate(redisdb, queue).open()  # the holder ends: its slot goes to the stored copy, re-enqueued

    def handed_off() -> bool:
        state = backend.inspect("concurrency:one")
        return (
            not state.waiters and not state.reserved and [h for h, _ in state.holders] == [message.message_id]
        )

    wait_until(handed_off, what="the stored copy to be handed the slot and re-enqueued")
    dramatiq_worker("actors", threads=4, broker_url=rabbitmq_url, queues=[queue])

    def outcomes() -> list[str]:
        return [
            r["phase"] for r in _records(recorder) if r.get("n") == 1 and r["phase"] in ("ran", "skipped")
        ]

    # The doomed worker's skip, then one outcome per copy on the next worker.
    wait_until(lambda: len(outcomes()) >= 3, timeout=60, what="both copies to be picked up")
    assert sorted(outcomes()) == ["ran", "skipped", "skipped"]
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)
