"""How the Redis backend's scripts reach the server: one function library, else EVALSHA.

Each test that talks to Redis starts a server of its own (``private_redis``, or
one started with options): they load and flush functions and add ACL users,
which must not touch the session's server.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
import redis
from harness.redis_server import RedisServer

from dramatiq_guard.backends import RedisBackend, Waiter
from dramatiq_guard.backends.base import Handoff
from dramatiq_guard.backends.redis_scripts import LEAN_SCRIPTS, PRELUDE_SCRIPTS, ScriptLibrary, load_lua
from dramatiq_guard.cli import main
from dramatiq_guard.errors import BackendUnavailable

KEY = "concurrency:k"
MINUTE = 60_000


def calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats; ``function|load`` for a subcommand)."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def hand_off(backend: RedisBackend) -> None:
    """A slot's life on a busy key: held, a waiter parked, the slot handed to it on release, confirmed."""
    assert backend.acquire(KEY, "a", limit=1, ttl_ms=MINUTE).acquired
    assert backend.acquire(KEY, "p1", limit=1, ttl_ms=MINUTE, wait=Waiter(payload=b"msg:p1")).parked
    assert backend.renew_many([(KEY, "a", MINUTE)]) == [True]
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["p1"]
    assert backend.release(KEY, "p1", limit=1).handoffs == ()
    assert backend.try_lock("dedup:k", "m1", ttl_ms=MINUTE).acquired


@pytest.fixture
def admin(private_redis: RedisServer) -> Iterator[redis.Redis]:
    client = private_redis.client()
    yield client
    client.close()


def user_client(server: RedisServer, admin: redis.Redis, name: str, *rules: str) -> redis.Redis:
    """A client of an ACL user allowed everything but ``rules`` take away."""
    admin.acl_setuser(name, enabled=True, nopass=True, keys=["*"], channels=["*"], commands=["+@all", *rules])
    return redis.Redis(host=server.host, port=server.port, username=name, password="")


def test_the_scripts_are_one_function_library_loaded_once(
    private_redis: RedisServer, admin: redis.Redis
) -> None:
    """Every call is an FCALL of one library, loaded by the first call that found it missing."""
    backend = RedisBackend(private_redis.client(), namespace="t")
    hand_off(backend)
    RedisBackend(private_redis.client(), namespace="t2").inspect(KEY)  # another process: already loaded
    [library] = admin.function_list()
    assert library[1].decode() == backend.scripts.library
    functions = {entry[1].decode(): [flag.decode() for flag in entry[5]] for entry in library[5]}
    prefix = backend.scripts.library + "_"
    assert set(functions) == {prefix + name for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS)}
    assert functions[prefix + "inspect"] == ["no-writes"] and functions[prefix + "release"] == ["allow-oom"]
    assert calls(admin, "function|load") == 1 and calls(admin, "fcall") > 0
    assert calls(admin, "evalsha") == calls(admin, "eval") == calls(admin, "script|load") == 0
    assert backend.scripts.functions


def test_two_versions_of_the_library_live_side_by_side(
    private_redis: RedisServer, admin: redis.Redis
) -> None:
    """Another version's library (another digest, so other function names) loads next to this one."""
    ours = ScriptLibrary()
    theirs = ours.code.replace(ours.library, "dramatiq_guard_" + "0" * 16).replace(
        "HOLDERS_SHOWN = 10", "HOLDERS_SHOWN = 9"
    )
    assert admin.function_load(theirs) == b"dramatiq_guard_" + b"0" * 16
    backend = RedisBackend(private_redis.client(), namespace="t")
    hand_off(backend)  # loads ours, next to theirs
    assert {entry[1].decode() for entry in admin.function_list()} == {
        ours.library,
        "dramatiq_guard_" + "0" * 16,
    }
    assert admin.fcall("dramatiq_guard_" + "0" * 16 + "_due", 1, "t:waiting") == []


OLDER_REDIS = ("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", "")  # as Redis 6 answers


