"""Every capability on ``async def`` actors (Dramatiq's AsyncIO middleware).

Dramatiq runs an async actor's coroutine on one event loop thread per
process while the worker thread blocks on it; the guards' hooks stay on the
worker thread, and the context variables they set there
(``current_lease()``, ``ledger_session()``) are copied into the coroutine.
Dedup, mutex and slots run on a RedisBroker with a real ``dramatiq`` worker
(releases and hand-offs happen in its hooks); the ledger on a StubBroker with
a ``dramatiq.Worker`` in this process, on each SQL backend.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import dramatiq
import pytest
import redis
import sqlalchemy as sa
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware.asyncio import AsyncIO
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend
from harness import DramatiqWorker, Recorder, guard_leftovers, wait_for_redis_broker_drain, wait_until

import dramatiq_guard
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.ledger import COMPLETED
from dramatiq_guard.middleware.dedup import deduplicated_by

Start = Callable[..., DramatiqWorker]

ACTORS = """
import asyncio

import dramatiq
from dramatiq.middleware.asyncio import AsyncIO
from harness import Gate, Recorder, broker_from_env

import dramatiq_guard

broker = broker_from_env()
broker.add_middleware(AsyncIO())
dramatiq_guard.install(broker, lease_ttl=2_000, sweep_interval=200)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


async def gate(name):
    # Off the event loop: the other coroutines of this process keep running.
    await asyncio.to_thread(Gate.from_env(name).wait, 60)


@dramatiq.actor(dedup={"strategy": "until_executed", "key": ["user_id"]}, max_retries=0)
async def refresh(user_id, fail=False):
    rec.record(event="start", user_id=user_id)
    await gate(f"refresh:{user_id}")
    if fail:
        raise RuntimeError("failed on purpose")
    rec.record(event="done", user_id=user_id)


async def exclusive(n):
    with rec.track("one") as running:
        lease = dramatiq_guard.current_lease()
        await asyncio.sleep(0.002)  # work: lets the other coroutines on the loop interleave
        rec.record(n=n, running=running, token=lease.token, holder=lease.holder, held=lease.held)


@dramatiq.actor(mutex={"on_busy": "park", "key": lambda n: "one"}, max_retries=0)
async def parking(n):
    await exclusive(n)


@dramatiq.actor(mutex={"on_busy": "wait", "wait": 60_000, "key": lambda n: "one"}, max_retries=0)
async def waiting(n):
    await exclusive(n)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n: "two"}, max_retries=0)
async def limited(n):
    with rec.track("two") as running:
        lease = dramatiq_guard.current_lease()
        await asyncio.sleep(0.002)
        rec.record(n=n, running=running, holder=lease.holder)
