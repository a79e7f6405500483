"""A funds transfer that moves money once, however often it is sent or retried.

The transfer's writes go through ``dramatiq_guard.ledger_session()``: they commit in one
transaction with the ledger row that marks the transfer id done. Sent twice, redelivered after
a worker crash, or retried after a failure, it moves the money once; every later run returns
the first run's result.

Run it (PostgreSQL shown; any SQLAlchemy URL works, SQLite included)::

    export DRAMATIQ_GUARD_LEDGER_URL=postgresql+psycopg://postgres@127.0.0.1/test
    python examples/transfer.py setup                 # tables and two accounts
    dramatiq examples.transfer --processes 2 --threads 8
    python examples/transfer.py send t-1 1 2 10       # send it as often as you like
    python examples/transfer.py show

Two things besides the ledger make a transfer safe:

* Row locks in one order. Both accounts are locked with ``SELECT ... FOR UPDATE`` in id order,
  so two transfers between the same accounts in opposite directions wait for each other
  instead of deadlocking.
* Deadlocks (and lock wait timeouts) still happen with other code paths. The database aborts
  one transaction; the exception rolls the whole run back, ledger row included, and Retries
  runs it again (``min_backoff`` keeps that quick). A business refusal
  (:class:`InsufficientFunds`) is in ``throws``: not retried.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import dramatiq
import sqlalchemy as sa
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard
from dramatiq_guard.ledger import default_ledger_url
from dramatiq_guard.ledger.engine import create_engine

engine = create_engine(default_ledger_url())  # the accounts live in the ledger's database
broker = RedisBroker(url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
dramatiq_guard.install(broker, ledger=engine)
dramatiq.set_broker(broker)

metadata = sa.MetaData()
accounts = sa.Table(
    "example_accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)


class InsufficientFunds(Exception):
    """The source account cannot cover the amount (not retried)."""


@dramatiq.actor(
    idempotency_key=lambda transfer_id, *_: transfer_id,
    throws=(InsufficientFunds,),
    max_retries=10,
    min_backoff=100,
    max_backoff=5_000,
)
def transfer(transfer_id: str, source_id: int, destination_id: int, amount: int) -> dict[str, Any]:
    session = dramatiq_guard.ledger_session()
    ids = sorted({source_id, destination_id})
    locked = session.execute(
        sa.select(accounts).where(accounts.c.id.in_(ids)).order_by(accounts.c.id).with_for_update()
    ).all()
    balances = {row.id: row.balance for row in locked}
    if balances[source_id] < amount:
        raise InsufficientFunds(f"account {source_id} has {balances[source_id]}, needs {amount}")
    balance = accounts.c.balance
    session.execute(sa.update(accounts).where(accounts.c.id == source_id).values(balance=balance - amount))
    session.execute(
        sa.update(accounts).where(accounts.c.id == destination_id).values(balance=balance + amount)
    )
    return {
        "transfer_id": transfer_id,
        "source_balance": balances[source_id] - amount,
        "destination_balance": balances[destination_id] + amount,
    }


def main(argv: list[str]) -> None:
    command = argv[0] if argv else "show"
    if command == "setup":
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.delete(accounts))
            conn.execute(sa.insert(accounts), [{"id": 1, "balance": 100}, {"id": 2, "balance": 0}])
    elif command == "send":
        transfer_id, source, destination, amount = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        print(transfer.send(transfer_id, source, destination, amount))
    with engine.connect() as conn:
        print({row.id: row.balance for row in conn.execute(sa.select(accounts).order_by(accounts.c.id))})


if __name__ == "__main__":
    main(sys.argv[1:])
