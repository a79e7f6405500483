"""The web dashboard's WSGI application, without a browser (Werkzeug's test client), and ``serve``."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq import Message
from harness import wait_until
from harness.dashboard import serving
from werkzeug.test import Client, TestResponse

from dramatiq_guard import admin
from dramatiq_guard.backends import Handoff, MemoryBackend, RedisBackend, Stake, Waiter
from dramatiq_guard.backends.values import DEBOUNCE_TIMER
from dramatiq_guard.cli import main
from dramatiq_guard.ledger import Ledger
from dramatiq_guard.web import Access, Dashboard, History, Page, make_app
from dramatiq_guard.web.history import sparkline

SECRET = "s3cret"
KEY = "concurrency:webhooks:42"
ORIGIN = "http://localhost"


def _park(backend: MemoryBackend, key: str, *args: Any, actor: str = "deliver", limit: int = 1) -> str:
    message: Message[Any] = Message(queue_name="q", actor_name=actor, args=args, kwargs={}, options={})
    result = backend.acquire(
        Stake(key, message.message_id, limit=limit, ttl_ms=60_000), wait=Waiter(payload=message.encode())
    )
    assert result.parked
    return message.message_id


def _busy(backend: MemoryBackend, key: str = KEY, *, limit: int = 2, waiting: int = 3) -> list[str]:
    for i in range(limit):
        assert backend.acquire(Stake(key, f"h{i}", limit=limit, ttl_ms=60_000, info="deliver")).acquired
    return [_park(backend, key, 42, n, limit=limit) for n in range(waiting)]


def _csrf(client: Client) -> str:
    client.get("/")
    cookie = client.get_cookie("dg_csrf")
    assert cookie is not None
    return cookie.value


def _post(client: Client, path: str, data: dict[str, Any], *, origin: str | None = ORIGIN) -> TestResponse:
    headers = {} if origin is None else {"Origin": origin}
    return client.post(path, data=data, headers=headers)


def _unlocked(app: Dashboard) -> tuple[Client, str]:
    client = Client(app)
    token = _csrf(client)
    response = _post(client, "/unlock", {"secret": SECRET, "csrf": token, "next": "/key?k=x"})
    assert response.status_code == 303 and response.headers["Location"].endswith("/key?k=x")
    return client, token


def test_the_overview_lists_busy_keys_most_in_need_of_a_look_first() -> None:
    backend = MemoryBackend()
    _busy(backend, "concurrency:a", waiting=1)
    _busy(backend, "mutex:b", limit=1, waiting=2)  # its oldest waiter came later
    backend.set_limit("concurrency:halted", 0)
    _park(backend, "concurrency:halted", 1)
    assert backend.acquire(Stake("dedup:c", "m", limit=1, ttl_ms=60_000)).acquired  # not in an index
    app = make_app(backend)
    page = Client(app).get("/")
    assert page.status_code == 200
    text = page.get_data(as_text=True)
    keys = re.findall(r'class="key" href="[^"]*">([^<]*)<', text)
    assert keys == ["concurrency:halted", "concurrency:a", "mutex:b"]
    assert "read-only" in text and "Unlock writes" not in text
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert page.headers["X-Frame-Options"] == "DENY"
    data = json.loads(Client(app).get("/api/overview?kind=mutex").get_data())
    assert [row["key"] for row in data["keys"]] == ["mutex:b"]
    assert data["keys"][0] | {"oldest_age_ms": 0} == {
        "key": "mutex:b",
        "kind": "mutex",
        "holders": 1,
        "waiters": 2,
        "reserved": 0,
        "oldest_age_ms": 0,
        "limit": None,
        "recorded_limit": 1,
        "limit_in_force": 1,
        "halted": False,
        "at_limit": True,
    }
    fragment = Client(app).get("/?fragment=1&q=concurrency:*").get_data(as_text=True)
    assert "<html" not in fragment and "mutex:b" not in fragment and "concurrency:a" in fragment


def test_the_overview_is_paginated() -> None:
    backend = MemoryBackend()
    for i in range(7):
        _busy(backend, f"concurrency:k{i}", limit=1, waiting=1)
    app = make_app(backend, page=Page(per_page=3))
    client = Client(app)
    text = client.get("/?page=2").get_data(as_text=True)
    assert "page 2 of 3" in text and "previous" in text and "next" in text
    assert len(re.findall('class="key"', text)) == 3
    assert len(re.findall('class="key"', client.get("/?page=9").get_data(as_text=True))) == 1  # the last
    assert "page 1 of 3" in client.get("/?page=x").get_data(as_text=True)


def test_the_key_page_shows_holders_waiters_in_order_and_the_limit() -> None:
    backend = MemoryBackend()
    waiting = _busy(backend)
    app = make_app(backend)
    text = Client(app).get("/key", query_string={"k": KEY}).get_data(as_text=True)
    assert re.findall(r'<td class="id">([^<]*)</td><td>parked', text) == waiting
    assert 'id="holders-count">2<' in text and 'id="waiters-count">3<' in text
    assert "default, recorded with the waiters" in text
    assert "42, 0" in text  # the first arguments
    assert 'id="limit-form"' not in text  # read-only
    view = json.loads(Client(app).get("/api/key", query_string={"k": KEY}).get_data())
    assert view == admin.key_views(backend, [KEY])[1][0] | {"now_ms": view["now_ms"]} | _ages(view)
    assert Client(app).get("/key?k=").status_code == 400
    assert Client(app).get("/key?k=}x").status_code == 400


def test_the_key_page_shows_a_throttle_keys_window(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url)
    key = "throttle:partner"
    for holder in ("m1:0", "m2:0"):
        assert backend.acquire(Stake(key, holder, limit=2, ttl_ms=60_000, info="sync_order")).acquired
    client = Client(make_app(backend))
    text = client.get("/key", query_string={"k": key}).get_data(as_text=True)
    assert 'id="window-starts">2<' in text and "the oldest leaves it (a place opens) in" in text
    view = json.loads(client.get("/api/key", query_string={"k": key}).get_data())
    oldest = min(deadline for _, deadline in backend.inspect(key).holders)
    assert view["window"] == {"starts": 2, "opens_in_ms": oldest - view["now_ms"]}
    assert 'id="window"' not in client.get("/key", query_string={"k": KEY}).get_data(as_text=True)
    backend.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_key_page_and_the_overview_show_a_debounce_keys_pending_run(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The pending run of a debounce key: its message and actor, when it is due, the sends it superseded."""
    backend = (
        MemoryBackend() if kind == "memory" else RedisBackend.from_url(request.getfixturevalue("redis_url"))
    )
    key = "debounce:doc-7"
    sends: list[Message[Any]] = [
        Message(queue_name="q", actor_name="reindex", args=(7, v), kwargs={}, options={}) for v in range(4)
    ]
    for message in sends:
        backend.debounce(key, message.message_id, message.encode(), wait_ms=60_000, max_wait_ms=120_000)
    due = dict(backend.inspect(key).holders)[DEBOUNCE_TIMER]
    client, last = Client(make_app(backend)), sends[-1].message_id

    text = client.get("/key", query_string={"k": key}).get_data(as_text=True)
    assert f'id="pending-id">{last}<' in text and " of reindex, due in " in text
    assert 'id="pending-superseded">3<' in text
    view = json.loads(client.get("/api/key", query_string={"k": key}).get_data())
    assert view["pending"] == {
        "id": last,
        "actor": "reindex",
        "args": "7, 3",
        "sent_ms": view["pending"]["sent_ms"],
        "due_ms": due,
        "due_in_ms": due - view["now_ms"],
        "superseded": 3,
    }
    assert 'id="pending"' not in client.get("/key", query_string={"k": KEY}).get_data(as_text=True)

    overview = json.loads(client.get("/api/overview").get_data())
    [row] = overview["keys"]
    assert row["kind"] == "debounce" and row["pending"] == view["pending"] | {
        "due_in_ms": due - overview["now_ms"]
    }
    assert overview["counts"] == {"debounce": {"keys": 1, "holders": 1, "waiters": 1}}
    text = client.get("/").get_data(as_text=True)
    assert f"run {last} of reindex, due in " in text and ", 3 superseded" in text
    backend.close()


