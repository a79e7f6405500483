"""Mount the dramatiq-guard dashboard under ``/guard/`` of a Django site, for staff only.

Copy the part below the settings line into your project's ``wsgi.py``. The dashboard is a plain
WSGI application (:func:`dramatiq_guard.web.make_app`), put beside Django's by Werkzeug's
``DispatcherMiddleware``; it asks the site who may write (``authorize``), and the wrapper below
keeps everyone but staff out of it altogether (the dashboard itself protects only writes).

Try it (a Redis at ``DRAMATIQ_GUARD_REDIS_URL``, else ``localhost:6379``)::

    pip install 'dramatiq-guard[web]' django
    DJANGO_SETTINGS_MODULE=examples.django_site.settings python -m django migrate
    DJANGO_SETTINGS_MODULE=examples.django_site.settings python -m django createsuperuser
    waitress-serve --listen 127.0.0.1:8000 examples.django_site.wsgi:application

then log in to the site (e.g. through ``django.contrib.admin`` in a real project) and open
http://127.0.0.1:8000/guard/. Set ``EXAMPLE_GUARD_BROKER`` to your broker (``myapp.tasks:broker``)
so that a limit raised from the page re-enqueues the messages that get a slot at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.wsgi import get_wsgi_application
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from dramatiq_guard.web import Access, make_app

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_site.settings")
site = get_wsgi_application()


def is_staff(environ: WSGIEnvironment) -> bool:
    """Whether the request comes from an active staff user logged in to this site (its session cookie)."""
    from django.contrib.auth import get_user
    from django.core.handlers.wsgi import WSGIRequest
    from django.db import close_old_connections

    request: Any = WSGIRequest(environ)  # reads no body: the dashboard gets the form intact
    store = import_module(settings.SESSION_ENGINE).SessionStore
    request.session = store(request.COOKIES.get(settings.SESSION_COOKIE_NAME))
    try:
        user = get_user(request)
        return bool(user.is_active and user.is_staff)
    finally:
        close_old_connections()  # outside Django's own request cycle


def staff_only(app: WSGIApplication) -> WSGIApplication:
    """``app`` for staff; a 403 for everyone else."""

    def gated(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if not is_staff(environ):
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"Staff only.\n"]
        return app(environ, start_response)

    return gated


guard = make_app(
    redis=os.environ.get("DRAMATIQ_GUARD_REDIS_URL"),
    broker=os.environ.get("EXAMPLE_GUARD_BROKER") or None,
    access=Access(
        authorize=is_staff,  # writes (limits, forced releases) for staff, still behind a confirmation
        # The site's own names: Django checks Host only for the requests it serves, not for /guard/.
        allowed_hosts=settings.ALLOWED_HOSTS,
    ),
)
application = DispatcherMiddleware(site, {"/guard": staff_only(guard)})
