"""How the Redis backend's scripts reach the server: one function library, else EVALSHA.

Each test that talks to Redis starts a server of its own (``private_redis``, or
one started with options): they load and flush functions and add ACL users,
which must not touch the session's server.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
from harness import DramatiqWorker, wait_until
from harness.redis_server import RedisServer

from dramatiq_guard.backends import RedisBackend, Stake, Waiter, redis_health
from dramatiq_guard.backends.base import Handoff
from dramatiq_guard.backends.redis_scripts import (
    LEAN_SCRIPTS,
    LIBRARY_PREFIX,
    PRELUDE_SCRIPTS,
    ScriptLibrary,
    load_lua,
    prelude,
)
from dramatiq_guard.cli import main
from dramatiq_guard.errors import BackendUnavailable

KEY = "concurrency:k"
MINUTE = 60_000


def calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats; ``function|load`` for a subcommand)."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def hand_off(backend: RedisBackend) -> None:
    """A slot's life on a busy key: held, a waiter parked, the slot handed to it on release, confirmed."""
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=MINUTE)).acquired
    assert backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=MINUTE), wait=Waiter(payload=b"msg:p1")).parked
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


def user_client(
    server: RedisServer, admin: redis.Redis, name: str, *rules: str, keys: tuple[str, ...] = ("*",)
) -> redis.Redis:
    """A client of an ACL user allowed everything (on ``keys``) but what ``rules`` take away."""
    admin.acl_setuser(
        name, enabled=True, nopass=True, keys=list(keys), channels=["*"], commands=["+@all", *rules]
    )
    return redis.Redis(host=server.host, port=server.port, username=name, password="")


#: The restricted ACL user of docs/redis.md ("A restricted ACL user"): it may call functions (FCALL)
#: but neither load them (FUNCTION LOAD) nor run scripts (EVAL, EVALSHA, SCRIPT).
RESTRICTED = "-@all +@read +@write +@connection -@dangerous +fcall +fcall_ro +time +info -function"


def restricted_client(server: RedisServer, admin: redis.Redis, namespace: str) -> redis.Redis:
    """A client of the restricted user of docs/redis.md, for the keys of ``namespace``."""
    admin.acl_setuser(
        "guard",
        enabled=True,
        nopass=True,
        reset_keys=True,
        keys=[f"{namespace}:*"],
        reset_channels=True,
        commands=RESTRICTED.split(),
    )
    return redis.Redis(host=server.host, port=server.port, username="guard", password="")


def test_the_restricted_user_is_the_documented_one_and_runs_the_guard(
    private_redis: RedisServer, admin: redis.Redis
) -> None:
    """With its library loaded by an operator, the user of docs/redis.md runs every operation as functions."""
    docs = (Path(__file__).parent.parent / "docs" / "redis.md").read_text()
    assert f"resetkeys ~dramatiq-guard:* resetchannels {RESTRICTED}\n" in docs
    ScriptLibrary().load_functions(admin)
    backend = RedisBackend(restricted_client(private_redis, admin, "t"), namespace="t")
    hand_off(backend)
    assert backend.set_limit(KEY, 3).handoffs == () and backend.get_limit(KEY) == 3
    assert [summary.limit for summary in backend.summaries([KEY])] == [3]
    assert backend.wait_for_handoff(KEY, "w", timeout_ms=0) is None
    redis_health.watch(backend)  # the state watch and the worker's record
    assert ScriptLibrary.running(backend.client, "t") == {
        backend.scripts.library: [f"{socket.gethostname()}:{os.getpid()}"]
    }
    assert backend.scripts.functions and calls(admin, "evalsha") == 0


def another_version() -> ScriptLibrary:
    """This version's scripts under the library name of another version of dramatiq-guard."""
    scripts = ScriptLibrary()
    ours, theirs = scripts.library, LIBRARY_PREFIX + "1" * 16
    scripts.library, scripts.code = theirs, scripts.code.replace(ours, theirs)
    scripts._scripts = {
        name: script._replace(function=script.function.replace(ours, theirs))
        for name, script in scripts._scripts.items()
    }
    return scripts


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
    assert admin.fcall("dramatiq_guard_" + "0" * 16 + "_due", 1, "t:waiting") == [[], None]


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
        with pytest.raises(redis.ResponseError, match="ttl_ms must be an integer from 1 to"):  # bad input
            backend._call(backend.scripts["lock"], [backend._prefix("dedup:k")], ["h", "0", ""])
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


