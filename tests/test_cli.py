"""The ``dramatiq-guard`` command against a real (private) Redis holding real guard state.

The state is made through the Redis backend directly; ``test_cli_worker.py``
makes it with a real worker.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, cast

import dramatiq
import pytest
import redis
from harness import wait_until

from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.backends.values import DEBOUNCE_TIMER
from dramatiq_guard.cli import main, parse_duration

MINUTE = 60_000


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = RedisBackend.from_url(redis_url)
    yield b
    b.close()


Run = Callable[..., "tuple[int, str, str]"]


@pytest.fixture
def run(redis_url: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run the command in-process: ``(status, stdout, stderr)``."""

    def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
        out = io.StringIO()
        status = main(["--redis", redis_url, *argv], stdin=io.StringIO(stdin), stdout=out)
        captured = capsys.readouterr()
        return status, out.getvalue() + captured.out, captured.err

    return run


def _park(backend: RedisBackend, key: str, waiter: str, payload: bytes = b"{}") -> None:
    result = backend.acquire(Stake(key, waiter, limit=1, ttl_ms=MINUTE), wait=Waiter(payload=payload))
    assert result.parked


# --- help and usage -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["inspect", "limit", "release", "ledger", "--redis", "--namespace", "Exit status"]),
        (["inspect"], ["PATTERN", "--json", "--redis", "indexes"]),
        (["limit"], ["get", "set", "clear"]),
        (["limit", "get"], ["KEY", "--actor", "--json"]),
        (["limit", "set"], ["KEY N | --actor NAME N", "--broker", "0 halts"]),
        (["limit", "clear"], ["KEY", "--actor"]),
        (["release"], ["KEY", "--yes", "--broker", "confirmation"]),
        (["ledger"], ["prune", "show", "list"]),
        (["ledger", "list"], ["--state", "--ledger", "--json"]),
        (["serve"], ["--host", "--port", "--broker", "--write-secret-file", "--allowed-host", "web extra"]),
        (["ledger", "prune"], ["--older-than", "--ledger", "30d"]),
        (["ledger", "show"], ["KEY", "--ledger", "--json"]),
    ],
)
def test_help_of_each_verb(argv: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dramatiq-guard {' '.join(argv)}".rstrip())
    for word in expected:
        assert word in out


def test_console_script_is_installed_and_reports_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dramatiq_guard.cli", "frobnicate"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "invalid choice: 'frobnicate'" in proc.stderr


# A base install (no web extra): this process cannot import the dashboard's libraries.
_WITHOUT_WEB_EXTRA = (
    "import sys; sys.modules.update(jinja2=None, werkzeug=None, waitress=None); "
    "from dramatiq_guard.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["serve", "--help"], ["inspect"]])
def test_every_verb_works_without_the_web_extra(argv: list[str], redis_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_WEB_EXTRA, "--redis", redis_url, *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_without_the_web_extra_says_what_to_install_in_one_line(redis_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_WEB_EXTRA, "--redis", redis_url, "serve"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'dramatiq-guard[web]'" in proc.stderr


def test_serve_help_states_the_dashboards_default_port(capsys: pytest.CaptureFixture[str]) -> None:
    from dramatiq_guard.web import DEFAULT_PORT

    assert main(["serve", "--help"]) == 0
    assert f"{DEFAULT_PORT})" in capsys.readouterr().out


def test_durations() -> None:
    assert parse_duration("30d") == 30 * 86_400_000
    assert parse_duration("90") == 90_000
    assert parse_duration("250ms") == 250
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("3x")


# --- inspect --------------------------------------------------------------------------------


def test_inspect_lists_indexed_keys_with_holders_waiters_and_limits(backend: RedisBackend, run: Run) -> None:
    assert backend.acquire(Stake("slots:c1", "m1", limit=1, ttl_ms=MINUTE, info="deliver_webhook")).acquired
    _park(backend, "slots:c1", "m2")
    _park(backend, "slots:c1", "m3")
    assert backend.acquire(Stake("mutex:only-held", "m4", limit=1, ttl_ms=MINUTE)).acquired
    [(_, since, _)] = backend.inspect("slots:c1").holder_info

    status, out, err = run("inspect", "--json")
    assert (status, err) == (0, "")
    view = json.loads(out)
    [key] = view["keys"]  # the held-only key is in no index
    assert key["key"] == "slots:c1"
    assert key["limit"] is None
    [holder] = key["holders"]
    assert holder["holder"] == "m1"
    assert 0 < holder["lease_left_ms"] <= MINUTE
    assert holder["reserved"] is False
    assert (holder["actor"], holder["since_ms"]) == ("deliver_webhook", since)
    assert key["waiters"]["count"] == 2
    assert key["waiters"]["parked"] == 2
    assert key["waiters"]["ids"] == ["m2", "m3"]
    assert key["waiters"]["oldest_age_ms"] >= 0

    status, out, _ = run("inspect")
    assert status == 0
    assert "slots:c1" in out
    assert "waiters 2 (2 parked, 0 blocking)" in out
    [row] = [line.split() for line in out.splitlines() if line.strip().startswith("m1")]
    assert row[2] == "deliver_webhook" and row[-1] == "ago"
    assert "only-held" not in out

    # Named exactly, a key in no index is shown.
    status, out, _ = run("inspect", "mutex:only-held", "--json")
    assert status == 0
    [key] = json.loads(out)["keys"]
    assert [h["holder"] for h in key["holders"]] == ["m4"]

    # Patterns filter.
    status, out, _ = run("inspect", "mutex:*")
    assert status == 0
    assert "No guard key matching 'mutex:*'" in out


def test_inspect_shows_a_throttle_keys_window(backend: RedisBackend, run: Run) -> None:
    """A throttle key's holders are its starts: the window shows them, and when the oldest leaves."""
    key = "throttle:partner"
    for holder in ("m1:0", "m2:0"):
        assert backend.acquire(Stake(key, holder, limit=2, ttl_ms=MINUTE, info="sync_order")).acquired
    for waiter in ("m3:0", "m4:0"):
        assert backend.acquire(Stake(key, waiter, limit=2, ttl_ms=MINUTE), wait=Waiter(payload=b"{}")).parked
    [handoff] = backend.release(key, "m1:0", limit=2).handoffs  # m3 takes the place, not started yet
    assert handoff.waiter_id == "m3:0"
    state = backend.inspect(key)

    status, out, err = run("inspect", "--json", key)
    assert (status, err) == (0, "")
    report = json.loads(out)
    [view] = report["keys"]
    assert view["kind"] == "throttle"
    oldest = min(deadline for _, deadline in state.holders)
    assert view["window"] == {"starts": 1, "opens_in_ms": oldest - report["now_ms"]}

    status, out, _ = run("inspect", key)
    assert status == 0
    assert "  window: 1 start(s); the oldest leaves it (a place opens) in " in out

    status, out, _ = run("inspect", "--summary")
    assert status == 0
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [[key, "throttle"]]


def test_inspect_shows_a_debounce_keys_pending_run(backend: RedisBackend, run: Run) -> None:
    """A debounce key's pending run: its message and actor, when it is due, the sends it superseded."""
    key = "debounce:doc-7"
    sends: list[dramatiq.Message[Any]] = [
        dramatiq.Message(queue_name="q", actor_name="reindex", args=(7, v), kwargs={}, options={})
        for v in range(3)
    ]
    for message in sends:
        backend.debounce(key, message.message_id, message.encode(), wait_ms=MINUTE, max_wait_ms=2 * MINUTE)
    due = dict(backend.inspect(key).holders)[DEBOUNCE_TIMER]

    status, out, err = run("inspect", "--json", key)
    assert (status, err) == (0, "")
    report = json.loads(out)
    [view] = report["keys"]
    assert view["kind"] == "debounce"
    pending = view["pending"]
    assert pending == {
        "id": sends[-1].message_id,
        "actor": "reindex",
        "args": "7, 2",
        "sent_ms": pending["sent_ms"],
        "due_ms": due,
        "due_in_ms": due - report["now_ms"],
        "superseded": 2,
    }
    assert 0 < pending["due_in_ms"] <= MINUTE and pending["sent_ms"] <= report["now_ms"]

    [bare] = json.loads(run("inspect", "--json", "--waiters", "0", key)[1])["keys"]
    assert (bare["pending"]["id"], bare["pending"]["actor"]) == (sends[-1].message_id, None)

    status, out, _ = run("inspect", key)
    assert status == 0
    assert f"  pending run {sends[-1].message_id} (reindex) due in " in out
    assert "2 send(s) superseded in this burst" in out

    status, out, _ = run("inspect", "--summary")
    assert status == 0
    header, line = out.splitlines()
    assert header.split()[-2:] == ["PENDING", "RUN"] and line.split()[:2] == [key, "debounce"]
    assert f"pending run {sends[-1].message_id} (reindex)" in line
    summary = json.loads(run("inspect", "--summary", "--json")[1])
    assert summary["keys"][0]["pending"]["id"] == sends[-1].message_id

    # Handed off when due: a holder now (its hand-off unconfirmed), nothing pending.
    backend.debounce(key, "m-last", sends[0].encode(), wait_ms=1, max_wait_ms=1)
    wait_until(lambda: backend.sweep(key, limit=1).handoffs)
    [view] = json.loads(run("inspect", "--json", key)[1])["keys"]
    assert view["pending"] is None and [h["holder"] for h in view["holders"]] == ["m-last"]
    assert "  no pending run (the last one was handed to the broker" in run("inspect", key)[1]


def test_inspect_shows_a_key_named_exactly_without_holders_or_waiters(run: Run) -> None:
    status, out, _ = run("inspect", "mutex:nobody")
    lines = out.splitlines()
    assert (status, lines[:2]) == (0, ["mutex:nobody", "  holders 0  limit actor default  waiters 0"])
    assert lines[2].startswith("Redis ")  # no table of holders or waiters between


def test_inspect_never_scans_the_keyspace(backend: RedisBackend, run: Run, redisdb: redis.Redis) -> None:
    assert backend.acquire(Stake("slots:c1", "m1", limit=1, ttl_ms=MINUTE)).acquired
    _park(backend, "slots:c1", "m2")
    before = {name: stats["calls"] for name, stats in redisdb.info("commandstats").items()}
    assert run("inspect")[0] == 0
    after = redisdb.info("commandstats")
    for command in ("cmdstat_keys", "cmdstat_scan"):
        assert after.get(command, {}).get("calls", 0) == before.get(command, 0)


# --- limits ---------------------------------------------------------------------------------


def test_limit_get_set_clear(backend: RedisBackend, run: Run) -> None:
    assert run("limit", "get", "slots:c1") == (
        0,
        "slots:c1: no run-time limit (the limit declared on the actor applies)\n",
        "",
    )
    assert run("limit", "set", "slots:c1", "4")[:2] == (0, "slots:c1: limit set to 4\n")
    assert backend.get_limit("slots:c1") == 4
    status, out, _ = run("limit", "get", "slots:c1", "--json")
    assert (status, json.loads(out)) == (0, {"key": "slots:c1", "limit": 4})

    # A key with a run-time limit shows in inspect.
    status, out, _ = run("inspect", "--json")
    if hasattr(backend, "limit_keys"):
        assert [k["key"] for k in json.loads(out)["keys"]] == ["slots:c1"]

    assert run("limit", "clear", "slots:c1")[0] == 0
    assert backend.get_limit("slots:c1") is None


def test_limit_of_an_actor(backend: RedisBackend, run: Run) -> None:
    assert run("limit", "set", "--actor", "deliver_webhook", "3")[:2] == (
        0,
        "concurrency-default:deliver_webhook: limit set to 3\n",
    )
    # Where the Concurrency middleware reads an actor's run-time default.
    assert backend.get_limit("concurrency-default:deliver_webhook") == 3
    status, out, _ = run("limit", "get", "--actor", "deliver_webhook", "--json")
    assert (status, json.loads(out)) == (0, {"key": "concurrency-default:deliver_webhook", "limit": 3})
    assert run("limit", "clear", "--actor", "deliver_webhook")[0] == 0
    assert backend.get_limit("concurrency-default:deliver_webhook") is None


def test_limit_zero_halts_and_raising_it_hands_off_leaving_reservations(
    backend: RedisBackend, run: Run
) -> None:
    assert run("limit", "set", "slots:c1", "0")[:2] == (0, "slots:c1: limit set to 0 (halted)\n")
    assert not backend.acquire(Stake("slots:c1", "m1", limit=5, ttl_ms=MINUTE)).acquired
    _park(backend, "slots:c1", "m1", b"payload-1")
    _park(backend, "slots:c1", "m2", b"payload-2")

    status, out, _ = run("limit", "set", "slots:c1", "1")
    assert status == 0
    assert "1 parked message(s) handed a slot and left reserved" in out
    state = backend.inspect("slots:c1")
    # Nothing is lost: m1 holds a reservation, its payload still stored until a worker re-enqueues it.
    assert state.reserved == ("m1",)
    assert [h for h, _ in state.holders] == ["m1"]
    assert [w for w, _, _ in state.waiters] == ["m2"]


def test_limit_set_with_broker_reenqueues_and_confirms(
    backend: RedisBackend, run: Run, actor_module: Callable[..., ModuleType], redisdb: redis.Redis
) -> None:
    module = actor_module(
        """
        import dramatiq
        from harness import broker_from_env

        broker = broker_from_env()
        dramatiq.set_broker(broker)

        @dramatiq.actor(queue_name="cli_requeue")
        def work(n):
            pass
        """,
        name="cli_requeue_app",
    )
    message = module.work.message(1)
    backend.set_limit("slots:c1", 0)
    _park(backend, "slots:c1", message.message_id, message.encode())

    status, out, err = run("limit", "set", "slots:c1", "1", "--broker", "cli_requeue_app:broker")
    assert (status, err) == (0, "")
    assert "1 parked message(s) re-enqueued" in out
    state = backend.inspect("slots:c1")
    assert state.reserved == ()  # confirmed: the broker has the message now
    assert [h for h, _ in state.holders] == [message.message_id]
    queued = redisdb.hgetall("dramatiq:cli_requeue.msgs")
    [payload] = queued.values()
    assert dramatiq.Message.decode(cast(bytes, payload)).message_id == message.message_id


def test_limit_set_rejects_bad_values(run: Run) -> None:
    status, _, err = run("limit", "set", "k", "-1")
    assert status == 2
    assert "a limit must be an integer >= 0" in err
    status, _, err = run("limit", "set", "5")
    assert status == 2
    assert "either KEY or --actor NAME" in err
    assert run("limit", "set", "k", "--actor", "a", "2")[0] == 2


def test_a_bad_broker_fails_before_anything_changes(backend: RedisBackend, run: Run) -> None:
    backend.set_limit("slots:c1", 0)
    _park(backend, "slots:c1", "m1")
    for spec, error in [("nocolon", "must be MODULE:ATTR"), ("no_such_module_xyz:broker", "No module named")]:
        status, out, err = run("limit", "set", "slots:c1", "1", "--broker", spec)
        assert (status, out) == (2, "")
        assert error in err
    assert backend.get_limit("slots:c1") == 0
    assert [w for w, _, _ in backend.inspect("slots:c1").waiters] == ["m1"]


# --- release --------------------------------------------------------------------------------


def test_release_asks_and_hands_off_to_the_oldest_waiter(backend: RedisBackend, run: Run) -> None:
    assert backend.acquire(Stake("mutex:report", "m1", limit=1, ttl_ms=MINUTE)).acquired
    _park(backend, "mutex:report", "m2")
    _park(backend, "mutex:report", "m3")

    status, out, err = run("release", "mutex:report", stdin="n\n")
    assert status == 1
    assert "Release 1 holder(s) of mutex:report (m1)" in out
    assert "not confirmed" in err
    assert [h for h, _ in backend.inspect("mutex:report").holders] == ["m1"]

    status, out, _ = run("release", "mutex:report", stdin="y\n")
    assert status == 0
    assert "released 1 holder(s)" in out
    state = backend.inspect("mutex:report")
    assert [h for h, _ in state.holders] == ["m2"]  # handed off, one slot: the limit holds
    assert state.reserved == ("m2",)
    assert [w for w, _, _ in state.waiters] == ["m3"]
    assert backend.renew("mutex:report", "m1", ttl_ms=MINUTE) is False  # the old holder is told

    # An unconfirmed hand-off is not released (its payload is the only copy).
    status, out, _ = run("release", "mutex:report", "--yes")
    assert status == 0
    assert "no holder to release (1 unconfirmed hand-off(s) left to lapse)" in out
    assert backend.inspect("mutex:report").reserved == ("m2",)


def test_release_of_a_free_key(run: Run) -> None:
    assert run("release", "mutex:none", "--yes") == (0, "mutex:none: no holder to release\n", "")


# --- errors ---------------------------------------------------------------------------------


def test_bad_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--redis", "bogus://x", "inspect"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("dramatiq-guard: error: bad Redis URL")


def test_unreachable_redis_is_an_operational_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness import free_port

    monkeypatch.setenv("DRAMATIQ_GUARD_REDIS_URL", f"redis://:secret@127.0.0.1:{free_port()}/0")
    assert main(["limit", "get", "k"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot reach Redis at redis://:***@127.0.0.1:" in err
    assert "secret" not in err


def test_bad_key_is_a_usage_error(run: Run) -> None:
    status, out, err = run("limit", "get", "}bad")
    assert (status, out) == (2, "")
    assert (
        err
        == "dramatiq-guard: error: a guard key must be non-empty and must not start with '}', got '}bad'\n"
    )


def test_inspect_describes_the_first_waiters_and_summarizes_many_keys(
    backend: RedisBackend, run: Run
) -> None:
    message: dramatiq.Message[object] = dramatiq.Message(
        queue_name="q", actor_name="deliver_webhook", args=(42, "x" * 200), kwargs={}, options={}
    )
    assert backend.acquire(Stake("slots:c1", "m1", limit=1, ttl_ms=MINUTE)).acquired
    _park(backend, "slots:c1", message.message_id, message.encode())
    _park(backend, "slots:c1", "m3", b"not a message")
    assert backend.acquire(Stake("slots:c2", "m4", limit=1, ttl_ms=MINUTE)).acquired
    _park(backend, "slots:c2", "m5")
    backend.set_limit("slots:halted", 0)

    status, out, _ = run("inspect", "slots:c1", "--json", "--waiters", "2")
    assert status == 0
    [key] = json.loads(out)["keys"]
    first, second = key["waiters"]["first"]
    assert (first["id"], first["parked"], first["actor"]) == (message.message_id, True, "deliver_webhook")
    assert first["args"].startswith('42, "xxx') and first["args"].endswith("…")
    assert (second["id"], second["actor"], second["args"]) == ("m3", None, "(cannot decode the message)")
    assert (key["recorded_limit"], key["limit_in_force"]) == (1, 1)

    status, out, _ = run("inspect", "slots:c1", "--waiters", "1")
    assert status == 0
    assert "WAITER" in out and "deliver_webhook" in out and "... and 1 more waiter(s)" in out

    status, out, _ = run("inspect", "--summary", "--json")
    assert status == 0
    rows = json.loads(out)["keys"]
    assert [r["key"] for r in rows] == ["slots:c1", "slots:c2", "slots:halted"]  # oldest wait first
    assert {r["key"]: (r["holders"], r["waiters"], r["limit_in_force"]) for r in rows} == {
        "slots:c1": (1, 2, 1),
        "slots:c2": (1, 1, 1),
        "slots:halted": (0, 0, 0),
    }
    status, out, _ = run("inspect", "--summary")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split() == ["KEY", "KIND", "HOLDERS", "LIMIT", "WAITERS", "OLDEST"]
    assert [line.split()[0] for line in lines[1:]] == ["slots:c1", "slots:c2", "slots:halted"]
    assert "0 (run-time)" in lines[3]
    status, out, _ = run("inspect", "nothing:*", "--summary")
    assert (status, out.strip()) == (0, "No guard key matching 'nothing:*' has waiters or a run-time limit.")
    status, _, err = run("inspect", "}bad")
    assert status == 2 and "}" in err
