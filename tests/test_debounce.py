"""The ``debounce`` actor option with real worker threads, on the guard's clock set by the test.

Each test runs twice: a RedisBroker whose guard backend is a private ``redis-server`` under
libfaketime, and a StubBroker on the in-memory backend (fakeredis on the same clock). The clock
is frozen and moved by the test, so "not due yet" and "due now" are states, not timings: a run
starts once the guard's clock passes its due time, and never before.
"""

from __future__ import annotations

import queue
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.middleware import CurrentMessage
from harness import (
    FakeClock,
    RedisServer,
    SettableClock,
    fakeredis_clock,
    libfaketime,
    unavailable,
    wait_until,
)

import dramatiq_guard
from dramatiq_guard import Debounce, GuardOptionError, events
from dramatiq_guard.backends import GuardBackend, MemoryBackend, RedisBackend, ReleaseResult
from dramatiq_guard.backends.values import Due
from dramatiq_guard.middleware.sweep import join_sweep, leave_sweep
from dramatiq_guard.testing import join

START_MS = 1_900_000_000_000
WAIT_MS, MAX_WAIT_MS = 1_000, 3_000
TIMEOUT = 30.0


Clock = FakeClock | SettableClock


@pytest.fixture(scope="module")
def clock() -> Iterator[FakeClock | SettableClock]:
    if libfaketime() is None:
        yield SettableClock(START_MS)  # the private redis-server cannot run on it: those tests skip
        return
    clock = FakeClock(START_MS)
    yield clock
    clock.close()


@pytest.fixture(params=["redis", "memory"])
def broker(request: pytest.FixtureRequest, clock: Clock) -> Iterator[dramatiq.Broker]:
    """A broker with every guard installed, its backend on ``clock``, and a worker of 4 threads."""
    if request.param == "memory":
        with fakeredis_clock(lambda: clock.now_ms):
            yield from _running(request.getfixturevalue("stub_broker"), MemoryBackend())
        return
    if shutil.which("redis-server") is None or not isinstance(clock, FakeClock):
        unavailable("redis-server or libfaketime (apt-get install libfaketime) is not installed")
    with RedisServer(env=clock.server_env()) as server:
        client: Any = redis.Redis(host=server.host, port=server.port)
        yield from _running(request.getfixturevalue("redis_broker"), RedisBackend(client))
        client.close()


def _running(broker: dramatiq.Broker, backend: GuardBackend) -> Iterator[dramatiq.Broker]:
    dramatiq_guard.install(broker, redis=backend, sweep_interval=50)
    broker.add_middleware(CurrentMessage())
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
    worker.start()
    yield broker
    worker.stop()


class Sink:
    """Counts the guard events of the test (``messages_debounced_total`` in metrics)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, event: str, actor: str) -> None:
        self.counts[event, actor] = self.counts.get((event, actor), 0) + 1

    def holders(self, actor: str, delta: int) -> None: ...

    def waiters(self, actor: str, delta: int) -> None: ...

    def lock_waited(self, actor: str, duration_ms: float) -> None: ...


@pytest.fixture
def sink() -> Iterator[Sink]:
    sink = Sink()
    previous = events.set_sink(sink)
    yield sink
    events.set_sink(previous)


def debounce_of(broker: dramatiq.Broker) -> Debounce:
    return next(m for m in broker.middleware if isinstance(m, Debounce))


def pending(broker: dramatiq.Broker, key: str) -> list[str]:
    """The message ids of ``key``'s pending run (at most one)."""
    debounce = debounce_of(broker)
    return [w for w, _, _ in debounce.backend(broker).inspect(f"debounce:{key}").waiters]


def recording_actor(broker: dramatiq.Broker, key: str, **options: Any) -> tuple[Any, list[tuple[int, str]]]:
    """An actor debounced on ``key`` that records each run's argument and message id."""
    runs: list[tuple[int, str]] = []
    lock = threading.Lock()

    @dramatiq.actor(actor_name=f"save_{key}", debounce={"key": lambda n: key, **options}, max_retries=0)
    def save(n: int) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        with lock:
            runs.append((n, message.message_id))

    return save, runs


