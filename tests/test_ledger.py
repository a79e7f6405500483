"""The idempotency ledger on each SQL backend (SQLite file, PostgreSQL, MariaDB).

The middleware tests run a real ``dramatiq.Worker`` (threads) on a StubBroker
in this process against a real database; the multi-process acceptance tests
are in ``test_ledger_workers.py``.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.brokers.stub import StubBroker
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend

import dramatiq_guard
from dramatiq_guard import events
from dramatiq_guard.errors import GuardOptionError, LeaseLost
from dramatiq_guard.ledger import (
    COMPLETED,
    FAILED,
    IdempotencyConflict,
    Ledger,
    current_claim,
    default_sqlite_path,
    ledger_table,
)
from dramatiq_guard.ledger.engine import LEDGER_URL_ENV, resolve_engine
from dramatiq_guard.middleware.idempotency import Idempotency

# --- helpers --------------------------------------------------------------------------------

metadata = sa.MetaData()
accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)
entries = sa.Table(
    "entries",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("note", sa.String(100), nullable=False),
)


@pytest.fixture
def db(sql_engine: sa.Engine) -> sa.Engine:
    metadata.create_all(sql_engine)
    with sql_engine.begin() as conn:
        conn.execute(sa.insert(accounts), [{"id": 1, "balance": 100}, {"id": 2, "balance": 0}])
    return sql_engine


def balances(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.id: row.balance for row in conn.execute(sa.select(accounts))}


def notes(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [row.note for row in conn.execute(sa.select(entries.c.note).order_by(entries.c.id))]


def move(amount: int) -> None:
    session = dramatiq_guard.ledger_session()
    session.execute(sa.update(accounts).where(accounts.c.id == 1).values(balance=accounts.c.balance - amount))
    session.execute(sa.update(accounts).where(accounts.c.id == 2).values(balance=accounts.c.balance + amount))


class Env:
    """A StubBroker with Results and the ledger, and a worker running it."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.results = StubBackend()
        self.broker = StubBroker()
        self.broker.add_middleware(Results(backend=self.results))
        self.idempotency = Idempotency(ledger=engine)
        self.broker.add_middleware(self.idempotency)
        self.broker.emit_after("process_boot")
        dramatiq.set_broker(self.broker)
        self.worker = dramatiq.Worker(self.broker, worker_timeout=50, worker_threads=2)
        self.worker.start()

    @property
    def ledger(self) -> Ledger:
        return self.idempotency.ledger

    def drain(self, queue: str = "default") -> None:
        self.broker.join(queue, fail_fast=True)
        self.worker.join()

    def result(self, message: dramatiq.Message[Any]) -> Any:
        return message.get_result(backend=self.results, block=True, timeout=10_000)

    def close(self) -> None:
        self.worker.stop()
        self.broker.close()


@pytest.fixture
def env(db: sa.Engine, restore_global_broker: None) -> Iterator[Env]:
    e = Env(db)
    yield e
    e.close()


# --- the Ledger alone -----------------------------------------------------------------------


def test_a_key_runs_once_and_then_returns_its_stored_result(db: sa.Engine) -> None:
    ledger = Ledger(db)
    runs = []

    def work() -> dict[str, int]:
        runs.append(1)
        move(10)
        return {"moved": 10}

    kw: dict[str, Any] = {"actor_name": "t", "payload": {"a": 1}, "fingerprint": "f1"}
    assert ledger.run("k", work, holder="m1", **kw) == {"moved": 10}
    assert ledger.run("k", work, holder="m2", **kw) == {"moved": 10}
    assert len(runs) == 1
    assert balances(db) == {1: 90, 2: 10}
    record = ledger.get("k")
    assert record is not None
    assert (record.state, record.attempts, record.holder, record.fencing_token) == (COMPLETED, 1, "m1", 1)
    assert record.result == {"moved": 10}
    assert record.expires_at is not None and record.completed_at is not None
    assert record.expires_at - record.completed_at == datetime.timedelta(days=7)


class _Sink:
    def __init__(self) -> None:
        self.counts: list[tuple[str, str]] = []

    def count(self, event: str, actor: str) -> None:
        self.counts.append((event, actor))

    def holders(self, actor: str, delta: int) -> None: ...

    def waiters(self, actor: str, delta: int) -> None: ...

    def lock_waited(self, actor: str, duration_ms: float) -> None: ...


