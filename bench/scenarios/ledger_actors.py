"""Worker-side actors of the ledger bench (``python -m dramatiq bench.scenarios.ledger_actors``).

Inert unless ``BENCH_LEDGER_DB_URL`` is set (the scenario loader imports every module here).
Every actor inserts one row; ``ledger_insert`` does it through the idempotency ledger (a new
key per message), ``plain_insert`` in a transaction of its own, ``floor_insert`` as the plain
one with two no-op statements more (the ledger's extra round trips, without their work). All
use the same Engine settings (the ledger's: for SQLite a 30 s lock timeout and write-ahead
logging).
"""

from __future__ import annotations

import os

import dramatiq
import sqlalchemy as sa

rows_metadata = sa.MetaData()
rows = sa.Table(
    "bench_rows",
    rows_metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("i", sa.Integer, nullable=False),
)

DB_URL = os.environ.get("BENCH_LEDGER_DB_URL")

if DB_URL:
    from dramatiq.brokers.redis import RedisBroker

    import dramatiq_guard
    from bench.actors import cross_finish_line, redis_url
    from dramatiq_guard.ledger.engine import create_engine
    from dramatiq_guard.middleware.idempotency import Idempotency

    engine = create_engine(DB_URL)
    broker = RedisBroker(url=redis_url())
    broker.add_middleware(Idempotency(ledger=engine))
    dramatiq.set_broker(broker)

    @dramatiq.actor(broker=broker, queue_name="bench_ledger", max_retries=0)
    def plain_insert(run_id: str, total: int, i: int) -> None:
        """Insert one row in its own transaction."""
        with engine.begin() as conn:
            conn.execute(sa.insert(rows).values(run_id=run_id, i=i))
        cross_finish_line(broker.client, run_id, total)

    @dramatiq.actor(broker=broker, queue_name="bench_ledger", max_retries=0)
    def floor_insert(run_id: str, total: int, i: int) -> None:
        """The floor of the ledger's cost: the plain insert with two more statements that do
        nothing (``SELECT 1``) in its transaction, as many round trips as the ledger's claim and
        its fenced update, and nothing else."""
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
            conn.execute(sa.insert(rows).values(run_id=run_id, i=i))
            conn.execute(sa.text("SELECT 1"))
        cross_finish_line(broker.client, run_id, total)

    @dramatiq.actor(
        broker=broker,
        queue_name="bench_ledger",
        max_retries=0,
        idempotency_key=lambda run_id, total, i: f"{run_id}:{i}",
    )
    def ledger_insert(run_id: str, total: int, i: int) -> None:
        """Insert one row through the ledger session (commits with the ledger row)."""
        dramatiq_guard.ledger_session().execute(sa.insert(rows).values(run_id=run_id, i=i))
        cross_finish_line(broker.client, run_id, total)
