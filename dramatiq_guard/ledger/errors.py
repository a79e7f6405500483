"""The ledger's exceptions.

Which of them Retries retries:

* :class:`IdempotencyConflict` and :class:`UnstorableResult` are permanent:
  running the message again cannot succeed. The :class:`~dramatiq_guard.Idempotency`
  middleware adds them to each guarded actor's ``throws`` option, so Retries
  fails the message at once (dead-letter) instead of looping.
* :class:`~dramatiq_guard.errors.LeaseLost` (the final fenced UPDATE found a
  newer holder) and any database error (a deadlock, a lock wait timeout, a lost
  connection) are retried like any other exception: the retry either finds the
  key completed and returns its stored result, or runs it.
"""

from __future__ import annotations

from dramatiq_guard.errors import IdempotencyConflict, LedgerError, UnstorableResult

__all__ = ["IdempotencyConflict", "LedgerError", "UnstorableResult"]
