"""What the ledger hands out: the running actor's claim, and a row as read."""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
from typing import Any

from dramatiq_guard.context import required


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a running guarded actor holds (see :func:`current_claim`).

    Attributes:
      key(str): The idempotency key.
      holder(str): This run's holder: the message's ``message_id`` (``call:<hex>``
        for a direct call of the actor).
      fencing_token(int): The token the row will carry once this run completes;
        it grows with every run of the key.
      attempt(int): This run's number among the key's runs that completed or failed.
    """

    key: str
    holder: str
    fencing_token: int
    attempt: int


@dataclasses.dataclass(frozen=True)
class LedgerRecord:
    """One row of the ledger, as :meth:`Ledger.get` returns it (see :mod:`.schema`)."""

    key: str
    state: str
    actor_name: str
    fingerprint: str
    payload: Any
    result: Any
    error: str | None
    attempts: int
    holder: str | None
    fencing_token: int
    created_at: datetime.datetime
    updated_at: datetime.datetime
    completed_at: datetime.datetime | None
    expires_at: datetime.datetime | None


_claim_var: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "dramatiq_guard_claim", default=None
)


def current_claim() -> Claim:
    """The ledger claim of the running actor: its key, holder and fencing token.

    Raises:
      RuntimeError: Outside an actor guarded by ``idempotency_key=``.
    """
    return required(_claim_var, "dramatiq_guard.ledger.current_claim()", "idempotency_key=")
