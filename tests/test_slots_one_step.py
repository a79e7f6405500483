"""A concurrency (or parking mutex) send on a RedisBroker that shares the guard's Redis: the
reservation and the push in one script, or the park and no push.

What a user relies on: a send under the limit is one round trip and leaves the message on the
broker's queue with its reservation (both or neither); a send over the limit parks without touching
the queue and ``send()`` returns normally; a worker runs them all, never over the limit; other
middleware's enqueue hooks run once per pushed message; where another guard decides about the
actor, or the layout is not one the guard knows, or the backend cannot, sends take two steps and
nothing is lost; an unreachable backend fails the send closed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from harness import wait_until
from harness.one_step import EnqueueHooks as Hooks
from harness.one_step import command_counts as calls

import dramatiq_guard
from dramatiq_guard.backends import GuardBackend, RedisBackend, redis_enqueue
from dramatiq_guard.backends.values import Enqueue, Stake
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.middleware.dedup import Deduplication

WAIT = 10.0


def scripts(client: redis.Redis) -> int:
    counts = calls(client)
    return counts.get("fcall", 0) + counts.get("evalsha", 0)


def queued_ids(client: redis.Redis, queue: str = "default") -> list[str]:
    """The message ids on the broker's queue (from its message hash)."""
    return [json.loads(m)["message_id"] for m in client.hvals(f"dramatiq:{queue}.msgs")]


def holders(client: redis.Redis, key: str) -> set[str]:
    """The holders of concurrency key ``key``: here, messages that reserved their slot at send."""
    found = client.zrange(f"dramatiq-guard:{{concurrency:{key}}}:holders", 0, -1)
    return {cast(bytes, h).decode() for h in found}


def parked(client: redis.Redis, key: str) -> set[str]:
    """The waiters of concurrency key ``key`` with a stored payload: its parked messages."""
    found = client.hkeys(f"dramatiq-guard:{{concurrency:{key}}}:payloads")
    return {cast(bytes, w).decode() for w in found}


