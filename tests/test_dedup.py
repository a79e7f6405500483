"""Deduplication (``dedup=``) in one process: StubBroker + in-memory backend, RedisBroker + Redis.

Actors are held inside their run by events, never by sleeps; locks are observed
through the backend's ``inspect``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AgeLimit, AsyncIO, GroupCallbacks, MiddlewareError, Retries
from dramatiq.rate_limits.backends import StubBackend
from harness import redis_broker_pending, wait_until

from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.errors import BackendUnavailable, GuardOptionError
from dramatiq_guard.middleware.dedup import (
    EXEMPT_OPTION,
    LOCK_OPTION,
    RERUN_OPTION,
    Deduplication,
    DuplicateMessage,
    deduplicated_by,
    rerun_id,
)

WAIT = 10.0


@pytest.fixture
def broker(restore_global_broker: None) -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.add_middleware(AsyncIO())
    broker.add_middleware(GroupCallbacks(StubBackend()))
    broker.add_middleware(Deduplication(), before=Retries)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def dedup_of(broker: dramatiq.Broker) -> Deduplication:
    return next(m for m in broker.middleware if isinstance(m, Deduplication))


def holders(broker: dramatiq.Broker, key: str) -> list[str]:
    """The live holders of ``key`` (``inspect`` does not reclaim lapsed ones)."""
    mw = dedup_of(broker)
    now_ms = time.time() * 1000
    return [h for h, deadline in mw.backend(broker).inspect(key).holders if deadline > now_ms]


def lock_of(message: dramatiq.Message[Any]) -> str:
    key = message.options[LOCK_OPTION]
    assert isinstance(key, str)
    return key


def guard_backend_of(kind: str, request: pytest.FixtureRequest, **options: Any) -> Any:
    """The memory backend, or a Redis one in a namespace of its own (``kind``: "memory", "redis")."""
    if kind == "memory":
        return MemoryBackend(**options)
    url = request.getfixturevalue("redis_server_url")
    return RedisBackend.from_url(url, namespace=f"dedup-{time.time_ns()}", **options)


def stub_broker_on(guard_backend: Any, *first: dramatiq.Middleware, **options: Any) -> StubBroker:
    """A StubBroker (the global one) with ``first``, then Deduplication on ``guard_backend``."""
    broker = StubBroker()
    for middleware in first:
        broker.add_middleware(middleware)
    broker.add_middleware(Deduplication(redis=guard_backend, **options), before=Retries)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def start_worker(broker: StubBroker) -> Iterator[Callable[[], dramatiq.Worker]]:
    workers: list[dramatiq.Worker] = []

    def start() -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


class Hold:
    """Holds an actor inside its run until released; counts runs."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Event()
        self.runs: list[Any] = []
        self.done = threading.Semaphore(0)

    def run(self, value: Any) -> None:
        self.runs.append(value)
        self.started.release()
        assert self.go.wait(WAIT), "the test never let the actor finish"
        self.done.release()

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=WAIT), "the actor did not start"

    def wait_done(self) -> None:
        assert self.done.acquire(timeout=WAIT), "the actor did not finish"


# --- declaration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "until_done",
        {"strategy": "until_executed", "on_duplicate": "ignore"},
        {"strategy": "until_executing", "on_duplicate": "reschedule_once"},
        {"strategy": "until_executed", "ttl": -1},
        {"strategy": "until_executed", "key": ["missing"]},
    ],
)
def test_a_bad_dedup_value_fails_at_declaration(broker: StubBroker, value: Any) -> None:
    with pytest.raises(GuardOptionError) as info:

        @dramatiq.actor(actor_name="bad_dedup", dedup=value)
        def bad_dedup(user_id: int) -> None: ...

    text = str(info.value)
    assert "'bad_dedup'" in text
    assert "dedup=" in text
    assert repr(value) in text
    assert '"until_executing", "until_executed" or "until_expired"' in text
    assert isinstance(info.value, ValueError)


# --- the send path ----------------------------------------------------------------------------


