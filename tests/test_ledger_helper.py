"""``testing_ledger.assert_idempotent`` catches a non-idempotent actor and passes a fixed one."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.brokers.stub import StubBroker

import dramatiq_guard
from dramatiq_guard.middleware.idempotency import Idempotency
from dramatiq_guard.testing_ledger import assert_idempotent

metadata = sa.MetaData()
emails = sa.Table(
    "emails",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("ticket", sa.String(50), nullable=False),
)


@pytest.fixture
def broker(sql_engine: sa.Engine, restore_global_broker: None) -> Iterator[StubBroker]:
    metadata.create_all(sql_engine)
    broker = StubBroker()
    broker.add_middleware(Idempotency(ledger=sql_engine))
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def sent(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [row.ticket for row in conn.execute(sa.select(emails.c.ticket))]


def test_it_fails_on_a_non_idempotent_actor(broker: StubBroker, sql_engine: sa.Engine) -> None:
    @dramatiq.actor(max_retries=0)
    def triage(ticket: str) -> None:
        with sql_engine.begin() as conn:  # its own transaction: every run sends again
            conn.execute(sa.insert(emails).values(ticket=ticket))

    with pytest.raises(AssertionError, match="triage is not idempotent"):
        assert_idempotent(triage, "T-1", effects=lambda: sent(sql_engine))
    assert sent(sql_engine) == ["T-1", "T-1"]


def test_it_passes_on_the_fixed_actor(broker: StubBroker, sql_engine: sa.Engine) -> None:
    @dramatiq.actor(max_retries=0, idempotency_key=lambda ticket: f"triage:{ticket}")
    def triage(ticket: str) -> None:
        dramatiq_guard.ledger_session().execute(sa.insert(emails).values(ticket=ticket))

    assert assert_idempotent(triage, "T-1", effects=lambda: sent(sql_engine)) == ["T-1"]
    assert sent(sql_engine) == ["T-1"]


def test_message_keys_and_redelivery(broker: StubBroker, sql_engine: sa.Engine) -> None:
    @dramatiq.actor(max_retries=0, idempotency_key=True)
    def triage(ticket: str) -> None:
        dramatiq_guard.ledger_session().execute(sa.insert(emails).values(ticket=ticket))

    assert_idempotent(triage, "T-1", effects=lambda: sent(sql_engine))  # the same message twice
    assert_idempotent(triage, "T-2", options={"idempotency_key": "t2"}, effects=lambda: sent(sql_engine))
    with pytest.raises(AssertionError, match="not idempotent"):  # two messages, each its own key
        assert_idempotent(triage, "T-3", same_message=False, effects=lambda: sent(sql_engine))


def test_a_run_that_raises_or_changes_nothing_fails(broker: StubBroker, sql_engine: sa.Engine) -> None:
    @dramatiq.actor(max_retries=0, idempotency_key=lambda ticket: ticket)
    def broken(ticket: str) -> None:
        raise RuntimeError("smtp down")

    @dramatiq.actor(max_retries=0, idempotency_key=lambda ticket: ticket)
    def idle(ticket: str) -> None: ...

    with pytest.raises(AssertionError, match="raised RuntimeError"):
        assert_idempotent(broken, "T-1", effects=lambda: sent(sql_engine))
    with pytest.raises(AssertionError, match="changed nothing"):
        assert_idempotent(idle, "T-2", effects=lambda: sent(sql_engine))