def _ages(view: dict[str, Any]) -> dict[str, Any]:
    """The parts of a view that change with time, as they were in ``view``."""
    return {"holders": view["holders"], "waiters": view["waiters"]}


def test_a_limit_is_changed_after_a_confirmation_that_says_what_will_happen() -> None:
    backend = MemoryBackend()
    waiting = _busy(backend)
    handed: list[Handoff] = []

    def requeue(handoffs: Sequence[Handoff]) -> None:  # as a broker's courier would
        for handoff in handoffs:
            handed.append(handoff)
            backend.confirm_handoff(
                handoff.key, handoff.waiter_id, ttl_ms=60_000, generation=handoff.generation
            )

    app = Dashboard(backend, requeue=requeue, access=Access(write_secret=SECRET))
    client, token = _unlocked(app)
    page = client.get("/key", query_string={"k": KEY}).get_data(as_text=True)
    assert 'id="limit-form"' in page and "writes enabled" in page
    confirm = client.get("/confirm/limit", query_string={"k": KEY, "limit": "4"}).get_data(as_text=True)
    assert "from none (the actor&#39;s own) to 4" in confirm
    assert "The first 2 waiter(s) get a slot at once, their messages re-enqueued on the broker" in confirm
    assert backend.get_limit(KEY) is None  # nothing changed yet
    done = _post(client, "/limit", {"k": KEY, "limit": "4", "csrf": token})
    assert done.status_code == 303
    assert backend.get_limit(KEY) == 4
    assert [h.waiter_id for h in handed] == waiting[:2]
    after = client.get(done.headers["Location"]).get_data(as_text=True)
    assert "limit set to 4" in after and "2 parked message(s) re-enqueued" in after
    assert client.get_cookie("dg_flash") is None  # shown once
    halt = client.get("/confirm/limit", query_string={"k": KEY, "limit": "0"}).get_data(as_text=True)
    assert "0 halts the key" in halt
    lower = client.get("/confirm/limit", query_string={"k": KEY, "limit": "1"}).get_data(as_text=True)
    assert "Nobody is evicted" in lower
    assert client.get("/confirm/limit", query_string={"k": KEY, "limit": "-1"}).status_code == 400
    assert _post(client, "/limit", {"k": KEY, "limit": "many", "csrf": token}).status_code == 400
    assert _post(client, "/limit", {"k": "", "limit": "1", "csrf": token}).status_code == 400


