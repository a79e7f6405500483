"""The ``idempotency_key`` actor option: a message's effects committed at most once, in SQL.

docs/ledger.md says which key a message gets, and why the actor's function is wrapped: at
``before_declare_actor`` ``actor.fn`` is replaced by a wrapper that runs the call through
:meth:`dramatiq_guard.ledger.Ledger.run`, and ``before_process_message`` tells it which message runs.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq
import sqlalchemy as sa
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy

from dramatiq_guard.bounds import MAX_RETENTION_MS
from dramatiq_guard.errors import IdempotencyConflict, UnstorableResult
from dramatiq_guard.keys import MESSAGE_KEY_RULE, canonical_json, digest, is_message_key
from dramatiq_guard.ledger.schema import DEFAULT_TABLE_NAME
from dramatiq_guard.ledger.store import DEFAULT_RETENTION, Ledger
from dramatiq_guard.middleware.base import GuardMiddleware
from dramatiq_guard.policies import Duration, IdempotencyPolicy, duration_ms, option_error

#: The message option that carries a message's own idempotency key.
MESSAGE_OPTION = "idempotency_key"
#: Exceptions that retrying cannot fix; added to each guarded actor's ``throws``.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (IdempotencyConflict, UnstorableResult)

#: The message the worker thread is about to run (set in before_process_message).
_running: contextvars.ContextVar[MessageProxy | None] = contextvars.ContextVar(
    "dramatiq_guard_ledger_message", default=None
)


class Idempotency(GuardMiddleware[IdempotencyPolicy]):
    """Runs actors declared with ``idempotency_key=`` through the SQL idempotency ledger (docs/ledger.md).

    Parameters:
      ledger: An SQLAlchemy Engine, a database URL, a
        :class:`~dramatiq_guard.ledger.Ledger`, or None: the
        ``DRAMATIQ_GUARD_LEDGER_URL`` environment variable, else a SQLite file
        (:func:`dramatiq_guard.ledger.default_sqlite_path`). Resolved, and the
        table created, on the first guarded run.
      metadata(MetaData): The MetaData to define the ledger table on, so
        Alembic sees it (ignored when ``ledger`` is a Ledger).
      table_name(str): The ledger table's name (ignored when ``ledger`` is a Ledger).
      retention: How long a completed key stays protected by default (ms or a
        timedelta; None: forever). Actors override it with ``retention``.
      create_tables(bool): Create the table on first use if missing (pass
        False when migrations manage it).
      redis: Unused (the ledger keeps no state in Redis); accepted for
        symmetry with the other guard middlewares.
    """

    policy_class = IdempotencyPolicy

    def __init__(
        self,
        *,
        ledger: sa.Engine | str | Ledger | None = None,
        metadata: sa.MetaData | None = None,
        table_name: str | None = None,
        retention: Duration | None = DEFAULT_RETENTION,
        create_tables: bool = True,
        redis: Any = None,
    ) -> None:
        super().__init__(redis=redis)
        #: The ledger (its database is connected on the first guarded run).
        self.ledger: Ledger
        if isinstance(ledger, Ledger):
            # Refused now even though the Ledger given keeps its own.
            duration_ms(retention, what="retention", allow_none=True, maximum=MAX_RETENTION_MS)
            self.ledger = ledger
        else:  # (it refuses a bad ledger or retention now, not at the first message)
            self.ledger = Ledger(
                ledger,
                metadata=metadata,
                table_name=table_name or DEFAULT_TABLE_NAME,
                retention=retention,
                create_tables=create_tables,
            )
        self._signatures: dict[str, inspect.Signature] = {}

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        super().before_declare_actor(broker, actor)  # parses the option into self.guard_lists
        if not self.guards_actor(actor.actor_name):
            return
        self._signatures[actor.actor_name] = inspect.signature(actor.fn)
        actor.options["throws"] = _with_permanent_errors(actor.options.get("throws"))
        if not getattr(actor.fn, "__dramatiq_guard_ledger__", False):
            fn, name = actor.fn, actor.actor_name

            @functools.wraps(fn)
            def run_in_ledger(*args: Any, **kwargs: Any) -> Any:
                return self._run(name, fn, args, kwargs)

            run_in_ledger.__dramatiq_guard_ledger__ = True  # type: ignore[attr-defined]
            actor.fn = run_in_ledger

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        key = message.options.get(MESSAGE_OPTION)
        if key is None:
            guard = self.guard_of(message)
            if guard is not None and guard.policy.key is not None:
                # Derived now, so arguments it cannot be derived from refuse the send, not the run.
                guard.key_of(message)
            return
        name = message.actor_name
        if name in broker.actors and not self.guards_actor(name):
            why = f"actor {name!r} is not declared with idempotency_key= (declare it with "
            why += "idempotency_key=True to key its messages by this option)"
            raise option_error(name, MESSAGE_OPTION, key, f"the message carries an idempotency key but {why}")
        if not is_message_key(key):
            raise option_error(name, MESSAGE_OPTION, key, f"a message's key {MESSAGE_KEY_RULE}")

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        if message._message.actor_name in self.guard_lists:  # (guards_actor, with no call)
            _running.set(message)

    def after_process_message(self, broker: Broker, message: MessageProxy, **_: Any) -> None:
        if _running.get() is message:
            _running.set(None)

    after_skip_message = after_process_message

    def _run(
        self, actor_name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        guards = self.guard_lists.get(actor_name)
        if not guards:  # the actor was redeclared without the option
            return fn(*args, **kwargs)
        policy = guards[0].policy
        message = _running.get()
        if message is None or message.actor_name != actor_name:  # a direct call: a message of its own
            holder, key = f"call:{uuid.uuid4().hex}", None
        else:
            holder, key = message.message_id, message.options.get(MESSAGE_OPTION)
        if key is None:
            key = guards[0].resolve_key(args, kwargs) if policy.key is not None else holder
        payload, fingerprint = _fingerprint(actor_name, self._signatures[actor_name], args, kwargs)
        running = _running.set(None)  # a guarded actor called inside is a direct call
        try:
            return self.ledger.run(
                key,
                functools.partial(fn, *args, **kwargs),
                actor_name=actor_name,
                payload=payload,
                fingerprint=fingerprint,
                holder=holder,
                retention_ms=policy.retention_ms,
            )
        finally:
            _running.reset(running)


def _fingerprint(
    actor_name: str, signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, str]:
    """The payload recorded with a key (the actor and its arguments bound through its signature),
    and its fingerprint."""
    try:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: Any = dict(bound.arguments)
    except TypeError:  # the call itself will fail the same way
        arguments = {"args": list(args), "kwargs": kwargs}
    payload = {"actor": actor_name, "arguments": arguments}
    try:
        canonical_json(payload)
    except (TypeError, ValueError):  # a direct call with arguments a message could not carry
        payload = {"actor": actor_name, "arguments": repr(arguments)}
    return payload, digest(payload)


def _with_permanent_errors(throws: Any) -> tuple[type[BaseException], ...]:
    current: tuple[type[BaseException], ...] = (throws,) if isinstance(throws, type) else tuple(throws or ())
    return current + tuple(e for e in PERMANENT_ERRORS if e not in current)
