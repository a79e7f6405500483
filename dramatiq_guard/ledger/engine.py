"""Where the ledger lives: an Engine, a URL, the environment, or a SQLite file (docs/ledger.md)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dramatiq_guard.errors import ConfigurationError

LEDGER_URL_ENV = "DRAMATIQ_GUARD_LEDGER_URL"
#: Seconds a SQLite connection the ledger created waits for the database lock.
SQLITE_TIMEOUT = 30.0

logger = logging.getLogger(__name__)


def default_sqlite_path() -> Path:
    """The SQLite file used when neither ``ledger=`` nor ``DRAMATIQ_GUARD_LEDGER_URL`` is set."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "dramatiq-guard" / "ledger.sqlite3"


def default_ledger_url() -> str:
    """``DRAMATIQ_GUARD_LEDGER_URL``, else the URL of :func:`default_sqlite_path`."""
    url = os.environ.get(LEDGER_URL_ENV)
    if url:
        return url
    return f"sqlite:///{default_sqlite_path()}"


def check_engine(ledger: object) -> None:
    """Refuse (:class:`ConfigurationError`) what cannot say where a ledger lives, as it is given."""
    if ledger is not None and not isinstance(ledger, (sa.Engine, str, sa.URL)):
        raise ConfigurationError(
            f"ledger={ledger!r} is not usable: pass an SQLAlchemy Engine, a database URL, a "
            f"dramatiq_guard.ledger.Ledger (to Idempotency), or None ({LEDGER_URL_ENV}, else a "
            f"SQLite file)"
        )


def resolve_engine(ledger: sa.Engine | str | sa.URL | None) -> sa.Engine:
    """An Engine for ``ledger`` (:func:`check_engine`-ed): an Engine, a URL, or None (the environment,
    else a SQLite file)."""
    if isinstance(ledger, sa.Engine):
        return ledger
    if ledger is None and not os.environ.get(LEDGER_URL_ENV):
        path = default_sqlite_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.warning(
            "dramatiq-guard's idempotency ledger uses the SQLite file %s: only workers on this "
            "machine share it. Pass ledger=<an Engine or a URL> or set %s for a shared database.",
            path,
            LEDGER_URL_ENV,
        )
    return create_engine(default_ledger_url() if ledger is None else ledger)


def create_engine(url: str | sa.URL) -> sa.Engine:
    """An Engine for ``url``; SQLite files get a 30 s lock timeout and write-ahead logging."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(parsed, pool_pre_ping=True)
    engine = sa.create_engine(parsed, connect_args={"timeout": SQLITE_TIMEOUT})

    @sa.event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if parsed.database and parsed.database != ":memory:":
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()

    return engine
