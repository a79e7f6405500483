"""A dedup send on a RedisBroker that shares the guard's Redis: the lock and the push in one script.

What a user relies on: an accepted send is one round trip and leaves the message on the broker's
queue with its lock (both or neither); a duplicate never touches the queue; a message written so is
one the broker fetches, runs and acks like its own; other middleware's enqueue hooks run once per
message; where the layout is not one the guard knows, sends take two steps and nothing is lost.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware, Retries
from harness import wait_until
from harness.one_step import EnqueueHooks as Hooks
from harness.one_step import command_counts as calls

import dramatiq_guard
from dramatiq_guard.backends import redis_enqueue
from dramatiq_guard.middleware.dedup import LOCK_OPTION, Deduplication, DuplicateMessage, deduplicated_by

WAIT = 10.0


def queued(client: redis.Redis, queue: str = "default") -> int:
    return int(client.llen(f"dramatiq:{queue}"))


def locks(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter("dramatiq-guard:{dedup:*}:holders"))


def test_an_accepted_send_is_one_script_that_enqueues_the_message_with_its_lock(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job(n: int) -> None: ...

    job.send(0)  # the first send probes the layout once
    redisdb.config_resetstat()
    sent = [job.send(n) for n in range(1, 21)]

    counts = calls(redisdb)
    assert counts.get("fcall", 0) + counts.get("evalsha", 0) == 20  # one script per send
    writes = {name: counts.get(name) for name in ("rpush", "hsetnx", "hset")}
    assert writes == {"rpush": 20, "hsetnx": 20, "hset": 20}  # the message (once), the lock's info
    assert queued(redisdb) == 21 and len(locks(redisdb)) == 21
    assert all(m.options[LOCK_OPTION] for m in sent)
    ids = [m.message_id for m in sent]
    assert [m for when, m in hooks.seen if when == "before"][-20:] == ids
    assert [m for when, m in hooks.seen if when == "after"][-20:] == ids


def test_a_duplicate_never_touches_the_queue_and_the_broker_runs_and_acks_the_holder(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    ran: list[int] = []
    started, finish = threading.Event(), threading.Event()

    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job(n: int) -> None:
        started.set()
        finish.wait(WAIT)
        ran.append(n)

    first = job.send(7)
    redisdb.config_resetstat()
    duplicates = [job.send(7) for _ in range(10)]
    assert [deduplicated_by(d) for d in duplicates] == [first.message_id] * 10
    assert queued(redisdb) == 1 and "rpush" not in calls(redisdb)
    assert ("after", duplicates[0].message_id) not in hooks.seen  # not pushed: no after-hook

    worker = dramatiq.Worker(redis_broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        assert started.wait(WAIT)
        assert deduplicated_by(job.send(7)) == first.message_id  # still held while it runs
        finish.set()
        redis_broker.join("default", timeout=int(WAIT * 1000))
        worker.join()
    finally:
        worker.stop()
    assert ran == [7]
    wait_until(lambda: not locks(redisdb), timeout=WAIT)
    assert redisdb.hlen("dramatiq:default.msgs") == 0  # acked by the broker like its own
    assert deduplicated_by(job.send(7)) is None  # free again


def test_on_duplicate_raise_raises_from_the_one_step_send(redis_broker: RedisBroker, hooks: Hooks) -> None:
    @dramatiq.actor(dedup={"strategy": "until_executed", "on_duplicate": "raise"})
    def job() -> None: ...

    first = job.send()
    with pytest.raises(DuplicateMessage) as raised:
        job.send()
    assert raised.value.holder == first.message_id


def test_a_duplicate_is_logged_at_debug_as_dramatiqs_own_enqueue(
    redis_broker: RedisBroker, hooks: Hooks, caplog: pytest.LogCaptureFixture
) -> None:
    """A duplicate is an expected outcome of a send (the metrics count it): it is logged at DEBUG, as
    Dramatiq logs its own enqueues, not at INFO, the level the ``dramatiq`` command runs at."""

    @dramatiq.actor(dedup="until_executed")
    def job() -> None: ...

    first = job.send()
    with caplog.at_level(logging.INFO, logger="dramatiq_guard"):
        assert deduplicated_by(job.send()) == first.message_id
    assert not [r for r in caplog.records if r.name == "dramatiq_guard.dedup"]
    with caplog.at_level(logging.DEBUG, logger="dramatiq_guard.dedup"):
        assert deduplicated_by(job.send()) == first.message_id
    [logged] = [r for r in caplog.records if r.name == "dramatiq_guard.dedup"]
    assert logged.levelno == logging.DEBUG and first.message_id in logged.getMessage()


def test_a_delayed_send_including_scheduled_goes_to_the_delay_queue_with_its_lock(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    ran = threading.Event()

    @dramatiq.actor(dedup={"strategy": "until_executed", "including_scheduled": True}, queue_name="default")
    def job() -> None:
        ran.set()

    job.send_with_options(delay=200)
    assert deduplicated_by(job.send_with_options(delay=200)) is not None
    assert redisdb.llen("dramatiq:default.DQ") == 1 and queued(redisdb) == 0
    worker = dramatiq.Worker(redis_broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        assert ran.wait(WAIT)
    finally:
        worker.stop()
    wait_until(lambda: not locks(redisdb), timeout=WAIT)


def test_an_actor_with_a_slots_guard_too_takes_the_two_step_path(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(dedup="until_executed", concurrency=1, queue_name="default")
    def job(n: int) -> None: ...

    job.send(1)
    redisdb.config_resetstat()
    job.send(2)
    assert calls(redisdb).get("evalsha", 0) == 1  # the broker's own push, after the guards' calls
    assert queued(redisdb) == 2


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

    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job(n: int) -> None:
        ran.append(n)

    with caplog.at_level(logging.WARNING, logger="dramatiq_guard.backends.redis"):
        first = [job.send(n) for n in range(5)]
    assert "take two steps" in caplog.text
    assert all(deduplicated_by(job.send(n)) == m.message_id for n, m in enumerate(first))
    assert queued(redisdb) == 5 and not redisdb.keys("dramatiq:dramatiq-guard-probe-*")
    if unknown == "version":  # the probe's broker is the real one: run them
        worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=50)
        worker.start()
        try:
            broker.join("default", timeout=int(WAIT * 1000))
        finally:
            worker.stop()
        assert sorted(ran) == [0, 1, 2, 3, 4]


def test_a_broker_on_another_redis_database_takes_two_steps(
    redis_url: str, redisdb: redis.Redis, restore_global_broker: None
) -> None:
    broker = RedisBroker(url=redis_url.rsplit("/", 1)[0] + "/1")
    dramatiq.set_broker(broker)
    dedup = Deduplication(redis=redis_url)
    broker.add_middleware(dedup, before=Retries)

    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job() -> None: ...

    job.send()
    assert deduplicated_by(job.send()) is not None
    assert not dedup.backend(broker).enqueues_on(broker)
    broker.client.flushdb()


PRODUCER = """
import sys, dramatiq, dramatiq_guard
from dramatiq.brokers.redis import RedisBroker
broker = RedisBroker(url=sys.argv[1])
dramatiq_guard.install(broker)
dramatiq.set_broker(broker)

