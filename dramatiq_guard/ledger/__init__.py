"""The idempotency ledger: a message's effects committed at most once, in SQL (docs/ledger.md)."""

from dramatiq_guard.errors import IdempotencyConflict, LedgerError, UnstorableResult
from dramatiq_guard.ledger.engine import LEDGER_URL_ENV, default_ledger_url, default_sqlite_path
from dramatiq_guard.ledger.records import Claim, LedgerRecord, current_claim
from dramatiq_guard.ledger.schema import COMPLETED, DEFAULT_TABLE_NAME, FAILED, IN_PROGRESS, ledger_table
from dramatiq_guard.ledger.store import DEFAULT_RETENTION, Ledger

__all__ = [
    "COMPLETED",
    "DEFAULT_RETENTION",
    "DEFAULT_TABLE_NAME",
    "FAILED",
    "IN_PROGRESS",
    "LEDGER_URL_ENV",
    "Claim",
    "IdempotencyConflict",
    "Ledger",
    "LedgerError",
    "LedgerRecord",
    "UnstorableResult",
    "current_claim",
    "default_ledger_url",
    "default_sqlite_path",
    "ledger_table",
]
