"""The mutex, and a list of concurrency limits, on RabbitMQ with a real ``dramatiq`` worker (2 x 4).

The guard state lives in the harness's Redis (``DRAMATIQ_GUARD_REDIS_URL``,
which ``install()`` uses for a broker that is not a RedisBroker). Parked
messages leave RabbitMQ and are re-published on hand-off; blocking waiters
hold a worker thread (and so an unacked delivery) while they wait.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import redis
from harness import DramatiqWorker, Recorder, guard_leftovers, wait_until
from harness.proxy import SilentProxy

ACTORS = """
import dramatiq
from harness import Recorder, broker_from_env

import dramatiq_guard

broker = broker_from_env()
dramatiq_guard.install(broker, lease_ttl=2_000, sweep_interval=200)  # guard state: DRAMATIQ_GUARD_REDIS_URL
dramatiq.set_broker(broker)
rec = Recorder.from_env()


def run(n):
    with rec.track("one") as running:
        rec.record(n=n, running=running, token=dramatiq_guard.current_lease().token)


@dramatiq.actor(queue_name={queue!r}, mutex={{"on_busy": "park", "key": lambda n: "one"}}, max_retries=0)
def parking(n):
    run(n)


@dramatiq.actor(
    queue_name={queue!r}, mutex={{"on_busy": "wait", "wait": 60_000, "key": lambda n: "one"}}, max_retries=0
)
def waiting(n):
    run(n)


@dramatiq.actor(
    queue_name={queue!r},
    concurrency=[{{"limit": 3, "key": lambda tenant, n: "all"}}, {{"limit": 1, "key": ["tenant"]}}],
    max_retries=0,
)
def per_tenant(tenant, n):
    with rec.track("all"), rec.track(f"tenant:{{tenant}}"):
        rec.record(tenant=tenant, n=n)
"""


@pytest.fixture
def actors(
    actor_module: Callable[..., ModuleType], rabbitmq_url: str, rabbitmq_broker: Any, unique_name: str
) -> ModuleType:
    return actor_module(ACTORS.format(queue=f"{unique_name}_q"), broker_url=rabbitmq_url)


def drained(worker: DramatiqWorker, recorder: Recorder, redisdb: redis.Redis) -> None:
    """Nothing of the guard is left; a graceful stop finishes what is in flight; nothing ran twice."""
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)
    assert worker.stop() == 0
    assert recorder.pending() == 0, "a message ran more than once"


@pytest.mark.parametrize("actor", ["parking", "waiting"])
def test_a_mutex_on_rabbitmq_never_runs_two_at_once_and_runs_every_message(
    actor: str,
    actors: ModuleType,
    dramatiq_worker: Callable[..., DramatiqWorker],
    rabbitmq_url: str,
    recorder: Recorder,
    redisdb: redis.Redis,
) -> None:
    send = getattr(actors, actor).send
    for n in range(10):  # before any worker: parked at enqueue (park), or queued (wait)
        send(n)
    worker = dramatiq_worker("actors", broker_url=rabbitmq_url, processes=2, threads=4)
    for n in range(10, 40):
        send(n)
    records = recorder.take(40, timeout=90)
    assert sorted(r["n"] for r in records) == list(range(40))
    assert recorder.max_concurrency("one") == 1
    tokens = [r["token"] for r in records]
    assert tokens == sorted(tokens)  # each holder's fencing token is above the one before
    drained(worker, recorder, redisdb)


def test_a_list_of_concurrency_limits_on_rabbitmq_holds_each_one(
    actors: ModuleType,
    dramatiq_worker: Callable[..., DramatiqWorker],
    rabbitmq_url: str,
    recorder: Recorder,
    redisdb: redis.Redis,
) -> None:
    """Three in all and one per tenant; parked messages leave RabbitMQ and come back, once each."""
    tenants = ("t0", "t1", "t2", "t3")
    for n in range(3):  # before any worker: parked at enqueue on the first limit that refuses
        for tenant in tenants:
            actors.per_tenant.send(tenant, n)
    worker = dramatiq_worker("actors", broker_url=rabbitmq_url, processes=2, threads=4)
    for tenant in tenants:
        actors.per_tenant.send(tenant, 3)
    records = recorder.take(16, timeout=90)
    assert sorted((r["tenant"], r["n"]) for r in records) == [(t, n) for t in tenants for n in range(4)]
    assert recorder.max_concurrency("all") <= 3
    assert all(recorder.max_concurrency(f"tenant:{tenant}") == 1 for tenant in tenants)
    drained(worker, recorder, redisdb)


REDELIVERY_ACTORS = """
import dramatiq
from dramatiq.middleware import Middleware
from harness import Gate, Recorder, broker_from_env

import dramatiq_guard

rec = Recorder.from_env()


class RecordSkips(Middleware):
    def after_skip_message(self, broker, message):
        rec.record(skipped=message.message_id)


broker = broker_from_env()
broker.add_middleware(RecordSkips())
dramatiq_guard.install(broker, lease_ttl=2_000)  # guard state: DRAMATIQ_GUARD_REDIS_URL
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name={queue!r}, mutex={{"key": lambda: "one"}}, max_retries=0)
def report():
    with rec.track("one"):
        rec.record(started=True)
        Gate.from_env("finish").wait(timeout=120)
    rec.record(finished=True)
"""


def test_a_message_rabbitmq_delivers_again_while_it_runs_does_not_run_beside_itself(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
    recorder: Recorder,
) -> None:
    """RabbitMQ redelivers a message whose consumer's connection was lost, while the actor still
    runs in that worker: the second copy is deferred (sent again once the first's lease would
    lapse, no retry consumed: the actor has none), and runs only once the first released the mutex. Without
    runners, it took the slot its own message held (a re-entrant acquire) and ran beside it."""
    host, port = rabbitmq_url.rsplit("@", 1)[1].split("/", 1)[0].split(":")
    with SilentProxy(host, int(port)) as proxy:
        via_proxy = rabbitmq_url.replace(f"@{host}:{port}", f"@{proxy.host}:{proxy.port}")
        actors = actor_module(REDELIVERY_ACTORS.format(queue=f"{unique_name}_q"), broker_url=rabbitmq_url)
        first = dramatiq_worker("actors", broker_url=via_proxy, threads=2)
        actors.report.send()
        started = recorder.take_one(timeout=60)
        assert started["started"] and started["pid"] in first.worker_pids
        second = dramatiq_worker("actors", broker_url=rabbitmq_url, threads=2)
        proxy.close()  # the first worker's connection is gone: RabbitMQ delivers the message again
        deferred = recorder.take_one(timeout=60)
        assert deferred.get("skipped") and deferred["pid"] in second.worker_pids, deferred
        recorder.gate("finish").open(2)  # the first run ends and releases; then the deferred copy runs
        runs: list[dict[str, Any]] = []
        while sum(1 for r in runs if r.get("finished")) < 2:  # further deferrals come in between
            record = recorder.take_one(timeout=60)
            if "skipped" not in record:
                runs.append(record)
    assert [(r.get("started", False), r["pid"] in first.worker_pids) for r in runs] == [
        (False, True),  # the first copy finished in the first worker...
        (True, False),  # ...before the second started, in the second worker
        (False, False),
    ]
    assert recorder.max_concurrency("one") == 1
