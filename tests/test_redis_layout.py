"""The scripts' KEYS, ARGV and constants, defined once in Python (``backends/redis_layout.py``).

The Lua side reads them through text generated from that definition: these tests run the
generated text on Redis, with the keys and arguments the backend builds, and check that each
name gets its own value; and that no script reads a KEYS or ARGV entry by its number.
"""

from __future__ import annotations

import re
from itertools import takewhile
from typing import Any

import pytest
import redis

from dramatiq_guard import bounds
from dramatiq_guard.backends import RedisBackend
from dramatiq_guard.backends.redis_layout import (
    CONSTANTS,
    FROM_PREFIX,
    INDEX_KEYS,
    LAYOUTS,
    LETTERS,
    NAMES,
    CallArgs,
    KeyNames,
    Settings,
    lua_binding,
    lua_constants,
    lua_prologue,
    settings_arg,
)
from dramatiq_guard.backends.redis_scripts import LEAN_SCRIPTS, PRELUDE, PRELUDE_SCRIPTS, load_lua, prelude
from dramatiq_guard.backends.redis_store import _key_names
from dramatiq_guard.backends.values import DEBOUNCE_TIMER, HOLDERS_SHOWN, MIN_STANDBY_WINDOW


def _text(value: Any) -> Any:
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value.decode() if isinstance(value, bytes) else value


def test_the_scripts_get_the_python_constants(redisdb: redis.Redis) -> None:
    names = [*CONSTANTS, *NAMES]
    got = redisdb.eval(lua_constants() + f"return {{{', '.join(names)}}}", 0)
    assert dict(zip(names, _text(got), strict=True)) == CONSTANTS | NAMES
    assert NAMES["DEBOUNCE_TIMER"] == DEBOUNCE_TIMER
    assert (
        CONSTANTS["MAX_DURATION_MS"] == bounds.MAX_DURATION_MS and CONSTANTS["MAX_COUNT"] == bounds.MAX_COUNT
    )
    assert (
        CONSTANTS["HOLDERS_SHOWN"] == HOLDERS_SHOWN and CONSTANTS["MIN_STANDBY_WINDOW"] == MIN_STANDBY_WINDOW
    )


def _binding_names() -> list[str]:
    """Every local ``bind()`` sets: the key names, the index keys, the leading arguments' values."""
    names = [LETTERS[field] for field in KeyNames._fields] + ["X", "LIMITS"]
    names += [f"ARG_{field.upper()}" for field in Settings._fields]
    return [*names, "ARG_DEFAULT_LIMIT", *(lua for lua, _ in FROM_PREFIX)]


@pytest.mark.parametrize("key", ["k", "a}b", "{x}:y{", "two words"])
def test_each_key_and_argument_gets_the_value_the_backend_passes_for_it(
    redisdb: redis.Redis, key: str
) -> None:
    """One declared key (the prefix) makes every name, the wake prefix and K; one argument the settings."""
    backend = RedisBackend(redisdb, namespace="layout", handoff_ttl_ms=4_001, stale_ttl_ms=70_000)
    backend.route = "a route with spaces"
    keys = [*backend._keys(key), "limits-index"]
    args = backend._args(7)
    assert len(keys) == len(INDEX_KEYS) + 1 and len(args) == len(CallArgs._fields)
    names = _binding_names()
    got = redisdb.eval(lua_binding() + f"bind()\nreturn {{{', '.join(names)}}}", len(keys), *keys, *args)
    expected = [*_key_names("layout", key), *keys[1:], "4001", "2000", "70000", "a route with spaces", "7"]
    assert _text(got) == [*expected, f"layout:{{{key}}}:wake:", key]
    assert _key_names("layout", key).holders == f"layout:{{{key}}}:holders"


def test_the_settings_argument_follows_a_changed_setting(redisdb: redis.Redis) -> None:
    backend = RedisBackend(redisdb, namespace="layout")
    assert backend._args(None)[0] == settings_arg(Settings(10_000, 5_000, 86_400_000, ""))
    backend.route = "r"
    backend.handoff_ttl_ms = 3
    assert backend._args(None) == [settings_arg(Settings(3, 1, 86_400_000, "r")), ""]
    backend.stale_ttl_ms = 9
    assert backend._args(1)[0] == "3 1 9 r"


