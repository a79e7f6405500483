"""The ``dramatiq-guard`` command: see and steer what the guard holds (docs/command.md).

Exit status: 0 success, 1 operational error, 2 usage error; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from dramatiq_guard.cli.commands import (
    _cmd_functions_list,
    _cmd_functions_load,
    _cmd_functions_prune,
    _cmd_inspect,
    _cmd_ledger_list,
    _cmd_ledger_prune,
    _cmd_ledger_show,
    _cmd_limit_clear,
    _cmd_limit_get,
    _cmd_limit_set,
    _cmd_release,
)
from dramatiq_guard.cli.common import (
    DEFAULT_NAMESPACE,
    LEDGER_URL_ENV,
    PROG,
    Context,
    OperationalError,
    UsageError,
    _duration_arg,
    _limit_arg,
    parse_duration,
)
from dramatiq_guard.cli.serve import _serve_parser
from dramatiq_guard.resolve import DEFAULT_REDIS_URL, REDIS_URL_ENV

__all__ = ["REDIS_URL_ENV", "Context", "build_parser", "main", "parse_duration"]

if TYPE_CHECKING:
    Verbs = argparse._SubParsersAction[argparse.ArgumentParser]

# -- the parser ---------------------------------------------------------------


def _options(*add: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """A parent parser of options, accepted after the verb too (given there, they win)."""
    parent = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for options in add:
        options(parent)
    return parent


def _connection_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    default = f"${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL}"
    group.add_argument("--redis", metavar="URL", help=f"the guard's Redis (default: {default})")
    group.add_argument(
        "--namespace",
        metavar="NS",
        help=f"the prefix of the guard's Redis keys (default: {DEFAULT_NAMESPACE})",
    )


def _ledger_options(parser: argparse.ArgumentParser) -> None:
    default = f"${LEDGER_URL_ENV}, else the default SQLite file"
    parser.add_argument("--ledger", metavar="URL", help=f"the ledger's SQLAlchemy URL (default: {default})")
    parser.add_argument(
        "--table",
        metavar="NAME",
        default="dramatiq_guard_ledger",
        help="the ledger's table (default: %(default)s)",
    )
    parser.add_argument(
        "--schema", metavar="NAME", default=None, help="the table's schema, if not the default"
    )


def _verb(
    verbs: Verbs, name: str, parent: argparse.ArgumentParser | None, help: str, run: Any = None, **kw: Any
) -> argparse.ArgumentParser:
    """Add the verb ``name``, which runs ``run`` (a description, if any, in ``kw``)."""
    parser = verbs.add_parser(name, parents=[] if parent is None else [parent], help=help, **kw)
    if run is not None:
        parser.set_defaults(run=run)
    return parser


def _json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def _key_or_actor(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("target", metavar="KEY", nargs="?", help="the guard key (omit with --actor)")
    parser.add_argument("--actor", metavar="NAME", help=f"{what} of this actor's keys")


def _broker_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        metavar="MODULE:ATTR",
        help="your app's broker (e.g. myapp.tasks:broker), to re-enqueue parked messages that get a slot",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command."""
    common = _options(_connection_options)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See and steer dramatiq-guard's state: guard keys (found through the guard's indexes, "
        "never by scanning Redis) and the idempotency ledger.",
        epilog="Exit status: 0 ok, 1 operational error, 2 usage error.",
    )
    _connection_options(parser)
    verbs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_inspect(verbs, common)
    _add_limit(verbs, common)
    release = _verb(
        verbs,
        "release",
        common,
        "force the release of a key's holders",
        _cmd_release,
        description="Release every holder of KEY by force (unconfirmed hand-offs excepted) and hand the "
        "freed slots to its oldest waiters. Asks for confirmation unless --yes.",
    )
    release.add_argument("key", metavar="KEY", help="the guard key")
    release.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _broker_option(release)
    _add_functions(verbs, common)
    _add_ledger(verbs)
    _serve_parser(verbs, common)
    return parser