def test_a_forced_release_hands_the_slots_to_the_oldest_waiters() -> None:
    backend = MemoryBackend()
    waiting = _busy(backend)
    app = make_app(backend, access=Access(write_secret=SECRET))  # no broker: the hand-offs stay reserved
    client, token = _unlocked(app)
    confirm = client.get("/confirm/release", query_string={"k": KEY}).get_data(as_text=True)
    assert "Release 2 holder(s) of concurrency:webhooks:42 by force: h0, h1." in confirm
    assert "left reserved until a worker&#39;s sweep" in confirm
    assert re.findall(r'name="holder" value="([^"]*)"', confirm) == ["h0", "h1"]
    done = _post(client, "/release", {"k": KEY, "holder": ["h0", "h1"], "csrf": token})
    assert done.status_code == 303
    state = backend.inspect(KEY)
    assert sorted(h for h, _ in state.holders) == sorted(waiting[:2]) == sorted(state.reserved)
    assert "released 2 holder(s)" in client.get(done.headers["Location"]).get_data(as_text=True)
    nothing = client.get("/confirm/release", query_string={"k": KEY}).get_data(as_text=True)
    assert "has no holder to release (2 unconfirmed hand-off(s) left to lapse)" in nothing
    assert 'id="confirm"' not in nothing
    assert _post(client, "/release", {"k": "", "csrf": token}).status_code == 400


def test_writes_need_the_secret_the_token_and_the_same_origin() -> None:
    backend = MemoryBackend()
    _busy(backend)
    app = make_app(backend, access=Access(write_secret=SECRET))
    anonymous = Client(app)
    token = _csrf(anonymous)
    assert "Unlock writes" in anonymous.get("/").get_data(as_text=True)
    assert _post(anonymous, "/limit", {"k": KEY, "limit": "0", "csrf": token}).status_code == 403
    assert anonymous.get("/confirm/limit", query_string={"k": KEY, "limit": "0"}).status_code == 403
    wrong = _post(anonymous, "/unlock", {"secret": "guess", "csrf": token, "next": "//evil"})
    assert wrong.status_code == 403
    client, token = _unlocked(app)
    refused = [
        _post(client, "/limit", {"k": KEY, "limit": "0"}),  # no token
        _post(client, "/limit", {"k": KEY, "limit": "0", "csrf": "x" * 43}),  # another token
        _post(client, "/limit", {"k": KEY, "limit": "0", "csrf": token}, origin="http://evil.example"),
        _post(client, "/limit", {"k": KEY, "limit": "0", "csrf": token}, origin=None),  # no origin
    ]
    assert [r.status_code for r in refused] == [403] * 4
    assert backend.get_limit(KEY) is None
    referer = client.post(
        "/limit", data={"k": KEY, "limit": "0", "csrf": token}, headers={"Referer": ORIGIN + "/"}
    )
    assert referer.status_code == 303 and backend.get_limit(KEY) == 0
    # The unlock is bound to the session's token: another session's cookie does not carry over.
    stranger = Client(app)
    stranger_token = _csrf(stranger)
    stolen = client.get_cookie("dg_write")
    assert stolen is not None
    stranger.set_cookie("dg_write", stolen.value)
    assert _post(stranger, "/limit", {"k": KEY, "limit": "1", "csrf": stranger_token}).status_code == 403
    locked = _post(client, "/lock", {"csrf": token})
    assert locked.status_code == 303 and client.get_cookie("dg_write") is None
    assert _post(client, "/limit", {"k": KEY, "limit": "1", "csrf": token}).status_code == 403
    readonly = make_app(backend)
    ro_client = Client(readonly)
    ro_token = _csrf(ro_client)
    assert _post(ro_client, "/unlock", {"secret": "", "csrf": ro_token}).status_code == 403


