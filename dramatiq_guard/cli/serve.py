"""``dramatiq-guard serve``: the web dashboard (:mod:`dramatiq_guard.web`).

The write secret is never an argument (a command line is readable by every
local user): ``--write-secret-file PATH``, else ``DRAMATIQ_GUARD_WRITE_SECRET``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

from dramatiq_guard.cli.common import BROKER, LEDGER_URL_ENV, Context, UsageError, _arg, _verb

#: Where ``serve`` reads the write secret when ``--write-secret-file`` is not given.
WRITE_SECRET_ENV = "DRAMATIQ_GUARD_WRITE_SECRET"


# Nothing of dramatiq_guard.web here: it needs the web extra, and a base install's --help must work.
SERVE = _verb(
    "serve",
    "serve the web dashboard (needs the web extra)",
    lambda ctx: _cmd_serve(ctx),
    _arg("--host", "the address to bind (default: %(default)s)", default="127.0.0.1"),
    _arg("--port", "the port to bind (default: the dashboard's, 8470)", type=int, default=None),
    BROKER,
    _arg(
        "--write-secret-file PATH",
        f"allow changes to a browser that gives the secret in this file (default: ${WRITE_SECRET_ENV})",
    ),
    _arg("--write-secret", argparse.SUPPRESS),  # refused, saying why (_write_secret)
    _arg(
        "--allowed-host NAME",
        "also answer to this Host name (repeatable; '.example.com': a domain and subdomains; '*': any)",
        action="append",
        default=[],
    ),
    _arg("--ledger URL", f"the idempotency ledger to show (default: ${LEDGER_URL_ENV}, else none)"),
    description="Serve the web dashboard (it needs the web extra: pip install 'dramatiq-guard[web]'), "
    "read-only unless a write secret is given.",
)


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
