"""The ``dramatiq-guard`` command: see and steer what the guard holds.

Usage (``dramatiq-guard COMMAND --help`` for each)::

  dramatiq-guard [--redis URL] [--namespace NS] inspect [PATTERN] [--json]
  dramatiq-guard limit get KEY [--json]
  dramatiq-guard limit set KEY N [--broker MODULE:ATTR]
  dramatiq-guard limit set --actor NAME N
  dramatiq-guard limit clear KEY
  dramatiq-guard release KEY [--yes] [--broker MODULE:ATTR]
  dramatiq-guard ledger prune --older-than 30d [--ledger URL]
  dramatiq-guard ledger show KEY [--ledger URL] [--json]

Redis comes from ``--redis`` or ``DRAMATIQ_GUARD_REDIS_URL`` (default
``redis://localhost:6379/0``); the ledger's database from ``--ledger`` or
``DRAMATIQ_GUARD_LEDGER_URL``.

Finding keys. No command scans the keyspace (no ``KEYS``, no ``SCAN``):
``inspect`` lists the keys of the backend's own indexes (the keys that have or
recently had waiters, and the keys with a run-time limit) and, when the
pattern has no wildcard, the key it names. A key that only has holders and
never had a waiter is therefore shown when named exactly.

Hand-offs. Raising a limit or releasing holders gives free slots to parked
waiters at once. A handed-off parked message must be put back on the broker,
and the command has no broker of its own, so either:

* with ``--broker MODULE:ATTR`` (your app's broker, e.g. ``myapp.tasks:broker``)
  it re-enqueues each handed-off message and confirms the hand-off; or
* without it, it leaves each hand-off *reserved*: the slot stays taken by
  that waiter, its payload stays stored in Redis, and when the reservation
  lapses (the backend's hand-off TTL, 10 s by default) it returns to its
  place at the head of the queue, where the next worker sweep hands it off
  and re-enqueues it. Nothing is lost either way; the second is only later.

Forced release. ``release KEY`` releases each holder the key has at that
moment (each one checked by its id, so a holder that starts meanwhile is not
touched), except unconfirmed hand-offs: their payload is still the only copy
of the message, and they lapse by themselves. A released holder that is still
running learns it at its next lease renewal (its lease is lost). Freed slots
are handed to waiters up to the number of holders released (the command does
not know the actor's default limit, and that many were running at once, so
the limit is never exceeded); a worker's sweep hands on any more.

Exit status: 0 success, 1 operational error (Redis or the database
unreachable, a confirmation declined), 2 usage error (a bad option, URL, key
or duration); errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from dramatiq_guard.backends.base import GuardBackend, Handoff, KeyState
from dramatiq_guard.bounds import MAX_COUNT, MAX_RETENTION_MS
from dramatiq_guard.resolve import REDIS_URL_ENV

__all__ = ["main", "parse_duration"]

PROG = "dramatiq-guard"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_NAMESPACE = "dramatiq-guard"
LEDGER_URL_ENV = "DRAMATIQ_GUARD_LEDGER_URL"

logger = logging.getLogger("dramatiq_guard.cli")

_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


class UsageError(Exception):
    """A bad argument value found after parsing (exit status 2)."""


class OperationalError(Exception):
    """The command could not do its work (exit status 1)."""


def parse_duration(text: str) -> int:
    """Parse a duration such as ``30d``, ``12h``, ``15m``, ``90s``, ``500ms`` into milliseconds.

    A bare number is seconds.

    Raises:
      ValueError: If ``text`` is not a duration.
    """
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30d, 12h, 15m, 90s, 500ms)")
    return int(match.group(1)) * _UNITS_MS[match.group(2) or "s"]


def _duration_arg(text: str) -> int:
    """A ledger age (``--older-than``): at most 100 years."""
    try:
        value = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_RETENTION_MS:
        raise argparse.ArgumentTypeError(
            f"a duration must be at most {MAX_RETENTION_MS // 86_400_000}d, got {text!r}"
        )
    return value


def _limit_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"a limit must be an integer >= 0 and <= {MAX_COUNT}, got {text!r}")
    return value


def _format_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 0:
        return "lapsed"
    if ms < 10_000:
        return f"{ms / 1000:.1f}s"
    seconds = ms // 1000
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
    if seconds < 86_400:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86_400}d{(seconds % 86_400) // 3600:02d}h"


# -- the parser ---------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    """The connection options, accepted after the command too (given there, they win)."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _connection_options(common)
    return common


