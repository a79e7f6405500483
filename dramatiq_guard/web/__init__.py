"""The web dashboard: keys, holders, waiters, limits and the ledger, in a browser (docs/dashboard.md).

Needs the ``web`` extra. :func:`make_app` makes the WSGI application, to serve
or to mount in an existing site; it answers only to its own Host names and is
read-only unless given a write secret or an ``authorize`` callable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dramatiq_guard import admin
from dramatiq_guard.web.app import MAX_KEY_CHARS, Dashboard
from dramatiq_guard.web.history import History, UnlockLimit
from dramatiq_guard.web.settings import LOCAL_HOSTS, Access, AllowedHosts, Page, settings_of

if TYPE_CHECKING:
    from dramatiq import Broker

    from dramatiq_guard.backends.base import GuardBackend
    from dramatiq_guard.ledger import Ledger

__all__ = [
    "DEFAULT_PORT",
    "LOCAL_HOSTS",
    "MAX_KEY_CHARS",
    "Access",
    "AllowedHosts",
    "Dashboard",
    "History",
    "Page",
    "UnlockLimit",
    "make_app",
    "serve",
]

#: The port ``dramatiq-guard serve`` binds by default.
DEFAULT_PORT = 8470


def make_app(
    backend: GuardBackend | None = None,
    *,
    redis: Any = None,
    namespace: str = "dramatiq-guard",
    broker: Broker | str | None = None,
    ledger: Ledger | str | None = None,
    access: Access | None = None,
    page: Page | None = None,
    **deprecated: Any,
) -> Dashboard:
    """Make the dashboard's WSGI application.

    Parameters:
      backend(GuardBackend|None): The guard's backend; else made from ``redis``.
      redis: A redis-py client or a URL (default: ``DRAMATIQ_GUARD_REDIS_URL``,
        else ``redis://localhost:6379/0``), used when ``backend`` is None.
      namespace(str): The prefix of the guard's Redis keys.
      broker(Broker|str|None): Your app's broker (or ``"module:attr"``), on
        which the messages that get a slot from the page are re-enqueued.
      ledger(Ledger|str|None): The idempotency ledger (or its URL) to show, or None.
      access(Access|None): Who it answers and who may write (default:
        read-only, for the loopback names only).
      page(Page|None): How its pages show (``refresh_ms``, ``per_page``).
      **deprecated: 0.1.0's ``write_secret``, ``authorize``, ``allowed_hosts``,
        ``refresh_ms`` and ``per_page``, with a ``DeprecationWarning``.

    Returns:
      Dashboard: The WSGI application.

    Raises:
      ValueError: If ``broker`` is not one of its forms, or a deprecated
        ``allowed_hosts`` not host names (as :class:`Access`).
      TypeError: If a keyword is none of the above.
    """
    access, page = settings_of(access, page, deprecated)
    if backend is None:
        from dramatiq_guard.resolve import open_backend

        backend = open_backend(redis, namespace)
    requeue = admin.broker_requeue(broker, backend)
    if isinstance(ledger, str):
        from dramatiq_guard.ledger import Ledger

        ledger = Ledger(ledger, create_tables=False)
    return Dashboard(backend, requeue=requeue, ledger=ledger, access=access, page=page)


def serve(app: Dashboard, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, threads: int = 4) -> None:
    """Serve ``app`` with waitress (a production server; Werkzeug's is for development) until interrupted."""
    import waitress

    waitress.serve(app, host=host, port=port, threads=threads, ident="dramatiq-guard")
