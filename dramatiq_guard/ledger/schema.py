"""The ledger table, defined with SQLAlchemy Core (columns and migrations: docs/ledger.md)."""

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
    """The type of the ``idempotency_key`` column: a ``str`` compared exactly, on every database.

    ``VARBINARY`` of the key's UTF-8 on MySQL/MariaDB, whose ``VARCHAR``
    collations are PAD SPACE (``"a"`` equals ``"a "``); ``VARCHAR`` elsewhere.
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
