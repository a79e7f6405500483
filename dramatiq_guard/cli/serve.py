"""``dramatiq-guard serve``: the web dashboard on 127.0.0.1 (see :mod:`dramatiq_guard.web`)."""

from __future__ import annotations

import argparse
import os

from dramatiq_guard.cli.common import LEDGER_URL_ENV, Context, UsageError

#: Where ``serve`` reads the write secret when ``--write-secret`` is not given.
WRITE_SECRET_ENV = "DRAMATIQ_GUARD_WRITE_SECRET"


def _serve_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    # Nothing of dramatiq_guard.web here: it needs the web extra, and the parser of every verb is built
    # from this (a base install's `dramatiq-guard --help` must work).
    serve = commands.add_parser(
        "serve",
        parents=[common],
        help="serve the web dashboard (needs the web extra)",
        description=(
            "Serve the web dashboard: every guard key with holders or waiters, its holders, waiters in "
            "order and limit, and the idempotency ledger. Read-only unless a write secret is given. "
            "Needs the web extra: pip install 'dramatiq-guard[web]'."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=None, help="the port to bind (default: the dashboard's, 8470)"
    )
    serve.add_argument(
        "--broker",
        metavar="MODULE:ATTR",
        help="your app's broker, to re-enqueue parked messages that get a slot from the page",
    )
    serve.add_argument(
        "--write-secret",
        metavar="SECRET",
        help=f"allow changes (limit, release) to a browser that gives it (default: ${WRITE_SECRET_ENV})",
    )
    serve.add_argument(
        "--ledger",
        metavar="URL",
        help=f"the idempotency ledger to show (default: ${LEDGER_URL_ENV}, else none)",
    )
    serve.set_defaults(run=_cmd_serve)


def _cmd_serve(ctx: Context) -> int:
    try:
        from dramatiq_guard import web
    except ImportError as e:
        raise UsageError(f"serve needs the web extra (pip install 'dramatiq-guard[web]'): {e}") from None
    from dramatiq_guard import admin

    args = ctx.args
    backend = ctx.backend
    broker = None
    if args.broker is not None:
        try:
            broker = admin.load_broker(args.broker)
        except ValueError as e:
            raise UsageError(str(e)) from None
    ledger_url = args.ledger or os.environ.get(LEDGER_URL_ENV)
    secret = args.write_secret or os.environ.get(WRITE_SECRET_ENV) or None
    app = web.make_app(backend, broker=broker, ledger=ledger_url, write_secret=secret)
    mode = "writes need the write secret" if secret else "read-only (no write secret)"
    port = web.DEFAULT_PORT if args.port is None else args.port
    ctx.print(f"dramatiq-guard dashboard on http://{args.host}:{port}/ ({mode}); Ctrl-C stops it")
    ctx.stdout.flush()
    web.serve(app, host=args.host, port=port)
    return 0