def _connection_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--redis",
        metavar="URL",
        help=f"the guard's Redis (default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL})",
    )
    group.add_argument(
        "--namespace",
        metavar="NS",
        help=f"the prefix of the guard's Redis keys (default: {DEFAULT_NAMESPACE})",
    )


def _broker_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        metavar="MODULE:ATTR",
        help=(
            "your app's broker (e.g. myapp.tasks:broker), used to re-enqueue parked messages that get a "
            "slot; without it they stay reserved and a worker's sweep re-enqueues them once the "
            "reservation lapses"
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command."""
    common = _common()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "See and steer the state of dramatiq-guard: holders, waiters and limits of guard keys, "
            "and the idempotency ledger. Keys are found through the guard's own indexes, never by "
            "scanning Redis."
        ),
        epilog="Exit status: 0 ok, 1 operational error, 2 usage error.",
    )
    _connection_options(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="show holders, waiters and limits of guard keys",
        description=(
            "Show, for each guard key, its holders (message id, actor, since, lease left), its waiters "
            "(count, parked, oldest age) and its limit. Keys come from the guard's indexes: keys that "
            "have or recently had waiters, and keys with a run-time limit; a PATTERN without "
            "wildcards also shows that key."
        ),
    )
    inspect.add_argument(
        "pattern", nargs="?", default="*", metavar="PATTERN", help="a key or a glob pattern (default: *)"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(run=_cmd_inspect)

    limit = commands.add_parser(
        "limit",
        parents=[common],
        help="get, set or clear run-time limits",
        description="Get, set or clear the run-time limit of a guard key (0 halts it: everything parks).",
    )
    limits = limit.add_subparsers(dest="limit_command", metavar="ACTION", required=True)
    get = limits.add_parser(
        "get",
        parents=[common],
        help="print a key's run-time limit",
        description=(
            "Print the run-time limit of KEY (or with --actor, actor NAME's run-time default), or that "
            "none is set (the limit declared on the actor applies)."
        ),
    )
    get.add_argument("target", metavar="KEY", nargs="?", help="the guard key (omit with --actor)")
    get.add_argument("--actor", metavar="NAME", help="print the default limit of this actor's keys")
    get.add_argument("--json", action="store_true", help="print JSON")
    get.set_defaults(run=_cmd_limit_get)
    set_ = limits.add_parser(
        "set",
        parents=[common],
        help="set a key's (or an actor's) run-time limit",
        usage=(
            f"{PROG} limit set [-h] [--redis URL] [--namespace NS] [--broker MODULE:ATTR]\n"
            "       (KEY N | --actor NAME N)"
        ),
        description=(
            "Set the run-time limit of KEY to N, or with --actor, the default limit of every key of "
            "actor NAME. 0 halts (new messages park, running ones finish); raising a limit hands the "
            "new slots to waiters at once."
        ),
    )
    set_.add_argument("target", metavar="KEY", nargs="?", help="the guard key (omit with --actor)")
    set_.add_argument("limit", metavar="N", type=_limit_arg, help="the limit, an integer >= 0")
    set_.add_argument("--actor", metavar="NAME", help="set the default limit of this actor's keys")
    _broker_option(set_)
    set_.set_defaults(run=_cmd_limit_set)
    clear = limits.add_parser(
        "clear",
        parents=[common],
        help="remove a key's run-time limit",
        description=(
            "Remove the run-time limit of KEY (or with --actor, of actor NAME): the limit declared on "
            "the actor applies again. Waiters that the restored limit admits are handed off by the "
            "workers' next sweep."
        ),
    )
    clear.add_argument("target", metavar="KEY", nargs="?", help="the guard key (omit with --actor)")
    clear.add_argument("--actor", metavar="NAME", help="clear the default limit of this actor's keys")
    clear.set_defaults(run=_cmd_limit_clear)

    release = commands.add_parser(
        "release",
        parents=[common],
        help="force the release of a key's holders",
        description=(
            "Release every holder of KEY by force and hand the freed slots to its oldest waiters. A "
            "released holder still running loses its lease (it is told at its next renewal). Hand-offs "
            "not yet confirmed are left alone: they lapse by themselves. Asks for confirmation unless "
            "--yes."
        ),
    )
    release.add_argument("key", metavar="KEY", help="the guard key")
    release.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _broker_option(release)
    release.set_defaults(run=_cmd_release)

    ledger = commands.add_parser(
        "ledger",
        help="show or prune the idempotency ledger",
        description="Show or prune the rows of the SQL idempotency ledger.",
    )
    ledger_common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    ledger_common.add_argument(
        "--ledger",
        metavar="URL",
        help=f"the ledger's SQLAlchemy URL (default: ${LEDGER_URL_ENV}, else the default SQLite file)",
    )
    ledger_common.add_argument(
        "--table",
        metavar="NAME",
        default="dramatiq_guard_ledger",
        help="the ledger's table (default: %(default)s)",
    )
    ledger_common.add_argument(
        "--schema", metavar="NAME", default=None, help="the table's schema, if not the default"
    )
    ledgers = ledger.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)
    prune = ledgers.add_parser(
        "prune",
        parents=[ledger_common],
        help="delete finished rows older than a duration",
        description="Delete the ledger rows of finished keys last updated longer ago than --older-than.",
    )
    prune.add_argument(
        "--older-than",
        metavar="DURATION",
        type=_duration_arg,
        required=True,
        help="e.g. 30d, 12h, 15m, 90s (a bare number is seconds)",
    )
    prune.set_defaults(run=_cmd_ledger_prune)
    show = ledgers.add_parser(
        "show",
        parents=[ledger_common],
        help="show a key's ledger row",
        description="Show the ledger row of an idempotency KEY: state, attempts, holder, timestamps.",
    )
    show.add_argument("key", metavar="KEY", help="the idempotency key")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_cmd_ledger_show)
    return parser


# -- running ------------------------------------------------------------------


class Context:
    """What a command runs with: the parsed arguments, the streams, the backend (made on first use)."""

    def __init__(self, args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self._backend: GuardBackend | None = None
        self.ledger: Any = None
        self.ledger_url: str | None = None

    @property
    def redis_url(self) -> str:
        url: str | None = getattr(self.args, "redis", None)
        return url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL

    @property
    def backend(self) -> GuardBackend:
        if self._backend is None:
            from dramatiq_guard.backends.redis import RedisBackend

            namespace = getattr(self.args, "namespace", None) or DEFAULT_NAMESPACE
            try:
                self._backend = RedisBackend.from_url(self.redis_url, namespace=namespace)
            except ValueError as e:
                raise UsageError(f"bad Redis URL or namespace: {e}") from None
        return self._backend

    def print(self, text: str = "") -> None:
        print(text, file=self.stdout)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        if self.ledger is not None:
            self.ledger.dispose()


def _check_key(backend: GuardBackend, key: str) -> KeyState:
    try:
        return backend.inspect(key)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _now_ms(backend: GuardBackend) -> int:
    """Now on the backend's clock (Redis ``TIME`` for a single Redis), in milliseconds."""
    client = getattr(backend, "client", None)
    import redis

    if isinstance(client, redis.Redis):
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) // 1000
    return time.time_ns() // 1_000_000