"""


def test_until_executed_is_released_when_the_async_holder_finishes(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: redis.Redis
) -> None:
    actors = actor_module(ACTORS)
    dramatiq_worker("actors", threads=2)
    backend = RedisBackend(redisdb)
    ok = actors.refresh.send(1)
    failing = actors.refresh.send(2, fail=True)
    assert sorted(r["user_id"] for r in recorder.take(2)) == [1, 2]  # both inside their coroutines

    assert deduplicated_by(actors.refresh.send(1)) == ok.message_id
    assert deduplicated_by(actors.refresh.send(2)) == failing.message_id

    recorder.gate("refresh:1").open()
    recorder.gate("refresh:2").open()
    done = recorder.take_one()
    assert (done["event"], done["user_id"]) == ("done", 1)
    for message in (ok, failing):  # success and final failure are both terminal
        key = message.options["dedup_lock"]
        wait_until(lambda k=key: backend.inspect(k).holders == (), 15, f"{key} released", redis=redisdb)  # type: ignore[misc]

    again = actors.refresh.send(1)
    assert deduplicated_by(again) is None
    recorder.gate("refresh:1").open()
    assert [r["event"] for r in recorder.take(2)] == ["start", "done"]
    wait_for_redis_broker_drain(redisdb)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


@pytest.mark.parametrize("actor", ["parking", "waiting"])
def test_an_async_mutex_never_runs_two_at_once_and_its_lease_is_visible_inside(
    actor: str,
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Start,
    recorder: Recorder,
    redisdb: redis.Redis,
) -> None:
    actors = actor_module(ACTORS)
    dramatiq_worker("actors", threads=4)
    sent = [getattr(actors, actor).send(n) for n in range(30)]
    records = recorder.take(30, timeout=60)
    assert sorted(r["n"] for r in records) == list(range(30))
    assert recorder.max_concurrency("one") == 1
    assert {r["holder"] for r in records} == {m.message_id for m in sent}  # the lease is the message's
    assert all(r["held"] for r in records)
    tokens = [r["token"] for r in records]
    assert tokens == sorted(tokens) and len(set(tokens)) == 30
    wait_for_redis_broker_drain(redisdb)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


def test_async_concurrency_slots_hold_the_limit_and_parked_messages_run_later(
    actor_module: Callable[..., ModuleType], dramatiq_worker: Start, recorder: Recorder, redisdb: redis.Redis
) -> None:
    actors = actor_module(ACTORS)
    sent = [actors.limited.send(n) for n in range(12)]
    state = RedisBackend(redisdb).inspect("concurrency:two")
    assert len(state.holders) == 2  # reservations of the two pushed messages
    parked = [w for w, _, is_parked in state.waiters if is_parked]
    assert parked == [m.message_id for m in sent[2:]]

    dramatiq_worker("actors", threads=4)
    records = recorder.take(12, timeout=60)
    assert sorted(r["n"] for r in records) == list(range(12))
    assert {r["holder"] for r in records} == {m.message_id for m in sent}
    assert recorder.max_concurrency("two") <= 2
    wait_for_redis_broker_drain(redisdb)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)


# --- the ledger -----------------------------------------------------------------------------

metadata = sa.MetaData()
accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)


def add(account_id: int, amount: int) -> sa.Update:
    return sa.update(accounts).where(accounts.c.id == account_id).values(balance=accounts.c.balance + amount)


class LedgerEnv:
    """A StubBroker with Results, AsyncIO and the guards (ledger on ``engine``), and a worker."""

    def __init__(self, engine: sa.Engine) -> None:
        self.results = StubBackend()
        self.broker = StubBroker()
        self.broker.add_middleware(Results(backend=self.results))
        self.broker.add_middleware(AsyncIO())
        dramatiq_guard.install(self.broker, ledger=engine)
        self.broker.emit_after("process_boot")
        dramatiq.set_broker(self.broker)
        self.worker = dramatiq.Worker(self.broker, worker_timeout=50, worker_threads=3)

    def close(self) -> None:
        self.worker.stop()
        self.broker.close()


@pytest.fixture
def ledger_env(sql_engine: sa.Engine, restore_global_broker: None) -> Iterator[LedgerEnv]:
    metadata.create_all(sql_engine)
    with sql_engine.begin() as conn:
        conn.execute(sa.insert(accounts), [{"id": 1, "balance": 100}, {"id": 2, "balance": 0}])
    env = LedgerEnv(sql_engine)
    yield env
    env.close()


def test_an_async_actors_ledger_writes_commit_once_and_results_get_the_stored_result(
    ledger_env: LedgerEnv, sql_engine: sa.Engine
) -> None:
    attempts: dict[str, int] = {}
    worker_threads: set[int] = set()
    lock = threading.Lock()

    @dramatiq.actor(
        idempotency_key=lambda transfer_id, amount: transfer_id,
        store_results=True,
        max_retries=3,
        min_backoff=10,
        max_backoff=20,
    )
    async def transfer(transfer_id: str, amount: int) -> dict[str, Any]:
        session = dramatiq_guard.ledger_session()  # set on the worker thread, seen in the coroutine
        with lock:
            attempts[transfer_id] = attempt = attempts.get(transfer_id, 0) + 1
        worker_threads.add(threading.get_ident())
        session.execute(
            sa.update(accounts).where(accounts.c.id == 1).values(balance=accounts.c.balance - amount)
        )
        await asyncio.sleep(0)
        session.execute(
            sa.update(accounts).where(accounts.c.id == 2).values(balance=accounts.c.balance + amount)
        )
        if transfer_id == "flaky" and attempt == 1:
            raise RuntimeError("after writing, on purpose")  # rolled back, then retried
        return {"transfer_id": transfer_id, "moved": amount}

    sent = [transfer.send("t1", 10) for _ in range(3)] + [transfer.send("flaky", 5)]
    ledger_env.worker.start()
    ledger_env.broker.join(transfer.queue_name, fail_fast=True)
    ledger_env.worker.join()

    results = [m.get_result(backend=ledger_env.results, block=True, timeout=10_000) for m in sent]
    assert results == [{"transfer_id": "t1", "moved": 10}] * 3 + [{"transfer_id": "flaky", "moved": 5}]
    assert attempts == {"t1": 1, "flaky": 2}
    with sql_engine.connect() as conn:
        assert dict(conn.execute(sa.select(accounts.c.id, accounts.c.balance)).all()) == {1: 85, 2: 15}
    ledger = next(m for m in ledger_env.broker.middleware if hasattr(m, "ledger")).ledger
    for key in ("t1", "flaky"):
        record = ledger.get(key)
        assert record is not None and record.state == COMPLETED
    # The coroutines ran on the event loop thread, not on the worker threads that ran the hooks.
    assert len(worker_threads) == 1
    assert threading.get_ident() not in worker_threads