@dramatiq.actor(dedup="until_executed", queue_name="burst")
def job(n): ...

job.send(-1)
print("ready", flush=True)
n = 0
while True:
    job.send(n)
    print(n, flush=True)
    n += 1
"""


def test_producers_killed_mid_burst_leave_every_message_with_its_lock_and_no_lock_alone(
    redis_url: str, redisdb: redis.Redis, tmp_path: Any
) -> None:
    import json
    import signal
    import subprocess
    import sys

    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    env = {**os.environ, "PYTHONPATH": str(Path(dramatiq_guard.__file__).parent.parent)}  # this checkout's
    confirmed: set[int] = set()
    for kill in range(4):
        process = subprocess.Popen(
            [sys.executable, str(script), redis_url], stdout=subprocess.PIPE, text=True, env=env
        )
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        for _ in range(50 + 37 * kill):  # a different instant each time
            confirmed.add(int(process.stdout.readline()))
        process.send_signal(signal.SIGKILL)
        process.wait()
        # The next producer sends the same keys from 0 again: duplicates of the first sends.

    messages = [json.loads(m) for m in redisdb.hvals("dramatiq:burst.msgs")]
    keys = {m["options"][LOCK_OPTION] for m in messages}
    assert len(keys) == len(messages)  # no key pushed twice
    assert confirmed <= {m["args"][0] for m in messages}  # every send that returned is on the queue
    held = {k.decode().split("{", 1)[1].rsplit("}", 1)[0] for k in locks(redisdb)}
    assert held == keys  # every message has its lock, and no lock is alone
    assert redisdb.llen("dramatiq:burst") == len(messages)


def test_a_probe_that_cannot_reach_redis_fails_the_send_closed_and_is_asked_again(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job(n: int) -> None: ...

    fetch = redis_broker.do_fetch

    def unreachable(*args: Any) -> Any:
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(redis_broker, "do_fetch", unreachable, raising=False)
    with pytest.raises(dramatiq_guard.BackendUnavailable):
        job.send(1)
    assert queued(redisdb) == 0 and not locks(redisdb)  # nothing of the failed send is left
    monkeypatch.setattr(redis_broker, "do_fetch", fetch, raising=False)
    job.send(1)  # probed again: one step from now on
    redisdb.config_resetstat()
    job.send(2)
    counts = calls(redisdb)
    assert counts.get("fcall", 0) + counts.get("evalsha", 0) == 1 and queued(redisdb) == 2


def test_a_message_another_middleware_sends_in_its_before_enqueue_keeps_its_own_push(
    redis_broker: RedisBroker, redisdb: redis.Redis, hooks: Hooks
) -> None:
    @dramatiq.actor(queue_name="audit")
    def audit(message_id: str) -> None: ...

    class Auditing(Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            if message.actor_name == "job":
                audit.send(message.message_id)  # pushed inside the guarded message's enqueue

    redis_broker.add_middleware(Auditing())

    @dramatiq.actor(dedup="until_executed", queue_name="default")
    def job(n: int) -> None: ...

    first = job.send(1)
    assert deduplicated_by(job.send(1)) == first.message_id
    assert queued(redisdb) == 1 and queued(redisdb, "audit") == 2  # each its own, the duplicate's too
    [data] = redisdb.hvals("dramatiq:default.msgs")
    assert first.message_id.encode() in data and len(locks(redisdb)) == 1
