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

import reprlib
from typing import Any

from dramatiq_guard.errors import GuardError

_repr = reprlib.Repr()
_repr.maxstring = 200
_repr.maxother = 200
_repr.maxlevel = 4


class LedgerError(GuardError):
    """Base class of the idempotency ledger's errors."""


class IdempotencyConflict(LedgerError):
    """An idempotency key already in the ledger was used with a different payload.

    The key is bound to the payload (actor name and arguments) of its first
    use until its row expires. The stored row is left untouched. Not retried.

    Parameters:
      key(str): The idempotency key.
      stored_fingerprint(str): The fingerprint the key is bound to.
      fingerprint(str): The fingerprint of the message that was refused.
      stored_payload: The payload the key is bound to (``{"actor", "arguments"}``).
      payload: The refused message's payload.
      holder(str): The message that first used the key (its ``message_id``).
    """

    def __init__(
        self,
        key: str,
        *,
        stored_fingerprint: str,
        fingerprint: str,
        stored_payload: Any,
        payload: Any,
        holder: str | None,
    ) -> None:
        super().__init__(
            f"idempotency key {key!r} is bound to another payload: it was first used by message "
            f"{holder!r} with fingerprint {stored_fingerprint} ({_repr.repr(stored_payload)}), "
            f"this message has fingerprint {fingerprint} ({_repr.repr(payload)}). "
            f"A key must identify one operation; use a new key for a different payload."
        )
        self.key = key
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint
        self.stored_payload = stored_payload
        self.payload = payload
        self.holder = holder


class UnstorableResult(LedgerError, TypeError):
    """The actor returned a value the ledger cannot store as JSON.

    Nothing of the run is committed. Not retried: the same code would return
    the same kind of value again.
    """


__all__ = ["IdempotencyConflict", "LedgerError", "UnstorableResult"]
