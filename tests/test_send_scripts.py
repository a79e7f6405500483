"""The Redis side of a guarded send: what ``lock.lua`` and acquire.lua's fast path
(``lua/acquire_fast.lua``) run, and that the fast path does what the full script does.

Each equality case drives the same acquires on two keys of one private ``redis-server`` under libfaketime:
one through the library's ``acquire`` (fast path first), one through ``acquire.lua`` with its fast
path taken out. The replies, and every Redis key each leaves (type, value, expiry), must be equal:
what the fast path skips (a read, a write of an expiry) relies on invariants the full script keeps,
which these cases reach (a lapsed holder among several, fenced and unfenced sends, holders
re-entering below the top and at it, more holders than one read of the holders fetches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis
from harness import FakeClock, RedisServer, libfaketime, unavailable

from dramatiq_guard.backends.redis_client import text
from dramatiq_guard.backends.redis_layout import lua_checks, lua_prologue
from dramatiq_guard.backends.redis_scripts import ScriptLibrary, load_lua

START_MS = 1_893_456_000_000  # 2030-01-01T00:00:00Z
SETTINGS = "10000 5000 86400000 redis://fast-test/0#q"
pytestmark = pytest.mark.redis

#: One acquire: (holder, ttl_ms, limit, fenced, runner); a number alone moves the clock on (ms).
Step = tuple[str, int, int, str, str] | int


@pytest.fixture(scope="module")
def frozen() -> Iterator[tuple[FakeClock, redis.Redis]]:
    if libfaketime() is None:
        unavailable("libfaketime is not installed (apt-get install libfaketime): these tests need it")
    clock = FakeClock(START_MS)
    with RedisServer(env=clock.server_env()) as server, server.client() as client:
        yield clock, client
    clock.close()


class Paths:
    """The library's acquire (fast path first) and acquire.lua without its fast path, on one server."""

    def __init__(self, client: redis.Redis) -> None:
        self.client, self.library = client, ScriptLibrary()
        self.library.load_functions(client)
        source = self.library["acquire"].source
        fast = lua_prologue("acquire") + lua_checks("acquire") + load_lua("acquire_fast") + "\n"
        assert source.count(fast) == 1
        self.full = client.script_load(source.replace(fast, lua_prologue("acquire") + lua_checks("acquire")))
        self.sent = 0

    def acquire(self, path: str, key: str, step: tuple[str, int, int, str, str], push: bool) -> Any:
        holder, ttl_ms, limit, fenced, runner = step
        self.sent += 1
        keys = [f"dramatiq-guard:{{{key}}}:", "dramatiq-guard:waiting", "dramatiq-guard:limits"]
        args = [
            SETTINGS,
            str(limit),
            holder,
            str(ttl_ms),
            "park",
            f"msg:{holder}",
            "0",
            "job",
            "",
            fenced,
            runner,
            "0",
        ]
        if push:
            keys += [f"q:{key}", f"q:{key}.msgs"]
            args.append(f"m{self.sent}:{holder}")
        if path == "fast":
            execute: Any = self.client.execute_command  # untyped in redis-py
            return execute(*self.library.command(self.library["acquire"], keys, args))
        return self.client.evalsha(self.full, len(keys), *keys, *args)


def state(client: redis.Redis, key: str) -> dict[str, tuple[Any, ...]]:
    """Every Redis key of guard key ``key`` and its queue: its type, value and expiry (ms)."""
    found: dict[str, tuple[Any, ...]] = {}
    for name in [*client.keys(f"dramatiq-guard:{{{key}}}:*"), *client.keys(f"q:{key}*")]:
        kind = text(client.type(name))
        if kind == "zset":
            value: Any = client.zrange(name, 0, -1, withscores=True)
        elif kind == "hash":
            value = sorted(client.hgetall(name).items())
        else:
            value = client.get(name) if kind == "string" else client.lrange(name, 0, -1)
        found[text(name).replace(key, "K")] = (kind, value, client.pttl(name))
    return found


def drive(
    frozen: tuple[FakeClock, redis.Redis], name: str, steps: Sequence[Step], *, push: bool = False
) -> None:
    clock, client = frozen
    paths = Paths(client)
    # Message ids differ by path (each its own queue): compare them with the path's key named alike.
    for step in steps:
        if isinstance(step, int):
            clock.advance(step)
            continue
        fast = paths.acquire("fast", f"{name}-fast", step, push)
        paths.sent -= 1
        full = paths.acquire("full", f"{name}-full", step, push)
        assert fast == full, step
        assert state(client, f"{name}-fast") == state(client, f"{name}-full"), step


def news(count: int, ttl_ms: int, limit: int, fenced: str = "1") -> list[Step]:
    return [(f"h{i}", ttl_ms, limit, fenced, "") for i in range(count)]


