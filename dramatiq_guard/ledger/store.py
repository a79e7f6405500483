"""The idempotency ledger: claim a key, run the work in the claim's transaction, complete in its commit.

How each database claims, and why the transaction is the lease: docs/ledger.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session

from dramatiq_guard import events
from dramatiq_guard.bounds import MAX_RETENTION_MS
from dramatiq_guard.context import ledger_session_var
from dramatiq_guard.errors import IdempotencyConflict, LeaseLost, LedgerError, UnstorableResult
from dramatiq_guard.ledger.engine import check_engine, resolve_engine
from dramatiq_guard.ledger.records import Claim, LedgerRecord, _claim_var
from dramatiq_guard.ledger.schema import (
    COMPLETED,
    DEFAULT_TABLE_NAME,
    FAILED,
    IN_PROGRESS,
    KEY_BYTES,
    ledger_table,
    storage_key,
)
from dramatiq_guard.policies import Duration, duration_ms

#: Completed and failed rows protect their key for this long by default: 7 days.
DEFAULT_RETENTION = datetime.timedelta(days=7)

logger = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What a claimed run does: the token its completion is fenced on, the one it writes, its attempt."""

    expected_token: int
    new_token: int
    attempts: int
    reset: bool  # the row expired: the run takes it over as if it were new