def test_the_host_app_may_authorize_writes() -> None:
    backend = MemoryBackend()
    _busy(backend)
    app = make_app(backend, access=Access(authorize=lambda environ: environ.get("HTTP_X_STAFF") == "yes"))
    client = Client(app)
    token = _csrf(client)
    data = {"k": KEY, "limit": "3", "csrf": token}
    assert client.post("/limit", data=data, headers={"Origin": ORIGIN}).status_code == 403
    assert client.post("/limit", data=data, headers={"Origin": ORIGIN, "X-Staff": "yes"}).status_code == 303
    assert backend.get_limit(KEY) == 3


def test_markup_in_keys_actors_and_arguments_is_escaped() -> None:
    backend = MemoryBackend()
    key = 'mutex:<script>alert("k")</script>'
    assert backend.acquire(Stake(key, "<b>h</b>", limit=1, ttl_ms=60_000, info="<i>actor</i>")).acquired
    _park(backend, key, "<img src=x onerror=alert(1)>", actor="<svg onload=alert(2)>")
    client = Client(make_app(backend))
    for page in (client.get("/"), client.get("/key", query_string={"k": key})):
        text = page.get_data(as_text=True)
        assert "<script>alert" not in text and "<img src=x" not in text and "<svg onload" not in text
        assert "<b>h</b>" not in text and "<i>actor</i>" not in text
        assert "&lt;script&gt;" in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in client.get("/key", query_string={"k": key}).get_data(
        as_text=True
    )


def test_static_files_unknown_pages_and_an_unreachable_redis() -> None:
    client = Client(make_app(MemoryBackend()))
    js = client.get("/static/dashboard.js")
    assert js.status_code == 200 and js.mimetype == "text/javascript" and b"fetch(" in js.get_data()
    assert client.get("/static/dashboard.css").mimetype == "text/css"
    assert client.get("/static/secrets.txt").status_code == 404
    assert client.get("/nowhere").status_code == 404
    assert client.get("/ledger").status_code == 404  # no ledger configured
    down = make_app(redis="redis://127.0.0.1:1/0?socket_connect_timeout=0.5")
    page = Client(down).get("/")
    assert page.status_code == 503 and "Redis unreachable" in page.get_data(as_text=True)


