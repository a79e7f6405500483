"""The dashboard's WSGI application (see :func:`dramatiq_guard.web.make_app`)."""

from __future__ import annotations

import hashlib
import hmac
import importlib.resources
import json
import secrets
import urllib.parse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jinja2
from werkzeug.exceptions import BadRequest, Forbidden, HTTPException, NotFound, TooManyRequests
from werkzeug.routing import Map, Rule
from werkzeug.utils import redirect
from werkzeug.wrappers import Request, Response

from dramatiq_guard import admin
from dramatiq_guard.backends.base import GuardBackend, check_key
from dramatiq_guard.bounds import MAX_COUNT
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.web.history import History, UnlockLimit, sparkline
from dramatiq_guard.web.settings import Access, AllowedHosts, Page, settings_of

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from dramatiq_guard.ledger import Ledger

#: The longest guard key (or search pattern) a request may name, so a reader cannot make the server
#: hold large made-up strings (``dramatiq-guard inspect`` shows a key of any length).
MAX_KEY_CHARS = 1024

CSRF_COOKIE = "dg_csrf"
WRITE_COOKIE = "dg_write"
FLASH_COOKIE = "dg_flash"
#: The pages (``/confirm/limit`` is answered by ``on_confirm_limit``; ``/api/key`` is ``on_key``'s view as
#: JSON; and ``/static/<name>``), then the writes (POST).
PAGES = ("/", "/key", "/ledger", "/api/overview", "/api/key", "/confirm/limit", "/confirm/release")
WRITES = ("/limit", "/release", "/unlock", "/lock")
STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
#: No inline script or style, nothing from elsewhere, no framing: a key or an argument that slips
#: past escaping still cannot run.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