class Stored(NamedTuple):
    """The key was completed: its stored result is the answer, and nothing runs."""

    result: Any


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a key: what its row records, whatever happens to it."""

    key: str
    row_key: str
    actor_name: str
    payload: Any
    fingerprint: str
    holder: str
    retention_ms: int | None

    def row(self, state: str, now: datetime.datetime) -> dict[str, Any]:
        """A new row of this run in ``state``: its first attempt, token 1."""
        return {
            "idempotency_key": self.row_key,
            "state": state,
            "actor_name": self.actor_name,
            "fingerprint": self.fingerprint,
            "payload": self.payload,
            "result": None,
            "error": None,
            "attempts": 1,
            "holder": self.holder,
            "fencing_token": 1,
            "created_at": now,
            "updated_at": now,
            "completed_at": None,
            "expires_at": None,
        }


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def expiry(now: datetime.datetime, retention_ms: int | None) -> datetime.datetime | None:
    return None if retention_ms is None else now + datetime.timedelta(milliseconds=retention_ms)


def check_storable(result: Any) -> None:
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnstorableResult(
            f"the actor returned {type(result).__name__} {result!r:.200}, which the idempotency ledger "
            f"cannot store as JSON ({e}); nothing was committed"
        ) from e


def record_of(row: Any) -> LedgerRecord:
    """A row of the table as a :class:`LedgerRecord` (its fields are the columns, ``key`` first)."""
    columns = [field.name for field in dataclasses.fields(LedgerRecord)][1:]
    return LedgerRecord(row.idempotency_key, *(getattr(row, name) for name in columns))


class Ledger:
    """An idempotency ledger in a SQL database.

    Parameters:
      engine: An SQLAlchemy Engine, a database URL, or None
        (``DRAMATIQ_GUARD_LEDGER_URL``, else a SQLite file).
      metadata(MetaData): The MetaData to define the table on (e.g. Alembic's
        ``target_metadata``). Default: a private one.
      table_name(str): The table's name.
      schema(str): The table's schema, if not the default.
      retention: How long a finished row protects its key (ms or a timedelta,
        at most 100 years; None: forever). Default: 7 days.
      create_tables(bool): Create the table (if missing) on first use.
    """

    def __init__(
        self,
        engine: sa.Engine | str | None = None,
        *,
        metadata: sa.MetaData | None = None,
        table_name: str = DEFAULT_TABLE_NAME,
        schema: str | None = None,
        retention: Duration | None = DEFAULT_RETENTION,
        create_tables: bool = True,
    ) -> None:
        check_engine(engine)
        self._engine_arg = engine
        self._engine: sa.Engine | None = engine if isinstance(engine, sa.Engine) else None
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.table = ledger_table(self.metadata, table_name, schema=schema)
        self.retention_ms = duration_ms(
            retention, what="retention", allow_none=True, maximum=MAX_RETENTION_MS
        )
        self.create_tables = create_tables
        self._lock = threading.RLock()
        self._prepared = False
        # Statements built once, their values bound at execution (building one costs more than running it).
        t = self.table
        self._select_for_update = (
            sa.select(t).where(t.c.idempotency_key == sa.bindparam("row_key")).with_for_update()
        )
        self._fenced_update = sa.update(t).where(
            t.c.idempotency_key == sa.bindparam("b_row_key"),
            t.c.fencing_token == sa.bindparam("b_expected_token"),
        )
        self._claims: dict[str, sa.Executable] = {}

    def _insert_new(self, conn: sa.Connection, values: dict[str, Any]) -> bool:
        """Insert a row unless its key has one (locking it on MySQL); whether it surely was inserted
        (never said on MySQL, whose rowcount counts a row found as one changed)."""
        dialect, t = conn.dialect.name, self.table
        stmt = self._claims.get(dialect)
        if stmt is None and dialect in ("postgresql", "sqlite"):
            insert = postgresql.insert(t) if dialect == "postgresql" else sqlite.insert(t)
            stmt = insert.on_conflict_do_nothing(index_elements=[t.c.idempotency_key])
        elif stmt is None and dialect in ("mysql", "mariadb"):
            upsert = mysql.insert(t)
            stmt = upsert.on_duplicate_key_update(idempotency_key=upsert.inserted.idempotency_key)
        elif stmt is None:  # generic SQL: in a savepoint
            try:
                with conn.begin_nested():
                    conn.execute(sa.insert(t), values)
                return True
            except sa.exc.IntegrityError:
                return False  # inserted meanwhile by another transaction, now committed
        self._claims[dialect] = stmt
        inserted = conn.execute(stmt, values, execution_options={"preserve_rowcount": True})
        return dialect in ("postgresql", "sqlite") and inserted.rowcount == 1

    # --- setup ----------------------------------------------------------------------------

    @property
    def engine(self) -> sa.Engine:
        """The Engine, created on first use."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    self._engine = resolve_engine(self._engine_arg)
        return self._engine

    def create_all(self) -> None:
        """Create the ledger table and its index if missing (safe from several processes at once)."""
        engine = self.engine
        try:
            self.metadata.create_all(engine, tables=[self.table], checkfirst=True)
        except sa.exc.DBAPIError:
            # Another process created it between the check and the CREATE.
            if not sa.inspect(engine).has_table(self.table.name, schema=self.table.schema):
                raise

    def prepare(self) -> None:
        """Create the table on first use if ``create_tables`` (once per Ledger)."""
        if self._prepared:
            return
        with self._lock:
            if not self._prepared:
                if self.create_tables:
                    self.create_all()
                self._check_key_column()
                self._prepared = True

    def _check_key_column(self) -> None:
        """Warn when a MySQL/MariaDB table still has the padded ``VARCHAR`` key of 0.1.0.dev0."""
        engine = self.engine
        if engine.dialect.name not in ("mysql", "mariadb"):
            return
        t = self.table
        try:
            columns = sa.inspect(engine).get_columns(t.name, schema=t.schema)
        except sa.exc.SQLAlchemyError:
            return  # the table is missing or unreadable: the first statement will say so
        for column in columns:
            if column["name"] == "idempotency_key" and not isinstance(
                column["type"], (sa.BINARY, sa.VARBINARY, sa.LargeBinary)
            ):
                logger.warning(
                    "The ledger table %s has idempotency_key %s, under which keys that differ only in "
                    "trailing spaces are one key. Convert it: ALTER TABLE %s MODIFY idempotency_key "
                    "VARBINARY(%d) NOT NULL",
                    t.fullname,
                    column["type"],
                    t.fullname,
                    KEY_BYTES,
                )

    def dispose(self) -> None:
        """Close the pooled connections of an Engine the ledger created itself."""
        if self._engine is not None and not isinstance(self._engine_arg, sa.Engine):
            self._engine.dispose()

    # --- running work ---------------------------------------------------------------------

    def run(
        self,
        key: str,
        fn: Callable[[], Any],
        *,
        actor_name: str,
        payload: Any,
        fingerprint: str,
        holder: str,
        retention_ms: int | None = None,
    ) -> Any:
        """Run ``fn`` at most once per ``key``, atomically with the ledger row.

        Parameters:
          key(str): The idempotency key.
          fn: The work; it may write through :func:`dramatiq_guard.ledger_session`.
            Its return value must be JSON-serialisable; it is stored.
          actor_name(str): Recorded with the row.
          payload: The JSON-serialisable payload recorded with the row.
          fingerprint(str): The payload's fingerprint; the key is bound to it.
          holder(str): Who runs it (a message id).
          retention_ms(int): Overrides the ledger's retention for this key.

        Returns:
          What ``fn`` returned, or the stored result if the key was completed.

        Raises:
          IdempotencyConflict: The key is bound to another fingerprint.
          UnstorableResult: ``fn`` returned something JSON cannot encode.
          LeaseLost: The row changed under this run; nothing was committed.
          Exception: Whatever ``fn`` or the database raised; nothing was committed.
        """
        self.prepare()
        retention = self.retention_ms if retention_ms is None else retention_ms
        run = Run(key, storage_key(key), actor_name, payload, fingerprint, holder, retention)
        with self.engine.connect() as conn:
            tx = conn.begin()
            try:
                plan = self._claim(conn, run)
            except BaseException:
                tx.rollback()
                raise
            if isinstance(plan, Stored):
                tx.rollback()  # nothing was written; this ends the row lock
                events.ledger_hit(actor_name)
                return plan.result
            return self._run_claimed(conn, tx, run, plan, fn)

    def _run_claimed(
        self, conn: sa.Connection, tx: sa.RootTransaction, run: Run, plan: Plan, fn: Callable[[], Any]
    ) -> Any:
        """Run ``fn`` on the claimed row's transaction ``tx`` and complete the row in its commit."""
        session = Session(bind=conn)  # joins `tx`: its commit() does not end it
        session_token = ledger_session_var.set(session)
        claim_token = _claim_var.set(Claim(run.key, run.holder, plan.new_token, plan.attempts))
        try:
            try:
                result = fn()
                session.flush()
            finally:
                ledger_session_var.reset(session_token)
                _claim_var.reset(claim_token)
            check_storable(result)
            if not tx.is_active:
                raise LedgerError(
                    f"the ledger transaction of key {run.key!r} was rolled back inside the actor "
                    f"(ledger_session().rollback()?): raise an exception to abort instead"
                )
            self._complete(conn, run, plan, result)
            tx.commit()
        except BaseException as e:
            if tx.is_active:
                tx.rollback()
            session.close()
            if isinstance(e, LeaseLost):
                events.lease_lost(run.actor_name)
            elif not isinstance(e, UnstorableResult):
                self._record_failure(conn, run, e)
            raise
        session.close()
        return result

    def _claim(self, conn: sa.Connection, run: Run) -> Plan | Stored:
        """Insert the key's row, or lock the existing one, and decide what this run does."""
        now = utcnow()
        row_key = run.row_key
        # Generic SQL locks an existing row first (the dialects named in _insert_new lock it by inserting).
        generic = conn.dialect.name not in ("postgresql", "sqlite", "mysql", "mariadb")
        found = generic and conn.execute(self._select_for_update, {"row_key": row_key}).first()
        if not found and self._insert_new(conn, run.row(IN_PROGRESS, now)):
            return Plan(expected_token=1, new_token=1, attempts=1, reset=False)
        row = conn.execute(self._select_for_update, {"row_key": row_key}).one()
        if row.state == IN_PROGRESS:
            # Only this transaction's own fresh insert can be in progress: another
            # transaction's uncommitted row would have blocked the insert above.
            return Plan(
                expected_token=row.fencing_token, new_token=row.fencing_token, attempts=1, reset=False
            )
        if row.expires_at is not None and row.expires_at <= now:
            return Plan(row.fencing_token, row.fencing_token + 1, attempts=1, reset=True)
        if row.fingerprint != run.fingerprint:
            raise IdempotencyConflict(
                run.key,
                stored_fingerprint=row.fingerprint,
                fingerprint=run.fingerprint,
                stored_payload=row.payload,
                payload=run.payload,
                holder=row.holder,
            )
        if row.state == COMPLETED:
            return Stored(row.result)
        return Plan(row.fencing_token, row.fencing_token + 1, attempts=row.attempts + 1, reset=False)

    def _complete(self, conn: sa.Connection, run: Run, plan: Plan, result: Any) -> None:
        """Mark the row completed with ``result``, fenced on the token read at the claim."""
        now = utcnow()
        values: dict[str, Any] = {
            "state": COMPLETED,
            "result": result,
            "error": None,
            "attempts": plan.attempts,
            "holder": run.holder,
            "fencing_token": plan.new_token,
            "updated_at": now,
            "completed_at": now,
            "expires_at": expiry(now, run.retention_ms),
        }
        if plan.reset:
            values.update(
                actor_name=run.actor_name, payload=run.payload, fingerprint=run.fingerprint, created_at=now
            )
        values.update(b_row_key=run.row_key, b_expected_token=plan.expected_token)
        if conn.execute(self._fenced_update, values).rowcount != 1:
            raise LeaseLost(run.key, run.holder)

    def _record_failure(self, conn: sa.Connection, run: Run, exc: BaseException) -> None:
        """Mark the key failed in a short transaction of its own; best effort (the run was rolled back)."""
        t = self.table
        now = utcnow()
        error = f"{type(exc).__name__}: {exc}"[:2000]
        expires_at = expiry(now, run.retention_ms)
        try:
            with conn.begin():
                failed = (
                    sa.update(t)
                    .where(
                        t.c.idempotency_key == run.row_key,
                        t.c.state != COMPLETED,
                        t.c.fingerprint == run.fingerprint,
                    )
                    .values(
                        state=FAILED,
                        error=error,
                        attempts=t.c.attempts + 1,
                        holder=run.holder,
                        fencing_token=t.c.fencing_token + 1,
                        updated_at=now,
                        expires_at=expires_at,
                    )
                )
                if conn.execute(failed).rowcount == 0:
                    values = {**run.row(FAILED, now), "error": error, "expires_at": expires_at}
                    self._insert_new(conn, values)
        except Exception:
            logger.warning("Could not record the failure of idempotency key %r.", run.key, exc_info=True)

    # --- inspection and retention ---------------------------------------------------------

    def get(self, key: str) -> LedgerRecord | None:
        """The committed row of ``key``, or None."""
        self.prepare()
        t = self.table
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.idempotency_key == storage_key(key))).first()
        return None if row is None else record_of(row)

    def counts(self) -> dict[str, int]:
        """How many rows the ledger has in each state (expired rows not yet pruned included)."""
        self.prepare()
        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all()
        return {str(state): int(count) for state, count in rows}

    def rows(self, *, state: str | None = None, limit: int = 50) -> list[LedgerRecord]:
        """The most recently updated rows (of one ``state``, if given), at most ``limit``."""
        self.prepare()
        t = self.table
        query = sa.select(t).order_by(t.c.updated_at.desc()).limit(limit)
        if state is not None:
            query = query.where(t.c.state == state)
        with self.engine.connect() as conn:
            return [record_of(row) for row in conn.execute(query)]

    def prune(self, older_than: Duration | None = None) -> int:
        """Delete the rows past their ``expires_at``; return how many.

        Parameters:
          older_than: Also delete finished rows last changed at least this
            long ago (ms or a timedelta, at most 100 years).
        """
        self.prepare()
        t = self.table
        now = utcnow()
        condition: sa.ColumnElement[bool] = sa.and_(t.c.expires_at.is_not(None), t.c.expires_at <= now)
        age = duration_ms(older_than, what="older_than", allow_none=True, maximum=MAX_RETENTION_MS)
        if age is not None:
            cutoff = now - datetime.timedelta(milliseconds=age)
            condition = sa.or_(condition, sa.and_(t.c.state != IN_PROGRESS, t.c.updated_at <= cutoff))
        with self.engine.begin() as conn:
            return int(conn.execute(sa.delete(t).where(condition)).rowcount)