def test_a_stored_result_counts_a_ledger_hit(db: sa.Engine) -> None:
    ledger = Ledger(db)
    sink = _Sink()
    previous = events.set_sink(sink)
    try:
        for holder in ("m1", "m2"):
            ledger.run("k", lambda: 1, actor_name="t", payload={}, fingerprint="f", holder=holder)
    finally:
        events.set_sink(previous)
    assert sink.counts == [("ledger_hit", "t")]


def test_work_that_raises_commits_nothing_and_the_retry_commits_once(db: sa.Engine) -> None:
    ledger = Ledger(db)
    kw: dict[str, Any] = {"actor_name": "t", "payload": {}, "fingerprint": "f"}

    def failing() -> None:
        move(10)
        raise RuntimeError("after writing")

    with pytest.raises(RuntimeError):
        ledger.run("k", failing, holder="m1", **kw)
    assert balances(db) == {1: 100, 2: 0}
    record = ledger.get("k")
    assert record is not None
    assert (record.state, record.attempts, record.error) == (FAILED, 1, "RuntimeError: after writing")

    assert ledger.run("k", lambda: move(10), holder="m1", **kw) is None
    assert balances(db) == {1: 90, 2: 10}
    record = ledger.get("k")
    assert record is not None
    assert (record.state, record.attempts, record.fencing_token) == (COMPLETED, 2, 2)


def test_a_different_payload_under_a_used_key_names_both_and_leaves_the_row(db: sa.Engine) -> None:
    ledger = Ledger(db)
    ledger.run("k", lambda: "first", actor_name="t", payload={"amount": 1}, fingerprint="a" * 64, holder="m1")
    with pytest.raises(IdempotencyConflict) as raised:
        ledger.run(
            "k", lambda: "second", actor_name="t", payload={"amount": 2}, fingerprint="b" * 64, holder="m2"
        )
    message = str(raised.value)
    assert "a" * 64 in message and "b" * 64 in message
    assert "{'amount': 1}" in message and "{'amount': 2}" in message and "'m1'" in message
    record = ledger.get("k")
    assert record is not None and (record.result, record.holder) == ("first", "m1")


def test_the_completion_is_fenced_on_the_token_read_at_the_claim(db: sa.Engine) -> None:
    ledger = Ledger(db)
    table = ledger.table

    def changes_the_row_under_its_holder() -> None:
        move(10)
        # Stands for a newer holder taking the key over: the row's token moves on.
        dramatiq_guard.ledger_session().execute(
            sa.update(table).values(fencing_token=table.c.fencing_token + 5)
        )

    with pytest.raises(LeaseLost):
        ledger.run(
            "k", changes_the_row_under_its_holder, actor_name="t", payload={}, fingerprint="f", holder="m"
        )
    assert balances(db) == {1: 100, 2: 0}
    assert (
        ledger.run(
            "k",
            lambda: current_claim().fencing_token,
            actor_name="t",
            payload={},
            fingerprint="f",
            holder="m",
        )
        == 1
    )


def test_retention_and_prune(db: sa.Engine) -> None:
    ledger = Ledger(db, retention=0)
    calls = []
    kw: dict[str, Any] = {"actor_name": "t", "payload": {}, "fingerprint": "f"}
    ledger.run("gone", lambda: calls.append(1), holder="m1", **kw)
    ledger.run("gone", lambda: calls.append(1), holder="m2", **kw)  # expired: counts as absent
    assert len(calls) == 2
    record = ledger.get("gone")
    assert record is not None and record.fencing_token == 2  # the token still only grows
    kept = Ledger(db, retention=None)
    kept.run("kept", lambda: None, holder="m3", **kw)
    assert ledger.prune() == 1
    assert ledger.get("gone") is None and ledger.get("kept") is not None
    assert ledger.prune(older_than=datetime.timedelta(0)) == 1
    assert ledger.get("kept") is None


def test_a_new_key_costs_two_statements_and_shares_the_commit(db: sa.Engine) -> None:
    ledger = Ledger(db)
    ledger.prepare()
    statements: list[str] = []
    sa.event.listen(
        db, "before_cursor_execute", lambda conn, cursor, sql, *args: statements.append(sql.split()[0])
    )
    ledger.run("k", lambda: move(1), actor_name="t", payload={}, fingerprint="f", holder="m")
    claim = ["INSERT"] if db.dialect.name != "mysql" else ["INSERT", "SELECT"]  # MariaDB cannot tell inserted
    assert statements == [
        *claim,
        "UPDATE",
        "UPDATE",
        "UPDATE",
    ]  # claim, the work's two, the fenced completion