def test_each_script_reads_its_own_arguments_by_name(redisdb: redis.Redis) -> None:
    """Every script's prologue, run with distinct values: each name gets the one at its place."""
    for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS):
        layout = LAYOUTS[name]
        leading = ["1 2 3 route", "4"] if layout.per_key else []
        named = layout.per_key or (layout.keys and set(layout.keys) <= set(KeyNames._fields))
        keys = ["{t}:"] if named else [f"{{t}}:{field}" for field in layout.keys]
        own = [f"{name}.{arg}" for arg in layout.args]
        each_keys = [f"{{t{n}}}:" for n in (1, 2)] if layout.each else []  # an item's one KEYS: its prefix
        each_args = [f"{n}:{arg}" for n in (1, 2) for arg in layout.each_args]
        reads = [*layout.args, *(LETTERS[key] for key in layout.keys)]
        if layout.each:  # last in a table constructor, a call keeps all its values: the 2nd item's
            reads.append(f"{layout.each}(2)")
        code = lua_constants() + (lua_binding() if layout.per_key else "") + lua_prologue(name)
        code += f"return {{{', '.join(reads)}}}"
        got = redisdb.eval(code, len(keys) + len(each_keys), *keys, *each_keys, *leading, *own, *each_args)
        second = [f"{{t2}}:{field}" for field in layout.each_keys] + each_args[len(layout.each_args) :]
        made = [f"{{t}}:{field}" for field in layout.keys] if named else keys[: len(layout.keys)]
        assert _text(got) == [*own, *made, *second], name


def test_no_script_reads_keys_or_arguments_by_number() -> None:
    for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS, *PRELUDE, "acquire_fast", "release_fast", "_common"):
        code = "\n".join(line.split("--")[0] for line in load_lua(name).splitlines())
        assert not re.search(r"\b(KEYS|ARGV)\[\s*\d|\barg\(", code), name


def test_each_script_names_its_own_arguments_in_its_header() -> None:
    """The comment a script starts with names every ARGV the layout gives it (its KEYS are generated)."""
    for name, layout in LAYOUTS.items():
        header = "\n".join(takewhile(lambda line: line.startswith("--"), load_lua(name).splitlines()))
        for arg in (*layout.args, *layout.each_args, *([layout.rest] if layout.rest else [])):
            assert re.search(rf"\b{arg}", header), f"{name}.lua does not name {arg}"


def test_no_argument_hides_a_shared_name() -> None:
    """A script's own arguments are locals of its callback: one named like a shared local would hide it."""
    shared = lua_constants() + lua_binding() + load_lua("_common") + prelude()
    top_level = set(re.findall(r"^local (?:function )?([\w, ]+)", shared, re.M))
    names = {name.strip() for line in top_level for name in line.split(",")}
    for name, layout in LAYOUTS.items():
        assert not names & {*layout.args, *layout.each_args}, name


def test_a_push_reads_the_queue_keys_the_backend_passes_after_a_scripts_own(redisdb: redis.Redis) -> None:
    """``more_keys`` (a RedisBroker queue's list and hash): after ``keys``; a per-key script's after the
    index keys, where :meth:`RedisBackend.reserve_and_enqueue` puts them; ``PUSH_FROM``: after the args."""
    for name in ("lock", "acquire"):
        layout = LAYOUTS[name]
        leading = ["1 2 3 route", "4"] if layout.per_key else []
        keys = ["{t}:", *(["X", "LIMITS"] if layout.per_key else []), "queue", "queue.msgs"]
        argv = [*leading, *layout.args, "push-id"]
        code = lua_constants() + (lua_binding() if layout.per_key else "") + lua_prologue(name)
        code += f"return {{{', '.join(layout.more_keys)}, ARGV[PUSH_FROM]}}"
        assert _text(redisdb.eval(code, len(keys), *keys, *argv)) == ["queue", "queue.msgs", "push-id"], name
