"""The external services the tests use, where to find them, and whether they answer.

Defaults are the machine's local services; each URL can be overridden by an
environment variable. ``python -m harness.services`` (with ``tests/`` on
``PYTHONPATH``) prints which are reachable; ``.ci/run`` does that before the tests.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Callable

from .env import MARIADB_URL_ENV, POSTGRES_URL_ENV, RABBITMQ_URL_ENV, in_ci

CONNECT_TIMEOUT = 3


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    env: str
    default: str
    probe: Callable[[str], None]

    @property
    def url(self) -> str:
        return os.environ.get(self.env) or self.default


def redact(url: str) -> str:
    """The URL with its password hidden."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user, has_password, _ = creds.partition(":")
    return f"{scheme}://{user}{':***' if has_password else ''}@{host}"


def probe_sql(url: str) -> None:
    """Connect with SQLAlchemy and run ``SELECT 1``; raises on failure."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT}, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    finally:
        engine.dispose()


def probe_rabbitmq(url: str) -> None:
    """Open and close an AMQP connection; raises on failure."""
    import pika

    params = pika.URLParameters(url)
    params.socket_timeout = CONNECT_TIMEOUT
    params.connection_attempts = 1
    params.blocked_connection_timeout = CONNECT_TIMEOUT
    connection = pika.BlockingConnection(params)
    connection.close()


POSTGRES_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
POSTGRES = Service("PostgreSQL", POSTGRES_URL_ENV, POSTGRES_DEFAULT, probe_sql)
MARIADB = Service("MariaDB", MARIADB_URL_ENV, "mysql+pymysql://root@127.0.0.1:3306/test", probe_sql)
RABBITMQ = Service("RabbitMQ", RABBITMQ_URL_ENV, "amqp://guest:guest@127.0.0.1:5672/", probe_rabbitmq)
SERVICES = (POSTGRES, MARIADB, RABBITMQ)

_probed: dict[tuple[str, str], str | None] = {}


def unreachable(service: Service) -> str | None:
    """None if ``service`` answers at its URL, else why not (probed once per process and URL)."""
    url = service.url
    cache_key = (service.name, url)
    if cache_key not in _probed:
        try:
            service.probe(url)
        except Exception as exc:
            _probed[cache_key] = f"{type(exc).__name__}: {exc}".strip()
        else:
            _probed[cache_key] = None
    return _probed[cache_key]


def unreachable_message(service: Service, reason: str) -> str:
    return (
        f"{service.name} is unreachable at {redact(service.url)} ({reason}). "
        f"Start it or point {service.env} at one"
        + ("; CI=true, so this is a failure, not a skip." if in_ci() else "; skipping (set CI=true to fail).")
    )


def main() -> int:
    """Print which services answer. Exit status 0 always: the tests decide what is fatal."""
    redis_server = shutil.which("redis-server")
    print(f"  redis-server: {'found at ' + redis_server if redis_server else 'NOT on PATH'}")
    for service in SERVICES:
        reason = unreachable(service)
        state = "reachable" if reason is None else f"UNREACHABLE ({reason})"
        print(f"  {service.name}: {redact(service.url)}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