def test_a_thousand_sends_leave_one_message_and_name_the_holder(broker: StubBroker) -> None:
    @dramatiq.actor(dedup="until_executing")
    def refresh(user_id: int) -> None: ...

    first = refresh.send(7)
    assert deduplicated_by(first) is None
    others = [refresh.send(7) for _ in range(999)]
    assert broker.queues["default"].qsize() == 1
    assert {deduplicated_by(m) for m in others} == {first.message_id}
    assert holders(broker, lock_of(first)) == [first.message_id]
    # Other arguments are another key.
    assert deduplicated_by(refresh.send(8)) is None
    assert broker.queues["default"].qsize() == 2


def test_a_duplicate_returns_a_copy_of_what_was_sent_marked_with_its_holder(broker: StubBroker) -> None:
    """What ``broker.enqueue`` returns for a duplicate: a copy of the message (of its own class, a
    subclass's fields kept), marked with the holder, and neither it nor the message sent holds the lock."""

    @dataclasses.dataclass(frozen=True)
    class Traced(dramatiq.Message[Any]):
        trace: str = ""

    @dramatiq.actor(dedup="until_executed")
    def job(n: int) -> None: ...

    first = job.send(1)
    sent = job.message(1)
    duplicate = broker.enqueue(sent)
    assert deduplicated_by(duplicate) == first.message_id and LOCK_OPTION not in duplicate.options
    assert (duplicate.message_id, duplicate.args, duplicate.queue_name) == (sent.message_id, (1,), "default")
    assert deduplicated_by(sent) is None and LOCK_OPTION not in sent.options
    traced = Traced(**{**sent.asdict(), "message_id": "traced-1"}, trace="t-1")
    copy = broker.enqueue(traced)
    assert isinstance(copy, Traced) and copy.trace == "t-1" and deduplicated_by(copy) == first.message_id
    assert LOCK_OPTION not in copy.options and deduplicated_by(traced) is None


def test_on_duplicate_raise_carries_the_holder(broker: StubBroker) -> None:
    @dramatiq.actor(dedup={"strategy": "until_executed", "on_duplicate": "raise"})
    def job(n: int) -> None: ...

    first = job.send(1)
    with pytest.raises(DuplicateMessage) as info:
        job.send(1)
    assert info.value.holder == first.message_id
    assert info.value.key == lock_of(first)
    assert broker.queues["default"].qsize() == 1


def test_the_key_can_be_overridden_per_message(broker: StubBroker) -> None:
    @dramatiq.actor(dedup={"strategy": "until_executed", "key": ["user_id"]})
    def job(user_id: int, reason: str = "") -> None: ...

    first = job.send(1, reason="a")
    assert deduplicated_by(job.send(1, reason="b")) == first.message_id  # the key is user_id only
    shared = job.send_with_options(args=(2,), dedup_key="tenant:9")
    assert lock_of(shared) == "dedup:tenant:9"
    assert deduplicated_by(job.send_with_options(args=(3,), dedup_key="tenant:9")) == shared.message_id
    with pytest.raises(GuardOptionError, match="dedup_key"):
        job.send_with_options(args=(4,), dedup_key=4)


def test_a_failed_push_releases_the_lock_at_once(restore_global_broker: None) -> None:
    from dramatiq.brokers.redis import RedisBroker

    backend = MemoryBackend()
    broker = RedisBroker(url="redis://127.0.0.1:1/0")  # nothing listens there: the push fails
    broker.add_middleware(Deduplication(redis=backend), before=Retries)

    @dramatiq.actor(broker=broker, dedup="until_executed")
    def job(n: int) -> None: ...

    message = job.message(1)
    with pytest.raises(redis.exceptions.ConnectionError):
        broker.enqueue(message)
    assert LOCK_OPTION not in message.options
    key = "dedup:" + dedup_of(broker).guard_lists[job.actor_name][0].key_of(message)
    assert backend.inspect(key).holders == ()


