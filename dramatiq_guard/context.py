"""What a guarded actor can ask about its own execution.

The guard middlewares set these context variables in ``before_process_message``
on the worker thread and reset them when the message is done. Dramatiq runs
async actors on its event loop thread with the worker thread's context, so
they see them too.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

#: The lease of the running message (set by the mutex and concurrency middlewares).
current_lease_var: contextvars.ContextVar[Any] = contextvars.ContextVar("dramatiq_guard_lease", default=None)

#: The ledger session of the running message (set by the idempotency middleware).
ledger_session_var: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "dramatiq_guard_ledger_session", default=None
)


def current_lease() -> Any:
    """The lease the running actor holds: its holder, fencing token and whether it still holds it.

    Raises:
      RuntimeError: Outside an actor guarded by ``mutex=`` or ``concurrency=``.
    """
    lease = current_lease_var.get()
    if lease is None:
        raise RuntimeError(
            "dramatiq_guard.current_lease() was called outside an actor guarded by mutex= or concurrency="
        )
    return lease


def ledger_session() -> Session:
    """The SQLAlchemy Session of the running actor's ledger transaction.

    Writes made through it commit in one transaction with the ledger row's
    move to completed, or not at all.

    Raises:
      RuntimeError: Outside an actor guarded by ``idempotency_key=``.
    """
    session = ledger_session_var.get()
    if session is None:
        raise RuntimeError(
            "dramatiq_guard.ledger_session() was called outside an actor guarded by idempotency_key="
        )
    return session