@pytest.mark.parametrize(
    ("server_args", "rules"),
    [
        pytest.param(OLDER_REDIS, (), id="older-redis"),
        pytest.param((), ("-fcall", "-fcall_ro", "-function"), id="acl-without-functions"),
        pytest.param((), ("-function",), id="acl-without-function-load"),
    ],
)
def test_a_redis_that_refuses_functions_runs_the_same_scripts_with_evalsha(
    server_args: tuple[str, ...], rules: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """An older Redis, or an ACL without FCALL or FUNCTION LOAD: EVALSHA, with a warning."""
    server = RedisServer(args=server_args).start()
    admin = server.client()
    try:
        client = user_client(server, admin, "guard", *rules) if rules else server.client()
        backend = RedisBackend(client, namespace="t")
        with caplog.at_level(logging.WARNING, logger="dramatiq_guard.backends.redis"):
            hand_off(backend)
            admin.script_flush()
            hand_off(backend)  # NOSCRIPT: loaded again
        assert not backend.scripts.functions
        [warning] = [r.getMessage() for r in caplog.records if "refuses functions" in r.getMessage()]
        assert "EVALSHA" in warning and re.search("fcall|function", warning, re.I)
        assert calls(admin, "evalsha") > 0
        names = backend._names("dedup:k")
        keys = [names.holders, names.waiters, names.reserved, names.limit, names.token, names.info]
        with pytest.raises(redis.ResponseError, match="ttl_ms must be an integer from 1 to"):  # bad input
            backend._call(backend.scripts["lock"], keys, ["h", "0", ""])
    finally:
        admin.close()
        server.close()


def test_a_user_not_allowed_to_load_functions_calls_a_library_an_admin_loaded(
    private_redis: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """FCALL needs no FUNCTION LOAD right: a deployment that loads the library once runs functions."""
    admin.function_load(ScriptLibrary().code)
    backend = RedisBackend(user_client(private_redis, admin, "guard", "-function"), namespace="t")
    with caplog.at_level(logging.WARNING, logger="dramatiq_guard.backends.redis"):
        hand_off(backend)
    assert backend.scripts.functions and not [
        r for r in caplog.records if "refuses functions" in r.getMessage()
    ]
    assert calls(admin, "evalsha") == 0 and calls(admin, "fcall") > 0


def test_a_full_noeviction_redis_still_inspects_and_releases(
    private_redis: RedisServer, admin: redis.Redis
) -> None:
    """At maxmemory a guard write that may grow memory is refused whole; reads and releases still run."""
    backend = RedisBackend(private_redis.client(), namespace="t")
    assert backend.acquire(KEY, "a", limit=1, ttl_ms=MINUTE).acquired  # the library is loaded
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "2mb")
    for size in (20_000, 100):  # up to the last few bytes
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for n in range(100_000):
                admin.set(f"fill:{size}:{n}", b"x" * size)
    with pytest.raises(BackendUnavailable, match="maxmemory"):
        backend.acquire(KEY, "p1", limit=1, ttl_ms=MINUTE, wait=Waiter(payload=b"msg:p1"))
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["a"]  # nothing half done
    assert backend.release(KEY, "a", limit=1).handoffs == ()
    assert backend.inspect(KEY).holders == ()


def test_every_value_a_call_changes_is_reset_by_begin() -> None:
    """As a function, the prelude's locals outlive a call: each one a function assigns must be reset
    by ``begin()``, or a call would see the one before it."""
    prelude = load_lua("_prelude")
    top_level = {
        name.strip()
        for line in re.findall(r"^local (?!function)([\w, ]+)", prelude, re.M)
        for name in line.split(",")
    }
    begin = re.search(r"^local function begin\(\)\n(.*?)^end$", prelude, re.M | re.S)
    assert begin is not None
    reset = {
        name.strip()
        for line in re.findall(r"^  ([\w, ]+) = ", begin.group(1), re.M)
        for name in line.split(",")
    }
    sources = prelude + "".join(load_lua(name) for name in PRELUDE_SCRIPTS)
    assigned = {
        name
        for name in top_level
        if re.search(rf"^\s*(?!local ){name}(?:, [\w, ]+)? = ", sources, re.M)  # in a function or a script
    }
    assert assigned - reset == set(), "reset these in begin()"
    assert "SWEEPING" in assigned and "TOKEN" in assigned  # the check sees assignments at all


def test_the_command_lists_loads_and_prunes_the_libraries(
    private_redis: RedisServer, admin: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dramatiq-guard functions``: what an operator needs for restricted ACLs and old versions."""
    ours = ScriptLibrary()
    older = "dramatiq_guard_" + "1" * 16

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        status = main(["--redis", private_redis.url, "functions", *argv], stdout=out)
        return status, out.getvalue() + capsys.readouterr().out

    assert run("list") == (
        0,
        f"no dramatiq-guard library here (this version's, {ours.library}, loads on first use)\n",
    )
    assert run("load") == (0, f"{ours.library}: loaded\n")
    admin.function_load(ours.code.replace(ours.library, older))  # as an older version left it
    status, out = run("list", "--json")
    assert status == 0 and json.loads(out) == {
        "this_version": ours.library,
        "libraries": {ours.library: len(PRELUDE_SCRIPTS) + len(LEAN_SCRIPTS), older: 14},
    }
    status, out = run("prune")
    assert status == 0 and out.startswith(f"{older}: deleted")
    assert [entry[1].decode() for entry in admin.function_list()] == [ours.library]
    assert run("prune")[1].startswith("nothing to prune")
    hand_off(RedisBackend(private_redis.client(), namespace="t"))  # this version's still serves
    private_redis.stop()
    status, _ = run("list")
    assert status == 1  # Redis unreachable: an operational error


def test_as_a_script_the_fast_paths_still_run_before_the_prelude_is_set_up() -> None:
    """On a Redis that refuses functions a fast path must not pay the prelude's set-up (its point)."""
    scripts = ScriptLibrary()
    prelude = load_lua("_prelude")
    for name in ("acquire", "release"):
        source = scripts[name].source
        fast, at = source.index(load_lua(f"{name}_fast")), source.index(prelude)
        assert fast < at and source.index("\nbegin()\n", at + len(prelude) - 1) > at  # begin() after it
    assert prelude not in scripts["lock"].source and load_lua("lock") == scripts["lock"].source