def _key_view(key: str, state: KeyState, now: int) -> dict[str, Any]:
    reserved = set(state.reserved)
    info = {holder: (since, actor) for holder, since, actor in state.holder_info}
    holders = []
    for holder, deadline in state.holders:
        since, actor = info.get(holder, (None, None))
        holders.append(
            {
                "holder": holder,
                "deadline_ms": deadline,
                "lease_left_ms": deadline - now,
                "reserved": holder in reserved,
                "actor": actor,
                "since_ms": since,
            }
        )
    parked = sum(1 for _, _, is_parked in state.waiters if is_parked)
    oldest = min((since for _, since, _ in state.waiters), default=None)
    return {
        "key": key,
        "limit": state.limit,
        "holders": holders,
        "waiters": {
            "count": len(state.waiters),
            "parked": parked,
            "blocking": len(state.waiters) - parked,
            "oldest_age_ms": None if oldest is None else now - oldest,
            "ids": [waiter for waiter, _, _ in state.waiters],
        },
        "token": state.token,
    }


def _indexed_keys(backend: GuardBackend) -> list[str]:
    keys = list(backend.waiting_keys())
    limit_keys: Callable[[], list[str]] | None = getattr(backend, "limit_keys", None)
    if limit_keys is not None:
        keys.extend(k for k in limit_keys() if k not in keys)
    return keys


