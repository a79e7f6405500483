"""The ledger's exceptions (which of them Retries retries: docs/ledger.md, "Retries")."""

from __future__ import annotations

from dramatiq_guard.errors import IdempotencyConflict, LedgerError, UnstorableResult

__all__ = ["IdempotencyConflict", "LedgerError", "UnstorableResult"]
