"""The failure model with real ``dramatiq`` worker processes: two applications on one guard Redis,
and a re-enqueue slower than the hand-off reservation (DESIGN §5).

Invariants, checked after every message ran:
  * a key's limit is never exceeded, whichever application's process sweeps it;
  * a parked message goes back to the broker it came from, never another application's;
  * a parked message starts exactly once, however slow the push of its hand-off.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import redis
from harness import DramatiqWorker, Recorder, wait_until

Start = Callable[..., DramatiqWorker]

APP_A = """
import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from harness import Recorder

import dramatiq_guard

broker = RedisBroker(url={broker_url!r})
dramatiq_guard.install(broker, redis={guard_url!r}, sweep_interval=200, lease_ttl=3_000)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(concurrency={{"limit": 1, "key": lambda n: "shared"}}, max_retries=0)
def a_job(n):
    rec.record(app="a", phase="start", n=n)
    with rec.track("a-shared"):
        time.sleep(0.05)  # the job's own work
    rec.record(app="a", phase="end", n=n)
"""

APP_B = """
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from harness import Recorder

import dramatiq_guard

broker = RedisBroker(url={broker_url!r})
dramatiq_guard.install(broker, redis={guard_url!r}, sweep_interval=100, lease_ttl=3_000)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


# Another application's actors: a larger limit on keys from a callable, the shape that made a
# sweep guess a limit for keys it did not know.
@dramatiq.actor(concurrency={{"limit": 5, "key": lambda n: "mine"}}, max_retries=0)
def b_job(n):
    rec.record(app="b", phase="start", n=n)
"""


def _records(recorder: Recorder) -> list[dict[str, Any]]:
    return [json.loads(item) for item in recorder.client.lrange(recorder.key, 0, -1)]


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


def test_two_applications_on_one_guard_redis_keep_their_limits_and_their_messages(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """App B's workers sweep app A's key (default namespace on a shared guard Redis): they must
    neither hand A's waiters on with a limit guessed from B's actors nor re-enqueue them on B's
    broker. A's 8 messages all run, on A, one at a time."""
    a_broker, b_broker = _db(redis_url, 1), _db(redis_url, 2)
    (tmp_path / "app_b.py").write_text(APP_B.format(broker_url=b_broker, guard_url=redis_url))
    dramatiq_worker("app_b", threads=4)  # sweeping before A's messages park
    app_a = actor_module(APP_A.format(broker_url=a_broker, guard_url=redis_url), "app_a")
    sent = 8
    for n in range(sent):
        app_a.a_job.send(n)
    dramatiq_worker("app_a", threads=4)

    def all_ran() -> bool:
        return {r["n"] for r in _records(recorder) if r["app"] == "a" and r["phase"] == "end"} == set(
            range(sent)
        )

    wait_until(all_ran, timeout=60, what="A's messages to run")
    records = _records(recorder)
    assert recorder.max_concurrency("a-shared") == 1
    assert Counter(r["n"] for r in records if r["app"] == "a" and r["phase"] == "start") == dict.fromkeys(
        range(sent), 1
    )
    assert not [r for r in records if r["app"] == "b"]  # nothing of A's ran as B's
    b_client = redis.Redis.from_url(b_broker)
    try:
        assert [k for k in b_client.scan_iter(b"dramatiq:*") if b"msgs" in k and b_client.hlen(k)] == []
    finally:
        b_client.close()


SLOW_PUSH = """
import os
import threading
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from harness import Recorder

import dramatiq_guard
from dramatiq_guard.backends import RedisBackend


class SlowFirstPush(dramatiq.Middleware):
    '''A broker that blocks a worker's first push of each message longer than the hand-off
    reservation (a RabbitMQ memory alarm, a long GC pause): the fault under test.'''

    def __init__(self):
        self.seen = set()
        self.lock = threading.Lock()

    def before_enqueue(self, broker, message, delay):
        with self.lock:
            first = message.message_id not in self.seen
            self.seen.add(message.message_id)
        if first and os.environ.get("SLOW_PUSH") == "1":
            time.sleep(1.5)  # three times the reservation below


broker = RedisBroker(url={broker_url!r})
broker.add_middleware(SlowFirstPush())
backend = RedisBackend.from_url({guard_url!r}, handoff_ttl_ms=500)
dramatiq_guard.install(broker, redis=backend, sweep_interval=100, lookahead=0)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(concurrency={{"limit": 1, "key": lambda n: "slow"}}, max_retries=0)
def job(n):
    rec.record(phase="start", n=n, pid=os.getpid())
    with rec.track("slow"):
        time.sleep(0.02)
    rec.record(phase="end", n=n)
"""


def test_a_push_slower_than_the_reservation_never_runs_a_message_twice(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redis_url: str,
) -> None:
    """Every hand-off's push stalls three times its reservation: the reservation lapses, the sweep
    hands the same parked message out again, and both copies reach the broker. Exactly one of
    them runs; the limit of 1 holds."""
    module = actor_module(SLOW_PUSH.format(broker_url=_db(redis_url, 3), guard_url=redis_url), "slow_app")
    sent = 5
    for n in range(sent):
        module.job.send(n)
    dramatiq_worker("slow_app", threads=4, env={"SLOW_PUSH": "1"})

    def all_ran() -> bool:
        return {r["n"] for r in _records(recorder) if r["phase"] == "end"} == set(range(sent))

    wait_until(all_ran, timeout=90, what="every message to run")
    broker_client = redis.Redis.from_url(_db(redis_url, 3))
    try:
        # The stale copies are on the broker too: wait until it has handed out everything.
        wait_until(
            lambda: all(not broker_client.hlen(k) for k in broker_client.scan_iter(b"dramatiq:*.msgs")),
            timeout=60,
            what="the broker to drain (stale copies included)",
        )
    finally:
        broker_client.close()
    starts = Counter(r["n"] for r in _records(recorder) if r["phase"] == "start")
    assert starts == dict.fromkeys(range(sent), 1)
    assert recorder.max_concurrency("slow") == 1
