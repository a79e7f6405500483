"""The dashboard against a hostile reader: other Host names, made-up keys, guessed secrets.

Real components: a real Redis backend, requests through Werkzeug's test client
(and, for ``serve``, a real waitress server in a subprocess). Time is a clock
the test sets, never a sleep.
"""

from __future__ import annotations

import fnmatch
import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dramatiq import Message
from harness import free_port, wait_until
from harness.dashboard import serving
from werkzeug.test import Client, TestResponse

from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.cli import main
from dramatiq_guard.web import Access, Dashboard, History, UnlockLimit, make_app

SECRET = "a-long-random-write-secret"
KEY = "concurrency:webhooks:42"
#: What a parked message's arguments carry: it must never reach a page served to another Host.
MARKER = "card-4242-4242"


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    """A Redis backend with one holder and one parked message (whose arguments carry MARKER) on KEY."""
    backend = RedisBackend.from_url(redis_url)
    assert backend.acquire(Stake(KEY, "h1", limit=1, ttl_ms=60_000, info="deliver")).acquired
    message: Message[Any] = Message(
        queue_name="q", actor_name="deliver", args=(42, MARKER), kwargs={}, options={}
    )
    parked = backend.acquire(
        Stake(KEY, message.message_id, limit=1, ttl_ms=60_000), wait=Waiter(payload=message.encode())
    )
    assert parked.parked
    yield backend
    backend.close()


def _csrf(client: Client) -> str:
    client.get("/")
    cookie = client.get_cookie("dg_csrf")
    assert cookie is not None
    return cookie.value


# -- (a) Host names ---------------------------------------------------------------------------


def test_a_request_for_a_host_name_not_allowed_gets_400_before_any_key_data_is_read(
    backend: RedisBackend,
) -> None:
    client = Client(make_app(backend))
    for path in ("/", f"/key?k={KEY}", f"/api/key?k={KEY}", "/api/overview", "/?fragment=1"):
        refused = client.get(path, headers={"Host": "evil.example:8470"})
        body = refused.get_data(as_text=True)
        assert refused.status_code == 400, path
        assert MARKER not in body and KEY not in body and "deliver" not in body, path
        assert "evil.example" in body and "allowed" in body  # it says what was wrong and how to allow it
    # The loopback names are allowed by default, with or without a port, IPv6 too.
    for host in ("localhost", "localhost:8470", "127.0.0.1:8470", "[::1]:8470"):
        page = client.get(f"/api/key?k={KEY}", headers={"Host": host})
        assert page.status_code == 200 and MARKER in page.get_data(as_text=True), host


def test_a_rebound_page_cannot_write_though_its_origin_matches_its_own_host(backend: RedisBackend) -> None:
    # A host site that lets every local request write: exactly what a DNS-rebinding page exploits,
    # since the victim's browser sends it from 127.0.0.1 with Origin and Host both the attacker's.
    app = make_app(backend, access=Access(authorize=lambda environ: True))
    rebound = Client(app)
    evil = "http://evil.example:8470"
    # The page makes its own double-submit pair: a script may set a cookie for its own name.
    rebound.set_cookie("dg_csrf", "t" * 43, domain="evil.example")
    posted = rebound.post(
        "/limit", base_url=evil, data={"k": KEY, "limit": "0", "csrf": "t" * 43}, headers={"Origin": evil}
    )
    assert posted.status_code == 400
    assert backend.get_limit(KEY) is None
    # From an allowed name, the same write goes through (the origin is checked against that name).
    local = Client(app)
    token = _csrf(local)
    done = local.post(
        "/limit", data={"k": KEY, "limit": "0", "csrf": token}, headers={"Origin": "http://localhost"}
    )
    assert done.status_code == 303 and backend.get_limit(KEY) == 0


def test_allowed_hosts_takes_names_subdomains_and_any(backend: RedisBackend) -> None:
    client = Client(
        make_app(backend, access=Access(allowed_hosts=["guard.example.com", ".internal.example", "[::1]"]))
    )
    assert client.get("/", headers={"Host": "guard.example.com"}).status_code == 200
    assert client.get("/", headers={"Host": "guard.example.com:8443"}).status_code == 200
    assert client.get("/", headers={"Host": "internal.example"}).status_code == 200
    assert client.get("/", headers={"Host": "a.b.internal.example"}).status_code == 200
    assert client.get("/", headers={"Host": "[::1]:8470"}).status_code == 200
    for host in ("localhost", "guard.example.com.evil.example", "xinternal.example", "a b", ""):
        assert client.get("/", headers={"Host": host}).status_code == 400, host
    # "*": any Host (a site that checks Host itself in front of the dashboard), still a valid one.
    anyhost = Client(make_app(backend, access=Access(allowed_hosts=["*"])))
    assert anyhost.get("/", headers={"Host": "whatever.example:81"}).status_code == 200
    assert anyhost.get("/", headers={"Host": "a/b"}).status_code == 400