def _add_inspect(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    inspect = _verb(
        verbs,
        "inspect",
        common,
        "show holders, waiters and limits of guard keys",
        _cmd_inspect,
        description="Show each guard key's holders, waiters and limit. Keys come from the guard's indexes "
        "(keys with waiters or a run-time limit); a PATTERN without wildcards also shows that key.",
    )
    inspect.add_argument(
        "pattern", nargs="?", default="*", metavar="PATTERN", help="a key or a glob (default: *)"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument(
        "--summary", action="store_true", help="one line per key, most in need of a look first"
    )
    inspect.add_argument(
        "--waiters",
        metavar="N",
        type=_limit_arg,
        default=10,
        help="describe each key's first N waiters (default: 10)",
    )


def _add_limit(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    limit = _verb(verbs, "limit", common, "get, set or clear run-time limits")
    limits = limit.add_subparsers(dest="limit_command", metavar="ACTION", required=True)
    get = _verb(limits, "get", common, "print a key's (or an actor's) run-time limit", _cmd_limit_get)
    _key_or_actor(get, "print the default limit")
    _json(get)
    set_ = _verb(
        limits,
        "set",
        common,
        "set a key's (or an actor's) run-time limit",
        _cmd_limit_set,
        usage=f"{PROG} limit set [-h] [--redis URL] [--namespace NS] [--broker MODULE:ATTR]\n"
        "       (KEY N | --actor NAME N)",
        description="Set KEY's run-time limit to N (0 halts it: new messages park, running ones finish), or "
        "with --actor, the default limit of actor NAME's keys.",
    )
    set_.add_argument("target", metavar="KEY", nargs="?", help="the guard key (omit with --actor)")
    set_.add_argument("limit", metavar="N", type=_limit_arg, help="the limit, an integer >= 0")
    set_.add_argument("--actor", metavar="NAME", help="set the default limit of this actor's keys")
    _broker_option(set_)
    clear = _verb(limits, "clear", common, "remove a key's (or an actor's) run-time limit", _cmd_limit_clear)
    _key_or_actor(clear, "clear the default limit")


def _add_functions(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    functions = _verb(
        verbs,
        "functions",
        common,
        "list, load or prune the guard's Redis function libraries",
        description="The guard's scripts are one Redis function library per version (on a Redis Cluster, "
        "run this against each primary).",
    )
    actions = functions.add_subparsers(dest="functions_command", metavar="ACTION", required=True)
    _json(
        _verb(
            actions,
            "list",
            common,
            "the libraries on the server, and the workers that run them",
            _cmd_functions_list,
        )
    )
    _verb(actions, "load", common, "load this version's library (FUNCTION LOAD REPLACE)", _cmd_functions_load)
    prune = _verb(
        actions,
        "prune",
        common,
        "delete other versions' libraries, unless a worker still runs one",
        _cmd_functions_prune,
    )
    prune.add_argument("--force", action="store_true", help="delete them even while workers still run them")


def _add_ledger(verbs: Verbs) -> None:
    ledger = _verb(verbs, "ledger", None, "show or prune the idempotency ledger")
    options = _options(_ledger_options)
    actions = ledger.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)
    prune = _verb(
        actions, "prune", options, "delete finished rows older than --older-than", _cmd_ledger_prune
    )
    prune.add_argument(
        "--older-than",
        metavar="DURATION",
        type=_duration_arg,
        required=True,
        help="e.g. 30d, 12h, 15m, 90s (a bare number is seconds)",
    )
    show = _verb(actions, "show", options, "show a key's ledger row", _cmd_ledger_show)
    show.add_argument("key", metavar="KEY", help="the idempotency key")
    _json(show)
    list_ = _verb(
        actions, "list", options, "count rows by state and list the most recent of some", _cmd_ledger_list
    )
    list_.add_argument(
        "--state",
        action="append",
        choices=["in_progress", "completed", "failed"],
        help="list rows of this state (repeatable; default: in_progress and failed)",
    )
    list_.add_argument(
        "--limit", metavar="N", type=_limit_arg, default=50, help="rows per state (default: 50)"
    )
    _json(list_)


# -- running ------------------------------------------------------------------


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
        from redis.exceptions import NoPermissionError, RedisError

        from dramatiq_guard.errors import BackendRefused, BackendUnavailable

        if isinstance(e, (BackendRefused, NoPermissionError)):  # reached, but this user may not
            said = e if isinstance(e, BackendRefused) else f"refused: {e}"
            print(f"{PROG}: error: Redis at {_redacted(ctx.redis_url)}: {said}", file=sys.stderr)
            return 1
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