def test_a_worker_whose_library_was_pruned_fails_closed_and_recovers_once_it_is_loaded_again(
    private_redis: RedisServer, admin: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """The restricted user cannot load a pruned library: every call fails closed (BackendUnavailable,
    so fail_open and Retries apply), naming the cure, until an operator loads it; then it serves again."""
    theirs = another_version()
    theirs.load_functions(admin)  # an operator loaded it for that version's workers
    backend = RedisBackend(restricted_client(private_redis, admin, "t"), namespace="t")
    backend.scripts = theirs  # a worker of that version
    assert backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=MINUTE)).acquired
    assert main(["--redis", private_redis.url, "functions", "prune"]) == 0  # no worker recorded as alive
    assert capsys.readouterr().out.startswith(f"{theirs.library}: deleted")
    for _ in range(2):  # every call, not only the first: nothing switches for good
        with pytest.raises(
            BackendUnavailable, match=rf"{theirs.library} is not on .*FUNCTION LOAD.*functions load"
        ):
            backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=MINUTE))
    status = main(
        ["--redis", f"redis://guard:@{private_redis.host}:{private_redis.port}/0", "functions", "load"]
    )
    assert (
        status == 1
        and "refused: this user has no permissions to run the 'function|load'" in capsys.readouterr().err
    )
    theirs.load_functions(admin)  # what that version's 'dramatiq-guard functions load' runs
    assert backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=MINUTE)).acquired  # the same backend, no restart
    assert backend.scripts.functions and calls(admin, "evalsha") == calls(admin, "script|load") == 0
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["a", "b"]


@pytest.mark.parametrize(
    ("rules", "keys", "run", "missing"),
    [
        pytest.param(
            ("-@scripting",),
            ("*",),
            lambda backend: backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=MINUTE)),
            "'script.load'",
            id="no-functions-nor-scripts",
        ),
        pytest.param(
            ("-@scripting",),
            ("*",),
            lambda backend: backend.sweep_many([(KEY, 1), ("concurrency:j", 1)]),  # pipelined
            "'script.load'",
            id="pipelined",
        ),
        pytest.param(("-get",), ("*",), lambda backend: backend.get_limit(KEY), "'get'", id="command"),
        pytest.param(
            (),
            ("other:*",),
            lambda backend: backend.get_limit(KEY),
            "access one of the keys",
            id="key",
        ),
    ],
)
def test_a_call_the_acl_refuses_fails_closed_naming_the_permission(
    private_redis: RedisServer,
    admin: redis.Redis,
    rules: tuple[str, ...],
    keys: tuple[str, ...],
    run: Callable[[RedisBackend], object],
    missing: str,
) -> None:
    """NOPERM is the backend being unavailable to this process (fail closed, fail_open applies), said so."""
    backend = RedisBackend(user_client(private_redis, admin, "guard", *rules, keys=keys), namespace="t")
    with pytest.raises(BackendUnavailable, match=rf"refused.*{missing}.*ACL user") as refused:
        run(backend)
    assert str(refused.value).count("\n") == 0


def test_a_full_noeviction_redis_still_inspects_and_releases(
    private_redis: RedisServer, admin: redis.Redis
) -> None:
    """At maxmemory a guard write that may grow memory is refused whole; reads and releases still run."""
    backend = RedisBackend(private_redis.client(), namespace="t")
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=MINUTE)).acquired  # the library is loaded
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "2mb")
    for size in (20_000, 100):  # up to the last few bytes
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for n in range(100_000):
                admin.set(f"fill:{size}:{n}", b"x" * size)
    with pytest.raises(BackendUnavailable, match="maxmemory"):
        backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=MINUTE), wait=Waiter(payload=b"msg:p1"))
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["a"]  # nothing half done
    assert backend.release(KEY, "a", limit=1).handoffs == ()
    assert backend.inspect(KEY).holders == ()