@pytest.mark.parametrize(
    ("hosts", "complaint"),
    [
        (["localhost:8470"], "without a port"),
        (["http://guard.example.com"], "a host name"),
        (["*.example.com"], "'.example.com'"),
        ([""], "a host name"),
        ([], "at least one"),
        ("localhost", "a list"),
    ],
)
def test_a_bad_allowed_host_is_refused_naming_it_and_what_is_allowed(hosts: Any, complaint: str) -> None:
    with pytest.raises(ValueError, match="allowed_hosts") as raised:
        Access(allowed_hosts=hosts)
    assert complaint in str(raised.value)


# -- (b) made-up keys -------------------------------------------------------------------------


def test_long_keys_are_refused_at_the_edge_and_made_up_keys_are_not_remembered(backend: RedisBackend) -> None:
    history = History(max_keys=10)
    client = Client(Dashboard(backend, history=history))
    for n in range(50):
        long = f"{n}:" + "x" * 60_000
        for path in ("/key", "/api/key", "/ledger"):
            refused = client.get(path, query_string={"k": long})
            assert refused.status_code in (400, 404), path  # 404: no ledger configured
        assert client.get("/", query_string={"q": long}).status_code == 400
        refused = client.get("/api/key", query_string={"k": long})
        assert refused.status_code == 400 and "characters" in refused.get_data(as_text=True)
    assert len(history) == 0
    assert client.get(f"/api/key?k={KEY}").status_code == 200
    for n in range(300):
        made_up = f"made-up:{n}:" + "y" * 500
        assert client.get("/api/key", query_string={"k": made_up}).status_code == 200
    assert len(history.of(KEY)) == 1 and len(history) == 1  # made-up keys (nothing in them) start no chart
    for n in range(20):  # keys that exist are remembered up to the bound, the least recent forgotten
        assert backend.acquire(Stake(f"real:{n}", "h", limit=1, ttl_ms=60_000)).acquired
        assert client.get("/api/key", query_string={"k": f"real:{n}"}).status_code == 200
    assert len(history) == 10 and history.of("real:9") == [] and history.of("real:19")


def test_searching_with_made_up_patterns_is_not_remembered(backend: RedisBackend) -> None:
    client = Client(make_app(backend))
    compiled: Any = fnmatch._compile_pattern  # type: ignore[attr-defined]  # the stdlib's cache of globs
    patterns_before = compiled.cache_info().currsize
    for n in range(300):
        found = client.get("/api/overview", query_string={"q": f"made-up:{n}:*" + "z" * 500})
        assert found.status_code == 200 and json.loads(found.get_data())["keys"] == []
    # fnmatch's cache (32,768 compiled patterns) is not filled by readers.
    assert compiled.cache_info().currsize <= patterns_before
    found = client.get("/api/overview", query_string={"q": "*:webhooks:*"})
    assert [row["key"] for row in json.loads(found.get_data())["keys"]] == [KEY]


def test_a_known_key_that_drains_is_charted_down_to_zero(backend: RedisBackend) -> None:
    now = [0.0]
    history = History(clock=lambda: now[0])
    client = Client(Dashboard(backend, history=history))
    assert backend.acquire(Stake("mutex:report", "h", limit=1, ttl_ms=60_000)).acquired
    client.get("/api/key?k=mutex:report")
    backend.release("mutex:report", "h", limit=1)
    now[0] = 10.0
    client.get("/api/key?k=mutex:report")
    assert [sample[1:] for sample in history.of("mutex:report")] == [(1, 0), (0, 0)]


# -- (c) the write secret, never on the command line -------------------------------------------


def test_serve_refuses_a_write_secret_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--write-secret", SECRET, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "--write-secret" in err and "DRAMATIQ_GUARD_WRITE_SECRET" in err and "--write-secret-file" in err
    assert SECRET not in err


