"""The idempotency ledger's acceptance, with real ``dramatiq`` worker processes.

Each test runs on a SQLite file, PostgreSQL and MariaDB (``sql_url``).

* the same transfer sent 20 times with one key across 2 processes x 8 threads
  moves the balances once and leaves one completed row; every message returns
  the first run's result through the Results middleware;
* an actor that raises after writing commits nothing, and its retry commits once;
* a different payload under a used key fails with the documented error, at once,
  leaving the first result untouched;
* a worker SIGKILLed inside the actor (on RabbitMQ, which redelivers a dead
  consumer's messages at once): after redelivery the transfer is committed once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from dramatiq.results import ResultFailure
from harness import DramatiqWorker, Recorder

from dramatiq_guard.ledger import COMPLETED, Ledger
from dramatiq_guard.ledger.engine import LEDGER_URL_ENV

ACTORS = """
import os

import dramatiq
import sqlalchemy as sa
from dramatiq.results import Results
from dramatiq.results.backends.redis import RedisBackend
from harness import Gate, Recorder, broker_from_env, redis_url_from_env

import dramatiq_guard
from dramatiq_guard.ledger import current_claim
from dramatiq_guard.middleware.idempotency import Idempotency

broker = broker_from_env()
broker.add_middleware(Results(backend=RedisBackend(url=redis_url_from_env())))
broker.add_middleware(Idempotency())  # the ledger: DRAMATIQ_GUARD_LEDGER_URL
dramatiq.set_broker(broker)

QUEUE = os.environ["LEDGER_TEST_QUEUE"]
GATE = os.environ.get("LEDGER_TEST_GATE")

metadata = sa.MetaData()
accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)


def move(source, destination, amount):
    session = dramatiq_guard.ledger_session()
    ids = sorted((source, destination))  # lock in one order: no deadlock between transfers
    session.execute(sa.select(accounts.c.id).where(accounts.c.id.in_(ids)).order_by(accounts.c.id).with_for_update())
    balance = accounts.c.balance
    session.execute(sa.update(accounts).where(accounts.c.id == source).values(balance=balance - amount))
    session.execute(sa.update(accounts).where(accounts.c.id == destination).values(balance=balance + amount))


@dramatiq.actor(
    queue_name=QUEUE,
    store_results=True,
    idempotency_key=lambda transfer_id, *_: transfer_id,
    max_retries=3,
    min_backoff=10,
    max_backoff=50,
)
def transfer(transfer_id, source, destination, amount):
    move(source, destination, amount)
    if GATE:
        Recorder.from_env().record(event="inside", attempt=current_claim().attempt, pid=os.getpid())
        Gate.from_env(GATE).wait()
    return {"transfer_id": transfer_id, "pid": os.getpid(), "token": current_claim().fencing_token}


@dramatiq.actor(
    queue_name=QUEUE,
    store_results=True,
    idempotency_key=lambda transfer_id, *_: transfer_id,
    max_retries=3,
    min_backoff=10,
    max_backoff=50,
)
def flaky_transfer(transfer_id, source, destination, amount):
    move(source, destination, amount)
    if current_claim().attempt == 1:
        raise RuntimeError("failed after writing")
    return current_claim().attempt
"""

accounts_metadata = sa.MetaData()
accounts = sa.Table(
    "accounts",
    accounts_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)


def seed(engine: sa.Engine) -> None:
    accounts_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(accounts), [{"id": 1, "balance": 100}, {"id": 2, "balance": 0}])


def balances(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.id: row.balance for row in conn.execute(sa.select(accounts))}


def ledger_rows(engine: sa.Engine) -> list[Any]:
    table = Ledger(engine).table
    if not sa.inspect(engine).has_table(table.name):
        return []
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.idempotency_key)))


def test_twenty_sends_of_one_transfer_across_processes_and_threads_commit_once(
    sql_url: str,
    sql_engine: sa.Engine,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
) -> None:
    seed(sql_engine)
    env = {LEDGER_URL_ENV: sql_url, "LEDGER_TEST_QUEUE": unique_name}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    actors = actor_module(ACTORS)

    sends = [actors.transfer.send("t-1", 1, 2, 10) for _ in range(20)]
    flaky = actors.flaky_transfer.send("t-2", 1, 2, 5)
    dramatiq_worker("actors", processes=2, threads=8, env=env)

    results = [message.get_result(block=True, timeout=60_000) for message in sends]
    assert flaky.get_result(block=True, timeout=60_000) == 2  # its first run raised after writing
    first = results[0]
    assert all(result == first for result in results), results  # the first run's stored result
    assert balances(sql_engine) == {1: 85, 2: 15}  # 10 once, and 5 once

    rows = {row.idempotency_key: row for row in ledger_rows(sql_engine)}
    assert set(rows) == {"t-1", "t-2"}
    assert (rows["t-1"].state, rows["t-1"].attempts, rows["t-1"].result) == (COMPLETED, 1, first)
    assert (rows["t-2"].state, rows["t-2"].attempts) == (COMPLETED, 2)

    # The same key with another payload: the documented error, at once; the first result stays.
    other = actors.transfer.send("t-1", 1, 2, 99)
    with pytest.raises(ResultFailure, match=r"IdempotencyConflict.*'t-1' is bound to another payload"):
        other.get_result(block=True, timeout=60_000)
    assert balances(sql_engine) == {1: 85, 2: 15}
    row = {r.idempotency_key: r for r in ledger_rows(sql_engine)}["t-1"]
    assert (row.result, row.attempts) == (first, 1)


def test_a_worker_killed_inside_the_actor_commits_once_after_redelivery(
    sql_url: str,
    sql_engine: sa.Engine,
    unique_name: str,
    rabbitmq_url: str,
    rabbitmq_broker: Any,
    recorder: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
) -> None:
    seed(sql_engine)
    env = {
        LEDGER_URL_ENV: sql_url,
        "LEDGER_TEST_QUEUE": f"{unique_name}_ledger",
        "LEDGER_TEST_GATE": unique_name,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    actors = actor_module(ACTORS, broker_url=rabbitmq_url)
    message = actors.transfer.send("t-kill", 1, 2, 10)

    doomed = dramatiq_worker("actors", broker_url=rabbitmq_url, env=env)
    assert recorder.take_one(timeout=60)["attempt"] == 1  # inside, its writes not committed
    doomed.kill_worker()  # SIGKILL the worker process, inside the actor; the CLI then exits
    doomed.wait_exit()
    assert balances(sql_engine) == {1: 100, 2: 0}
    assert ledger_rows(sql_engine) == []  # a crashed run leaves nothing that blocks the key

    recorder.gate(unique_name).open()
    dramatiq_worker("actors", broker_url=rabbitmq_url, env=env)  # RabbitMQ redelivers the message
    assert recorder.take_one(timeout=60)["attempt"] == 1
    result = message.get_result(block=True, timeout=60_000)
    assert result["transfer_id"] == "t-kill"
    assert balances(sql_engine) == {1: 90, 2: 10}
    [row] = ledger_rows(sql_engine)
    assert (row.state, row.attempts, row.result) == (COMPLETED, 1, result)
