"""The ``throttle`` actor option on a RedisBroker with real worker threads.

The invariant a user relies on: at most ``limit`` starts of a key in any window of ``period``,
read off the backend's own clock (each start's acquire time, as the key records it), every
message runs once, and a message over the limit waits parked, off the broker, consuming no retry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Retries
from harness import wait_until

import dramatiq_guard
from dramatiq_guard import GuardOptionError, Throttle

WAIT = 30.0
PERIOD = 1_000


def starts_of(broker: RedisBroker, key: str, holder: str) -> int:
    """When ``holder`` started holding ``key``, on the backend's clock (ms)."""
    throttle = next(m for m in broker.middleware if isinstance(m, Throttle))
    state = throttle.backend(broker).inspect(f"throttle:{key}")
    [since] = [since for h, since, _ in state.holder_info if h == holder]
    return since


@pytest.fixture
def guarded(redis_broker: RedisBroker) -> RedisBroker:
    dramatiq_guard.install(redis_broker)
    return redis_broker


@pytest.fixture
def worker(guarded: RedisBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(guarded, worker_threads=4, worker_timeout=50)
    yield worker
    worker.stop()


def assert_window(starts: list[int], limit: int, period: int) -> None:
    starts = sorted(starts)
    for first, later in zip(starts, starts[limit:], strict=False):
        assert later - first >= period, f"{limit + 1} starts within {later - first} ms: {starts}"


def test_at_most_limit_starts_in_any_window_and_every_message_runs_once(
    guarded: RedisBroker, worker: dramatiq.Worker, redisdb: redis.Redis
) -> None:
    starts: dict[int, int] = {}
    lock = threading.Lock()

    @dramatiq.actor(throttle={"limit": 2, "period": PERIOD, "key": lambda n: "partner"}, max_retries=0)
    def call(n: int) -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        assert message is not None
        since = starts_of(guarded, "partner", f"{message.message_id}:0")
        with lock:
            assert n not in starts
            starts[n] = since

    guarded.add_middleware(dramatiq.middleware.CurrentMessage())
    for n in range(6):
        call.send(n)
    assert redisdb.llen(f"dramatiq:{call.queue_name}") == 2  # the rest wait parked, off the broker
    worker.start()
    wait_until(lambda: len(starts) == 6, timeout=WAIT)
    assert sorted(starts) == list(range(6))
    assert_window(list(starts.values()), 2, PERIOD)


def test_a_retry_is_a_new_start(guarded: RedisBroker, worker: dramatiq.Worker) -> None:
    attempts: list[tuple[str, int]] = []
    done = threading.Event()

    @dramatiq.actor(
        throttle={"limit": 1, "period": PERIOD, "key": lambda: "once"},
        max_retries=1,
        min_backoff=1,
        max_backoff=1,
    )
    def flaky() -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        assert message is not None
        holder = f"{message.message_id}:{message.options.get('retries', 0)}"
        attempts.append((holder, starts_of(guarded, "once", holder)))
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")
        done.set()

    guarded.add_middleware(dramatiq.middleware.CurrentMessage())
    flaky.send()
    worker.start()
    assert done.wait(WAIT)
    (first, t1), (second, t2) = attempts
    assert first != second  # each attempt takes a place of its own
    assert t2 - t1 >= PERIOD  # the retry waited for the window


def test_a_limit_of_zero_halts_the_key_until_raised(guarded: RedisBroker, worker: dramatiq.Worker) -> None:
    ran = threading.Event()

    @dramatiq.actor(throttle={"limit": 1, "period": PERIOD, "key": lambda: "halted"})
    def job() -> None:
        ran.set()

    throttle = next(m for m in guarded.middleware if isinstance(m, Throttle))
    throttle.set_limit("halted", 0)
    job.send()
    worker.start()
    assert len(throttle.backend(guarded).inspect("throttle:halted").waiters) == 1  # parked at send
    throttle.set_limit("halted", None)
    assert ran.wait(WAIT)


@pytest.mark.parametrize("value", [5, {"limit": 2}, {"limit": 2, "period": 0}, {"limit": -1, "period": 10}])
def test_a_bad_throttle_fails_at_declaration_naming_the_allowed_forms(
    guarded: RedisBroker, value: Any
) -> None:
    with pytest.raises(GuardOptionError, match="throttle"):

        @dramatiq.actor(throttle=value)
        def job() -> None: ...


def test_throttle_sits_before_retries(guarded: RedisBroker) -> None:
    names = [type(m).__name__ for m in guarded.middleware]
    assert names.index("Throttle") < names.index(Retries.__name__)