def test_the_table_lives_on_a_user_metadata(db: sa.Engine) -> None:
    mine = sa.MetaData()
    table = ledger_table(mine, "my_ledger")
    assert ledger_table(mine, "my_ledger") is table
    ledger = Ledger(db, metadata=mine, table_name="my_ledger")
    assert ledger.table is table
    ledger.run("k" * 300, lambda: 1, actor_name="t", payload={}, fingerprint="f", holder="m")
    assert sa.inspect(db).has_table("my_ledger")
    record = ledger.get("k" * 300)
    assert record is not None and record.key.startswith("sha256:")


def test_keys_are_compared_exactly_trailing_spaces_and_case_included(db: sa.Engine) -> None:
    # MariaDB/MySQL's PAD SPACE collations compare "a" and "a " as equal: the second key
    # would find the first's row and be refused as a conflict.
    ledger = Ledger(db)
    keys = ["a", "a ", "a  ", "A", " a", "é", "e\u0301"]
    for n, key in enumerate(keys):
        result = ledger.run(
            key,
            functools.partial(str, key),
            actor_name="t",
            payload={"n": n},
            fingerprint=f"f{n}",
            holder=f"m{n}",
        )
        assert result == key
    for n, key in enumerate(keys):
        record = ledger.get(key)
        assert record is not None
        assert (record.key, record.fingerprint, record.result) == (key, f"f{n}", key)
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(ledger.table)).scalar() == len(keys)


