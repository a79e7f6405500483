"""What the Redis backend's Lua scripts are given, defined once: their KEYS, their ARGV, their constants.

The Python side builds every script call from these definitions, by keyword; the Lua side reads
them through text generated from them (docs/redis.md, "The scripts").
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NamedTuple, get_type_hints

from dramatiq_guard import bounds
from dramatiq_guard.backends.values import DEBOUNCE_TIMER, HOLDERS_SHOWN, MIN_STANDBY_WINDOW

#: The latest a key with waiters is due for a sweep, whatever its deadlines say (ms).
DUE_BACKSTOP_MS = 30_000

#: The numbers the scripts use, by their Lua name.
CONSTANTS: dict[str, int] = {
    "MAX_DURATION_MS": bounds.MAX_DURATION_MS,
    "MAX_COUNT": bounds.MAX_COUNT,
    "MAX_GENERATION": 2**53,  # a generation is a fencing token, exact in Lua's doubles
    "HOLDERS_SHOWN": HOLDERS_SHOWN,
    "MIN_STANDBY_WINDOW": MIN_STANDBY_WINDOW,
    "DUE_BACKSTOP_MS": DUE_BACKSTOP_MS,
    "MAX_PRIORITY": bounds.MAX_PRIORITY,
    "PLACE_BAND": 2**41,  # ms: MAX_PRIORITY bands each side of priority 0's [0, 2^52) fill +-2^53
    "PLACE_EPOCH_MS": 1_767_225_600_000,  # 2026-01-01
}

#: The names the scripts use (of members), by their Lua name.
NAMES: dict[str, str] = {"DEBOUNCE_TIMER": DEBOUNCE_TIMER}


class Check(NamedTuple):
    """An ARGV number a script refuses before its first write unless whole and in ``low..high`` (a
    number or a constant's name); ``name``: the one its error gives; ``optional``: ``''`` or none
    passes."""

    low: int | str
    high: str
    name: str = ""
    optional: bool = False


MS, COUNT, GENERATION = (
    Check(1, "MAX_DURATION_MS"),
    Check(0, "MAX_COUNT"),
    Check(0, "MAX_GENERATION", optional=True),
)
WAIT_MS, LIMIT = Check(0, "MAX_DURATION_MS"), Check(0, "MAX_COUNT", optional=True)
PRIORITY = Check("-MAX_PRIORITY", "MAX_PRIORITY", optional=True)


def since_ms(place: float) -> int:
    """When a waiter took ``place`` in W (``enqueue`` in ``_handoff.lua``), in ms since the epoch."""
    n = int(place)
    return n // 1000 if 0 <= n < 2**52 else CONSTANTS["PLACE_EPOCH_MS"] + n % CONSTANTS["PLACE_BAND"]


class KeyNames(NamedTuple):
    """The Redis keys of one guard key K, as its scripts name them.

    Each is ``<namespace>:{K}:<field>``: one hash tag, one Redis Cluster slot. A script is given
    the prefix ``<namespace>:{K}:`` alone, as its first KEYS (:func:`key_prefix`), and makes each
    name of it (the binding, the prologue): a name it makes is in the prefix's slot.
    Its annotation gives its name in the scripts and what it holds.
    """

    holders: Annotated[str, "H", "zset holder -> deadline (ms)"]
    waiters: Annotated[str, "W", "zset waiter -> place: by priority, then FIFO (a sequence, see enqueue)"]
    payloads: Annotated[str, "P", "hash waiter -> payload (parked waiters, reservations not confirmed yet)"]
    reserved: Annotated[str, "R", "hash waiter -> its place in W, while it holds an unconfirmed reservation"]
    deadlines: Annotated[
        str, "D", "zset ready waiter (a thread blocks on it) -> when its entry is dropped (ms)"
    ]
    token: Annotated[str, "T", "string the last fencing token; outlives the rest by STALE_TTL (store_token)"]
    limit: Annotated[str, "L", "string the run-time limit"]
    info: Annotated[str, "I", "hash holder -> '<since_ms>[@<runner>]|<info>'; ready waiter -> '|<info>'"]
    standbys: Annotated[
        str, "S", "zset standby -> deadline (ms): sent ahead to the broker, not picked up yet"
    ]
    meta: Annotated[
        str,
        "M",
        "hash while queued: 'limit', 'r:<w>' route, 'g:<w>' generation, 'u:<w>' runner; a debounce key's"
        " 'first' (its burst's first send, ms) and 'superseded' (the sends its pending run superseded)",
    ]
    gens: Annotated[str, "G", "prefix of the strings G:<w>: the generation of w that may start"]
    ready: Annotated[str, "Q", "zset ready waiter -> its place in W (D's members by place, for choose)"]


def key_prefix(namespace: str, key: str) -> str:
    """The prefix of guard key ``key``'s names, ``<namespace>:{<key>}:``: a guard key's one KEYS entry."""
    return f"{namespace}:{{{key}}}:"


#: The KEYS after a guard key's prefix, on a standalone Redis only (each is in another Cluster slot):
#: name in the scripts, what it holds.
INDEX_KEYS = (
    ("X", "zset the waiting-keys index: guard key -> when it is next due for a sweep (next_due)"),
    ("LIMITS", "set the limits index: the guard keys with a run-time limit (set_limit.lua only)"),
)


class Settings(NamedTuple):
    """A backend's values every per-key script is given, the same for each of its calls: one
    argument, the values in this order joined by spaces (:func:`settings_arg`; the route, last,
    may hold spaces). Lua: ``ARG_<NAME>``."""

    handoff_ttl_ms: Annotated[int, "how long a slot handed to a waiter stays reserved", MS]
    wake_ttl_ms: Annotated[int, "how long a wake waits to be taken (GuardBackend.wake_ttl_ms)", MS]
    stale_ttl_ms: Annotated[int, "how long G and T outlive their last write", MS]
    route: Annotated[str, "the caller's route: the broker it delivers parked messages to"]


class CallArgs(NamedTuple):
    """The leading ARGV of every per-key script: values the Python side owns. Lua: ``ARG_<NAME>``
    (the settings' values by their own names)."""

    settings: Annotated[str, "the backend's Settings, in one argument (settings_arg)"]
    default_limit: Annotated[int | str, "the default limit, or '' if the caller does not know it", LIMIT]


#: What a per-key script makes of its prefix: name in the scripts, what it is.
FROM_PREFIX = (
    ("ARG_WAKE", "the prefix of the per-waiter wake lists (wake .. waiter id)"),
    ("ARG_KEY", "the guard key K itself (for the indexes)"),
)


def settings_arg(settings: Settings) -> str:
    """The ``settings`` argument of a per-key script (:class:`CallArgs`): ``settings`` joined by spaces."""
    return " ".join(map(str, settings))


# Each script's own arguments (a per-key script's after CallArgs), in order (its header says what they
# mean); a Check annotation makes the script refuse a bad number (lua_checks).


class AcquireArgs(NamedTuple):
    holder: str
    ttl_ms: Annotated[int, MS]
    mode: str
    payload: bytes
    wait_ms: Annotated[int, WAIT_MS]
    info: str
    generation: Annotated[int | str, GENERATION]
    fenced: str
    runner: str
    priority: Annotated[int, PRIORITY]


class ReleaseArgs(NamedTuple):
    holder: str
    standbys: Annotated[int, COUNT._replace(name="send_ahead")]
    reserved_only: str = ""


class ConfirmArgs(NamedTuple):
    op: str
    waiter: str
    ttl_ms: Annotated[int, MS]
    generation: Annotated[int | str, GENERATION]
    payload: bytes = b""
    message_id: str = ""
    data: bytes = b""


class CancelWaitArgs(NamedTuple):
    waiter: str
    generation: Annotated[int | str, GENERATION]


class SweepArgs(NamedTuple):
    pass


class SetLimitArgs(NamedTuple):
    limit: Annotated[int | str, LIMIT]


class InspectArgs(NamedTuple):
    waiters: Annotated[int | str, LIMIT]


class StandbyArgs(NamedTuple):
    standbys: Annotated[int, COUNT._replace(name="count")]


class ForgetCopyArgs(NamedTuple):
    waiter: str


class DebounceArgs(NamedTuple):
    op: str
    waiter: str
    payload: bytes = b""
    wait_ms: Annotated[int | str, WAIT_MS._replace(optional=True)] = ""
    max_wait_ms: Annotated[int | str, WAIT_MS._replace(optional=True)] = ""
    generation: Annotated[int | str, GENERATION] = ""


class LockArgs(NamedTuple):
    holder: str
    ttl_ms: Annotated[int, MS]
    info: str


class LeaseArgs(NamedTuple):
    holder: str
    ttl_ms: int


class UnindexArgs(NamedTuple):
    member: str
    cutoff_ms: int


class SummariesArgs(NamedTuple):
    first: int


class Layout(NamedTuple):
    """A script's KEYS and ARGV by name, in order.

    ``keys``: :class:`KeyNames` fields, made of the guard key's prefix given as the first KEYS (or
    ``index``: the waiting-keys index); ``per_key``: a guard key's KEYS (its prefix, then the
    :data:`INDEX_KEYS`) and :class:`CallArgs` come first; ``each``: per item, one KEYS (a guard key's
    prefix, of which its ``each_keys`` names are made; on a Redis Cluster, every item's of one slot) and
    ARGV ``each_args``, read by ``<each>(n)``; ``rest``: the name of any ARGV after ``args``.
    """

    args: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    per_key: bool = False
    each: str = ""
    each_keys: tuple[str, ...] = ()
    each_args: tuple[str, ...] = ()
    rest: str = ""
    #: Optional KEYS after ``keys`` (not guard keys), by their names in the script.
    more_keys: tuple[str, ...] = ()


#: The per-key script of each own-arguments tuple.
SCRIPTS: dict[Any, str] = {
    AcquireArgs: "acquire",
    ReleaseArgs: "release",
    ConfirmArgs: "confirm",
    CancelWaitArgs: "cancel_wait",
    SweepArgs: "sweep",
    SetLimitArgs: "set_limit",
    InspectArgs: "inspect",
    StandbyArgs: "standby",
    ForgetCopyArgs: "forget_copy",
    DebounceArgs: "debounce",
}

#: Every script's layout, by name.
LAYOUTS: dict[str, Layout] = {
    **{name: Layout(args=args._fields, per_key=True) for args, name in SCRIPTS.items()},
    # With a push (a RedisBroker queue's list and message hash), a reservation at send enqueues.
    "acquire": Layout(
        args=AcquireArgs._fields, per_key=True, rest="push", more_keys=("QUEUE", "QUEUE_MESSAGES")
    ),
    # A hand-off's or standby's copy confirmed; with a push, pushed to a RedisBroker queue first.
    "confirm": Layout(args=ConfirmArgs._fields, per_key=True, more_keys=("QUEUE", "QUEUE_MESSAGES")),
    "lock": Layout(
        args=LockArgs._fields,
        keys=("holders", "waiters", "reserved", "limit", "token", "info"),
        rest="push",
        more_keys=("QUEUE", "QUEUE_MESSAGES"),
    ),
    "renew": Layout(each="lease", each_keys=("holders", "token", "info"), each_args=LeaseArgs._fields),
    "unindex": Layout(args=UnindexArgs._fields, keys=("index",)),
    "due": Layout(args=("within_ms",), keys=("index",), rest="prompt"),
    "summaries": Layout(
        args=SummariesArgs._fields,
        each="guard_key",
        each_keys=("holders", "waiters", "reserved", "limit", "meta"),
    ),
    "health": Layout(args=("namespace",), keys=("index",), rest="seen"),
}


def _annotations(cls: type) -> dict[str, tuple[Any, ...]]:
    hints = get_type_hints(cls, include_extras=True).items()
    return {name: hint.__metadata__ for name, hint in hints if hasattr(hint, "__metadata__")}


def _checks(cls: type, prefix: str = "") -> list[tuple[str, str, int | str, str]]:
    """The name, value, low and high of ``cls``'s checked fields (Lua locals: ``prefix`` and the name
    in capitals)."""
    found = [(name, m) for name, meta in _annotations(cls).items() for m in meta if isinstance(m, Check)]
    entries = []
    for name, check in found:
        value = prefix + name.upper() if prefix else name
        value = f"({value} or '') == '' and {check.low} or {value}" if check.optional else value
        entries.append((check.name or name, value, check.low, check.high))
    return entries


#: A :class:`KeyNames` field's name in the scripts (and the index's).
LETTERS = {name: meta[0] for name, meta in _annotations(KeyNames).items()} | {"index": "X"}


def lua_constants() -> str:
    """The constants and names, in front of every script (and at the top of the library)."""
    lines = ["-- Generated from dramatiq_guard/backends/redis_layout.py (the layout, defined once).\n"]
    lines += [f"local {name} = {value}\n" for name, value in CONSTANTS.items()]
    lines += [f"local {name} = {json.dumps(value)}\n" for name, value in NAMES.items()]
    return "".join(lines)


def _made_of_prefix(fields: tuple[str, ...], prefix: str) -> str:
    """Lua: the names of ``fields`` (:class:`KeyNames`) made of the prefix ``prefix``, comma-separated."""
    return ", ".join(f"{prefix} .. {json.dumps(field)}" for field in fields)


def lua_binding() -> str:
    """A per-key script's KEYS and leading ARGV as locals, set by ``bind()`` (its prologue calls it):
    the names made of its prefix, the index keys, the settings' values, the default limit."""
    keys = [(meta[0], meta[1], name) for name, meta in _annotations(KeyNames).items()]
    index = [(letter, meaning, f"KEYS[{i}]") for i, (letter, meaning) in enumerate(INDEX_KEYS, 2)]
    settings = [(f"ARG_{name.upper()}", meta[0]) for name, meta in _annotations(Settings).items()]
    lines = [
        "-- KEYS[1]: the guard key's prefix <namespace>:{K}:, of which each name is made (prefix .. field)\n"
    ]
    lines += [f"-- {lua} (prefix .. {field}): {meaning}\n" for lua, meaning, field in keys]
    lines += [f"-- {where} {lua}: {meaning}\n" for lua, meaning, where in index]
    lines += ["-- ARGV[1] settings, space-separated:\n"]
    lines += [f"--   {lua}: {meaning}\n" for lua, meaning in settings]
    lines += [f"-- ARGV[2] ARG_DEFAULT_LIMIT: {_annotations(CallArgs)['default_limit'][0]}\n"]
    lines += [f"-- {lua} (of the prefix): {meaning}\n" for lua, meaning in FROM_PREFIX]
    key_names = [lua for lua, _, _ in keys + index]
    arg_names = [lua for lua, _ in settings] + ["ARG_DEFAULT_LIMIT"] + [lua for lua, _ in FROM_PREFIX]
    # Each value but the last is a number (no space): the route, last, is the rest.
    pattern = "^" + " ".join(["(%S*)"] * (len(settings) - 1) + ["(.*)"]) + "$"
    lines += [
        f"local {', '.join(key_names)}\n",
        f"local {', '.join(arg_names)}\n",
        "local function bind()\n",
        "  local prefix = KEYS[1]\n",
        f"  {', '.join(lua for lua, _, _ in keys)} = {_made_of_prefix(KeyNames._fields, 'prefix')}\n",
        f"  {', '.join(lua for lua, _, _ in index)} = unpack(KEYS, 2, {len(INDEX_KEYS) + 1})\n",
        f"  {', '.join(lua for lua, _ in settings)} = string.match(ARGV[1], '{pattern}')\n",
        "  ARG_DEFAULT_LIMIT = ARGV[2]\n",
        # K: from after the first '{' (the namespace has none) to before the closing '}:'.
        "  ARG_WAKE = prefix .. 'wake:'\n",
        "  ARG_KEY = string.sub(prefix, string.find(prefix, '{', 1, true) + 1, -3)\n",
        "end\n",
    ]
    return "".join(lines)


def lua_prologue(name: str) -> str:
    """The top of script ``name``, run on every call: its KEYS and ARGV read into named locals."""
    layout = LAYOUTS[name]
    lines = ["bind()\n"] if layout.per_key else []
    first = len(CallArgs._fields) + 1 if layout.per_key else 1
    named = bool(layout.keys) and set(layout.keys) <= set(KeyNames._fields)  # made of a prefix
    if layout.keys:
        letters = ", ".join(LETTERS[key] for key in layout.keys)
        values = _made_of_prefix(layout.keys, "KEYS[1]") if named else f"unpack(KEYS, 1, {len(layout.keys)})"
        lines.append(f"local {letters} = {values}\n")
    if layout.more_keys:  # a per-key script's come after the index keys (INDEX_KEYS)
        at = len(INDEX_KEYS) + 2 if layout.per_key else (2 if named else len(layout.keys) + 1)
        more = ", ".join(layout.more_keys)
        lines.append(f"local {more} = unpack(KEYS, {at}, {at + len(layout.more_keys) - 1})\n")
    if layout.args:
        lines.append(
            f"local {', '.join(layout.args)} = unpack(ARGV, {first}, {first + len(layout.args) - 1})\n"
        )
    if layout.rest:
        lines.append(f"local {layout.rest.upper()}_FROM = {first + len(layout.args)}\n")
    if layout.each:  # the n-th item's names made of its prefix, KEYS[n]; its ARGV after ``args``
        na = len(layout.each_args)
        returned = [LETTERS[key] for key in layout.each_keys] + list(layout.each_args)
        items = [_made_of_prefix(layout.each_keys, "prefix")] + [f"ARGV[a + {i}]" for i in range(1, na + 1)]
        offset = f", a = KEYS[n], {len(layout.args)} + (n - 1) * {na}" if na else " = KEYS[n]"
        lines += [f"local ARGV_PER_{layout.each.upper()} = {na}\n"] if na else []
        lines += [
            f"-- {layout.each}(n) -> {', '.join(returned)} of the n-th (one KEYS each: its prefix)\n",
            f"local function {layout.each}(n)\n",
            f"  local prefix{offset}\n",
            f"  return {', '.join(items)}\n",
            "end\n",
        ]
    return "".join(lines)


def lua_checks(name: str) -> str:
    """What script ``name`` runs after its prologue: the refusal of a bad number (its checks)."""
    own = {script: args for args, script in SCRIPTS.items()} | {"lock": LockArgs}
    shared = _checks(Settings, "ARG_") + _checks(CallArgs, "ARG_")
    checks = (shared if LAYOUTS[name].per_key else []) + _checks(own.get(name, tuple))
    if not checks:
        return ""
    # Every number whole first (no table made on the common path), then the refusal naming the first not.
    valid = " and ".join(f"whole_number({value}, {low}, {high})" for _, value, low, high in checks)
    entries = [f"  {{ '{name}', {value}, {low}, {high} }},\n" for name, value, low, high in checks]
    return "".join([f"if not ({valid}) then\n  return refusal({{\n", *entries, "  })\nend\n"])