def test_the_backend_unreachable_fails_closed_unless_fail_open(restore_global_broker: None) -> None:
    broker = StubBroker()
    broker.add_middleware(Deduplication(redis="redis://127.0.0.1:1/0"), before=Retries)

    @dramatiq.actor(broker=broker, dedup="until_executed")
    def closed(n: int) -> None: ...

    @dramatiq.actor(broker=broker, dedup={"strategy": "until_executed", "fail_open": True})
    def opened(n: int) -> None: ...

    with pytest.raises(BackendUnavailable):
        closed.send(1)
    assert broker.queues["default"].qsize() == 0
    message = opened.send(1)
    assert message.options[EXEMPT_OPTION] == "backend_unavailable"
    assert broker.queues["default"].qsize() == 1


def test_delayed_sends_are_not_deduplicated_unless_including_scheduled(broker: StubBroker) -> None:
    @dramatiq.actor(dedup="until_executed")
    def plain(n: int) -> None: ...

    @dramatiq.actor(dedup={"strategy": "until_executed", "including_scheduled": True, "ttl": 1_000})
    def scheduled(n: int) -> None: ...

    a = plain.send_with_options(args=(1,), delay=60_000)
    b = plain.send_with_options(args=(1,), delay=60_000)
    assert deduplicated_by(a) is None and deduplicated_by(b) is None
    assert a.options[EXEMPT_OPTION] == "scheduled"
    assert deduplicated_by(plain.send(1)) is None  # the delayed ones hold no lock

    held = scheduled.send_with_options(args=(1,), delay=60_000)
    assert deduplicated_by(held) is None
    assert deduplicated_by(scheduled.send(1)) == held.message_id
    assert deduplicated_by(scheduled.send_with_options(args=(1,), delay=5)) == held.message_id
    dedup_of(broker).flush()
    ((holder, deadline),) = dedup_of(broker).backend(broker).inspect(lock_of(held)).holders
    assert holder == held.message_id
    assert deadline > time.time() * 1000 + 30_000  # covers the 60 s delay, not just ttl (1 s)


def test_the_pending_lock_is_confirmed_to_ttl_in_the_background(broker: StubBroker) -> None:
    @dramatiq.actor(dedup={"strategy": "until_executed", "ttl": 3_600_000})
    def job(n: int) -> None: ...

    message = job.send(1)
    dedup_of(broker).flush()
    ((_, deadline),) = dedup_of(broker).backend(broker).inspect(lock_of(message)).holders
    assert deadline - message.message_timestamp > 600_000  # pending would be 10 s


# --- strategies -------------------------------------------------------------------------------


