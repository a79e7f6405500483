"""The verbs of ``dramatiq-guard``: inspect, limit, release, ledger, functions and serve.

Nothing of :mod:`dramatiq_guard.web` is imported before ``serve`` runs: it needs the web extra, and
a base install's ``--help`` must work.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dramatiq_guard import admin
from dramatiq_guard.admin import format_ms as _format_ms
from dramatiq_guard.backends.base import GuardBackend, KeyState
from dramatiq_guard.cli.common import LEDGER_URL_ENV, Context, OperationalError, UsageError

#: Where ``serve`` reads the write secret when ``--write-secret-file`` is not given (never an
#: argument: a command line is readable by every local user).
WRITE_SECRET_ENV = "DRAMATIQ_GUARD_WRITE_SECRET"


def _check_key(backend: GuardBackend, key: str) -> KeyState:
    try:
        return backend.inspect(key)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _cmd_inspect(ctx: Context) -> int:
    if ctx.args.summary:
        return _inspect_summary(ctx)
    backend = ctx.backend
    pattern: str = ctx.args.pattern
    keys = admin.indexed_keys(backend, pattern)
    if not any(c in pattern for c in "*?[") and pattern not in keys:
        keys.append(pattern)
    try:
        now, views = admin.key_views(backend, sorted(keys), waiters=ctx.args.waiters)
    except ValueError as e:
        raise UsageError(str(e)) from None
    views = [
        v
        for v in views
        if v["holders"] or v["waiters"]["count"] or v["limit"] is not None or v["key"] == pattern
    ]
    from dramatiq_guard.backends.redis_health import read_settings

    settings = read_settings(backend.client)  # what Redis does with its keys (eviction, persistence)
    if ctx.args.json:
        ctx.print(json.dumps({"now_ms": now, "keys": views, "redis": settings.as_dict()}, indent=2))
        return 0
    if not views:
        ctx.print(f"No guard key matching {pattern!r} has waiters or a run-time limit.")
    for view in views:
        _print_key(ctx, view, now)
    ctx.print(f"Redis {settings.where}:")
    for line in settings.describe():
        ctx.print(f"  {line}")
    return 0


def _inspect_summary(ctx: Context) -> int:
    """``inspect --summary``: one line per key, most in need of a look first (the dashboard's overview)."""
    report = admin.overview(ctx.backend, pattern=ctx.args.pattern)
    if ctx.args.json:
        ctx.print(json.dumps(report, indent=2))
        return 0
    if not report["keys"]:
        ctx.print(f"No guard key matching {ctx.args.pattern!r} has waiters or a run-time limit.")
        return 0
    rows: list[tuple[str, ...]] = [
        (
            row["key"],
            row["kind"],
            str(row["holders"]),
            "?"
            if row["limit_in_force"] is None
            else f"{row['limit_in_force']}{'' if row['limit'] is None else ' (run-time)'}",
            str(row["waiters"]),
            _format_ms(row["oldest_age_ms"]),
        )
        for row in report["keys"]
    ]
    header: tuple[str, ...] = ("KEY", "KIND", "HOLDERS", "LIMIT", "WAITERS", "OLDEST")
    if any("pending" in row for row in report["keys"]):  # a debounce key's pending run, in a last column
        header += ("PENDING RUN",)
        pending = [admin.describe_pending(r["pending"]) if "pending" in r else "-" for r in report["keys"]]
        rows = [(*row, text) for row, text in zip(rows, pending, strict=True)]
    _print_table(ctx, header, rows, indent="")
    return 0


def _print_key(ctx: Context, view: dict[str, Any], now: int) -> None:
    waiters, limit, in_force = view["waiters"], view["limit"], view["limit_in_force"]
    text = "actor default" if limit is None else str(limit)  # a run-time limit
    if limit is None and in_force is not None:
        text = f"{in_force} (actor default, as recorded with its waiters)"
    summary = f"holders {len(view['holders'])}  limit {text}{' (halted)' if in_force == 0 else ''}"
    summary += f"  waiters {waiters['count']}"
    if waiters["count"]:
        summary += (
            f" ({waiters['parked']} parked, {waiters['blocking']} blocking),"
            f" oldest {_format_ms(waiters['oldest_age_ms'])}"
        )
    ctx.print(f"{view['key']}\n  {summary}")
    if "window" in view:
        opens = view["window"]["opens_in_ms"]
        when = "" if opens is None else f"; the oldest leaves it (a place opens) in {_format_ms(opens)}"
        ctx.print(f"  window: {view['window']['starts']} start(s){when}")
    if "pending" in view:
        ctx.print(f"  {admin.describe_pending(view['pending'])}")
    holders = [
        (
            h["holder"] + (" (hand-off, unconfirmed)" if h["reserved"] else ""),
            _format_ms(h["lease_left_ms"]),
            h["actor"] or "-",
            "-" if h["since_ms"] is None else f"{_format_ms(now - h['since_ms'])} ago",
        )
        for h in view["holders"]
    ]
    _print_table(ctx, ("HOLDER", "LEASE LEFT", "ACTOR", "SINCE"), holders)
    first = waiters["first"]
    rows = [
        (
            w["id"],
            _format_ms(w["waited_ms"]),
            "parked" if w["parked"] else "blocking",
            w["actor"] or "-",
            w["args"] or "-",
        )
        for w in first
    ]
    _print_table(ctx, ("WAITER", "WAITED", "KIND", "ACTOR", "ARGUMENTS"), rows)
    if first and waiters["count"] > len(first):
        ctx.print(f"  ... and {waiters['count'] - len(first)} more waiter(s)")


def _print_table(
    ctx: Context, header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  "
) -> None:
    """Rows under ``header`` as aligned columns, indented (the last column not padded); none without rows."""
    if not rows:
        return
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        ctx.print(
            indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )


def _print_lines(ctx: Context, lines: list[str]) -> int:
    """What a write did: its first line, then its notes indented."""
    first, *notes = lines
    ctx.print(first)
    for note in notes:
        ctx.print(f"  {note}")
    return 0


def _broker_requeue(ctx: Context) -> admin.Requeue | None:
    """How to re-enqueue hand-offs on ``--broker`` (None without it); loaded before anything changes."""
    try:
        return admin.broker_requeue(getattr(ctx.args, "broker", None), ctx.backend)
    except ValueError as e:  # a ConfigurationError too: a broker of no known route
        raise UsageError(str(e)) from None


def _target(ctx: Context) -> tuple[str, KeyState]:
    """The key of ``limit``'s KEY or ``--actor NAME``, and its state."""
    from dramatiq_guard.middleware.slots.limits import ACTOR_LIMIT_PREFIX

    args = ctx.args
    if (args.target is None) == (args.actor is None):
        raise UsageError(f"limit {args.limit_command}: give either KEY or --actor NAME")
    key = f"{ACTOR_LIMIT_PREFIX}:{args.actor}" if args.actor is not None else str(args.target)
    return key, _check_key(ctx.backend, key)


def _cmd_limit_get(ctx: Context) -> int:
    key, state = _target(ctx)
    if ctx.args.json:
        ctx.print(json.dumps({"key": key, "limit": state.limit}))
    elif state.limit is None:
        ctx.print(f"{key}: no run-time limit (the limit declared on the actor applies)")
    else:
        ctx.print(f"{key}: {state.limit}" + (" (halted)" if state.limit == 0 else ""))
    return 0


def _cmd_limit_set(ctx: Context) -> int:
    key, _ = _target(ctx)
    return _print_lines(ctx, admin.set_limit(ctx.backend, key, ctx.args.limit, _broker_requeue(ctx)))


def _cmd_limit_clear(ctx: Context) -> int:
    key, _ = _target(ctx)
    # The command does not know the actor: the backend hands slots on with the limit recorded
    # with the key's waiters (to blocking waiters; parked ones are left to a worker's sweep).
    ctx.backend.set_limit(key, None, default=None)
    ctx.print(f"{key}: run-time limit cleared (the limit declared on the actor applies)")
    return 0


def _cmd_release(ctx: Context) -> int:
    key: str = ctx.args.key
    backend = ctx.backend
    state = _check_key(backend, key)
    requeue = _broker_requeue(ctx)
    holders = admin.releasable(state)
    if not holders:
        extra = f" ({len(state.reserved)} unconfirmed hand-off(s) left to lapse)" if state.reserved else ""
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
    return _print_lines(ctx, admin.release_holders(backend, key, holders, requeue))


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
    fields = admin.ledger_row(_ledger(ctx), ctx.args.key)
    if fields is None:
        raise OperationalError(f"no ledger row for idempotency key {ctx.args.key!r}")
    if ctx.args.json:
        ctx.print(json.dumps(fields, indent=2, default=str))
        return 0
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        text = json.dumps(value, default=str) if name in ("payload", "result") else value
        ctx.print(f"{name + ':':<{width + 1}} {'-' if value is None else text}")
    return 0


def _cmd_ledger_list(ctx: Context) -> int:
    ledger = _ledger(ctx)
    states = ctx.args.state or ["in_progress", "failed"]
    view = admin.ledger_view(ledger, states=states, limit=ctx.args.limit)
    if ctx.args.json:
        ctx.print(json.dumps(view, indent=2, default=str))
        return 0
    counts = view["counts"]
    ctx.print("rows: " + ("  ".join(f"{state} {n}" for state, n in sorted(counts.items())) or "none"))
    for state, rows in view["rows"].items():
        ctx.print(f"{state}: {len(rows)} shown")
        table = [
            (r["key"], r["actor_name"], str(r["attempts"]), r["updated_at"], r["error"] or "-") for r in rows
        ]
        _print_table(ctx, ("KEY", "ACTOR", "ATTEMPTS", "UPDATED", "ERROR"), table)
    return 0


def _processes(processes: list[str], most: int = 5) -> str:
    """``host:pid, ...`` (the first ``most``)."""
    more = f" and {len(processes) - most} more" if len(processes) > most else ""
    return ", ".join(processes[:most]) + more


def _cmd_functions_list(ctx: Context) -> int:
    client, scripts, namespace = ctx.backend.client, ctx.backend.scripts, ctx.backend.namespace
    found = scripts.libraries(client)
    running = scripts.running(client, namespace)
    if ctx.args.json:
        report = {"this_version": scripts.library, "libraries": found, "processes": running}
        ctx.print(json.dumps(report))
        return 0
    if not found:
        ctx.print(f"no dramatiq-guard library here (this version's, {scripts.library}, loads on first use)")
    for name, count in sorted(found.items()):
        ours = " (this version)" if name == scripts.library else ""
        run_by = f", run by {_processes(running[name])}" if name in running else ""
        ctx.print(f"{name}: {count} functions{ours}{run_by}")
    return 0


def _cmd_functions_load(ctx: Context) -> int:
    ctx.backend.scripts.load_functions(ctx.backend.client)
    ctx.print(f"{ctx.backend.scripts.library}: loaded")
    return 0


def _cmd_functions_prune(ctx: Context) -> int:
    client, scripts, namespace = ctx.backend.client, ctx.backend.scripts, ctx.backend.namespace
    others = set(scripts.libraries(client)) - {scripts.library}
    running = {name: found for name, found in scripts.running(client, namespace).items() if name in others}
    if running and not ctx.args.force:
        live = "; ".join(f"{name} by {_processes(processes)}" for name, processes in sorted(running.items()))
        raise UsageError(
            f"functions prune: refused: workers of namespace {namespace!r} still run another version's "
            f"library ({live}), and would fail every call if their ACL user may not load it; stop or "
            f"upgrade them first, or pass --force"
        )
    deleted = scripts.prune(client)
    for name in deleted:
        if name in running:
            ctx.print(
                f"{name}: deleted while {_processes(running[name])} still run it (--force): they load it "
                f"again on their next call, or fail closed until an operator does if their ACL user may not"
            )
        else:
            ctx.print(f"{name}: deleted (no worker of namespace {namespace!r} runs it)")
    if not deleted:
        ctx.print(f"nothing to prune: no dramatiq-guard library but this version's ({scripts.library})")
    return 0


def _write_secret(args: argparse.Namespace) -> str | None:
    """The write secret: ``--write-secret-file``'s (whitespace around it dropped), else the environment's."""
    if args.write_secret is not None:
        raise UsageError(
            "--write-secret is refused: a secret on the command line is readable by every user of this "
            f"machine (ps, /proc/PID/cmdline) and kept in shell history; set {WRITE_SECRET_ENV} or give "
            "--write-secret-file PATH"
        )
    if args.write_secret_file is None:
        return os.environ.get(WRITE_SECRET_ENV) or None
    path = args.write_secret_file
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the write secret file {path}: {e}") from None
    if not secret:
        raise UsageError(f"the write secret file {path} is empty")
    return secret


def _bound_name(host: str) -> list[str]:
    """The address ``serve`` binds, as an allowed Host name: none for a wildcard (0.0.0.0, ::)."""
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = not host
    return [] if wildcard else [host]


def _cmd_serve(ctx: Context) -> int:
    try:
        from dramatiq_guard import web
    except ImportError as e:
        raise UsageError(f"serve needs the web extra (pip install 'dramatiq-guard[web]'): {e}") from None
    args = ctx.args
    secret = _write_secret(args)
    try:
        hosts = web.AllowedHosts(
            [*web.LOCAL_HOSTS, *_bound_name(args.host), *args.allowed_host], what="--allowed-host (or --host)"
        )
        access = web.Access(write_secret=secret, allowed_hosts=hosts.entries)
        ledger = args.ledger or os.environ.get(LEDGER_URL_ENV)
        app = web.make_app(ctx.backend, broker=args.broker, ledger=ledger, access=access)
    except ValueError as e:  # a bad --broker too
        raise UsageError(str(e)) from None
    mode = "writes need the write secret" if secret else "read-only (no write secret)"
    port = web.DEFAULT_PORT if args.port is None else args.port
    shown = f"[{args.host}]" if ":" in args.host else args.host
    ctx.print(
        f"dramatiq-guard dashboard on http://{shown}:{port}/ ({mode}; answers to Host {hosts}); "
        "Ctrl-C stops it"
    )
    ctx.stdout.flush()
    web.serve(app, host=args.host, port=port)
    return 0