def test_serve_refuses_a_write_secret_file_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    assert main(["serve", "--write-secret-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read the write secret file {missing}" in err and "No such file" in err
    blank = tmp_path / "secret"
    blank.write_text("\n")
    assert main(["serve", "--write-secret-file", str(blank)]) == 2
    assert f"the write secret file {blank} is empty" in capsys.readouterr().err


def _request(
    port: int, method: str, path: str, *, host: str, body: str = "", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=True)
        connection.putheader("Host", host)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        if body:
            connection.putheader("Content-Type", "application/x-www-form-urlencoded")
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body.encode() if body else None)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


def test_serve_reads_the_write_secret_from_a_file_and_answers_only_its_host_names(
    redis_url: str, tmp_path: Path, backend: RedisBackend
) -> None:
    secret_file = tmp_path / "write-secret"
    secret_file.write_text(SECRET + "\n")
    args = ["--write-secret-file", str(secret_file), "--allowed-host", "guard.internal"]
    with serving(redis_url, args, env={"DRAMATIQ_GUARD_WRITE_SECRET": None}) as (_, port, line):
        assert "writes need the write secret" in line and "guard.internal" in line, line

        def answers() -> bool:
            try:
                return _request(port, "GET", "/", host=f"127.0.0.1:{port}")[0] == 200
            except OSError:
                return False

        wait_until(answers, timeout=30, what="the dashboard to answer")
        status, _, body = _request(port, "GET", f"/api/key?k={KEY}", host=f"evil.example:{port}")
        assert status == 400 and MARKER not in body
        status, _, body = _request(port, "GET", f"/api/key?k={KEY}", host=f"guard.internal:{port}")
        assert status == 200 and MARKER in body
        # The file's secret (without its newline) unlocks writes.
        status, headers, _ = _request(port, "GET", "/", host=f"localhost:{port}")
        token = re.search(r"dg_csrf=([^;]+)", headers["Set-Cookie"])
        assert token is not None
        origin = {"Origin": f"http://localhost:{port}", "Cookie": f"dg_csrf={token[1]}"}
        form = f"secret={SECRET}&csrf={token[1]}&next=/"
        status, headers, _ = _request(
            port, "POST", "/unlock", host=f"localhost:{port}", body=form, headers=origin
        )
        assert status == 303 and "dg_write=" in headers["Set-Cookie"]


# -- (d) guessing the write secret --------------------------------------------------------------


def _unlock(client: Client, token: str, secret: str) -> TestResponse:
    return client.post(
        "/unlock", data={"secret": secret, "csrf": token, "next": "/"}, headers={"Origin": "http://localhost"}
    )


def test_after_five_wrong_secrets_even_the_right_one_gets_429(backend: RedisBackend) -> None:
    guesser = Client(make_app(backend, access=Access(write_secret=SECRET)))
    token = _csrf(guesser)
    assert [_unlock(guesser, token, f"guess-{n}").status_code for n in range(5)] == [403] * 5
    refused = _unlock(guesser, token, SECRET)
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 60
    assert "Too many wrong write secrets" in refused.get_data(as_text=True)
    assert guesser.get_cookie("dg_write") is None


def test_unlock_is_rate_limited_per_client_after_wrong_secrets(backend: RedisBackend) -> None:
    now = [0.0]
    limit = UnlockLimit(failures=5, window_s=60.0, clock=lambda: now[0])
    app = Dashboard(backend, access=Access(write_secret=SECRET), unlock_limit=limit)
    guesser = Client(app)
    token = _csrf(guesser)
    for n in range(5):
        now[0] = float(n)
        assert _unlock(guesser, token, f"guess-{n}").status_code == 403
    refused = _unlock(guesser, token, SECRET)  # the right secret, too soon: refused unread
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "56"
    assert "dg_write=" not in refused.headers.get("Set-Cookie", "")
    # Another client address is not held back by this one's guesses.
    other = Client(app)
    other_token = _csrf(other)
    elsewhere = other.post(
        "/unlock",
        data={"secret": SECRET, "csrf": other_token, "next": "/"},
        headers={"Origin": "http://localhost"},
        environ_base={"REMOTE_ADDR": "192.0.2.7"},
    )
    assert elsewhere.status_code == 303
    now[0] = 59.9
    assert _unlock(guesser, token, SECRET).status_code == 429
    now[0] = 60.0  # the first guess left the window: one more try
    assert _unlock(guesser, token, "guess-again").status_code == 403
    assert _unlock(guesser, token, SECRET).status_code == 429
    now[0] = 66.0
    assert _unlock(guesser, token, SECRET).status_code == 303


def test_the_unlock_limit_remembers_a_bounded_number_of_clients(backend: RedisBackend) -> None:
    limit = UnlockLimit(failures=2, window_s=60.0, max_clients=3, clock=lambda: 0.0)
    app = Dashboard(backend, access=Access(write_secret=SECRET), unlock_limit=limit)
    client = Client(app)
    token = _csrf(client)
    for n in range(20):
        wrong = client.post(
            "/unlock",
            data={"secret": "guess", "csrf": token, "next": "/"},
            headers={"Origin": "http://localhost"},
            environ_base={"REMOTE_ADDR": f"192.0.2.{n}"},
        )
        assert wrong.status_code == 403
        assert len(limit) <= 3