def test_until_executing_accepts_a_send_while_the_holder_runs(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    hold = Hold()

    @dramatiq.actor(dedup="until_executing")
    def job(n: int) -> None:
        hold.run(n)

    first = job.send(1)
    assert deduplicated_by(job.send(1)) == first.message_id  # still queued
    start_worker()
    hold.wait_started()
    second = job.send(1)
    assert deduplicated_by(second) is None
    hold.go.set()
    broker.join("default")
    assert hold.runs == [1, 1]
    assert holders(broker, lock_of(second)) == []


def test_until_executed_drops_while_the_holder_runs_and_releases_when_done(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    hold = Hold()

    @dramatiq.actor(dedup="until_executed")
    def job(n: int) -> None:
        hold.run(n)

    first = job.send(1)
    start_worker()
    hold.wait_started()
    assert deduplicated_by(job.send(1)) == first.message_id
    hold.go.set()
    broker.join("default")
    assert holders(broker, lock_of(first)) == []
    assert deduplicated_by(job.send(1)) is None
    broker.join("default")
    assert hold.runs == [1, 1]


def test_until_expired_holds_for_ttl_whatever_the_holder_did(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    @dramatiq.actor(dedup={"strategy": "until_expired", "ttl": 500})
    def job(n: int) -> None: ...

    first = job.send(1)
    key = lock_of(first)
    dedup_of(broker).flush()
    confirmed = dedup_of(broker).backend(broker).inspect(key).holders
    start_worker()
    broker.join("default")
    # The run did not touch the lock: it is still the confirmed one, or it lapsed at its deadline.
    after = dedup_of(broker).backend(broker).inspect(key).holders
    assert after == confirmed or (after == () and time.time() * 1000 >= confirmed[0][1])
    wait_until(lambda: holders(broker, key) == [], WAIT, "the until_expired lock to lapse")
    assert deduplicated_by(job.send(1)) is None


def test_retries_keep_the_lock_and_exhausted_retries_release_it(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    second_attempt = threading.Event()
    go = threading.Event()
    attempts: list[int] = []

    @dramatiq.actor(dedup="until_executed", max_retries=1, min_backoff=1, max_backoff=1)
    def flaky(n: int) -> None:
        attempts.append(n)
        if len(attempts) == 2:
            second_attempt.set()
            assert go.wait(WAIT)
        raise RuntimeError("fails every time")

    first = flaky.send(1)
    start_worker()
    assert second_attempt.wait(WAIT)
    assert deduplicated_by(flaky.send(1)) == first.message_id  # kept across the retry
    go.set()
    broker.join("default", fail_fast=False)
    assert [m.message_id for m in broker.dead_letters] == [first.message_id]
    assert holders(broker, lock_of(first)) == []
    assert deduplicated_by(flaky.send(1)) is None


def test_a_holder_skipped_by_age_limit_releases_the_lock(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    assert any(isinstance(m, AgeLimit) for m in broker.middleware)

    @dramatiq.actor(dedup="until_executed", max_age=60_000)
    def job(n: int) -> None:
        raise AssertionError("an expired message must not run")

    stale = broker.enqueue(job.message(1).copy(message_timestamp=1))
    assert LOCK_OPTION in stale.options
    start_worker()
    broker.join("default", fail_fast=False)
    assert holders(broker, lock_of(stale)) == []
    assert deduplicated_by(job.send(1)) is None


def test_async_actors_are_deduplicated_and_released(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    ran: list[int] = []

    @dramatiq.actor(dedup="until_executed")
    async def job(n: int) -> None:
        ran.append(n)

    first = job.send(1)
    assert deduplicated_by(job.send(1)) == first.message_id
    start_worker()
    broker.join("default")
    assert ran == [1]
    assert holders(broker, lock_of(first)) == []


# --- reschedule_once --------------------------------------------------------------------------


def test_reschedule_once_runs_once_more_for_fifty_duplicates_during_a_run(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    hold = Hold()

    @dramatiq.actor(dedup={"strategy": "until_executed", "on_duplicate": "reschedule_once"})
    def job(n: int) -> None:
        hold.run(n)

    first = job.send(1)
    for _ in range(5):  # while it is queued: covered by its own run
        assert deduplicated_by(job.send(1)) == first.message_id
    start_worker()
    hold.wait_started()
    duplicates = [job.send(1) for _ in range(50)]
    assert {deduplicated_by(m) for m in duplicates} == {first.message_id}
    assert len({m.options[RERUN_OPTION] for m in duplicates}) == 1
    hold.go.set()
    hold.wait_done()
    hold.wait_done()  # the one rerun
    broker.join("default")
    assert len(hold.runs) == 2
    assert holders(broker, lock_of(first)) == []
    assert dedup_of(broker).backend(broker).inspect(lock_of(first)).waiters == ()


def test_reschedule_once_does_not_rerun_for_duplicates_sent_before_the_start(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    ran: list[int] = []

    @dramatiq.actor(dedup={"strategy": "until_executed", "on_duplicate": "reschedule_once"})
    def job(n: int) -> None:
        ran.append(n)

    first = job.send(1)
    for _ in range(10):
        job.send(1)
    start_worker()
    broker.join("default")
    assert ran == [1]
    assert holders(broker, lock_of(first)) == []


# --- groups and pipelines ---------------------------------------------------------------------


def test_pipeline_and_group_members_are_never_dropped(
    broker: StubBroker, start_worker: Callable[[], dramatiq.Worker]
) -> None:
    ran: list[str] = []
    finished = threading.Event()

    @dramatiq.actor(dedup={"strategy": "until_executed", "key": lambda *a: "shared"})
    def step(*args: Any) -> None:
        ran.append("step")

    @dramatiq.actor
    def callback() -> None:
        finished.set()

    holder = step.send(0)  # holds "shared" while queued
    dramatiq.pipeline([step.message(1), step.message(2), step.message(3)]).run()
    members = dramatiq.group([step.message(4), step.message(5)])
    members.add_completion_callback(callback.message())
    members.run()
    start_worker()
    assert finished.wait(WAIT)
    broker.join("default")
    assert ran == ["step"] * 6
    assert holders(broker, lock_of(holder)) == []


# --- RedisBroker ------------------------------------------------------------------------------


def test_a_thousand_sends_on_a_redis_broker_leave_one_message(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    mw = Deduplication()
    redis_broker.add_middleware(mw, before=Retries)

    @dramatiq.actor(dedup="until_executed", queue_name="dedup_redis")
    def refresh(user_id: int) -> None: ...

    results = [refresh.send(42) for _ in range(1000)]
    holder = results[0].message_id
    assert deduplicated_by(results[0]) is None
    assert {deduplicated_by(m) for m in results[1:]} == {holder}
    assert redis_broker_pending(redisdb, ["dedup_redis"]) == 1
    mw.flush()
    key = lock_of(results[0])
    assert [h for h, _ in mw.backend(redis_broker).inspect(key).holders] == [holder]

    worker = dramatiq.Worker(redis_broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        wait_until(lambda: redis_broker_pending(redisdb, ["dedup_redis"]) == 0, WAIT, "the holder to run")
        wait_until(lambda: mw.backend(redis_broker).inspect(key).holders == (), WAIT, "the release")
    finally:
        worker.stop()
    assert deduplicated_by(refresh.send(42)) is None


@pytest.mark.parametrize("on_duplicate", ["drop", "reschedule_once"])
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_holder_whose_lock_lapsed_and_was_taken_runs_without_it_and_leaves_the_new_holders_lock(
    backend: str,
    on_duplicate: str,
    request: pytest.FixtureRequest,
    restore_global_broker: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder starts by extending the lock its send took; lapsed and taken by a later send, the
    lock stays the later message's: the first runs without it (with a warning), and neither its
    start nor its end takes or frees the new holder's lock."""
    guard_backend = guard_backend_of(backend, request)
    broker = stub_broker_on(guard_backend, pending_ttl=1_000)
    hold = Hold()

    @dramatiq.actor(dedup={"strategy": "until_executed", "ttl": 1_000, "on_duplicate": on_duplicate})
    def job(n: int) -> None:
        hold.run(n)

    first = job.send(1)
    key = lock_of(first)
    dedup_of(broker).flush()
    wait_until(lambda: holders(broker, key) == [], timeout=WAIT)  # lapsed while queued
    second = job.send(1)
    assert deduplicated_by(second) is None
    dedup_of(broker).flush()
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        hold.wait_started()
        hold.wait_started()
        assert [h for h, _ in guard_backend.inspect(key).holders] == [second.message_id]
        assert f"{first.message_id} starts without its dedup lock" in caplog.text
        hold.go.set()
        broker.join("default")
        assert sorted(hold.runs) == [1, 1]
        wait_until(lambda: guard_backend.inspect(key).holders == (), timeout=WAIT)
    finally:
        worker.stop()
        broker.close()
        guard_backend.close()


@pytest.mark.parametrize("on_duplicate", ["drop", "reschedule_once"])
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_holders_start_counts_its_locks_ttl_from_then(
    backend: str, on_duplicate: str, request: pytest.FixtureRequest, restore_global_broker: None
) -> None:
    """Invariant: an ``until_executed`` lock lasts ``ttl`` from its holder's start, whatever the
    holder waited in its queue (the renewer, told so, renews it a third of a ttl after the start).
    A ``reschedule_once`` holder's start left its lock at its confirmation's deadline: one that
    waited in its queue more than two thirds of ``ttl`` lost it under the running job."""
    guard_backend = guard_backend_of(backend, request)
    broker = stub_broker_on(guard_backend)
    hold = Hold()

    @dramatiq.actor(dedup={"strategy": "until_executed", "ttl": 3_000, "on_duplicate": on_duplicate})
    def job(n: int) -> None:
        hold.run(n)

    message = job.send(1)
    key = lock_of(message)
    dedup_of(broker).flush()
    ((_, confirmed_deadline),) = guard_backend.inspect(key).holders
    # Queued for a third of its ttl: the clock moves past the confirmation + 1 s.
    wait_until(lambda: time.time() * 1000 > confirmed_deadline - 2_000, timeout=WAIT)
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        hold.wait_started()
        ((_, deadline),) = guard_backend.inspect(key).holders  # before its first renewal, 1 s on
        assert deadline > confirmed_deadline
        hold.go.set()
        broker.join("default")
        assert guard_backend.inspect(key).holders == ()
    finally:
        worker.stop()
        broker.close()
        guard_backend.close()


# --- with the slots middlewares ---------------------------------------------------------------


def test_a_holder_parked_by_the_concurrency_limit_keeps_its_lock_until_it_runs(
    restore_global_broker: None,
) -> None:
    import dramatiq_guard

    broker = StubBroker()
    dramatiq_guard.install(broker)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    first_running = threading.Event()
    go = threading.Event()
    ran: list[int] = []

    @dramatiq.actor(dedup="until_executed", concurrency={"limit": 1, "key": lambda n: "one"})
    def job(n: int) -> None:
        ran.append(n)
        if n == 1:
            first_running.set()
            assert go.wait(WAIT)

    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        job.send(1)
        assert first_running.wait(WAIT)
        waiting = job.send(2)  # over the limit: parked, holding its dedup lock
        assert deduplicated_by(waiting) is None
        assert deduplicated_by(job.send(2)) == waiting.message_id
        go.set()
        wait_until(lambda: ran == [1, 2], WAIT, "both to run")
        wait_until(lambda: holders(broker, lock_of(waiting)) == [], WAIT, "the release")
        assert deduplicated_by(job.send(2)) is None
        broker.join("default")
    finally:
        go.set()
        worker.stop()
        broker.close()
    assert ran == [1, 2, 2]


class FailFirstPushOf(dramatiq.Middleware):
    """Fails the first push of one message id (its enqueue raises, as a broker that is down would)."""

    def __init__(self) -> None:
        self.message_id: str | None = None
        self.failed = threading.Event()

    def before_enqueue(self, broker: dramatiq.Broker, message: dramatiq.Message[Any], delay: int) -> None:
        if message.message_id == self.message_id and not self.failed.is_set():
            self.failed.set()
            # Only a MiddlewareError stops a push (Dramatiq logs and swallows any other).
            raise MiddlewareError("the broker refused the push")


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_rerun_whose_push_failed_is_handed_on_by_the_sweep(
    backend: str, request: pytest.FixtureRequest, restore_global_broker: None
) -> None:
    """A ``reschedule_once`` rerun handed the lock, whose re-enqueue fails, still runs.

    Invariant: a rerun waiting in the lock's queue is never stranded; the workers' sweep covers
    dedup keys and hands the lock to it again once the failed hand-off's reservation lapsed.
    """
    guard_backend = guard_backend_of(backend, request, handoff_ttl_ms=300)
    failing = FailFirstPushOf()
    broker = stub_broker_on(guard_backend, failing, sweep_interval=100)
    hold = Hold()

    @dramatiq.actor(dedup={"strategy": "until_executed", "on_duplicate": "reschedule_once"})
    def job(n: int) -> None:
        hold.run(n)

    first = job.send(1)
    failing.message_id = rerun_id(first.message_id)
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        hold.wait_started()
        assert deduplicated_by(job.send(1)) == first.message_id  # asks for one more run
        hold.go.set()
        hold.wait_done()
        assert failing.failed.wait(WAIT), "the rerun was never pushed"
        hold.wait_done()  # the rerun ran, after all
        broker.join("default")
        assert len(hold.runs) == 2
        key = lock_of(first)
        wait_until(lambda: not guard_backend.inspect(key).waiters and not holders(broker, key), timeout=WAIT)
    finally:
        worker.stop()
        broker.close()
        guard_backend.close()
