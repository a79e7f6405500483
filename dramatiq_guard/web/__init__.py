"""The web dashboard: keys, holders, waiters, limits and the ledger, in a browser.

Needs the ``web`` extra (``pip install 'dramatiq-guard[web]'``: Jinja2,
Werkzeug, waitress). Run it on its own with ``dramatiq-guard serve`` (bound to
127.0.0.1), or mount the WSGI application :func:`make_app` returns in an
existing site, as Dramatiq's own dashboard is mounted::

    from werkzeug.middleware.dispatcher import DispatcherMiddleware
    from dramatiq_guard.web import Access, make_app

    guard = make_app(redis="redis://...", broker=broker, access=Access(allowed_hosts=["guard.example.com"]))
    application = DispatcherMiddleware(site, {"/guard": guard})

It shows what ``dramatiq-guard inspect --json``, ``inspect --summary --json``
and ``ledger list --json`` show (the same view functions,
:mod:`dramatiq_guard.admin`), plus small charts of holders and waiters per key
since the page server started (:mod:`dramatiq_guard.web.history`).

Safe by default. It answers only to the Host names it is given
(:class:`Access`'s ``allowed_hosts``, :mod:`~dramatiq_guard.web.hosts`; by default the
loopback names ``localhost``, ``127.0.0.1``, ``[::1]``): any other Host gets
a 400 before anything is read, which is what keeps a DNS-rebinding page out.
Mounted in a site served under another name, pass the site's names (a Django
site may pass ``settings.ALLOWED_HOSTS``), or ``["*"]`` if something in front
already checks Host (Django's own check does not run for a prefix that
Werkzeug's ``DispatcherMiddleware`` sends to the dashboard). It is read-only
unless given a ``write_secret`` (a browser session unlocks writes with it; a
client that gives a wrong one 5 times in a minute waits, :mod:`~dramatiq_guard.web.unlocks`)
or an ``authorize(environ)`` callable (the host application's own auth).
Every POST must carry the session's CSRF token (a double-submit cookie,
``SameSite=Strict``) and come from the same origin (``Origin``, else
``Referer``, compared with the checked Host). Keys, actor names and
arguments come from messages: the templates escape everything (Jinja2
autoescape), and a strict Content-Security-Policy allows no inline script. A
key or search longer than :data:`~dramatiq_guard.web.app.MAX_KEY_CHARS` is
refused, and the charts remember only keys that exist, so what a reader asks
for costs the server no lasting memory. Reads are not protected: bind it to
localhost, or protect its prefix in the host application. Behind a reverse
proxy, pass the browser's ``Host`` on (or apply Werkzeug's ``ProxyFix``), or
the Host check and the same-origin check refuse it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dramatiq_guard.web.app import MAX_KEY_CHARS, Dashboard
from dramatiq_guard.web.history import History
from dramatiq_guard.web.hosts import LOCAL_HOSTS, AllowedHosts
from dramatiq_guard.web.settings import Access, Page, settings_of
from dramatiq_guard.web.unlocks import UnlockLimit

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
      broker(Broker|str|None): Your app's broker (or ``"module:attr"``): a limit
        raised or a key released from the page re-enqueues the messages that
        get a slot on it, as ``--broker`` does for the command. Without it a
        worker's sweep does, after the reservation lapses.
      ledger(Ledger|str|None): The idempotency ledger (or its URL) to show, or None.
      access(Access|None): Who it answers (``allowed_hosts``) and who may write
        (``write_secret``, ``authorize``); default: read-only, for the
        loopback names only.
      page(Page|None): How its pages show (``refresh_ms``, ``per_page``).
      **deprecated: 0.1.0's ``write_secret``, ``authorize``, ``allowed_hosts``,
        ``refresh_ms`` and ``per_page`` still work, with a ``DeprecationWarning``:
        pass them in ``access`` and ``page``.

    Returns:
      Dashboard: The WSGI application.

    Raises:
      ValueError: If ``broker`` is not one of its forms, or a deprecated
        ``allowed_hosts`` not host names (as :class:`Access`).
      TypeError: If a keyword is none of the above.
    """
    access, page = settings_of(access, page, deprecated)
    if backend is None:
        backend = _backend(redis, namespace)
    requeue = None
    if broker is not None:
        from dramatiq_guard import admin

        if isinstance(broker, str):
            broker = admin.load_broker(broker)
        requeue = admin.broker_requeue(broker, backend)
    if isinstance(ledger, str):
        from dramatiq_guard.ledger import Ledger

        ledger = Ledger(ledger, create_tables=False)
    return Dashboard(backend, requeue=requeue, ledger=ledger, access=access, page=page)


def _backend(redis: Any, namespace: str) -> GuardBackend:
    import os

    from dramatiq_guard.backends.redis import RedisBackend
    from dramatiq_guard.resolve import REDIS_URL_ENV

    if redis is None or isinstance(redis, str):
        url = redis or os.environ.get(REDIS_URL_ENV) or "redis://localhost:6379/0"
        return RedisBackend.from_url(url, namespace=namespace)
    return RedisBackend(redis, namespace=namespace)


def serve(app: Dashboard, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, threads: int = 4) -> None:
    """Serve ``app`` with waitress until interrupted.

    waitress rather than Werkzeug's ``run_simple``: Werkzeug documents its
    server as a development server, while waitress is a small, pure-Python
    production server with no dependencies of its own.
    """
    import waitress

    waitress.serve(app, host=host, port=port, threads=threads, ident="dramatiq-guard")