class Dashboard:
    """The dashboard: a WSGI application (made by :func:`dramatiq_guard.web.make_app`).

    Parameters:
      backend(GuardBackend): The guard's backend.
      requeue(admin.Requeue|None): How hand-offs are re-enqueued (the app's broker), or None.
      history(History|None): Where the charts' samples are kept.
      unlock_limit(UnlockLimit|None): How often a client may give a wrong write secret.
      ledger, access, page, **deprecated: As :func:`~dramatiq_guard.web.make_app`'s, which raises
        what this raises.
    """

    def __init__(
        self,
        backend: GuardBackend,
        *,
        requeue: admin.Requeue | None = None,
        ledger: Ledger | None = None,
        access: Access | None = None,
        page: Page | None = None,
        history: History | None = None,
        unlock_limit: UnlockLimit | None = None,
        **deprecated: Any,
    ) -> None:
        access, page = settings_of(access, page, deprecated)
        self.backend = backend
        self.allowed_hosts = AllowedHosts(access.allowed_hosts)
        self.unlock_limit = UnlockLimit() if unlock_limit is None else unlock_limit
        self.requeue = requeue
        self.ledger = ledger
        self.write_secret = access.write_secret or None
        self.authorize = access.authorize
        self.refresh_ms = page.refresh_ms
        self.per_page = page.per_page
        self.history = History() if history is None else history
        self.jinja = jinja2.Environment(
            loader=jinja2.PackageLoader("dramatiq_guard.web", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.jinja.filters["ms"] = admin.format_ms
        self.jinja.filters["time"] = admin.format_time
        self.jinja.globals["sparkline"] = lambda key: sparkline(self.history.of(key))
        self.jinja.globals["args_query"] = _args_query
        methods = {path: ["POST" if path in WRITES else "GET"] for path in PAGES + WRITES}
        rules = [Rule(path, endpoint=_endpoint(path), methods=m) for path, m in methods.items()]
        self.urls = Map([*rules, Rule("/static/<name>", endpoint="static", methods=["GET"])])

    # -- WSGI -------------------------------------------------------------------

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        request = Request(environ)
        allowed = self.allowed_hosts.allows(request.host)
        response = self.respond(request) if allowed else self.wrong_host(request)
        response.headers.update(HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")
        return response(environ, start_response)

    def respond(self, request: Request) -> Response:
        """The response to a request for an allowed Host: its page, or a page that says what went wrong."""
        try:
            return self.dispatch(request)
        except HTTPException as e:
            response = self.render(
                request, "message.html", status=e.code or 500, title=e.name, text=e.description
            )
            for name, value in e.get_headers():  # e.g. Retry-After
                if name.lower() != "content-type":
                    response.headers[name] = value
            return response
        except BackendUnavailable as e:
            return self.render(request, "message.html", status=503, title="Redis unreachable", text=str(e))

    def dispatch(self, request: Request) -> Response:
        adapter = self.urls.bind_to_environ(request.environ)
        endpoint, values = adapter.match()
        if endpoint.startswith("api_"):
            return Response(
                json.dumps(self.view(endpoint[4:], request), default=str), mimetype="application/json"
            )
        if request.method == "POST":
            self.check_post(request)
        handler: Callable[..., Response] = getattr(self, f"on_{endpoint}")
        return handler(request, **values)

    # -- security ---------------------------------------------------------------

    def wrong_host(self, request: Request) -> Response:
        """A request for a Host name not allowed: 400, before anything is read (:class:`.AllowedHosts`)."""
        given = request.headers.get("Host", "")
        text = (
            f"This dashboard does not answer to the Host {given[:200]!r}. To allow a name, start it with "
            "--allowed-host NAME, or pass make_app(access=Access(allowed_hosts=[...])).\n"
        )
        return Response(text, status=400, mimetype="text/plain")

    def csrf_token(self, request: Request) -> str:
        """The session's CSRF token: its cookie, or a new one (set by :meth:`render`)."""
        token = request.cookies.get(CSRF_COOKIE, "")
        if len(token) < 32:
            token = getattr(request, "_new_csrf", "") or secrets.token_urlsafe(32)
            request._new_csrf = token  # type: ignore[attr-defined]
        return token

    def check_post(self, request: Request) -> None:
        """Refuse a cross-site POST: Origin (else Referer) must be the checked Host, the token the cookie."""
        here = urllib.parse.urlsplit(request.host_url)
        origin = request.headers.get("Origin") or request.headers.get("Referer")
        if not origin:
            raise Forbidden("A write needs the Origin or Referer header of this site.")
        there = urllib.parse.urlsplit(origin)
        if (there.scheme, there.netloc) != (here.scheme, here.netloc):
            raise Forbidden("A write from another site is refused.")
        cookie = request.cookies.get(CSRF_COOKIE, "")
        form = request.form.get("csrf", "")
        if len(cookie) < 32 or not hmac.compare_digest(cookie.encode(), form.encode()):
            raise Forbidden("The form's token is missing or stale: reload the page and try again.")

    def _write_mac(self, token: str) -> str:
        assert self.write_secret is not None
        return hmac.new(self.write_secret.encode(), b"write:" + token.encode(), hashlib.sha256).hexdigest()

    def can_write(self, request: Request) -> bool:
        """Whether this request may change the guard: the host app says so, or the session was unlocked."""
        if self.authorize is not None and self.authorize(request.environ):
            return True
        if self.write_secret is None:
            return False
        token = request.cookies.get(CSRF_COOKIE, "")
        unlocked = request.cookies.get(WRITE_COOKIE, "")
        return len(token) >= 32 and hmac.compare_digest(unlocked.encode(), self._write_mac(token).encode())

    def require_write(self, request: Request) -> None:
        if not self.can_write(request):
            raise Forbidden("This dashboard is read-only for you: unlock it with the write secret first.")

    # -- rendering --------------------------------------------------------------

    def render(self, request: Request, template: str, *, status: int = 200, **context: Any) -> Response:
        token = self.csrf_token(request)
        flash = request.cookies.get(FLASH_COOKIE)
        flash = None if flash is None else urllib.parse.unquote(flash)
        page = self.jinja.get_template(template).render(
            root=request.script_root,
            csrf=token,
            writable=self.can_write(request),
            unlockable=self.write_secret is not None,
            refresh_ms=self.refresh_ms,
            flash=flash,
            **context,
        )
        response = Response(page, status=status, mimetype="text/html")
        if getattr(request, "_new_csrf", None):
            _set_cookie(request, response, CSRF_COOKIE, request._new_csrf)  # type: ignore[attr-defined]
        if flash is not None and not context.get("fragment"):
            response.delete_cookie(FLASH_COOKIE, path=request.script_root or "/")
        return response

    def done(self, request: Request, key: str, lines: list[str]) -> Response:
        """After a write: back to the key's page, which says what was done."""
        response = redirect(f"{request.script_root}/key?{urllib.parse.urlencode({'k': key})}", code=303)
        _set_cookie(request, response, FLASH_COOKIE, urllib.parse.quote(" ".join(lines))[:3000])
        return response

    # -- pages ------------------------------------------------------------------

    def _key_arg(self, request: Request, values: Any = None) -> str:
        """The guard key named by the ``k`` field (of the query, or of ``values``)."""
        key = _bounded(str((request.args if values is None else values).get("k", "")), "key")
        try:
            check_key(key)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return key

    def view(self, name: str, request: Request) -> dict[str, Any]:
        """The view ``overview`` or ``key`` (the ``k`` field's) asked for, its rows sampled for the charts."""
        if name == "key":
            key = self._key_arg(request)
            now, [view] = admin.key_views(self.backend, [key])
            view["now_ms"] = now
            self.history.record([(key, len(view["holders"]), view["waiters"]["count"])])
            return view
        kind = request.args.get("kind")
        view = admin.overview(
            self.backend,
            pattern=_bounded(request.args.get("q") or "*", "search pattern"),
            kind=kind if kind in admin.KINDS else None,
            page=request.args.get("page", 1, type=int),  # 1 if it is not an integer
            per_page=self.per_page,
        )
        self.history.record((r["key"], r["holders"], r["waiters"]) for r in view["keys"])
        return view

    def _ledger(self) -> dict[str, Any] | None:
        if self.ledger is None:
            return None
        try:
            return admin.ledger_view(self.ledger, limit=20)
        except Exception as e:  # the database down must not take the guard's page with it
            return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}

    def on_overview(self, request: Request, name: str = "overview") -> Response:
        """The overview or a key's page, whole or (``fragment=1``) the part a page updates itself with."""
        fragment = request.args.get("fragment") == "1"
        view = self.view(name, request)
        context = {"key": view["key"]} if name == "key" else {"ledger": self._ledger(), "kinds": admin.KINDS}
        template = f"{'_' if fragment else ''}{name}.html"
        return self.render(request, template, view=view, args=request.args, fragment=fragment, **context)

    def on_key(self, request: Request) -> Response:
        return self.on_overview(request, "key")

    def on_ledger(self, request: Request) -> Response:
        if self.ledger is None:
            raise NotFound("No ledger is configured for this dashboard (start it with --ledger URL).")
        key = _bounded(request.args.get("k", ""), "key")
        row = admin.ledger_row(self.ledger, key) if key else None
        fields = (
            None if row is None else [(name, json.dumps(value, default=str)) for name, value in row.items()]
        )
        return self.render(request, "ledger.html", key=key, fields=fields)

    def on_static(self, request: Request, name: str) -> Response:
        if name not in STATIC:
            raise NotFound()
        body = importlib.resources.files("dramatiq_guard.web").joinpath("static").joinpath(name).read_bytes()
        response = Response(body, mimetype=STATIC[name])
        response.headers["Cache-Control"] = "max-age=300"
        return response

    # -- confirmations and writes ---------------------------------------------

    def _limit_arg(self, values: Any) -> int:
        text = values.get("limit", "")
        limit = admin.parse_limit(text)
        if limit is None:
            raise BadRequest(f"A limit must be an integer from 0 to {MAX_COUNT}, got {text!r}.")
        return limit

    def _parked_go(self, note: str = "") -> str:
        """Where the parked messages handed a slot go: the broker, or a worker's sweep (``note`` added)."""
        if self.requeue is not None:
            return "re-enqueued on the broker at once"
        return f"left reserved until a worker's sweep re-enqueues them{note}"

    def on_confirm_limit(self, request: Request) -> Response:
        self.require_write(request)
        limit = self._limit_arg(request.args)
        view = self.view("key", request)
        holders, waiters, before = len(view["holders"]), view["waiters"]["count"], view["limit"]
        lines = [
            f"Set the run-time limit of {view['key']} from "
            + ("none (the actor's own)" if before is None else str(before))
            + f" to {limit}. It has {holders} holder(s) and {waiters} waiter(s) now."
        ]
        if limit == 0:
            lines.append("0 halts the key: new messages park; running ones finish.")
        elif limit > holders and waiters:
            handed = min(waiters, limit - holders)
            where = self._parked_go(" (no --broker given)")
            lines.append(f"The first {handed} waiter(s) get a slot at once, their messages {where}.")
        elif limit < holders:
            lines.append("Nobody is evicted: new holders wait until the running ones drop below the limit.")
        return self._confirm(request, view["key"], "limit", lines, fields={"limit": limit})

    def on_confirm_release(self, request: Request) -> Response:
        self.require_write(request)
        key = self._key_arg(request)
        state = self.backend.inspect(key)
        holders = admin.releasable(state)
        if not holders:
            left = f"({len(state.reserved)} unconfirmed hand-off(s) left to lapse)"
            return self._confirm(request, key, None, [f"{key} has no holder to release {left}."])
        lines = [
            f"Release {len(holders)} holder(s) of {key} by force: {', '.join(holders)}.",
            f"Their slots go to the first of its {len(state.waiters)} waiter(s), within the limit recorded "
            f"with them; parked messages are {self._parked_go()}.",
            "A released holder that is still running loses its lease (it is told at its next renewal).",
        ]
        return self._confirm(request, key, "release", lines, holders=holders)

    def _confirm(
        self, request: Request, key: str, action: str | None, lines: list[str], **form: Any
    ) -> Response:
        """The page that says what a write will do, with its form (``action`` None: nothing to do)."""
        form = {"fields": {}, "holders": (), **form}
        return self.render(request, "confirm.html", key=key, action=action, lines=lines, **form)

    def on_limit(self, request: Request) -> Response:
        self.require_write(request)
        key = self._key_arg(request, request.form)
        limit = self._limit_arg(request.form)
        return self.done(request, key, admin.set_limit(self.backend, key, limit, self.requeue))

    def on_release(self, request: Request) -> Response:
        self.require_write(request)
        key = self._key_arg(request, request.form)
        # Only holders a release may release: never an unconfirmed hand-off (its payload is the only copy).
        releasable = set(admin.releasable(self.backend.inspect(key)))
        holders = [holder for holder in request.form.getlist("holder") if holder in releasable]
        return self.done(request, key, admin.release_holders(self.backend, key, holders, self.requeue))

    def on_unlock(self, request: Request) -> Response:
        if self.write_secret is None:
            raise Forbidden("This dashboard has no write secret: it is read-only.")
        client = request.remote_addr or ""
        wait = self.unlock_limit.retry_after(client)
        if wait:
            raise TooManyRequests(
                f"Too many wrong write secrets from {client or 'this address'}: try again in {wait} s.",
                retry_after=wait,
            )
        given = request.form.get("secret", "")
        back = request.form.get("next", "")
        if not back.startswith("/") or back.startswith("//"):
            back = "/"
        # Digests of equal length: the comparison's time says nothing of the secret, its length included.
        if not hmac.compare_digest(_digest(given), _digest(self.write_secret)):
            self.unlock_limit.failed(client)
            raise Forbidden("Wrong write secret.")
        self.unlock_limit.succeeded(client)
        response = redirect(request.script_root + back, code=303)
        _set_cookie(request, response, WRITE_COOKIE, self._write_mac(request.cookies[CSRF_COOKIE]))
        return response

    def on_lock(self, request: Request) -> Response:
        response = redirect(request.script_root + "/", code=303)
        response.delete_cookie(WRITE_COOKIE, path=request.script_root or "/")
        return response


def _bounded(text: str, what: str) -> str:
    """``text``, a key or pattern from a request, if it is at most :data:`MAX_KEY_CHARS` long."""
    if len(text) > MAX_KEY_CHARS:
        raise BadRequest(
            f"A {what} must be at most {MAX_KEY_CHARS} characters long, got {len(text)} "
            "(dramatiq-guard inspect shows a key of any length)."
        )
    return text


def _set_cookie(request: Request, response: Response, name: str, value: str) -> None:
    """Set a cookie of the dashboard: HTTP only, same site only, under its prefix."""
    response.set_cookie(name, value, httponly=True, samesite="Strict", path=request.script_root or "/")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _endpoint(path: str) -> str:
    """``/confirm/limit``: ``confirm_limit``; ``/``: ``overview``."""
    return path.strip("/").replace("/", "_") or "overview"


def _args_query(args: Any, **overrides: Any) -> str:
    """The overview's query string with ``overrides`` (``fragment`` only when given)."""
    query = {name: value for name, value in args.items() if name in ("q", "kind", "page") and value}
    query.update({name: str(value) for name, value in overrides.items()})
    return urllib.parse.urlencode(query)