def test_a_burst_runs_once_with_the_last_send(broker: dramatiq.Broker, clock: Clock, sink: Sink) -> None:
    save, runs = recording_actor(broker, "burst", wait=WAIT_MS, max_wait=MAX_WAIT_MS)
    sent = []
    for n in range(5):
        sent.append(save.send(n))  # each returns normally
        clock.advance(100)
    assert pending(broker, "burst") == [sent[-1].message_id]  # one pending run: the last send's
    assert runs == []  # not due on the guard's clock
    clock.advance(WAIT_MS)
    wait_until(lambda: runs, timeout=TIMEOUT, what="the burst's run")
    join(broker, save.queue_name, timeout=int(TIMEOUT * 1000))
    assert runs == [(4, sent[-1].message_id)]  # once, with the last send's arguments and message
    assert sink.counts.get(("debounced", save.actor_name)) == 4
    assert pending(broker, "burst") == []


def test_max_wait_bounds_the_delay_of_a_burst_that_never_pauses(
    broker: dramatiq.Broker, clock: Clock
) -> None:
    save, runs = recording_actor(broker, "steady", wait=WAIT_MS, max_wait=MAX_WAIT_MS)
    for burst in range(2):
        for n in range(6):  # a send every half wait: the wait never passes
            save.send(10 * burst + n)
            clock.advance(WAIT_MS // 2)
        # Now first send + max_wait, before last send + wait: only max_wait makes the run due.
        wait_until(lambda b=burst: len(runs) == b + 1, timeout=TIMEOUT, what=f"run {burst}")  # type: ignore[misc]
    join(broker, save.queue_name, timeout=int(TIMEOUT * 1000))
    assert [n for n, _ in runs] == [5, 15]


def test_without_max_wait_a_burst_defers_its_run_until_it_pauses(
    broker: dramatiq.Broker, clock: Clock
) -> None:
    save, runs = recording_actor(broker, "unbounded", wait=WAIT_MS)
    for n in range(10):
        save.send(n)
        clock.advance(WAIT_MS // 2)
        assert len(pending(broker, "unbounded")) == 1  # never due while the sends go on
    clock.advance(WAIT_MS // 2)
    wait_until(lambda: runs, timeout=TIMEOUT, what="the run")
    join(broker, save.queue_name, timeout=int(TIMEOUT * 1000))
    assert [n for n, _ in runs] == [9]


def test_a_send_during_the_run_starts_the_next_pending_run(broker: dramatiq.Broker, clock: Clock) -> None:
    started: list[int] = []
    go_on = threading.Event()

    @dramatiq.actor(debounce={"wait": WAIT_MS, "key": lambda n: "during"}, max_retries=0)
    def sync(n: int) -> None:
        started.append(n)
        if n == 1:
            assert go_on.wait(TIMEOUT)

    sync.send(1)
    clock.advance(WAIT_MS)
    wait_until(lambda: started == [1], timeout=TIMEOUT, what="the first run")
    second = sync.send(2)  # the first run still runs: its record was taken, this one starts the next
    assert pending(broker, "during") == [second.message_id]
    clock.advance(WAIT_MS)
    wait_until(lambda: started == [1, 2], timeout=TIMEOUT, what="the second run")
    go_on.set()
    join(broker, sync.queue_name, timeout=int(TIMEOUT * 1000))
    assert started == [1, 2]


def test_a_hand_off_whose_sweeper_died_before_confirming_runs_once(clock: Clock) -> None:
    """A sweeper that pushed the run and died unconfirmed: the next sweep hands it off again, and
    the first copy, if it reached the broker, is stale (the contract's *generations*)."""
    with fakeredis_clock(lambda: clock.now_ms):
        backend = MemoryBackend(handoff_ttl_ms=500)
        key = "debounce:died"
        backend.debounce(key, "m1", b"one", wait_ms=100, max_wait_ms=100)
        clock.advance(100)
        [lost] = backend.sweep(key, limit=1).handoffs  # pushed, never confirmed
        assert backend.sweep(key, limit=1).handoffs == ()  # reserved: not handed off twice
        clock.advance(500)
        [again] = backend.sweep(key, limit=1).handoffs
        assert (again.waiter_id, again.payload) == ("m1", b"one")
        assert backend.confirm_handoff(key, "m1", ttl_ms=1, generation=again.generation)
        assert lost.generation is not None and again.generation is not None
        assert not backend.copy_is_live(key, "m1", lost.generation)
        assert backend.copy_is_live(key, "m1", again.generation)
        clock.advance(1)
        backend.sweep(key, limit=1)
        state = backend.inspect(key)
        assert (state.holders, state.waiters, state.reserved) == ((), (), ())  # nothing left but its token


class DebounceKeys:
    """A sweep member of the debounce keys that records the runs the sweep hands on."""

    prompt_prefix = "debounce:"

    def __init__(self, backend: GuardBackend) -> None:
        self._backend = backend
        self.handed: queue.Queue[str] = queue.Queue()

    def backend(self, broker: dramatiq.Broker) -> GuardBackend:
        return self._backend

    def claims(self, key: str) -> bool:
        return key.startswith(self.prompt_prefix)

    def sweep_limit(self, key: str) -> int:
        return 1

    def swept(self, broker: dramatiq.Broker, key: str, result: ReleaseResult) -> None:
        for handoff in result.handoffs:
            self.handed.put(handoff.waiter_id)


def test_a_pass_sweeps_again_when_the_first_run_ahead_is_due(redisdb: redis.Redis, stub_broker: Any) -> None:
    """A producer's run, not due at a pass: the pass learns when it is due (in its due_keys call) and
    the sweep hands it on then, without waiting for the next pass (an hour away here)."""
    backend = RedisBackend(redisdb)
    asked: list[list[str]] = []
    due_keys = backend.due_keys

    def spy(prompt: Sequence[str] = (), *, within_ms: int = 0) -> Due:
        asked.append(list(prompt))
        return due_keys(prompt, within_ms=within_ms)

    backend.due_keys = spy  # type: ignore[method-assign]
    backend.debounce("debounce:k", "m1", b"run", wait_ms=300, max_wait_ms=300)  # a producer's send
    member = DebounceKeys(backend)
    sweeper = join_sweep(member, stub_broker, interval_ms=3_600_000)
    try:
        sweeper.soon(0)  # a pass, as at each interval
        assert member.handed.get(timeout=TIMEOUT) == "m1"
    finally:
        leave_sweep(member, sweeper)
        sweeper.thread.join()
    assert asked == [["debounce:"], ["debounce:"]]  # that pass, and one when the run was due


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (-1, "wait must not be negative"),
        (0, "wait must be at least 1 ms"),
        ({"wait": 1_000, "max_wait": 500}, "max_wait must be None or at least wait"),
        ({"wait": 1_000, "wiat": 5}, "unknown key"),
        ({"max_wait": 5}, "wait"),
        ("soon", "not one of the allowed forms"),
    ],
)
def test_a_bad_debounce_fails_at_declaration_naming_what_is_wrong_and_the_allowed_forms(
    stub_broker: dramatiq.Broker, value: Any, reason: str
) -> None:
    dramatiq_guard.install(stub_broker)
    with pytest.raises(GuardOptionError, match=reason) as raised:

        @dramatiq.actor(debounce=value)
        def job() -> None: ...

    assert "debounce takes integer milliseconds or a datetime.timedelta" in str(raised.value)


def test_debounce_is_installed_before_retries_and_decides_first_at_enqueue(
    stub_broker: dramatiq.Broker,
) -> None:
    dramatiq_guard.install(stub_broker)
    names = [type(m).__name__ for m in stub_broker.middleware]
    assert names.index("Debounce") < names.index("Retries")
    assert debounce_of(stub_broker).gate_priority < min(
        m.gate_priority
        for m in stub_broker.middleware
        if hasattr(m, "gate_priority") and not isinstance(m, Debounce)
    )


def _shorthand_forms() -> list[Callable[[], Any]]:
    import datetime

    return [
        lambda: 250,
        lambda: datetime.timedelta(milliseconds=250),
        lambda: dramatiq_guard.DebouncePolicy(wait=250),
    ]


@pytest.mark.parametrize("form", _shorthand_forms())
def test_the_shorthands_are_a_wait(stub_broker: dramatiq.Broker, form: Callable[[], Any]) -> None:
    dramatiq_guard.install(stub_broker)

    @dramatiq.actor(debounce=form())
    def job() -> None: ...

    policy = debounce_of(stub_broker).guard_lists[job.actor_name][0].policy
    assert (policy.wait_ms, policy.max_wait) == (250, None)
