"""The ledger table, defined with SQLAlchemy Core.

One row per idempotency key:

=================  ==========================================================
column             meaning
=================  ==========================================================
idempotency_key    the key (primary key; keys over 255 characters are stored
                   as ``sha256:<hex digest of the key>``), compared exactly:
                   see :class:`LedgerKey`
state              ``in_progress`` (only ever seen inside the transaction
                   that inserted it), ``completed`` or ``failed``
actor_name         the actor of the key's first use
fingerprint        hex SHA-256 of the canonical JSON of ``payload``
payload            ``{"actor": ..., "arguments": {...}}`` of the first use
result             the actor's return value (JSON), once completed
error              the last failure (``ExceptionType: message``), if any
attempts           runs that completed or failed (a crashed run leaves no trace)
holder             the ``message_id`` of the last run that completed or failed
fencing_token      grows by one with every completed or failed run
created_at         when the key was first used (naive UTC)
updated_at         the last change (naive UTC)
completed_at       when it completed (naive UTC)
expires_at         from then on the row no longer protects the key and
                   :meth:`Ledger.prune` deletes it (naive UTC; NULL: never)
=================  ==========================================================

Migrations: the table lives on a :class:`~sqlalchemy.MetaData` of your
choice, so Alembic's autogenerate sees it::

    # env.py
    from dramatiq_guard.ledger import ledger_table
    ledger_table(target_metadata)      # then: alembic revision --autogenerate

and pass the same ``MetaData`` (or ``create_tables=False``) to the ledger.
Changes to the table are announced in the CHANGELOG with what an existing
table needs. One so far: on MySQL/MariaDB, ``idempotency_key`` became
``VARBINARY(1020)`` (it was ``VARCHAR(255) COLLATE utf8mb4_bin``, under which
``"a"`` and ``"a "`` are one key); convert a table created before with::

    ALTER TABLE dramatiq_guard_ledger MODIFY idempotency_key VARBINARY(1020) NOT NULL;

(the stored bytes, the keys' UTF-8, stay as they are). Other databases need nothing.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

DEFAULT_TABLE_NAME = "dramatiq_guard_ledger"
KEY_LENGTH = 255

IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"

#: Bytes of the longest stored key on MySQL/MariaDB: KEY_LENGTH characters of UTF-8.
KEY_BYTES = 4 * KEY_LENGTH


class LedgerKey(sa.types.TypeDecorator[str]):
    """The type of the ``idempotency_key`` column: a string compared exactly, on every database.

    ``VARCHAR(255)`` on SQLite and PostgreSQL, whose string comparisons are
    exact. ``VARBINARY(1020)`` holding the key's UTF-8 on MySQL/MariaDB: their
    ``VARCHAR`` collations, ``utf8mb4_bin`` included, are PAD SPACE (``"a"``
    and ``"a "`` are equal, so a real key would be refused as the other's
    conflict), and the NO PAD ones are named differently on each server.
    Binary strings compare byte for byte everywhere. Values are ``str`` both
    ways. Alembic's autogenerate writes it as
    ``dramatiq_guard.ledger.schema.LedgerKey()`` (import ``dramatiq_guard`` in
    the migration).
    """

    impl = sa.String(KEY_LENGTH)
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.VARBINARY(KEY_BYTES))
        return dialect.type_descriptor(sa.String(KEY_LENGTH))

    def process_bind_param(self, value: str | None, dialect: sa.Dialect) -> Any:
        if value is not None and dialect.name in ("mysql", "mariadb"):
            return value.encode("utf-8")
        return value

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> str | None:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value).decode("utf-8")
        return value  # type: ignore[no-any-return]


# MySQL/MariaDB: the holder in a binary collation, and microsecond timestamps
# (DATETIME defaults to whole seconds there).
_Holder = sa.String(255).with_variant(mysql.VARCHAR(255, collation="utf8mb4_bin"), "mysql", "mariadb")
_Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def ledger_table(
    metadata: sa.MetaData, name: str = DEFAULT_TABLE_NAME, *, schema: str | None = None
) -> sa.Table:
    """The ledger table on ``metadata`` (defined on first call, then returned as is).

    Parameters:
      metadata(MetaData): Where to define it (e.g. your Alembic ``target_metadata``).
      name(str): The table's name.
      schema(str): The table's schema, if not the default.
    """
    existing = metadata.tables.get(f"{schema}.{name}" if schema else name)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        metadata,
        sa.Column("idempotency_key", LedgerKey(), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("actor_name", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("payload", sa.JSON, nullable=True),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("holder", _Holder, nullable=True),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        sa.Column("created_at", _Timestamp, nullable=False),
        sa.Column("updated_at", _Timestamp, nullable=False),
        sa.Column("completed_at", _Timestamp, nullable=True),
        sa.Column("expires_at", _Timestamp, nullable=True, index=True),
        schema=schema,
    )


def storage_key(key: str) -> str:
    """The primary key a key is stored under: itself, or ``sha256:<hex>`` when it is too long."""
    if len(key) <= KEY_LENGTH:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
