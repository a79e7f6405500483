"""``dramatiq-guard ledger show|prune`` against a real ledger (SQLite, and PostgreSQL / MariaDB)."""

from __future__ import annotations

import datetime
import io
import json

import pytest
import sqlalchemy as sa

from dramatiq_guard.cli import main
from dramatiq_guard.ledger import Ledger


def _run(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    status = main(list(argv), stdout=out)
    captured = capsys.readouterr()
    return status, out.getvalue() + captured.out, captured.err


def _ledger_with_rows(url: str) -> Ledger:
    ledger = Ledger(url)
    for key, amount in [("transfer-1", 10), ("transfer-2", 20)]:
        ledger.run(
            key,
            lambda amount=amount: {"moved": amount},  # type: ignore[misc]
            actor_name="transfer",
            payload={"amount": amount},
            fingerprint=f"fp-{amount}",
            holder=f"msg-{key}",
        )
    return ledger


def test_show_and_prune(sql_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = _ledger_with_rows(sql_url)

    status, out, err = _run("ledger", "show", "transfer-1", "--ledger", sql_url, "--json", capsys=capsys)
    assert (status, err) == (0, "")
    row = json.loads(out)
    assert row["key"] == "transfer-1"
    assert row["state"] == "completed"
    assert row["actor_name"] == "transfer"
    assert row["result"] == {"moved": 10}
    assert row["attempts"] == 1

    status, out, _ = _run("ledger", "show", "transfer-2", "--ledger", sql_url, capsys=capsys)
    assert status == 0
    assert "state:" in out and "completed" in out and '{"moved": 20}' in out

    status, out, err = _run("ledger", "show", "nope", "--ledger", sql_url, capsys=capsys)
    assert (status, out) == (1, "")
    assert err == "dramatiq-guard: error: no ledger row for idempotency key 'nope'\n"

    # Nothing is old enough; then age one row past the cutoff.
    assert _run("ledger", "prune", "--older-than", "30d", "--ledger", sql_url, capsys=capsys)[:2] == (
        0,
        "deleted 0 ledger row(s): finished more than 30d00h ago, or past their retention\n",
    )
    with ledger.engine.begin() as conn:
        old = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) - datetime.timedelta(days=31)
        t = ledger.table
        conn.execute(
            sa.update(t)
            .where(t.c.actor_name == "transfer", t.c.fingerprint == "fp-10")
            .values(updated_at=old)
        )
    status, out, _ = _run("ledger", "prune", "--older-than", "30d", "--ledger", sql_url, capsys=capsys)
    assert (status, out.split(":")[0]) == (0, "deleted 1 ledger row(s)")
    assert ledger.get("transfer-1") is None
    assert ledger.get("transfer-2") is not None
    ledger.dispose()


def test_ledger_url_from_the_environment(
    sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _ledger_with_rows(sqlite_url).dispose()
    monkeypatch.setenv("DRAMATIQ_GUARD_LEDGER_URL", sqlite_url)
    assert _run("ledger", "show", "transfer-1", capsys=capsys)[0] == 0


def test_ledger_errors(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run("ledger", "show", "k", "--ledger", "not a url", capsys=capsys)
    assert status == 2
    assert err.startswith("dramatiq-guard: error: bad ledger URL 'not a url'") and err.count("\n") == 1
    # A database without the ledger table: one line, not a traceback, and nothing created.
    status, _, err = _run("ledger", "show", "k", "--ledger", sqlite_url, capsys=capsys)
    assert status == 1
    assert err.startswith("dramatiq-guard: error: the ledger at sqlite:///") and err.count("\n") == 1
    assert "no such table" in err
    assert not sa.inspect(sa.create_engine(sqlite_url)).has_table("dramatiq_guard_ledger")
