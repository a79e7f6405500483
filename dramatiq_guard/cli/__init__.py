"""The ``dramatiq-guard`` command: see and steer what the guard holds.

Usage (``dramatiq-guard COMMAND --help`` for each)::

  dramatiq-guard [--redis URL] [--namespace NS] inspect [PATTERN] [--json]
  dramatiq-guard limit get KEY [--json]
  dramatiq-guard limit set KEY N [--broker MODULE:ATTR]
  dramatiq-guard limit set --actor NAME N
  dramatiq-guard limit clear KEY
  dramatiq-guard release KEY [--yes] [--broker MODULE:ATTR]
  dramatiq-guard functions list [--json] | load | prune [--force]
  dramatiq-guard ledger prune --older-than 30d [--ledger URL]
  dramatiq-guard ledger show KEY [--ledger URL] [--json]
  dramatiq-guard ledger list [--state S] [--ledger URL] [--json]
  dramatiq-guard serve [--host 127.0.0.1] [--port 8470] [--broker MODULE:ATTR] [--write-secret-file PATH]

Redis comes from ``--redis`` or ``DRAMATIQ_GUARD_REDIS_URL`` (default
``redis://localhost:6379/0``); the ledger's database from ``--ledger`` or
``DRAMATIQ_GUARD_LEDGER_URL``.

Finding keys. No command scans the keyspace (no ``KEYS``, no ``SCAN``):
``inspect`` lists the keys of the backend's own indexes (the keys that have or
recently had waiters, and the keys with a run-time limit) and, when the
pattern has no wildcard, the key it names. A key that only has holders and
never had a waiter is therefore shown when named exactly. ``inspect`` also
shows what the guard's Redis does with its keys: its ``maxmemory-policy``
(anything but ``noeviction`` may evict them) and its persistence (``"redis"``
in ``--json``; see :mod:`dramatiq_guard.backends.redis_health`).

Hand-offs. Raising a limit or releasing holders gives free slots to parked
waiters at once. A handed-off parked message must be put back on the broker,
and the command has no broker of its own, so either:

* with ``--broker MODULE:ATTR`` (your app's broker, e.g. ``myapp.tasks:broker``)
  it re-enqueues each handed-off message and confirms the hand-off; or
* without it, the command delivers nothing: a parked message stays parked
  (it records its application's broker, and only a process of that broker
  hands it a slot: a worker's sweep does, within its ``sweep_interval``); a
  waiter parked with no broker recorded is handed its slot and left
  *reserved* until the reservation lapses (10 s by default), when a worker's
  sweep hands it over again. Nothing is lost either way.

Forced release. ``release KEY`` releases each holder the key has at that
moment (each one checked by its id, so a holder that starts meanwhile is not
touched), except unconfirmed hand-offs: their payload is still the only copy
of the message, and they lapse by themselves. A released holder that is still
running learns it at its next lease renewal (its lease is lost). Freed slots
are handed to waiters within the limit recorded with the key's waiters (the
command does not know the actor, and never guesses its limit).

Exit status: 0 success, 1 operational error (Redis or the database
unreachable, a confirmation declined), 2 usage error (a bad option, URL, key
or duration); errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

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
    DEFAULT_REDIS_URL,
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
from dramatiq_guard.resolve import REDIS_URL_ENV

__all__ = ["REDIS_URL_ENV", "Context", "build_parser", "main", "parse_duration"]

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
            "slot; without it a worker's sweep hands them their slots"
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

    _add_inspect(commands, common)
    _add_limit(commands, common)
    _add_release(commands, common)
    _add_functions(commands, common)
    _add_ledger(commands, common)
    _serve_parser(commands, common)
    return parser


def _add_inspect(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``inspect`` command."""
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
    inspect.add_argument(
        "--summary",
        action="store_true",
        help="one line per key (holders, limit, waiters, oldest wait), most in need of a look first",
    )
    inspect.add_argument(
        "--waiters",
        metavar="N",
        type=_limit_arg,
        default=10,
        help="describe each key's first N waiters: actor, arguments, waited for (default: %(default)s)",
    )
    inspect.set_defaults(run=_cmd_inspect)


def _add_limit(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``limit get|set|clear`` commands."""
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


def _add_release(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``release`` command."""
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


def _add_functions(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``functions list|load|prune`` commands."""
    functions = commands.add_parser(
        "functions",
        parents=[common],
        help="list, load or prune the guard's Redis function libraries",
        description=(
            "The guard runs its scripts as functions of one Redis library per version of "
            "dramatiq-guard (dramatiq_guard_<digest>), loaded by its first call. List the libraries "
            "on the server and the workers that run them, load this version's (for applications whose "
            "ACL user may call functions but not load them), or delete other versions' once no worker "
            "runs them (a worker of --namespace records the library it runs). On a Redis Cluster, run "
            "it against each primary."
        ),
    )
    functions_actions = functions.add_subparsers(dest="functions_command", metavar="ACTION", required=True)
    functions_list = functions_actions.add_parser(
        "list", parents=[common], help="the dramatiq-guard libraries on the server, and who runs them"
    )
    functions_list.add_argument("--json", action="store_true", help="print JSON")
    functions_list.set_defaults(run=_cmd_functions_list)
    functions_actions.add_parser(
        "load", parents=[common], help="load this version's library (FUNCTION LOAD REPLACE)"
    ).set_defaults(run=_cmd_functions_load)
    functions_prune = functions_actions.add_parser(
        "prune",
        parents=[common],
        help="delete every dramatiq-guard library but this version's, unless a worker still runs one",
        description=(
            "Delete every dramatiq-guard library but this version's. Refused (exit status 2) while a "
            "worker of --namespace still runs one of them: a worker whose ACL user may not load "
            "functions would fail every call until an operator loads it again. A worker that died "
            "counts for up to a minute."
        ),
    )
    functions_prune.add_argument(
        "--force", action="store_true", help="delete them even while workers still run them"
    )
    functions_prune.set_defaults(run=_cmd_functions_prune)


def _ledger_options() -> argparse.ArgumentParser:
    """The options of every ``ledger`` action: which database and table."""
    options = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    options.add_argument(
        "--ledger",
        metavar="URL",
        help=f"the ledger's SQLAlchemy URL (default: ${LEDGER_URL_ENV}, else the default SQLite file)",
    )
    options.add_argument(
        "--table",
        metavar="NAME",
        default="dramatiq_guard_ledger",
        help="the ledger's table (default: %(default)s)",
    )
    options.add_argument(
        "--schema", metavar="NAME", default=None, help="the table's schema, if not the default"
    )
    return options


def _add_ledger(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``ledger prune|show|list`` commands."""
    ledger = commands.add_parser(
        "ledger",
        help="show or prune the idempotency ledger",
        description="Show or prune the rows of the SQL idempotency ledger.",
    )
    ledger_common = _ledger_options()
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
    list_ = ledgers.add_parser(
        "list",
        parents=[ledger_common],
        help="count rows by state and list the in-progress and failed ones",
        description=(
            "Count the ledger's rows by state, and list the most recently updated rows of some states "
            "(default: in_progress and failed)."
        ),
    )
    list_.add_argument(
        "--state",
        action="append",
        choices=["in_progress", "completed", "failed"],
        help="list rows of this state (repeatable)",
    )
    list_.add_argument(
        "--limit", metavar="N", type=_limit_arg, default=50, help="rows per state (default: 50)"
    )
    list_.add_argument("--json", action="store_true", help="print JSON")
    list_.set_defaults(run=_cmd_ledger_list)


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
