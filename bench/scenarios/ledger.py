"""The idempotency ledger: an actor that inserts one row, with and without the ledger."""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import sqlalchemy as sa
from dramatiq.brokers.stub import StubBroker

import dramatiq_guard
from bench.core import Context, Figure, scenario
from bench.scenarios.ledger_actors import rows, rows_metadata
from dramatiq_guard.ledger.engine import create_engine
from dramatiq_guard.middleware.idempotency import Idempotency

PROCESSES, THREADS = 2, 8
ACTORS = "bench.scenarios.ledger_actors"


@contextlib.contextmanager
def _sqlite_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"


@contextlib.contextmanager
def _postgres_url() -> Iterator[str | None]:
    from harness import services

    if services.unreachable(services.POSTGRES) is not None:
        yield None
        return
    base = sa.make_url(services.POSTGRES.url)
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False
        )
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


class _Statements:
    """Counts what one connection pool sends: cursor executions and COMMIT/ROLLBACK."""

    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", self._statement)
        sa.event.listen(engine, "rollback", self._statement)

    def _statement(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1


def _statements_per_job(url: str, n: int) -> tuple[float, float, float]:
    """Statements per job: plain insert, ledger insert (new key), ledger duplicate (completed key)."""
    engine = create_engine(url)
    rows_metadata.create_all(engine)
    broker = StubBroker()
    broker.add_middleware(Idempotency(ledger=engine))
    tag = uuid.uuid4().hex[:8]

    @dramatiq.actor(broker=broker, actor_name=f"count_{tag}", idempotency_key=lambda i: f"{tag}:{i}")
    def ledger_insert(i: int) -> None:
        dramatiq_guard.ledger_session().execute(sa.insert(rows).values(run_id=tag, i=i))

    def plain_insert(i: int) -> None:
        with engine.begin() as conn:
            conn.execute(sa.insert(rows).values(run_id=tag, i=i))

    ledger_insert(-1)  # creates the ledger table; not counted
    counter = _Statements(engine)
    figures = []
    for call in (plain_insert, ledger_insert, ledger_insert):  # the third: every key completed
        counter.count = 0
        for i in range(n):
            call(i)
        figures.append(counter.count / n)
    broker.close()
    engine.dispose()
    return figures[0], figures[1], figures[2]


@scenario("ledger", title="Idempotency ledger: one-row insert, with and without the ledger", order=40)
def ledger(ctx: Context) -> list[Figure]:
    """An actor that inserts one row, plain (its own transaction) or through the ledger
    (``idempotency_key=``, a new key per message, the row written through ``ledger_session()``),
    on a SQLite file and on PostgreSQL (a fresh schema; skipped if unreachable).

    * drain rate: a real ``dramatiq`` worker (2 processes x 8 threads) on the run's RedisBroker;
      the clock runs from the first of N sends to the last completion, as in the baseline.
      SQLite has one writer at a time, so its figures measure lock hand-offs more than work.
    * floor: the plain insert with two ``SELECT 1`` in its transaction: the two round trips the
      ledger adds (its claim and its fenced update) and nothing else, so the ledger's rate can be
      read against what two round trips cost on this machine.
    * statements per job: every cursor execution plus COMMIT/ROLLBACK, counted with
      SQLAlchemy's ``before_cursor_execute`` / ``commit`` / ``rollback`` events, over N direct
      calls of the actor in this process (the same code path as in a worker). "duplicate" is
      a message whose key is already completed: it returns the stored result.
    """
    n_drain = ctx.n(2000, 100)
    n_count = ctx.n(200, 20)
    actors_env = "BENCH_LEDGER_DB_URL"
    figures: list[Figure] = []
    with _sqlite_url() as sqlite_url, _postgres_url() as postgres_url:
        for name, url in (("sqlite", sqlite_url), ("postgres", postgres_url)):
            if url is None:
                continue
            plain, guarded, duplicate = _statements_per_job(url, n_count)
            os.environ[actors_env] = url
            try:
                actors = importlib.reload(importlib.import_module(ACTORS))
                ctx.flush()
                ctx.worker(ACTORS, processes=PROCESSES, threads=THREADS, env={actors_env: url})
                plain_rate = ctx.drain_rate(
                    lambda run_id, total, i, a=actors: a.plain_insert.send(run_id, total, i),  # type: ignore[misc]
                    n_drain,
                )
                floor_rate = ctx.drain_rate(
                    lambda run_id, total, i, a=actors: a.floor_insert.send(run_id, total, i),  # type: ignore[misc]
                    n_drain,
                )
                ledger_rate = ctx.drain_rate(
                    lambda run_id, total, i, a=actors: a.ledger_insert.send(run_id, total, i),  # type: ignore[misc]
                    n_drain,
                )
                ctx.stop_workers()
                actors.broker.close()
                actors.engine.dispose()
            finally:
                del os.environ[actors_env]
            sized = f"N={n_drain}, {PROCESSES} processes x {THREADS} threads, median of {ctx.repeats}"
            figures += [
                Figure(
                    f"{name}_plain_rate",
                    f"{name}: drain rate, plain insert",
                    plain_rate,
                    "msg/s",
                    detail=sized,
                ),
                Figure(
                    f"{name}_floor_rate",
                    f"{name}: drain rate, floor: plain insert + 2 no-op statements",
                    floor_rate,
                    "msg/s",
                    vs=f"ledger/{name}_plain_rate",
                    detail=f"{sized}; SELECT 1 before and after the INSERT, in its transaction: the "
                    "ledger's two extra round trips and nothing else",
                ),
                Figure(
                    f"{name}_ledger_rate",
                    f"{name}: drain rate, insert through the ledger",
                    ledger_rate,
                    "msg/s",
                    vs=f"ledger/{name}_plain_rate",
                    detail=sized,
                ),
                Figure(
                    f"{name}_plain_statements",
                    f"{name}: statements per job, plain insert",
                    plain,
                    better="lower",
                    detail=f"over {n_count} jobs (INSERT, COMMIT)",
                ),
                Figure(
                    f"{name}_ledger_statements",
                    f"{name}: statements per job, through the ledger",
                    guarded,
                    vs=f"ledger/{name}_plain_statements",
                    compare="delta",
                    better="lower",
                    detail=f"over {n_count} jobs, new keys (claim INSERT, INSERT, fenced UPDATE, COMMIT)",
                ),
                Figure(
                    f"{name}_duplicate_statements",
                    f"{name}: statements per duplicate (completed key)",
                    duplicate,
                    better="lower",
                    detail=f"over {n_count} jobs (claim INSERT, SELECT ... FOR UPDATE, ROLLBACK)",
                ),
            ]
    return figures