def test_every_value_a_call_changes_is_reset_by_begin() -> None:
    """As a function, the prelude's locals outlive a call: each one a function assigns must be reset
    by ``begin()``, or a call would see the one before it."""
    text = prelude()
    top_level = {
        name.strip()
        for line in re.findall(r"^local (?!function)([\w, ]+)", text, re.M)
        for name in line.split(",")
    }
    begin = re.search(r"^local function begin\(\)\n(.*?)^end$", text, re.M | re.S)
    assert begin is not None
    reset = {
        name.strip()
        for line in re.findall(r"^  ([\w, ]+) = ", begin.group(1), re.M)
        for name in line.split(",")
    }
    sources = text + "".join(load_lua(name) for name in PRELUDE_SCRIPTS)
    assigned = {
        name
        for name in top_level
        if re.search(rf"^\s*(?!local ){name}(?:, [\w, ]+)? = ", sources, re.M)  # in a function or a script
    }
    assert assigned - reset == set(), "reset these in begin()"
    assert "REINDEX" in assigned and "TOKEN" in assigned  # the check sees assignments at all


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
    functions = len(PRELUDE_SCRIPTS) + len(LEAN_SCRIPTS)  # the older one is this one renamed
    assert status == 0 and json.loads(out) == {
        "this_version": ours.library,
        "libraries": {ours.library: functions, older: functions},
        "processes": {},  # no worker recorded
    }
    status, out = run("prune")
    assert status == 0 and out.startswith(f"{older}: deleted")
    assert [entry[1].decode() for entry in admin.function_list()] == [ours.library]
    assert run("prune")[1].startswith("nothing to prune")
    hand_off(RedisBackend(private_redis.client(), namespace="t"))  # this version's still serves
    private_redis.stop()
    status, _ = run("list")
    assert status == 1  # Redis unreachable: an operational error


def test_prune_refuses_while_workers_of_another_version_run(
    private_redis: RedisServer, admin: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's sweep records the library it runs; prune deletes none while one of another version lives."""
    theirs = another_version()
    theirs.load_functions(admin)
    worker = RedisBackend(private_redis.client(), namespace="dramatiq-guard")
    worker.scripts = theirs
    redis_health.watch(worker)  # a pass of that worker's sweep
    process = f"{socket.gethostname()}:{os.getpid()}"

    def prune(*argv: str) -> tuple[int, str, str]:
        status = main(["--redis", private_redis.url, "functions", "prune", *argv])
        out, err = capsys.readouterr()
        return status, out, err

    status, out, err = prune()
    assert (status, out) == (2, "") and err.count("\n") == 1
    assert theirs.library in err and process in err and "--force" in err
    assert theirs.library in {entry[1].decode() for entry in admin.function_list()}
    assert main(["--redis", private_redis.url, "functions", "list"]) == 0
    assert (
        f"{theirs.library}: {len(PRELUDE_SCRIPTS) + len(LEAN_SCRIPTS)} functions, run by {process}"
        in capsys.readouterr().out
    )

    redis_health.leave(worker)  # the worker stops: its sweep withdraws the record
    status, out, err = prune()
    assert (status, err) == (0, "") and out.startswith(f"{theirs.library}: deleted")

    theirs.load_functions(admin)
    redis_health.watch(worker)
    status, out, err = prune("--force")
    assert status == 0 and out.startswith(f"{theirs.library}: deleted") and process in out
    assert [entry[1].decode() for entry in admin.function_list()] == []


WORKER = """
import dramatiq
from harness import broker_from_env
import dramatiq_guard

broker = broker_from_env()
dramatiq_guard.install(broker, sweep_interval=100)
dramatiq.set_broker(broker)


@dramatiq.actor(concurrency=1)
def noop():
    pass
"""


def test_a_worker_records_the_library_it_runs_while_it_runs(
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
    redisdb: redis.Redis,
) -> None:
    """The record prune reads is kept by each worker process's sweep, and withdrawn when it stops."""
    actor_module(WORKER)
    worker = dramatiq_worker("actors", processes=2)
    library = ScriptLibrary().library
    processes = {f"{socket.gethostname()}:{pid}" for pid in worker.worker_pids}

    def recorded() -> set[str]:  # of this worker's (a sweep of this test process may record itself too)
        return processes.intersection(ScriptLibrary.running(redisdb, "dramatiq-guard").get(library, []))

    wait_until(lambda: recorded() == processes, what="both processes recorded", redis=redisdb)
    assert worker.stop() == 0
    assert recorded() == set()


def test_as_a_script_the_fast_paths_still_run_before_the_prelude_is_set_up() -> None:
    """On a Redis that refuses functions a fast path must not pay the prelude's set-up (its point)."""
    scripts = ScriptLibrary()
    shared = prelude()
    for name in ("acquire", "release"):
        source = scripts[name].source
        fast, at = source.index(load_lua(f"{name}_fast")), source.index(shared)
        assert fast < at and source.index("\nbegin()\n", at + len(shared) - 1) > at  # begin() after it
    assert shared not in scripts["lock"].source and scripts["lock"].source.endswith(load_lua("lock"))