def test_a_send_under_the_limit_is_one_script_that_enqueues_the_message_with_its_reservation(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(concurrency={"limit": 100, "key": lambda n: "k"}, queue_name="default")
    def job(n: int) -> None: ...

    job.send(0)  # the first send probes the layout once
    redisdb.config_resetstat()
    sent = [job.send(n) for n in range(1, 21)]

    counts = calls(redisdb)
    assert scripts(redisdb) == 20 and counts.get("rpush") == 20  # one script per send, with the push
    ids = [m.message_id for m in sent]
    assert set(ids) < set(queued_ids(redisdb)) and len(queued_ids(redisdb)) == 21
    assert holders(redisdb, "k") == set(queued_ids(redisdb))  # each with its reservation
    assert [m for when, m in hooks.seen if when == "before"][-20:] == ids
    assert [m for when, m in hooks.seen if when == "after"][-20:] == ids


def test_a_parking_mutex_send_is_one_script_too(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(mutex={"on_busy": "park"}, queue_name="default")
    def job(n: int) -> None: ...

    job.send(0)
    redisdb.config_resetstat()
    for n in range(1, 11):
        job.send(n)
    assert scripts(redisdb) == 10 and calls(redisdb).get("rpush") == 10
    assert len(queued_ids(redisdb)) == 11


def test_sends_over_the_limit_park_without_touching_the_queue(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(concurrency={"limit": 3, "key": lambda n: "k"}, queue_name="default")
    def job(n: int) -> None: ...

    pushed = [job.send(n) for n in range(3)]
    redisdb.config_resetstat()
    over = [job.send(n) for n in range(3, 13)]  # send() returns normally

    assert scripts(redisdb) == 10 and "rpush" not in calls(redisdb) and "hset" in calls(redisdb)
    assert sorted(queued_ids(redisdb)) == sorted(m.message_id for m in pushed)
    assert holders(redisdb, "k") == {m.message_id for m in pushed}
    assert parked(redisdb, "k") == {m.message_id for m in over}
    assert not any(("after", m.message_id) in hooks.seen for m in over)  # not pushed: no after-hook


def test_a_worker_runs_them_all_never_over_the_limit(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    lock, running, most, ran = threading.Lock(), [0], [0], []

    @dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "k"}, queue_name="default", max_retries=0)
    def job(n: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
            ran.append(n)

    for n in range(6):
        job.send(n)
    assert len(queued_ids(redisdb)) == 2 and len(parked(redisdb, "k")) == 4
    worker = dramatiq.Worker(redis_broker, worker_threads=4, worker_timeout=50)
    worker.start()
    try:
        wait_until(lambda: ran, timeout=WAIT, what="a first message ran")
        for n in range(6, 12):  # while hand-offs are under way: the whole acquire script decides
            job.send(n)
        wait_until(lambda: len(ran) == 12, timeout=WAIT * 3, what="every message ran")
    finally:
        worker.stop()
    assert sorted(ran) == list(range(12)) and most[0] <= 2
    wait_until(lambda: not holders(redisdb, "k") and not parked(redisdb, "k"), timeout=WAIT)


def test_the_whole_acquire_script_pushes_what_it_reserves_and_nothing_else(
    redis_broker: RedisBroker, redisdb: redis.Redis
) -> None:
    """Past the fast path (a lapsed holder to reclaim first): reserved and pushed, or parked."""
    backend = RedisBackend(redisdb)
    key = "concurrency:k"

    def push(rid: str) -> Enqueue:
        message: dramatiq.Message[Any] = dramatiq.Message("default", "job", (), {}, {"redis_message_id": rid})
        return Enqueue(redis_broker, "default", rid, message.encode())

    backend.acquire(Stake(key, "lapsed", 1, 1))
    wait_until(
        lambda: all(deadline <= backend.now_ms() for _, deadline in backend.inspect(key).holders),
        timeout=WAIT,
        what="the 1 ms holder lapsed",
    )
    result = backend.reserve_and_enqueue(Stake(key, "first", 1, 60_000), push("r1"))
    assert result is not None and result.acquired
    assert holders(redisdb, "k") == {"first"} and redisdb.lrange("dramatiq:default", 0, -1) == [b"r1"]
    stored = cast(bytes, redisdb.hget("dramatiq:default.msgs", "r1"))
    assert json.loads(stored)["options"]["redis_message_id"] == "r1"

    second = push("r2")
    result = backend.reserve_and_enqueue(Stake(key, "second", 1, 60_000), second)
    assert result is not None and result.parked and parked(redisdb, "k") == {"second"}
    assert redisdb.llen("dramatiq:default") == 1 and redisdb.hlen("dramatiq:default.msgs") == 1
    [handoff] = backend.release(key, "first", limit=1).handoffs  # "second" is handed the slot
    assert handoff.payload == second.data  # the payload parked is the message pushed


def test_an_actor_with_dedup_too_takes_the_two_step_path(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    concurrency = {"limit": 5, "key": lambda n: "k"}

    @dramatiq.actor(dedup="until_executed", concurrency=concurrency, queue_name="default")
    def job(n: int) -> None: ...

    job.send(1)
    redisdb.config_resetstat()
    job.send(2)
    assert calls(redisdb).get("evalsha", 0) == 1  # the broker's own push, after the guards' calls
    assert len(queued_ids(redisdb)) == 2 and holders(redisdb, "k") == set(queued_ids(redisdb))
    for middleware in redis_broker.middleware:
        if isinstance(middleware, Deduplication):
            middleware.flush()  # the pending locks' confirmations, before the server goes


def test_a_fail_open_policy_takes_the_two_step_path(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(concurrency={"limit": 5, "key": lambda n: "k", "fail_open": True}, queue_name="default")
    def job(n: int) -> None: ...

    job.send(1)
    redisdb.config_resetstat()
    job.send(2)
    assert calls(redisdb).get("evalsha", 0) == 1 and calls(redisdb).get("fcall", 0) == 1
    assert holders(redisdb, "k") == set(queued_ids(redisdb))


def test_a_backend_that_cannot_decide_in_one_step_takes_two_and_loses_nothing(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RedisBackend, "reserve_and_enqueue", GuardBackend.reserve_and_enqueue)

    @dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "k"}, queue_name="default")
    def job(n: int) -> None: ...

    sent = [job.send(n) for n in range(5)]
    assert sorted(queued_ids(redisdb)) == sorted(m.message_id for m in sent[:2])
    assert holders(redisdb, "k") == {m.message_id for m in sent[:2]}
    assert parked(redisdb, "k") == {m.message_id for m in sent[2:]}


def test_an_unreachable_backend_fails_the_send_closed_and_leaves_nothing(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    @dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "k"}, queue_name="default")
    def job(n: int) -> None: ...

    job.send(0)

    def unreachable(self: RedisBackend, *args: Any) -> None:
        raise BackendUnavailable("redis is down")

    monkeypatch.setattr(RedisBackend, "reserve_and_enqueue", unreachable)
    with pytest.raises(BackendUnavailable):
        job.send(1)
    assert len(queued_ids(redisdb)) == 1 and len(holders(redisdb, "k")) == 1 and not parked(redisdb, "k")


@pytest.mark.parametrize("unknown", ["version", "probe"])
def test_a_layout_the_guard_does_not_know_takes_two_steps_and_loses_nothing(
    redis_url: str,
    redisdb: redis.Redis,
    restore_global_broker: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    unknown: str,
) -> None:
    class OtherLayout(RedisBroker):
        """A broker that keeps its messages under other names than Dramatiq's own."""

        def do_fetch(self, queue_name: str, prefetch: int) -> list[bytes]:
            return []

    if unknown == "version":
        monkeypatch.setattr(redis_enqueue, "KNOWN_DRAMATIQ", ())
    broker = (RedisBroker if unknown == "version" else OtherLayout)(url=redis_url)  # type: ignore[no-untyped-call]
    dramatiq.set_broker(broker)
    dramatiq_guard.install(broker)
    ran: list[int] = []

    @dramatiq.actor(concurrency={"limit": 3, "key": lambda n: "k"}, queue_name="default")
    def job(n: int) -> None:
        ran.append(n)

    with caplog.at_level(logging.WARNING, logger="dramatiq_guard.backends.redis"):
        sent = [job.send(n) for n in range(5)]
    assert "take two steps" in caplog.text
    assert sorted(queued_ids(redisdb)) == sorted(m.message_id for m in sent[:3])
    assert holders(redisdb, "k") == set(queued_ids(redisdb))
    assert parked(redisdb, "k") == {m.message_id for m in sent[3:]}
    assert not redisdb.keys("dramatiq:dramatiq-guard-probe-*")
    if unknown == "version":  # the probe's broker is the real one: run them
        worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=50)
        worker.start()
        try:
            wait_until(lambda: len(ran) == 5, timeout=WAIT * 3, what="every message ran")
        finally:
            worker.stop()
        assert sorted(ran) == [0, 1, 2, 3, 4]


PRODUCER = """
import sys, dramatiq, dramatiq_guard
from dramatiq.brokers.redis import RedisBroker
broker = RedisBroker(url=sys.argv[1])
dramatiq_guard.install(broker)
dramatiq.set_broker(broker)

@dramatiq.actor(concurrency={"limit": 200, "key": lambda n: "burst"}, queue_name="burst")
def job(n): ...

job.send(-1)
print("ready", flush=True)
n = 0
while True:
    job.send(n)
    print(n, flush=True)
    n += 1
"""


def test_producers_killed_mid_burst_leave_every_reservation_with_its_message_and_no_message_alone(
    redis_url: str, redisdb: redis.Redis, tmp_path: Any
) -> None:
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    env = {**os.environ, "PYTHONPATH": str(Path(dramatiq_guard.__file__).parent.parent)}  # this checkout's
    confirmed: set[int] = set()
    for kill in range(4):  # 200 reserve and are pushed, the rest park
        process = subprocess.Popen(
            [sys.executable, str(script), redis_url], stdout=subprocess.PIPE, text=True, env=env
        )
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        for _ in range(50 + 37 * kill):  # a different instant each time
            confirmed.add(int(process.stdout.readline()))
        process.send_signal(signal.SIGKILL)
        process.wait()

    messages = [json.loads(m) for m in redisdb.hvals("dramatiq:burst.msgs")]
    on_queue = {m["message_id"] for m in messages}
    assert len(messages) == 200 and redisdb.llen("dramatiq:burst") == 200  # the limit, exactly
    assert holders(redisdb, "burst") == on_queue  # every reservation has its message, and no message is alone
    waiting = parked(redisdb, "burst")
    assert not waiting & on_queue  # a message is on the queue or parked, never both
    stored = [json.loads(p) for p in redisdb.hvals("dramatiq-guard:{concurrency:burst}:payloads")]
    sends = [m["args"][0] for m in messages] + [p["args"][0] for p in stored]
    assert confirmed <= set(sends)  # every send that returned is on the queue or parked


def test_a_one_step_send_run_again_after_its_reply_was_lost_pushes_one_copy(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    # redis-py tries a call again when its reply is lost (its retry): the script runs twice. The
    # second run finds the lock or reservation its first run took, and the message already pushed.
    dedup = next(m for m in redis_broker.middleware if isinstance(m, Deduplication))
    backend = dedup.backend(redis_broker)
    lock = Enqueue(redis_broker, "default", "lock-push", b"{}")
    locked = [backend.lock_and_enqueue("dedup:k", "m1", ttl_ms=60_000, info="job", push=lock) for _ in "ab"]
    assert [r is not None and r.acquired for r in locked] == [True, True]
    reserve = Enqueue(redis_broker, "default", "reserve-push", b"{}")
    stake = Stake("concurrency:k", "m2", limit=1, ttl_ms=60_000)
    reserved = [backend.reserve_and_enqueue(stake, reserve) for _ in "ab"]
    assert [r is not None and r.acquired for r in reserved] == [True, True]
    assert redisdb.lrange("dramatiq:default", 0, -1) == [b"lock-push", b"reserve-push"]
