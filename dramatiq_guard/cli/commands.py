"""The verbs of ``dramatiq-guard``: inspect, limit, release, ledger (docs in :mod:`dramatiq_guard.cli`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dramatiq_guard.backends.base import GuardBackend, Handoff, KeyState
from dramatiq_guard.cli.common import (
    Context,
    OperationalError,
    UsageError,
    _format_ms,
)

if TYPE_CHECKING:
    from dramatiq_guard.backends.redis_health import RedisSettings


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
    settings = _redis_settings(backend)
    if ctx.args.json:
        report: dict[str, Any] = {"now_ms": now, "keys": views}
        if settings is not None:
            report["redis"] = settings.as_dict()
        ctx.print(json.dumps(report, indent=2))
        return 0
    if not views:
        ctx.print(f"No guard key matching {pattern!r} has waiters or a run-time limit.")
    for view in views:
        _print_key(ctx, view, now)
    if settings is not None:
        ctx.print(f"Redis {settings.where}:")
        for line in settings.describe():
            ctx.print(f"  {line}")
    return 0


def _redis_settings(backend: GuardBackend) -> RedisSettings | None:
    """What the guard's Redis does with its keys (eviction, persistence), best effort."""
    from dramatiq_guard.backends import RedisBackend
    from dramatiq_guard.backends.redis_health import read_settings

    if not isinstance(backend, RedisBackend):
        return None
    return read_settings(backend.client)


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
    Each hand-off is delivered exactly as a worker would
    (:func:`dramatiq_guard.delivery.courier_for`): by the guard middleware on
    that broker that claims its key, else enqueued through the gate as
    holding its key and confirmed for the backend's hand-off time.
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
    from dramatiq import Broker

    from dramatiq_guard.delivery import courier_for
    from dramatiq_guard.resolve import route_of

    if not isinstance(broker, Broker):
        raise UsageError(f"--broker {spec} is a {type(broker).__name__}, not a dramatiq Broker")
    backend = ctx.backend
    # This command now delivers for that broker: its parked messages may be handed their slots.
    backend.route = route_of(broker)

    def requeue(handoffs: Sequence[Handoff]) -> None:
        for handoff in handoffs:
            courier_for(broker, backend, handoff.key).deliver([handoff])

    return requeue


def _actor_limit_key(name: str) -> str:
    from dramatiq_guard.middleware.slots.limits import ACTOR_LIMIT_PREFIX

    return f"{ACTOR_LIMIT_PREFIX}:{name}"


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
    # The command does not know the actor: the backend hands slots on with the limit recorded
    # with the key's waiters (to blocking waiters; parked ones are left to a worker's sweep).
    backend.set_limit(key, None, default=None)
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
    # The command does not know the actor: the backend uses the limit recorded with the key's
    # waiters (a run-time limit, if set, wins anyway).
    released = 0
    handoffs: list[Handoff] = []
    for holder in holders:
        result = backend.release(key, holder, limit=None)
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
