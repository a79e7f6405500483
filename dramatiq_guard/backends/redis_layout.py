"""What the Redis backend's Lua scripts are given, defined once: their KEYS, their ARGV, their constants.

The Python side builds every script call from these definitions, by keyword; the Lua side reads
them through text generated from them (docs/redis.md, "The scripts").
"""

from __future__ import annotations

import json
from operator import attrgetter
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
    """The Redis keys of one guard key K, in the order a per-key script gets them (its KEYS).

    Each is ``<namespace>:{K}:<field>``: one hash tag, one Redis Cluster slot.
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


#: The KEYS after a guard key's own, on a standalone Redis only (each is in another Cluster slot):
#: name in the scripts, what it holds.
INDEX_KEYS = (
    ("X", "zset the waiting-keys index: guard key -> when it is next due for a sweep (next_due)"),
    ("LIMITS", "set the limits index: the guard keys with a run-time limit (set_limit.lua only)"),
)


class CallArgs(NamedTuple):
    """The leading ARGV of every per-key script: values the Python side owns. Lua: ``ARG_<NAME>``."""

    wake: Annotated[str, "the prefix of the per-waiter wake lists (wake .. waiter id)"]
    handoff_ttl_ms: Annotated[int, "how long a slot handed to a waiter stays reserved", MS]
    wake_ttl_ms: Annotated[int, "how long a wake waits to be taken (GuardBackend.wake_ttl_ms)", MS]
    key: Annotated[str, "the guard key K itself (for the indexes)"]
    default_limit: Annotated[int | str, "the default limit, or '' if the caller does not know it", LIMIT]
    route: Annotated[str, "the caller's route: the broker it delivers parked messages to"]
    stale_ttl_ms: Annotated[int, "how long G and T outlive their last write", MS]


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


class ConfirmHandoffArgs(NamedTuple):
    waiter: str
    ttl_ms: Annotated[int, MS]
    generation: Annotated[int | str, GENERATION]


class DeliverArgs(NamedTuple):
    op: str
    waiter: str
    ttl_ms: Annotated[int, MS]
    generation: Annotated[int | str, GENERATION]
    payload: bytes
    message_id: str
    data: bytes


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
    op: str
    standbys: Annotated[int | str, LIMIT._replace(name="count")] = ""
    waiter: str = ""
    ttl_ms: Annotated[int | str, MS._replace(optional=True)] = ""
    payload: bytes = b""
    generation: Annotated[int | str, GENERATION] = ""


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

    ``keys``: :class:`KeyNames` fields (``index``: the waiting-keys index); ``per_key``: a guard
    key's KEYS and :class:`CallArgs` come first; ``each``: KEYS ``each_keys`` and ARGV ``each_args``
    repeat per item, read by ``<each>(n)``; ``rest``: the name of any ARGV after ``args``.
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
    ConfirmHandoffArgs: "confirm_handoff",
    DeliverArgs: "deliver",
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
    # A hand-off's or standby's copy pushed to a RedisBroker queue, and confirmed.
    "deliver": Layout(args=DeliverArgs._fields, per_key=True, more_keys=("QUEUE", "QUEUE_MESSAGES")),
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

#: The keys of a ``lock.lua`` call, and of one lease of a ``renew.lua`` call, from a :class:`KeyNames`.
lock_keys = attrgetter(*LAYOUTS["lock"].keys)
lease_keys = attrgetter(*LAYOUTS["renew"].each_keys)


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


def lua_binding() -> str:
    """A per-key script's KEYS and leading ARGV as locals, set by ``bind()`` (its prologue calls it)."""
    keys = [
        (meta[0], meta[1], f"KEYS[{i}] {name}")
        for i, (name, meta) in enumerate(_annotations(KeyNames).items(), 1)
    ]
    keys += [(letter, meaning, f"KEYS[{i}]") for i, (letter, meaning) in enumerate(INDEX_KEYS, len(keys) + 1)]
    args = [
        (f"ARG_{name.upper()}", meta[0], f"ARGV[{i}]")
        for i, (name, meta) in enumerate(_annotations(CallArgs).items(), 1)
    ]
    lines = [f"-- {where} {lua}: {meaning}\n" for lua, meaning, where in keys + args]
    names = [lua for lua, _, _ in keys], [lua for lua, _, _ in args]
    lines += [f"local {', '.join(names[0])}\n", f"local {', '.join(names[1])}\n", "local function bind()\n"]
    lines += [f"  {', '.join(names[0])} = unpack(KEYS, 1, {len(names[0])})\n"]
    lines += [f"  {', '.join(names[1])} = unpack(ARGV, 1, {len(names[1])})\n"]
    return "".join([*lines, "end\n"])


def lua_prologue(name: str) -> str:
    """The top of script ``name``, run on every call: its KEYS and ARGV read into named locals."""
    layout = LAYOUTS[name]
    lines = ["bind()\n"] if layout.per_key else []
    first = len(CallArgs._fields) + 1 if layout.per_key else 1
    if layout.keys:
        letters = ", ".join(LETTERS[key] for key in layout.keys)
        lines.append(f"local {letters} = unpack(KEYS, 1, {len(layout.keys)})\n")
    if layout.more_keys:  # a per-key script's come after the index keys (INDEX_KEYS)
        at = len(KeyNames._fields) + len(INDEX_KEYS) + 1 if layout.per_key else len(layout.keys) + 1
        more = ", ".join(layout.more_keys)
        lines.append(f"local {more} = unpack(KEYS, {at}, {at + len(layout.more_keys) - 1})\n")
    if layout.args:
        lines.append(
            f"local {', '.join(layout.args)} = unpack(ARGV, {first}, {first + len(layout.args) - 1})\n"
        )
    if layout.rest:
        lines.append(f"local {layout.rest.upper()}_FROM = {first + len(layout.args)}\n")
    if layout.each:
        nk, na = len(layout.each_keys), len(layout.each_args)
        returned = [LETTERS[key] for key in layout.each_keys] + list(layout.each_args)
        items = [f"KEYS[k + {i}]" for i in range(1, nk + 1)] + [f"ARGV[a + {i}]" for i in range(1, na + 1)]
        offset = f"{len(layout.args)} + (n - 1) * {na}"
        lines += [
            f"local KEYS_PER_{layout.each.upper()}, ARGV_PER_{layout.each.upper()} = {nk}, {na}\n",
            f"-- {layout.each}(n) -> {', '.join(returned)} of the n-th\n",
            f"local function {layout.each}(n)\n",
            f"  local k, a = (n - 1) * {nk}, {offset}\n",
            f"  return {', '.join(items)}\n",
            "end\n",
        ]
    return "".join(lines)


def lua_checks(name: str) -> str:
    """What script ``name`` runs after its prologue: the refusal of a bad number (its checks)."""
    own = {script: args for args, script in SCRIPTS.items()} | {"lock": LockArgs}
    checks = (_checks(CallArgs, "ARG_") if LAYOUTS[name].per_key else []) + _checks(own.get(name, tuple))
    if not checks:
        return ""
    # Every number whole first (no table made on the common path), then the refusal naming the first not.
    valid = " and ".join(f"whole_number({value}, {low}, {high})" for _, value, low, high in checks)
    entries = [f"  {{ '{name}', {value}, {low}, {high} }},\n" for name, value, low, high in checks]
    return "".join([f"if not ({valid}) then\n  return refusal({{\n", *entries, "  })\nend\n"])