def test_new_holders_fenced_and_not_up_to_the_limit_and_past_it(
    frozen: tuple[FakeClock, redis.Redis],
) -> None:
    steps: list[Step] = [*news(3, 60_000, 4), 1, ("u", 30_000, 4, "0", ""), 1, ("v", 90_000, 4, "0", "")]
    drive(frozen, "news", [*steps, 1, ("w", 60_000, 4, "1", "")], push=True)


def test_a_lapsed_holder_among_several_is_reclaimed_by_the_full_path(
    frozen: tuple[FakeClock, redis.Redis],
) -> None:
    steps: list[Step] = [("a", 500, 4, "1", ""), ("b", 60_000, 4, "1", ""), ("c", 30_000, 4, "1", "")]
    drive(frozen, "lapsed", [*steps, 600, ("d", 60_000, 4, "1", ""), ("e", 60_000, 4, "0", "")])


def test_holders_re_entering_below_the_top_and_at_it(frozen: tuple[FakeClock, redis.Redis]) -> None:
    steps: list[Step] = [*news(3, 60_000, 5), 10, ("h1", 90_000, 5, "1", "w1"), ("h1", 20_000, 5, "1", "w1")]
    steps += [("h2", 10_000, 5, "0", ""), ("h0", 70_000, 5, "1", "w2"), ("h0", 70_000, 5, "1", "w3")]
    drive(frozen, "again", [*steps, ("h0", 5_000, 5, "0", "w2"), ("h9", 100, 5, "1", "")], push=True)


def test_more_holders_than_one_read_fetches(frozen: tuple[FakeClock, redis.Redis]) -> None:
    steps: list[Step] = [*news(20, 60_000, 22), 1]
    steps += [("h3", 60_000, 22, "1", "w"), ("h19", 90_000, 22, "1", "w"), ("h19", 1_000, 22, "0", "w")]
    steps += [("x", 120_000, 22, "1", ""), ("y", 60_000, 22, "1", ""), ("z", 60_000, 22, "1", "")]
    drive(frozen, "many", [*steps, ("h5", 60_000, 22, "1", ""), ("h5", 60_000, 22, "1", "v")])


def commands_run(client: redis.Redis, call: Callable[[], Any]) -> dict[str, int]:
    """The commands ``call`` ran on the server (in scripts too), the script call itself left out."""
    client.config_resetstat()
    call()
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if name.removeprefix("cmdstat_").split("|")[0] not in ("fcall", "evalsha", "info", "config")
    }


def test_a_new_holder_of_a_key_with_others_costs_eleven_commands(
    frozen: tuple[FakeClock, redis.Redis],
) -> None:
    """EXISTS, one ZRANGE of the holders, TIME, MGET, ZADD, HSET, two PEXPIREAT, SET of the token,
    and the push (HSETNX, RPUSH): the holders' count, lapsed check, latest deadline and whether
    the caller holds come from the one ZRANGE."""
    clock, client = frozen
    paths = Paths(client)
    for step in news(4, 60_000, 10):
        assert not isinstance(step, int) and paths.acquire("fast", "count", step, True)[0] == 1
    clock.advance(1)  # its deadline the latest: H and I expire later
    ran = commands_run(client, lambda: paths.acquire("fast", "count", ("new", 60_000, 10, "1", ""), True))
    assert ran == {
        **dict.fromkeys(("exists", "zrange", "time", "mget", "zadd", "hset", "set", "hsetnx", "rpush"), 1),
        "pexpireat": 2,
    }


def lock(client: redis.Redis, key: str, holder: str) -> Any:
    library = ScriptLibrary()
    keys = [f"dramatiq-guard:{{{key}}}:", f"q:{key}", f"q:{key}.msgs"]
    args = [holder, "60000", "job", f"m:{holder}", f"msg:{holder}"]
    execute: Any = client.execute_command  # untyped in redis-py
    return execute(*library.command(library["lock"], keys, args))


def test_a_send_lock_is_taken_in_eight_commands_and_refused_in_three(
    frozen: tuple[FakeClock, redis.Redis],
) -> None:
    """Taken: EXISTS, TIME, ZADD, HSET, two PEXPIREAT and the push (HSETNX, RPUSH). Refused (a
    duplicate): EXISTS, TIME and the ZRANGE of the holders; the one EXISTS names the run-time
    limit often enough to tell it apart (a key with one falls through to acquire.lua)."""
    _, client = frozen
    ScriptLibrary().load_functions(client)
    taken = commands_run(client, lambda: lock(client, "dup", "first"))
    assert taken == {
        **dict.fromkeys(("exists", "time", "zadd", "hset", "hsetnx", "rpush"), 1),
        "pexpireat": 2,
    }
    assert commands_run(client, lambda: lock(client, "dup", "second")) == dict.fromkeys(
        ("exists", "time", "zrange"), 1
    )
    assert client.lrange("q:dup", 0, -1) == [b"m:first"]
    client.set("dramatiq-guard:{dup}:limit", "2")
    assert lock(client, "dup", "third") == [-1, []]