def test_the_ledger_counts_lists_and_finds_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ledger = Ledger(url)
    ledger.create_all()
    with ledger.engine.begin() as conn:
        for i, state in enumerate(["completed", "failed", "failed"]):
            conn.execute(
                ledger.table.insert().values(
                    idempotency_key=f"<k{i}>",
                    state=state,
                    actor_name="transfer",
                    fingerprint="f" * 64,
                    payload={"n": i},
                    result=None,
                    error="ValueError: <bad>" if state == "failed" else None,
                    attempts=1,
                    holder="m",
                    fencing_token=1,
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
    client = Client(make_app(MemoryBackend(), ledger=url))
    text = client.get("/").get_data(as_text=True)
    assert "completed <b>1</b>" in text and "failed <b>2</b>" in text
    assert "ValueError: &lt;bad&gt;" in text and "&lt;k1&gt;" in text
    row = client.get("/ledger", query_string={"k": "<k1>"}).get_data(as_text=True)
    assert "&#34;failed&#34;" in row and "&#34;transfer&#34;" in row
    assert "No ledger row for &lt;nope&gt;" in client.get("/ledger?k=<nope>").get_data(as_text=True)
    broken = Client(make_app(MemoryBackend(), ledger=f"sqlite:///{tmp_path / 'missing' / 'x.sqlite3'}"))
    assert "The ledger cannot be read" in broken.get("/").get_data(as_text=True)
    out = io.StringIO()
    assert main(["ledger", "list", "--ledger", url, "--json"], stdout=out) == 0
    listed = json.loads(out.getvalue())
    assert listed["counts"] == {"completed": 1, "failed": 2}
    assert sorted(r["key"] for r in listed["rows"]["failed"]) == ["<k1>", "<k2>"]
    out = io.StringIO()
    assert main(["ledger", "list", "--ledger", url, "--state", "completed"], stdout=out) == 0
    assert "completed 1  failed 2" in out.getvalue() and "<k0>" in out.getvalue()
    ledger.dispose()


def _now() -> Any:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def test_the_history_keeps_a_ring_per_key_and_draws_it() -> None:
    now = [0.0]
    history = History(size=3, interval_s=5.0, max_keys=2, clock=lambda: now[0])
    history.record([("a", 1, 2)])
    history.record([("a", 9, 9)])  # too soon: skipped
    assert sparkline(history.of("a")) is None  # one sample: nothing to draw
    for t in (5.0, 10.0, 15.0):
        now[0] = t
        history.record([("a", int(t), 1)])
    assert [s[0] for s in history.of("a")] == [5.0, 10.0, 15.0]
    history.record([("b", 1, 0)])
    now[0] = 20.0
    history.record([("c", 0, 1)])
    assert history.of("a") == [] and history.of("b") and history.of("c")  # the least recent forgotten
    line = sparkline([(0.0, 0, 4), (1.0, 2, 0)], width=10, height=10)
    assert line == {"holders": "0.0,9.0 10.0,5.0", "waiters": "0.0,1.0 10.0,9.0", "max": "4"}


def test_the_overview_draws_a_chart_once_a_key_was_sampled_twice() -> None:
    backend = MemoryBackend()
    _busy(backend)
    now = [0.0]
    app = Dashboard(backend, history=History(clock=lambda: now[0]))
    client = Client(app)
    assert "<polyline" not in client.get("/").get_data(as_text=True)
    now[0] = 10.0
    assert '<polyline class="holders"' in client.get("/").get_data(as_text=True)
    now[0] = 20.0
    assert '<polyline class="waiters"' in client.get("/key", query_string={"k": KEY}).get_data(as_text=True)


def test_make_app_builds_its_backend_broker_and_ledger(redis_url: str, tmp_path: Path) -> None:
    from dramatiq.brokers.stub import StubBroker

    app = make_app(redis=redis_url, namespace="ns", broker=StubBroker())
    assert isinstance(app.backend, RedisBackend) and app.backend.namespace == "ns"
    assert app.requeue is not None
    client = redis.Redis.from_url(redis_url)
    assert isinstance(make_app(redis=client).backend, RedisBackend)
    client.close()
    with pytest.raises(ValueError, match="MODULE:ATTR"):
        make_app(MemoryBackend(), broker="nonsense")


def test_the_keywords_of_0_1_still_work_with_a_deprecation_warning() -> None:
    """``write_secret=`` and the others, from before :class:`Access` and :class:`Page`."""

    def staff(environ: Any) -> bool:
        return False

    with pytest.warns(DeprecationWarning, match=r"write_secret=, per_page=.*access=Access") as warned:
        app = make_app(MemoryBackend(), write_secret=SECRET, per_page=3, access=Access(authorize=staff))
    assert [w.filename for w in warned] == [__file__]  # the caller's line
    assert (app.write_secret, app.authorize, app.per_page, app.refresh_ms) == (SECRET, staff, 3, 1500)
    with pytest.warns(DeprecationWarning, match="allowed_hosts="):
        dashboard = Dashboard(MemoryBackend(), allowed_hosts=["*"], refresh_ms=500)
    assert (dashboard.allowed_hosts.entries, dashboard.refresh_ms) == (("*",), 500)
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*: per_pgae"):
        make_app(MemoryBackend(), per_pgae=3)


def test_serve_runs_the_dashboard_on_localhost(redis_url: str, tmp_path: Path) -> None:
    import urllib.request

    with serving(redis_url, env={"DRAMATIQ_GUARD_WRITE_SECRET": SECRET}) as (_, port, line):
        assert f"http://127.0.0.1:{port}/" in line and "writes need the write secret" in line

        def fetch() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    return str(response.read().decode())
            except OSError:
                return None

        page = wait_until(fetch, timeout=30, what="the dashboard to answer")
        assert "Unlock writes" in page and "No guard key has holders" in page


def test_serve_refuses_a_bad_broker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--broker", "no_such_module_here:broker"]) == 2
    assert "no_such_module_here" in capsys.readouterr().err
