"""What a guarded actor can ask about its own execution.

Set by the guard middlewares on the worker thread while a message runs (async
actors run with the worker thread's context, so they see them too).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

T = TypeVar("T")

#: The lease of the running message (set by the mutex and concurrency middlewares).
current_lease_var: contextvars.ContextVar[Any] = contextvars.ContextVar("dramatiq_guard_lease", default=None)

#: The ledger session of the running message (set by the idempotency middleware).
ledger_session_var: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "dramatiq_guard_ledger_session", default=None
)


def current_lease() -> Any:
    """The lease the running actor holds: its holder, fencing token and whether it still holds it
    (a RuntimeError outside an actor guarded by ``mutex=`` or ``concurrency=``)."""
    return required(current_lease_var, "dramatiq_guard.current_lease()", "mutex= or concurrency=")


def ledger_session() -> Session:
    """The SQLAlchemy Session of the running actor's ledger transaction.

    Writes made through it commit in one transaction with the ledger row's
    move to completed, or not at all (a RuntimeError outside an actor guarded by ``idempotency_key=``).
    """
    return required(ledger_session_var, "dramatiq_guard.ledger_session()", "idempotency_key=")


def required(var: contextvars.ContextVar[T | None], call: str, options: str) -> T:
    """The value of ``var``, or a RuntimeError saying ``call`` was made outside an actor guarded so."""
    value = var.get()
    if value is None:
        raise RuntimeError(f"{call} was called outside an actor guarded by {options}")
    return value
