"""Deduplication across processes: a producer killed mid-send, a worker SIGKILLed mid-run.

Real Redis (the harness's private server) holds the guard state; the crash test
runs real ``dramatiq`` workers on RabbitMQ, which redelivers a killed worker's
messages as soon as its connection drops (a RedisBroker would wait 60 s).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Retries
from harness import DramatiqWorker, Recorder, wait_until

from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.middleware.dedup import Deduplication, deduplicated_by

REPO_ROOT = Path(__file__).resolve().parent.parent

PRODUCER = textwrap.dedent(
    """
    import json, os, signal, sys
    import dramatiq
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import Retries
    from dramatiq_guard.gate import gate_for
    from dramatiq_guard.middleware.dedup import Deduplication

    broker = StubBroker()
    broker.add_middleware(Deduplication(redis=sys.argv[1], pending_ttl=1_000), before=Retries)

    @dramatiq.actor(broker=broker, actor_name="refresh", dedup="until_executed")
    def refresh(user_id): ...

    def die_before_pushing(message, *, delay=None):
        print(json.dumps({"holder": message.message_id, "key": message.options["dedup_lock"]}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    gate_for(broker).original = die_before_pushing
    refresh.send(1)
    """
)


def test_a_producer_killed_between_lock_and_push_leaves_a_lock_that_lapses_in_seconds(
    redis_url: str, redisdb: redis.Redis, restore_global_broker: None
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", PRODUCER, redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    took = json.loads(child.stdout)

    backend = RedisBackend(redisdb)
    state = backend.inspect(took["key"]).holders
    # Still pending, or lapsed already; never held for the hour-long ttl.
    assert all(
        holder == took["holder"] and deadline < time.time() * 1000 + 5_000 for holder, deadline in state
    )

    broker = StubBroker()
    broker.add_middleware(Deduplication(redis=backend), before=Retries)

    @dramatiq.actor(broker=broker, actor_name="refresh", dedup="until_executed")
    def refresh(user_id: int) -> None: ...

    wait_until(
        lambda: backend.inspect(took["key"]).holders == (),
        15,
        "the pending lock to lapse",
        redis=redisdb,
        keys=["*"],
    )
    assert deduplicated_by(refresh.send(1)) is None
    assert broker.queues["default"].qsize() == 1


ACTORS = """
import dramatiq
from dramatiq.middleware import Retries
from harness import Gate, Recorder, broker_from_env

from dramatiq_guard.middleware.dedup import Deduplication

broker = broker_from_env()
dedup = Deduplication()  # guard state: DRAMATIQ_GUARD_REDIS_URL (set by the harness)
broker.add_middleware(dedup, before=Retries)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(queue_name="{queue}", dedup="until_executed", max_retries=0)
def refresh(user_id):
    rec.record(event="start", user_id=user_id)
    Gate.from_env("{gate}").wait()
    rec.record(event="done", user_id=user_id)
"""


def test_a_worker_killed_mid_run_lets_no_duplicate_in_until_the_redelivered_holder_finishes(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    unique_name: str,
    recorder: Recorder,
    redisdb: redis.Redis,
) -> None:
    gate = f"{unique_name}_gate"
    actors = actor_module(ACTORS.format(queue=f"{unique_name}_q", gate=gate), broker_url=rabbitmq_url)
    holder = actors.refresh.send(1)
    key = holder.options["dedup_lock"]
    backend = RedisBackend(redisdb)

    first = dramatiq_worker("actors", broker_url=rabbitmq_url)
    assert recorder.take_one()["event"] == "start"
    first.kill_worker()  # SIGKILL, inside the actor
    assert deduplicated_by(actors.refresh.send(1)) == holder.message_id

    dramatiq_worker("actors", broker_url=rabbitmq_url)
    assert recorder.take_one()["event"] == "start"  # the redelivered holder
    assert deduplicated_by(actors.refresh.send(1)) == holder.message_id
    recorder.gate(gate).open()
    assert recorder.take_one()["event"] == "done"
    wait_until(lambda: backend.inspect(key).holders == (), 15, "the release", redis=redisdb)

    recorder.gate(gate).open()
    assert deduplicated_by(actors.refresh.send(1)) is None
    assert [r["event"] for r in recorder.take(2)] == ["start", "done"]