def _cmd_inspect(ctx: Context) -> int:
    backend = ctx.backend
    pattern: str = ctx.args.pattern
    keys = [k for k in _indexed_keys(backend) if fnmatch.fnmatchcase(k, pattern)]
    if not any(c in pattern for c in "*?[") and pattern not in keys:
        keys.append(pattern)
    now = _now_ms(backend)
    views = []
    for key in sorted(keys):
        state = _check_key(backend, key)
        if state.holders or state.waiters or state.limit is not None or key == pattern:
            views.append(_key_view(key, state, now))
    if ctx.args.json:
        ctx.print(json.dumps({"now_ms": now, "keys": views}, indent=2))
        return 0
    if not views:
        ctx.print(f"No guard key matching {pattern!r} has waiters or a run-time limit.")
        return 0
    for view in views:
        _print_key(ctx, view, now)
    return 0


def _print_key(ctx: Context, view: dict[str, Any], now: int) -> None:
    waiters = view["waiters"]
    limit = "actor default" if view["limit"] is None else str(view["limit"])
    if view["limit"] == 0:
        limit += " (halted)"
    summary = f"holders {len(view['holders'])}  limit {limit}  waiters {waiters['count']}"
    if waiters["count"]:
        summary += (
            f" ({waiters['parked']} parked, {waiters['blocking']} blocking),"
            f" oldest {_format_ms(waiters['oldest_age_ms'])}"
        )
    ctx.print(f"{view['key']}")
    ctx.print(f"  {summary}")
    if view["holders"]:
        rows = [("HOLDER", "LEASE LEFT", "ACTOR", "SINCE")]
        for holder in view["holders"]:
            since = holder["since_ms"]
            rows.append(
                (
                    holder["holder"] + (" (hand-off, unconfirmed)" if holder["reserved"] else ""),
                    _format_ms(holder["lease_left_ms"]),
                    holder["actor"] or "-",
                    "-" if since is None else f"{_format_ms(now - since)} ago",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            ctx.print(
                "  "
                + "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
                + "  "
                + row[3]
            )


#: Puts handed-off parked messages back on the app's broker and confirms them.
Requeue = Callable[[Sequence[Handoff]], None]


def _requeue(ctx: Context, handoffs: Sequence[Handoff], requeue: Requeue | None) -> str:
    """Put handed-off parked messages back on the broker, or leave them reserved; say which.

    Parameters:
      requeue: What ``--broker`` gives (see :func:`_broker_requeue`), or None.
    """
    parked = [h for h in handoffs if h.payload is not None]
    woken = len(handoffs) - len(parked)
    notes = []
    if woken:
        notes.append(f"{woken} blocking waiter(s) woken")
    if not parked:
        return "; ".join(notes) or "no waiter was handed a slot"
    if requeue is None:
        ttl = _format_ms(ctx.backend.handoff_ttl_ms)
        notes.append(
            f"{len(parked)} parked message(s) handed a slot and left reserved: a worker's sweep "
            f"re-enqueues them once the reservation lapses (~{ttl}); pass --broker to re-enqueue now"
        )
        return "; ".join(notes)
    requeue(parked)
    # A hand-off whose re-enqueue failed is still an unconfirmed reservation
    # (its payload stored): it lapses back into the queue by itself.
    failed = [h.waiter_id for h in parked if h.waiter_id in ctx.backend.inspect(h.key).reserved]
    notes.append(f"{len(parked) - len(failed)} parked message(s) re-enqueued")
    if failed:
        notes.append(f"could not re-enqueue {', '.join(failed)}: left reserved (see the log)")
    return "; ".join(notes)


def _broker_requeue(ctx: Context) -> Requeue | None:
    """How to re-enqueue hand-offs on the ``--broker MODULE:ATTR``, or None without it.

    Loaded before anything changes, so a bad ``--broker`` changes nothing.
    A hand-off of a key with a guard middleware on that broker (``mutex:``,
    ``concurrency:``) is re-enqueued by that middleware, exactly as a worker
    would (bypassing its own enqueue gate, then confirming). Any other
    hand-off goes straight to the broker, around the enqueue gate (it holds
    its reservation already), and is then confirmed.
    """
    spec: str | None = getattr(ctx.args, "broker", None)
    if spec is None:
        return None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--broker must be MODULE:ATTR (e.g. myapp.tasks:broker), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        broker = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--broker {spec}: {e}") from None
    from dramatiq import Broker, Message

    from dramatiq_guard.gate import EnqueueGate
    from dramatiq_guard.middleware.slots import SlotsMiddleware

    if not isinstance(broker, Broker):
        raise UsageError(f"--broker {spec} is a {type(broker).__name__}, not a dramatiq Broker")
    slots = [m for m in broker.middleware if isinstance(m, SlotsMiddleware)]
    gate = getattr(broker.enqueue, "__self__", None)
    enqueue = gate.original if isinstance(gate, EnqueueGate) else broker.enqueue
    backend = ctx.backend

    def requeue(handoffs: Sequence[Handoff]) -> None:
        for handoff in handoffs:
            middleware = next((m for m in slots if handoff.key.startswith(m.prefix + ":")), None)
            if middleware is not None:
                middleware.requeue(broker, [handoff])
                continue
            assert handoff.payload is not None
            try:
                enqueue(Message.decode(handoff.payload))
            except Exception:
                logger.exception(
                    "Could not re-enqueue %s handed a slot of %r.", handoff.waiter_id, handoff.key
                )
                continue
            backend.confirm_handoff(handoff.key, handoff.waiter_id, ttl_ms=backend.handoff_ttl_ms)

    return requeue


def _actor_limit_key(name: str) -> str:
    from dramatiq_guard.middleware.slots import Concurrency

    return f"{Concurrency.actor_limit_prefix}:{name}"


def _target(ctx: Context) -> str:
    args = ctx.args
    if (args.target is None) == (args.actor is None):
        raise UsageError(f"limit {args.limit_command}: give either KEY or --actor NAME")
    return _actor_limit_key(args.actor) if args.actor is not None else str(args.target)


def _cmd_limit_get(ctx: Context) -> int:
    key = _target(ctx)
    state = _check_key(ctx.backend, key)
    if ctx.args.json:
        ctx.print(json.dumps({"key": key, "limit": state.limit}))
    elif state.limit is None:
        ctx.print(f"{key}: no run-time limit (the limit declared on the actor applies)")
    else:
        ctx.print(f"{key}: {state.limit}" + (" (halted)" if state.limit == 0 else ""))
    return 0


def _cmd_limit_set(ctx: Context) -> int:
    key = _target(ctx)
    backend = ctx.backend
    _check_key(backend, key)
    requeue = _broker_requeue(ctx)
    # The default is only used if no run-time limit is in force; here one always is.
    result = backend.set_limit(key, ctx.args.limit, default=0)
    ctx.print(f"{key}: limit set to {ctx.args.limit}" + (" (halted)" if ctx.args.limit == 0 else ""))
    if result.handoffs:
        ctx.print(f"  {_requeue(ctx, result.handoffs, requeue)}")
    return 0


def _cmd_limit_clear(ctx: Context) -> int:
    key = _target(ctx)
    backend = ctx.backend
    _check_key(backend, key)
    # The command does not know the actor's declared limit: hand nothing off
    # here (default 0 never exceeds it); the workers' sweep does it.
    backend.set_limit(key, None, default=0)
    ctx.print(f"{key}: run-time limit cleared (the limit declared on the actor applies)")
    return 0


def _cmd_release(ctx: Context) -> int:
    key: str = ctx.args.key
    backend = ctx.backend
    state = _check_key(backend, key)
    requeue = _broker_requeue(ctx)
    reserved = set(state.reserved)
    holders = [holder for holder, _ in state.holders if holder not in reserved]
    if not holders:
        extra = f" ({len(reserved)} unconfirmed hand-off(s) left to lapse)" if reserved else ""
        ctx.print(f"{key}: no holder to release{extra}")
        return 0
    if not ctx.args.yes:
        ctx.stdout.write(
            f"Release {len(holders)} holder(s) of {key} ({', '.join(holders)}) and hand their slots "
            f"to {len(state.waiters)} waiter(s)? Holders still running lose their lease. [y/N] "
        )
        ctx.stdout.flush()
        answer = ctx.stdin.readline().strip().lower()
        if not ctx.stdin.isatty():
            ctx.print()
        if answer not in {"y", "yes"}:
            raise OperationalError("not released (not confirmed; pass --yes to skip the question)")
    # As many held the key at once, so handing off up to that many never
    # exceeds the actor's limit; a run-time limit, if set, wins anyway.
    default = max(1, len(state.holders))
    released = 0
    handoffs: list[Handoff] = []
    for holder in holders:
        result = backend.release(key, holder, limit=default)
        released += result.released
        handoffs.extend(result.handoffs)
    ctx.print(f"{key}: released {released} holder(s)")
    if handoffs:
        ctx.print(f"  {_requeue(ctx, handoffs, requeue)}")
    return 0


def _ledger(ctx: Context) -> Any:
    """The ledger of ``--ledger`` / ``DRAMATIQ_GUARD_LEDGER_URL`` (else the default SQLite file)."""
    import sqlalchemy as sa

    from dramatiq_guard.ledger import Ledger, default_ledger_url

    url: str = getattr(ctx.args, "ledger", None) or default_ledger_url()
    try:
        engine = sa.make_url(url)
    except sa.exc.ArgumentError as e:
        raise UsageError(f"bad ledger URL {url!r}: {e}") from None
    ctx.ledger_url = engine.render_as_string(hide_password=True)
    try:
        ledger = Ledger(url, table_name=ctx.args.table, schema=ctx.args.schema, create_tables=False)
        ledger.engine  # noqa: B018 (made now, so a missing driver is a clear error here)
    except Exception as e:
        raise UsageError(f"cannot use the ledger URL {ctx.ledger_url}: {e}") from None
    ctx.ledger = ledger
    return ledger


def _cmd_ledger_prune(ctx: Context) -> int:
    ledger = _ledger(ctx)
    deleted = ledger.prune(older_than=ctx.args.older_than)
    ctx.print(
        f"deleted {deleted} ledger row(s): finished more than {_format_ms(ctx.args.older_than)} ago, "
        "or past their retention"
    )
    return 0


def _cmd_ledger_show(ctx: Context) -> int:
    ledger = _ledger(ctx)
    record = ledger.get(ctx.args.key)
    if record is None:
        raise OperationalError(f"no ledger row for idempotency key {ctx.args.key!r}")
    fields = dataclasses.asdict(record)
    if ctx.args.json:
        ctx.print(json.dumps(fields, indent=2, default=str))
        return 0
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        text = json.dumps(value, default=str) if name in ("payload", "result") else value
        ctx.print(f"{name + ':':<{width + 1}} {'-' if value is None else text}")
    return 0


def main(
    argv: Sequence[str] | None = None, *, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> int:
    """Run the command; returns its exit status.

    Parameters:
      argv(Sequence[str]|None): The arguments (default: ``sys.argv[1:]``).
      stdin(TextIO|None): Where a confirmation is read (default: ``sys.stdin``).
      stdout(TextIO|None): Where output goes (default: ``sys.stdout``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    ctx = Context(args, stdin or sys.stdin, stdout or sys.stdout)
    try:
        run: Callable[[Context], int] = args.run
        return run(ctx)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OperationalError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 1
    except Exception as e:
        from redis.exceptions import RedisError

        from dramatiq_guard.errors import BackendUnavailable

        if isinstance(e, (BackendUnavailable, RedisError)):
            print(f"{PROG}: error: cannot reach Redis at {_redacted(ctx.redis_url)}: {e}", file=sys.stderr)
            return 1
        import sqlalchemy as sa

        if isinstance(e, sa.exc.SQLAlchemyError) and ctx.ledger_url is not None:
            reason = str(getattr(e, "orig", None) or e).splitlines()[0]
            print(f"{PROG}: error: the ledger at {ctx.ledger_url}: {reason}", file=sys.stderr)
            return 1
        raise
    finally:
        ctx.close()


def _redacted(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


if __name__ == "__main__":
    sys.exit(main())
