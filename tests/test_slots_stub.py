"""Concurrency slots and the mutex on a StubBroker with the in-memory backend (one process, no services)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import CurrentMessage, Retries
from dramatiq.results import ResultMissing, Results
from dramatiq.results.backends import StubBackend
from harness import wait_until

from dramatiq_guard import current_lease, events
from dramatiq_guard.backends import Stake
from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.slots import Concurrency, Mutex, MutexWaitTimeout
from dramatiq_guard.middleware.slots.limits import ACTOR_LIMIT_PREFIX, ActorLimits
from dramatiq_guard.middleware.slots.standbys import DEFAULT_LOOKAHEAD, Standbys, StandbySeats
from dramatiq_guard.testing import join, parked_count


class Tracker:
    """Counts what runs, per key, from inside the actors."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.done: list[Any] = []
        self.release = threading.Event()

    def enter(self, key: str) -> None:
        with self.lock:
            self.running[key] = self.running.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self.running[key])

    def leave(self, key: str, value: Any) -> None:
        with self.lock:
            self.running[key] -= 1
            self.done.append(value)


class CountingSink:
    """An event sink (:mod:`dramatiq_guard.events`) that only counts."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def count(self, event: str, actor: str) -> None:
        self.counts[event, actor] += 1

    def holders(self, actor: str, delta: int) -> None:
        pass

    def waiters(self, actor: str, delta: int) -> None:
        pass

    def lock_waited(self, actor: str, duration_ms: float) -> None:
        pass


class Env:
    def __init__(self, mutex_class: type[Mutex] = Mutex) -> None:
        self.broker = StubBroker()
        self.broker.emit_after("process_boot")
        self.backend = MemoryBackend()
        self.results = StubBackend()
        self.broker.add_middleware(Results(backend=self.results))
        self.mutex = mutex_class(redis=self.backend, lease_ttl=2_000, sweep_interval=50)
        self.concurrency = Concurrency(redis=self.backend, lease_ttl=2_000, sweep_interval=50, limit_cache=0)
        self.broker.add_middleware(self.mutex, before=Retries)
        self.broker.add_middleware(self.concurrency, before=Retries)
        dramatiq.set_broker(self.broker)
        self.tracker = Tracker()
        self.worker: dramatiq.Worker | None = None

    def start(self, threads: int = 8) -> None:
        self.worker = dramatiq.Worker(self.broker, worker_threads=threads, worker_timeout=20)
        self.worker.start()

    def close(self) -> None:
        self.tracker.release.set()
        if self.worker is not None:
            self.worker.stop()
        self.broker.close()


@pytest.fixture
def env(restore_global_broker: None) -> Iterator[Env]:
    env = Env()
    yield env
    env.close()


def send_standbys(middleware: Concurrency, broker: dramatiq.Broker, key: str, limit: int) -> None:
    """Send the first waiters of ``key`` ahead as standbys, as a release of it would (up to ``lookahead``)."""
    backend = middleware.backend(broker)
    handoffs, sent = backend.send_standbys(key, limit=limit, count=middleware.standbys.count())
    middleware.deliver(broker, handoffs)
    middleware.courier(broker).send_ahead(sent)


def test_a_burst_reserves_the_limit_and_parks_the_rest_at_enqueue(env: Env) -> None:
    t = env.tracker

    @dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "k"}, store_results=True)
    def job(n: int) -> int:
        t.enter("k")
        t.leave("k", n)
        return n * 10

    messages = [job.send(n) for n in range(10)]
    state = env.backend.inspect("concurrency:k")
    assert len(state.holders) == 2  # reservations of the two pushed messages
    assert [w for w, _, parked in state.waiters if parked] == [m.message_id for m in messages[2:]]
    assert env.broker.queues[job.queue_name].qsize() == 2  # the rest never reach the broker

    env.start()
    join(env.broker, job.queue_name, timeout=10_000)
    env.worker.join()  # type: ignore[union-attr]
    assert sorted(t.done) == list(range(10))
    assert t.peak["k"] <= 2
    # A parked message's result is its real one, not the None of a skip.
    assert [m.get_result(block=True, timeout=5_000) for m in messages] == [n * 10 for n in range(10)]
    assert env.backend.inspect("concurrency:k").holders == ()


def test_observed_concurrency_never_exceeds_the_limit_per_key(env: Env) -> None:
    t = env.tracker

    @dramatiq.actor(concurrency={"limit": 3, "key": ["customer"]}, max_retries=0)
    def deliver(customer: str, n: int) -> None:
        t.enter(customer)
        t.leave(customer, (customer, n))

    @dramatiq.actor(concurrency=1, max_retries=0)
    def export(n: int) -> None:
        t.enter("export")
        t.leave("export", ("export", n))

    env.start(threads=12)
    for n in range(60):
        deliver.send("a" if n % 2 else "b", n)
        export.send(0)  # all the same arguments: one key, one at a time
    join(env.broker, deliver.queue_name, timeout=20_000)
    env.worker.join()  # type: ignore[union-attr]
    assert len(t.done) == 120
    assert t.peak["a"] <= 3 and t.peak["b"] <= 3
    assert t.peak["export"] == 1


def test_a_message_parked_after_pickup_keeps_its_id_and_retries_and_stores_no_result(env: Env) -> None:
    t = env.tracker
    started = threading.Event()

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k"}, store_results=True, max_retries=0)
    def job(n: int) -> int:
        if n == 0:
            started.set()
            t.release.wait(10)
        t.enter("k")
        t.leave("k", n)
        return n

    env.start(threads=4)
    first = job.send(0)
    assert started.wait(10)
    # Bypass the gate so the second message reaches the broker while the key is full.
    second = job.message(1).copy(options={"retries": 3})
    env.broker.queues[job.queue_name].put(second.encode())
    wait_until(lambda: parked_count(env.broker) == 1, what="the second message parked after pickup")
    state = env.backend.inspect("concurrency:k")
    assert [w for w, _, _ in state.waiters] == [second.message_id]
    with pytest.raises(Exception):  # noqa: B017 - no result was stored for the skip
        env.results.get_result(second, block=False)
    t.release.set()
    join(env.broker, job.queue_name, timeout=10_000)
    assert first.get_result(block=True, timeout=5_000) == 0
    assert env.results.get_result(second, block=True, timeout=5_000) == 1
    assert sorted(t.done) == [0, 1]


def send_a_second_copy_while_it_runs(
    env: Env, job: dramatiq.Actor[..., Any], started: threading.Event
) -> tuple[dramatiq.Message[Any], dramatiq.Message[Any]]:
    """Start the workers, send ``job(0)`` and, once it ``started`` (its run waits), put a second copy
    of the message on the broker past the gate, as a redelivery does; the message and the copy,
    once it was skipped."""
    skipped: list[dramatiq.Message[Any]] = []

    class Skips(dramatiq.Middleware):
        def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
            skipped.append(message._message)

    env.broker.add_middleware(Skips())
    env.start(threads=4)
    first = job.send(0)
    assert started.wait(10)
    env.broker.queues[job.queue_name].put(first.copy(options={"retries": 0}).encode())
    wait_until(lambda: skipped, what="the second copy skipped")
    return first, skipped[0]


@pytest.mark.parametrize("on_busy", ["park", "wait", "drop"])
def test_a_second_copy_of_a_running_message_is_deferred_as_it_is_and_runs_after_the_first(
    env: Env, on_busy: str
) -> None:
    """The broker delivers a running message again (RabbitMQ, a lost connection): the copy does not
    run beside it; it goes back to the broker delayed by a lease ttl, with its id and its retries
    (none consumed, though the actor has none), stores no result, and runs after the first."""
    t = env.tracker
    started = threading.Event()

    @dramatiq.actor(mutex={"key": lambda n: "k", "on_busy": on_busy}, store_results=True, max_retries=0)
    def job(n: int) -> int:
        t.enter("k")
        if not started.is_set():
            started.set()
            t.release.wait(10)
        t.leave("k", n)
        return n

    first, copy = send_a_second_copy_while_it_runs(env, job, started)
    assert (copy.message_id, copy.options["retries"]) == (first.message_id, 0)
    assert t.peak == {"k": 1} and t.done == []
    with pytest.raises(ResultMissing):  # the skipped copy stored nothing
        env.results.get_result(first, block=False)
    t.release.set()
    join(env.broker, job.queue_name, timeout=10_000)
    assert t.done == [0, 0] and t.peak == {"k": 1}  # the first, then the deferred copy after it
    assert env.backend.inspect("mutex:k").holders == ()


def test_a_subclass_hook_after_process_message_hears_the_runs_not_a_skipped_copy(
    restore_global_broker: None,
) -> None:
    """A slots middleware's subclass that overrides ``after_process_message`` (to count runs, say)
    hears the messages that ran; a second copy of a running message, skipped and deferred, is not one."""
    heard: list[str] = []

    class HearingMutex(Mutex):
        def after_process_message(self, broker: dramatiq.Broker, message: Any, **kwargs: Any) -> None:
            heard.append(message.message_id)
            super().after_process_message(broker, message, **kwargs)

    env = Env(mutex_class=HearingMutex)
    try:
        started = threading.Event()

        @dramatiq.actor(mutex={"key": lambda n: "k", "on_busy": "park"}, max_retries=0)
        def job(n: int) -> None:
            if not started.is_set():
                started.set()
                env.tracker.release.wait(10)

        first, _ = send_a_second_copy_while_it_runs(env, job, started)
        assert heard == []
        env.tracker.release.set()
        join(env.broker, job.queue_name, timeout=10_000)
        assert heard == [first.message_id, first.message_id]  # the first, then the copy deferred behind it
    finally:
        env.close()


def test_a_pipeline_through_a_limited_actor_runs_each_step_once_in_order(env: Env) -> None:
    t = env.tracker

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda *a: "p"}, store_results=True)
    def step(*values: int) -> int:
        t.enter("p")
        t.leave("p", values)
        return sum(values) + 1

    env.start(threads=4)
    # Fill the key first, so the pipeline's steps park on the way.
    for _ in range(3):
        step.send(100)
    pipe = dramatiq.pipeline([step.message(0), step.message(), step.message()]).run()
    assert pipe.get_result(block=True, timeout=10_000) == 3
    join(env.broker, step.queue_name, timeout=10_000)
    steps = [v for v in t.done if v != (100,)]
    assert steps == [(0,), (1,), (2,)]
    assert t.peak["p"] == 1


def test_limit_zero_parks_everything_and_raising_it_drains_that_many_at_a_time(env: Env) -> None:
    t = env.tracker
    four_running = threading.Event()

    @dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "h"}, max_retries=0)
    def job(n: int) -> None:
        t.enter("h")
        with t.lock:
            if t.running["h"] >= 4:
                four_running.set()
        assert t.release.wait(10)
        t.leave("h", n)

    env.concurrency.set_limit("h", 0)
    env.start(threads=8)
    for n in range(12):
        job.send(n)
    assert parked_count(env.broker) == 12  # all parked: nothing reached the broker
    assert env.broker.queues[job.queue_name].qsize() == 0

    env.concurrency.set_limit("h", 4)
    assert four_running.wait(10)
    assert t.peak["h"] == 4
    t.release.set()
    join(env.broker, job.queue_name, timeout=10_000)
    assert len(t.done) == 12 and t.peak["h"] == 4
    env.concurrency.set_limit("h", None)
    # Nothing is left of the key but its last fencing token (kept stale_ttl_ms, see the contract).
    drained = env.backend.inspect("concurrency:h")
    assert drained.token is not None
    assert dataclasses.replace(drained, token=None) == env.backend.inspect("concurrency:nothing")


def test_a_per_actor_default_limit_set_at_run_time(env: Env) -> None:
    @dramatiq.actor(concurrency={"limit": 5, "key": lambda n: f"c{n}"})
    def job(n: int) -> None:
        pass

    env.concurrency.set_actor_limit(job, 0)
    assert env.concurrency.get_actor_limit(job) == 0
    job.send(1)
    assert parked_count(env.broker) == 1
    env.concurrency.set_actor_limit(job, None)  # back to 5: the sweep hands the slot on
    assert parked_count(env.broker) == 0
    assert env.broker.queues[job.queue_name].qsize() == 1


def test_an_expired_run_time_limit_is_read_by_one_thread_while_the_others_use_the_last() -> None:
    """When the cached limit expires, every worker thread asks for it: one reads it from the backend
    (a round trip in its message's path), the others go on with the last value meanwhile."""
    backend = MemoryBackend()
    backend.set_limit(f"{ACTOR_LIMIT_PREFIX}:job", 3, default=0)
    limits = ActorLimits(cache_ms=0)  # expired as soon as read
    assert limits.get(backend, "job") == 3
    backend.set_limit(f"{ACTOR_LIMIT_PREFIX}:job", 4, default=0)
    reading, answer = threading.Event(), threading.Event()
    reads: list[str] = []
    read = backend.get_limit

    def slow_read(key: str) -> int | None:
        reads.append(key)
        reading.set()
        assert answer.wait(30)
        return read(key)

    backend.get_limit = slow_read  # type: ignore[method-assign]
    got: list[int | None] = []
    reader = threading.Thread(target=lambda: got.append(limits.get(backend, "job")))
    reader.start()
    assert reading.wait(30)
    assert limits.get(backend, "job") == 3  # the last value, no second read
    answer.set()
    reader.join(30)
    assert got == [4] and len(reads) == 1
    backend.get_limit = read  # type: ignore[method-assign]
    assert limits.get(backend, "job") == 4  # expired again: read again


def test_mutex_drop_five_sends_during_a_run_give_one_run(env: Env) -> None:
    t = env.tracker
    started = threading.Event()

    @dramatiq.actor(mutex=True)
    def report() -> None:
        started.set()
        t.enter("report")
        assert t.release.wait(10)
        t.leave("report", current_lease().token)

    env.start(threads=4)
    report.send()
    assert started.wait(10)
    for _ in range(4):
        report.send()
    wait_until(lambda: env.mutex.dropped == 4, what="four dropped")
    t.release.set()
    join(env.broker, report.queue_name, timeout=10_000)
    assert len(t.done) == 1


def test_mutex_wait_runs_sends_one_after_another(env: Env) -> None:
    t = env.tracker
    tokens: list[int] = []

    @dramatiq.actor(mutex={"on_busy": "wait", "wait": 10_000})
    def report(n: int) -> None:
        t.enter("r")
        tokens.append(current_lease().token)
        t.leave("r", n)

    env.start(threads=3)
    for _ in range(3):
        report.send(0)
    join(env.broker, report.queue_name, timeout=10_000)
    assert len(t.done) == 3 and t.peak["r"] == 1
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_mutex_wait_timeout_raises_and_retries_retry_it(env: Env) -> None:
    t = env.tracker
    started = threading.Event()
    failures: list[BaseException] = []

    class Spy(dramatiq.Middleware):
        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            if isinstance(exception, MutexWaitTimeout):
                failures.append(exception)

    env.broker.add_middleware(Spy())

    @dramatiq.actor(
        mutex={"on_busy": "wait", "wait": 50, "key": lambda n: "w"}, min_backoff=10, max_backoff=20
    )
    def report(n: int) -> None:
        if n == 0:
            started.set()
            assert t.release.wait(10)
        t.done.append(n)

    env.start(threads=3)
    report.send(0)
    assert started.wait(10)
    report.send(1)
    wait_until(lambda: len(failures) >= 2, what="the waiter timed out twice (a retry)")
    t.release.set()
    join(env.broker, report.queue_name, timeout=10_000)
    assert sorted(t.done) == [0, 1]
    assert "waited 50 ms" in str(failures[0])


def test_mutex_park_is_a_one_slot_limit(env: Env) -> None:
    t = env.tracker

    @dramatiq.actor(mutex={"on_busy": "park", "key": lambda n: "m"})
    def job(n: int) -> None:
        t.enter("m")
        t.leave("m", n)

    for n in range(8):
        job.send(n)
    assert parked_count(env.broker) == 7
    env.start(threads=4)
    join(env.broker, job.queue_name, timeout=10_000)
    assert sorted(t.done) == list(range(8)) and t.peak["m"] == 1


def test_a_lost_lease_is_reported_and_its_token_is_lower(env: Env) -> None:
    backend = env.backend
    first = backend.acquire(Stake("mutex:x", "a", limit=1, ttl_ms=100))
    lease = Lease(backend, "mutex:x", "a", first, limit=1, ttl_ms=100)
    # The holder stalls: its renewals stop (as if paused), the lease lapses and is taken over.
    lease.unregister()
    second = wait_until(
        lambda: (r := backend.acquire(Stake("mutex:x", "b", limit=1, ttl_ms=10_000))).acquired and r,
        what="the lease to lapse and be taken over",
    )
    assert second.token is not None and second.token > lease.token
    result = lease.release()
    assert not result.released and lease.lost and not lease.held
    assert backend.inspect("mutex:x").holders[0][0] == "b"  # the release did not free b's lock


def test_the_renewer_tells_a_holder_its_lease_was_taken(env: Env) -> None:
    backend = env.backend
    first = backend.acquire(Stake("mutex:y", "a", limit=1, ttl_ms=300))
    lease = Lease(backend, "mutex:y", "a", first, limit=1, ttl_ms=300)
    backend.release("mutex:y", "a", limit=1)  # released by force (e.g. the CLI)
    assert lease.wait_lost(10)
    assert not lease.held


def test_a_capped_lease_ends_at_its_ttl(env: Env) -> None:
    backend = env.backend
    first = backend.acquire(Stake("mutex:z", "a", limit=1, ttl_ms=10_000))
    lease = Lease(backend, "mutex:z", "a", first, limit=1, ttl_ms=10_000, cap_ms=50)
    assert lease.wait_lost(10)
    # The holder is told first; the lease is then ended on the backend (from a thread of its own).
    wait_until(
        lambda: backend.acquire(Stake("mutex:z", "b", limit=1, ttl_ms=1_000)).acquired,
        what="the capped lease to be ended on the backend",
    )


def test_capped_leases_released_early_never_end_and_do_not_pile_up(env: Env) -> None:
    """Many capped leases (a limit of hundreds with a ttl) released before their cap: none is
    ended or told it was lost, the one still held ends at its cap, and the released ones do not
    stay in the renewer."""
    backend = env.backend
    released = []
    for i in range(300):
        taken = backend.acquire(Stake("concurrency:wide", f"h{i}", limit=1000, ttl_ms=60_000))
        lease = Lease(backend, "concurrency:wide", f"h{i}", taken, limit=1000, ttl_ms=60_000, cap_ms=60_000)
        lease.release()
        released.append(lease)
    taken = backend.acquire(Stake("concurrency:wide", "last", limit=1000, ttl_ms=10_000))
    last = Lease(backend, "concurrency:wide", "last", taken, limit=1000, ttl_ms=10_000, cap_ms=50)
    assert not any(lease._active for lease in released)  # the renewer keeps no time for them
    assert last.wait_lost(10)
    assert not any(lease.lost for lease in released)
    wait_until(
        lambda: backend.acquire(Stake("concurrency:wide", "next", limit=1, ttl_ms=1_000)).acquired,
        what="the capped lease to be ended on the backend (nobody else holds the key)",
    )


def test_a_lost_flag_wakes_the_threads_waiting_for_it_and_answers_those_that_come_after() -> None:
    """LostFlag (what Lease.lost and wait_lost rest on) makes its Event only for a waiter: one
    that waits before it is set is woken by the set, one that comes after returns at once, and
    one whose timeout passes first is told it is not set."""
    from dramatiq_guard.renewer import LostFlag

    flag = LostFlag()
    assert not flag.wait(0.01)
    woken: list[bool] = []
    waiting = [threading.Thread(target=lambda: woken.append(flag.wait(30))) for _ in range(3)]
    for thread in waiting:
        thread.start()
    wait_until(lambda: flag._event is not None, what="a waiter to make the flag's event")
    flag.set()
    for thread in waiting:
        thread.join(30)
    assert woken == [True, True, True]
    assert flag.is_set() and flag.wait(0)
    late = LostFlag()
    late.set()
    assert late.wait(0) and late._event is None  # set before anyone waited: no Event was made


def test_a_standby_never_woken_parks_again_first_in_line_without_a_retry_or_a_result(env: Env) -> None:
    t = env.tracker
    started = threading.Event()
    retries: dict[int, int] = {}
    env.broker.add_middleware(CurrentMessage())
    env.concurrency.standbys.wait_ms = 200  # the standby gives up soon: a wait on time itself

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k"}, store_results=True, max_retries=0)
    def job(n: int) -> int:
        current = CurrentMessage.get_current_message()
        assert current is not None
        retries[n] = current.options.get("retries", 0)
        if n == 0:
            started.set()
            t.release.wait(30)
        t.enter("k")
        t.leave("k", n)
        return n * 10

    env.start(threads=4)
    holder = job.send(0)
    assert started.wait(10)
    first, second = job.send(1), job.send(2)  # parked at enqueue: the key is full
    send_standbys(env.concurrency, env.broker, "concurrency:k", 1)
    assert [(w, parked) for w, _, parked in env.backend.inspect("concurrency:k").waiters] == [
        (first.message_id, False),  # standbys (a limit of 1 keeps MIN_STANDBY_WINDOW), on the
        (second.message_id, False),  # broker, in their places
    ]

    def parked_again() -> bool:
        waiters = env.backend.inspect("concurrency:k").waiters
        return [(w, parked) for w, _, parked in waiters] == [
            (first.message_id, True),
            (second.message_id, True),
        ]

    # Picked up, it blocks for a slot; nobody frees one, so it parks again, keeping its place.
    wait_until(parked_again, timeout=10, what="the standby to park again")
    assert env.broker.queues[job.queue_name].qsize() == 0
    with pytest.raises(ResultMissing):  # the skip stored no result
        env.results.get_result(first, block=False)
    t.release.set()
    join(env.broker, job.queue_name, timeout=10_000)
    env.worker.join()  # type: ignore[union-attr]
    assert t.done == [0, 1, 2]  # each once, in order
    assert retries == {0: 0, 1: 0, 2: 0}  # parking again consumed no retry
    assert [m.get_result(block=True, timeout=5_000) for m in (holder, first, second)] == [0, 10, 20]
    assert env.backend.inspect("concurrency:k").holders == ()


def test_a_freed_slot_goes_to_the_standby_sent_ahead_by_a_push(env: Env) -> None:
    t = env.tracker
    gates = {n: threading.Event() for n in range(3)}
    handed: list[Any] = []
    release = env.concurrency.release

    def spy(broker: Any, lease: Lease, **options: Any) -> Any:
        result = release(broker, lease, **options)
        if result is not None:
            handed.extend((h.waiter_id, h.payload is None) for h in result.handoffs)
        return result

    env.concurrency.release = spy  # type: ignore[method-assign]
    counted = CountingSink()
    previous_sink = events.set_sink(counted)

    @dramatiq.actor(concurrency={"limit": 1, "key": lambda n: "k"}, max_retries=0)
    def job(n: int) -> None:
        if n in gates:
            assert gates[n].wait(30)
        t.enter("k")
        t.leave("k", n)

    messages = [job.send(n) for n in range(4)]
    ids = [m.message_id for m in messages]
    env.start(threads=4)
    gates[0].set()

    def waiting() -> list[tuple[str, bool]]:
        return [(w, parked) for w, _, parked in env.backend.inspect("concurrency:k").waiters]

    # 0 released: its slot went to 1 (parked: re-enqueued), and 2 and 3 were sent ahead as
    # standbys (a limit of 1 keeps MIN_STANDBY_WINDOW of them).
    # (The release's result reaches the spy a moment after the key shows it: wait for both.)
    wait_until(
        lambda: waiting() == [(ids[2], False), (ids[3], False)] and handed == [(ids[1], False)],
        what="2 and 3 to be standbys, and 1 handed the slot",
    )
    gates[1].set()
    wait_until(lambda: waiting() == [(ids[3], False)], what="3 to be a standby")
    gates[2].set()
    join(env.broker, job.queue_name, timeout=10_000)
    env.worker.join()  # type: ignore[union-attr]
    assert t.done == [0, 1, 2, 3] and t.peak["k"] == 1
    # 1's slot went to the standby by a push (nothing to re-enqueue), and so on.
    assert handed == [(ids[1], False), (ids[2], True), (ids[3], True)]
    events.set_sink(previous_sink)
    # Every hand-off is counted for the metrics, re-enqueued or pushed.
    assert counted.counts[("handed_off", "job")] == 3


def test_slots_fail_closed_when_the_backend_is_unreachable_unless_fail_open(
    restore_global_broker: None,
) -> None:
    """Invariant: a guarded message never runs unguarded unless its actor chose ``fail_open``."""
    broker = StubBroker()
    broker.add_middleware(Concurrency(redis="redis://127.0.0.1:1/0"), before=Retries)
    broker.emit_after("process_boot")
    ran: list[str] = []

    @dramatiq.actor(broker=broker, concurrency=1)
    def closed(n: int) -> None:
        ran.append("closed")

    @dramatiq.actor(broker=broker, concurrency={"limit": 1, "fail_open": True})
    def opened(n: int) -> None:
        ran.append("opened")

    with pytest.raises(BackendUnavailable):
        closed.send(1)
    assert broker.queues["default"].qsize() == 0
    opened.send(1)  # enqueued unguarded
    assert broker.queues["default"].qsize() == 1
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        broker.join("default", fail_fast=True)
    finally:
        worker.stop()
    assert ran == ["opened"]  # and it ran unguarded


def test_the_default_lookahead_sends_16_standbys_ahead_however_wide_the_limit(env: Env) -> None:
    """Every release of a key with waiters reads as many waiters as it may send ahead, so the
    default window stops at DEFAULT_LOOKAHEAD: the Redis time of a release stays flat in the limit."""
    limit = 100

    @dramatiq.actor(concurrency={"limit": limit, "key": lambda n: "wide"}, max_retries=0)
    def job(n: int) -> None:
        pass

    messages = [job.send(n) for n in range(limit + 40)]  # the limit is reserved, 40 park
    queue = env.broker.queues[job.queue_name]
    assert queue.qsize() == limit
    env.concurrency.standbys.seats.seats = 4  # as a started worker of 8 threads allows
    send_standbys(env.concurrency, env.broker, "concurrency:wide", limit)
    waiters = env.backend.inspect("concurrency:wide").waiters
    assert [(w, parked) for w, _, parked in waiters] == [
        (m.message_id, i >= DEFAULT_LOOKAHEAD) for i, m in enumerate(messages[limit:])
    ]
    assert queue.qsize() == limit + DEFAULT_LOOKAHEAD


def test_a_release_keeps_only_the_standbys_that_can_get_a_slot_within_standby_wait() -> None:
    """The k-th standby waits about k x held / limit for its slot: after a long job a release sends
    only those that can get one within standby_wait (the others would block their threads for
    nothing, park again, and be sent again: a broker pickup each time)."""
    standbys = Standbys(lookahead=None, seats=4, wait_ms=5_000)
    assert standbys.count_after(10, 8) == DEFAULT_LOOKAHEAD  # short jobs: the whole window
    assert standbys.count_after(2_000, 1) == 2  # a mutex's: a slot every 2 s, two within 5 s
    assert standbys.count_after(2_000, 8) == DEFAULT_LOOKAHEAD  # eight slots free in 2 s
    assert standbys.count_after(6_000, 1) == 0  # none would get the slot in time
    assert standbys.count_after(6_000, 4) == 3
    assert standbys.count_after(6_000, None) == 0  # a limit not known here counts as 1
    assert Standbys(lookahead=3, seats=4).count_after(10, 8) == 3  # never more than lookahead
    assert Standbys(lookahead=None, seats=0).count_after(10, 8) == 0  # no seat, no standby


def test_a_worker_lets_half_its_threads_block_as_standbys(env: Env) -> None:
    env.start(threads=8)
    seats = env.concurrency.standbys.seats
    assert [seats.take() for _ in range(5)] == [True, True, True, True, False]
    seats.give_back()
    assert seats.take() is True


class _SeenWaiting(threading.Condition):
    """A seat's condition that says when a thread starts to wait on it."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.waiting = threading.Event()

    def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
        if not predicate():
            self.waiting.set()
        return super().wait_for(predicate, timeout)


def test_a_standby_picked_up_with_every_seat_taken_gets_the_next_one_given_back() -> None:
    """A process can fetch more standbys than it has seats: one picked up then waits for a seat (a
    standby blocked on one gets its slot) instead of parking again at once, a broker pickup more."""
    seats = StandbySeats(1)
    assert seats.take() is True
    seen = seats._freed = _SeenWaiting()
    taken: list[bool] = []
    late = threading.Thread(target=lambda: taken.append(seats.take(wait_s=60)))
    late.start()
    assert seen.waiting.wait(timeout=30)  # every seat taken: it waits
    seats.give_back()
    late.join(timeout=30)
    assert taken == [True]
    assert seats.take() is False  # the seat went to it


def test_a_standby_waits_for_a_seat_no_longer_than_asked() -> None:
    """Waiting for a seat keeps the thread from other work: bounded, then the standby parks again."""
    seats = StandbySeats(1)
    assert seats.take() is True
    assert seats.take(wait_s=0.01) is False
    seats.give_back()
    assert seats.take(wait_s=0.01) is True


def test_standby_threads_given_is_the_most_for_every_standby(restore_global_broker: None) -> None:
    broker = StubBroker()
    concurrency = Concurrency(redis=MemoryBackend(), standby_threads=3)
    broker.add_middleware(concurrency, before=Retries)
    worker = dramatiq.Worker(broker, worker_threads=8, worker_timeout=20)
    worker.start()
    try:
        seats = concurrency.standbys.seats
        assert [seats.take() for _ in range(4)] == [True, True, True, False]
    finally:
        worker.stop()
        broker.close()
