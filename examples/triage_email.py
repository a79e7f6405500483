"""A triage email that goes out once: deliver, then mark, under a row lock.

An email is an outside effect: no database transaction can take it back. The pattern is
check-state-then-change-state, with the state in the database and a row lock around both:

1. the ledger claims the key ``triage-email:<ticket_id>`` and holds its row lock while the
   actor runs, so a second worker with the same job waits, then finds it completed and does
   not send (two workers that pick the job at the same moment never both send);
2. the actor locks the ticket's notification row (``SELECT ... FOR UPDATE``) and checks it:
   other code paths that send for this ticket (a "resend" button, another actor) take the
   same lock and see the same state;
3. it sends, then marks the row sent through ``ledger_session()``: the mark commits together
   with the ledger's "completed".

What remains: a worker that dies after the provider accepted the email and before the commit
leaves no mark, so the redelivered job sends again (at least once, never twice *because of a
retry or a duplicate job*). Pass the idempotency key to a provider that deduplicates by it
(many transactional email APIs take an idempotency key or a custom Message-ID) to close that
gap too.

Run it::

    export DRAMATIQ_GUARD_LEDGER_URL=sqlite:////tmp/triage.sqlite3
    python examples/triage_email.py setup
    dramatiq examples.triage_email
    python examples/triage_email.py send 42     # as often as you like: one email
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any

import dramatiq
import sqlalchemy as sa
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard
from dramatiq_guard.ledger import current_claim, default_ledger_url
from dramatiq_guard.ledger.engine import create_engine

engine = create_engine(default_ledger_url())
broker = RedisBroker(url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
dramatiq_guard.install(broker, ledger=engine)
dramatiq.set_broker(broker)
logger = logging.getLogger("triage_email")

metadata = sa.MetaData()
notifications = sa.Table(
    "example_triage_notifications",
    metadata,
    sa.Column("ticket_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("state", sa.String(16), nullable=False),  # pending | sent
    sa.Column("sent_at", sa.DateTime, nullable=True),
    sa.Column("provider_message_id", sa.String(255), nullable=True),
)


def deliver(ticket_id: int, *, idempotency_key: str) -> str:
    """Stands for the email provider's API call; returns its message id."""
    logger.warning("Sending the triage email of ticket %s (key %s).", ticket_id, idempotency_key)
    return f"<{idempotency_key}@example.invalid>"


@dramatiq.actor(
    idempotency_key=lambda ticket_id: f"triage-email:{ticket_id}", max_retries=5, min_backoff=1_000
)
def triage_email(ticket_id: int) -> dict[str, Any]:
    session = dramatiq_guard.ledger_session()
    row = session.execute(
        sa.select(notifications).where(notifications.c.ticket_id == ticket_id).with_for_update()
    ).first()
    if row is not None and row.state == "sent":  # another code path sent it already
        return {
            "ticket_id": ticket_id,
            "status": "already sent",
            "provider_message_id": row.provider_message_id,
        }
    provider_message_id = deliver(ticket_id, idempotency_key=current_claim().key)
    values = {"state": "sent", "sent_at": datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)}
    values["provider_message_id"] = provider_message_id
    if row is None:
        session.execute(sa.insert(notifications).values(ticket_id=ticket_id, **values))
    else:
        session.execute(
            sa.update(notifications).where(notifications.c.ticket_id == ticket_id).values(**values)
        )
    return {"ticket_id": ticket_id, "status": "sent", "provider_message_id": provider_message_id}


def main(argv: list[str]) -> None:
    command = argv[0] if argv else "show"
    if command == "setup":
        metadata.create_all(engine)
    elif command == "send":
        print(triage_email.send(int(argv[1])))
    with engine.connect() as conn:
        for row in conn.execute(sa.select(notifications)):
            print(dict(row._mapping))


if __name__ == "__main__":
    main(sys.argv[1:])