def test_a_mariadb_table_with_the_old_padded_key_is_named_and_converts_in_place(
    mariadb_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    Ledger(mariadb_engine).create_all()
    with mariadb_engine.begin() as conn:  # the column as 0.1.0.dev0 created it
        conn.execute(
            sa.text(
                "ALTER TABLE dramatiq_guard_ledger MODIFY idempotency_key"
                " VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
            )
        )
    kw: dict[str, Any] = {"actor_name": "t", "payload": {}, "holder": "m"}
    with caplog.at_level("WARNING", logger="dramatiq_guard.ledger.store"):
        Ledger(mariadb_engine).run("a", lambda: "old", fingerprint="f0", **kw)
    assert "ALTER TABLE dramatiq_guard_ledger MODIFY idempotency_key VARBINARY(1020) NOT NULL" in caplog.text

    caplog.clear()
    with mariadb_engine.begin() as conn:  # the statement the CHANGELOG and docs/ledger.md give
        conn.execute(
            sa.text("ALTER TABLE dramatiq_guard_ledger MODIFY idempotency_key VARBINARY(1020) NOT NULL")
        )
    ledger = Ledger(mariadb_engine)
    with caplog.at_level("WARNING", logger="dramatiq_guard.ledger.store"):
        assert ledger.run("a", lambda: "again", fingerprint="f0", **kw) == "old"  # the existing row
        assert ledger.run("a ", lambda: "new", fingerprint="f1", **kw) == "new"
    assert caplog.text == ""


def test_the_default_ledger_is_a_sqlite_file_in_the_user_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LEDGER_URL_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_sqlite_path() == tmp_path / "dramatiq-guard" / "ledger.sqlite3"
    ledger = Ledger()
    ledger.run("k", lambda: 1, actor_name="t", payload={}, fingerprint="f", holder="m")
    assert (tmp_path / "dramatiq-guard" / "ledger.sqlite3").exists()
    ledger.dispose()
    monkeypatch.setenv(LEDGER_URL_ENV, f"sqlite:///{tmp_path / 'env.sqlite3'}")
    assert resolve_engine(None).url.database == str(tmp_path / "env.sqlite3")


# --- the middleware -------------------------------------------------------------------------


def test_a_completed_key_returns_the_first_result_to_results(env: Env) -> None:
    runs = []

    @dramatiq.actor(store_results=True, idempotency_key=lambda transfer_id, amount: transfer_id)
    def transfer(transfer_id: str, amount: int) -> dict[str, Any]:
        runs.append(transfer_id)
        move(amount)
        return {"transfer": transfer_id, "run": len(runs)}

    first = transfer.send("t-1", 10)
    env.drain()
    second = transfer.send("t-1", 10)
    env.drain()
    assert env.result(first) == {"transfer": "t-1", "run": 1}
    assert env.result(second) == {"transfer": "t-1", "run": 1}
    assert runs == ["t-1"]
    assert balances(env.engine) == {1: 90, 2: 10}


def test_a_raising_actor_commits_nothing_and_its_retry_commits_once(env: Env) -> None:
    @dramatiq.actor(idempotency_key=["transfer_id"], max_retries=3, min_backoff=1, max_backoff=1)
    def transfer(transfer_id: str, amount: int) -> None:
        move(amount)
        if current_claim().attempt == 1:
            raise RuntimeError("after writing")

    transfer.send("t-1", 10)
    env.drain()
    assert balances(env.engine) == {1: 90, 2: 10}
    [row] = _rows(env)
    assert row.idempotency_key.startswith("transfer:")  # argument names: scoped to the actor, digested
    assert (row.state, row.attempts) == (COMPLETED, 2)


def test_a_different_payload_fails_without_retries_and_the_first_result_stays(env: Env) -> None:
    runs = []

    @dramatiq.actor(store_results=True, idempotency_key=lambda transfer_id, amount: transfer_id)
    def transfer(transfer_id: str, amount: int) -> int:
        runs.append(amount)
        move(amount)
        return amount

    first = transfer.send("t-1", 10)
    env.drain()
    transfer.send("t-1", 99)
    with pytest.raises(IdempotencyConflict, match="'t-1' is bound to another payload"):
        env.drain()
    env.worker.join()
    assert runs == [10]
    assert len(env.broker.dead_letters) == 1
    assert "retries" not in env.broker.dead_letters[0].options  # failed at once, never retried
    assert env.result(first) == 10
    assert balances(env.engine) == {1: 90, 2: 10}


def test_message_level_keys(env: Env) -> None:
    runs = []

    @dramatiq.actor(store_results=True, idempotency_key=True)
    def charge(amount: int) -> int:
        runs.append(amount)
        return len(runs)

    @dramatiq.actor
    def unguarded(amount: int) -> None: ...

    a = charge.send_with_options(args=(5,), idempotency_key="order-1")
    b = charge.send_with_options(args=(5,), idempotency_key="order-1")
    c = charge.send(5)  # no key: its message_id
    env.drain()
    env.broker.enqueue(c)  # the same message again (a redelivery)
    env.drain()
    assert env.result(a) == env.result(b) != env.result(c)
    assert runs == [5, 5]
    with pytest.raises(GuardOptionError, match="not declared with idempotency_key="):
        unguarded.send_with_options(args=(5,), idempotency_key="order-2")
    with pytest.raises(GuardOptionError, match="non-empty str"):
        charge.send_with_options(args=(5,), idempotency_key=7)


def test_the_actor_cannot_commit_or_escape_the_ledger_transaction(env: Env) -> None:
    @dramatiq.actor(idempotency_key=lambda note: note, max_retries=0)
    def write(note: str) -> None:
        session = dramatiq_guard.ledger_session()
        session.execute(sa.insert(entries).values(note=note))
        session.commit()  # joins the ledger transaction: commits nothing on its own
        raise RuntimeError("after commit")

    write.send("a")
    with pytest.raises(RuntimeError):
        env.drain()
    assert notes(env.engine) == []


def test_a_direct_call_goes_through_the_ledger(env: Env) -> None:
    @dramatiq.actor(idempotency_key=lambda note: note)
    def write(note: str) -> None:
        dramatiq_guard.ledger_session().execute(sa.insert(entries).values(note=note))

    write("a")
    write("a")
    assert notes(env.engine) == ["a"]


def test_bad_option_values_fail_at_declaration(env: Env) -> None:
    with pytest.raises(ValueError, match=r"actor 'nope': idempotency_key='x' is not valid"):

        @dramatiq.actor(actor_name="nope", idempotency_key="x")
        def nope() -> None: ...

    with pytest.raises(ValueError, match="does not take"):

        @dramatiq.actor(actor_name="nope2", idempotency_key=["missing"])
        def nope2(present: int) -> None: ...


def test_two_threads_on_one_key_never_both_run(env: Env) -> None:
    inside = threading.Event()
    release = threading.Event()
    runs = []

    @dramatiq.actor(store_results=True, idempotency_key=lambda k: k)
    def slow(k: str) -> int:
        runs.append(k)
        move(1)
        inside.set()
        assert release.wait(10)
        return len(runs)

    first = slow.send("k")
    assert inside.wait(10)
    second = slow.send("k")  # the second worker thread blocks on the first's lock
    release.set()
    env.drain()
    assert env.result(first) == env.result(second) == 1
    assert runs == ["k"]
    assert balances(env.engine) == {1: 99, 2: 1}


def _rows(env: Env) -> list[Any]:
    with env.engine.connect() as conn:
        return list(conn.execute(sa.select(env.ledger.table)))
