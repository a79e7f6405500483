"""The ``dramatiq-guard`` command: see and steer what the guard holds (docs/command.md).

Exit status: 0 success, 1 operational error, 2 usage error; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from dramatiq_guard.admin import parse_limit
from dramatiq_guard.bounds import MAX_COUNT, MAX_RETENTION_MS
from dramatiq_guard.cli import commands as c
from dramatiq_guard.cli.common import (
    DEFAULT_NAMESPACE,
    LEDGER_URL_ENV,
    PROG,
    Context,
    OperationalError,
    UsageError,
)
from dramatiq_guard.resolve import DEFAULT_REDIS_URL, REDIS_URL_ENV

__all__ = ["REDIS_URL_ENV", "Context", "build_parser", "main", "parse_duration"]

# -- the parser ---------------------------------------------------------------

_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_duration(text: str) -> int:
    """A duration such as ``30d``, ``12h``, ``15m``, ``90s``, ``500ms`` (a bare number: seconds) in
    milliseconds; else a ValueError."""
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
    value = parse_limit(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"a limit must be an integer >= 0 and <= {MAX_COUNT}, got {text!r}")
    return value


Arg = tuple[list[str], dict[str, Any]]
#: A verb: its name, help, what runs it (or its actions), its arguments, the parser's other keywords.
Verb = tuple[str, str, Any, list[Arg], dict[str, Any]]


def _arg(spec: str, help: str, **kw: Any) -> Arg:
    """An argument of ``"--flag METAVAR"`` or ``"dest METAVAR"`` (a last word in capitals: the metavar)."""
    names = spec.split()
    if len(names) > 1 and names[-1].isupper():
        kw.setdefault("metavar", names.pop())
    return names, {"help": help, **kw}


def _switch(spec: str, help: str) -> Arg:
    return _arg(spec, help, action="store_true")


def _verb(name: str, help: str, run: Any, *arguments: Arg, **kw: Any) -> Verb:
    return name, help, run, list(arguments), kw


BROKER = _arg(
    "--broker MODULE:ATTR",
    "your app's broker (e.g. myapp.tasks:broker), to re-enqueue parked messages that get a slot",
)


JSON = _switch("--json", "print JSON")
KEY = _arg("target KEY", "the guard key (omit with --actor)", nargs="?")
CONNECTION = [
    _arg("--redis URL", f"the guard's Redis (default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL})"),
    _arg("--namespace NS", f"the prefix of the guard's Redis keys (default: {DEFAULT_NAMESPACE})"),
]
LEDGER = [
    _arg(
        "--ledger URL",
        f"the ledger's SQLAlchemy URL (default: ${LEDGER_URL_ENV}, else the default SQLite file)",
    ),
    _arg("--table NAME", "the ledger's table (default: %(default)s)", default="dramatiq_guard_ledger"),
    _arg("--schema NAME", "the table's schema, if not the default", default=None),
]
LIMIT_USAGE = f"""{PROG} limit set [-h] [--redis URL] [--namespace NS] [--broker MODULE:ATTR]
       (KEY N | --actor NAME N)"""


def _actor(what: str) -> Arg:
    return _arg("--actor NAME", f"{what} of this actor's keys")


VERBS = [
    _verb(
        "inspect",
        "show holders, waiters and limits of guard keys",
        c._cmd_inspect,
        _arg("pattern PATTERN", "a key or a glob (default: *)", nargs="?", default="*"),
        _switch("--json", "print JSON instead of a table"),
        _switch("--summary", "one line per key, most in need of a look first"),
        _arg("--waiters N", "describe each key's first N waiters (default: 10)", type=_limit_arg, default=10),
        description="Show each guard key's holders, waiters and limit. Keys come from the guard's indexes "
        "(keys with waiters or a run-time limit); a PATTERN without wildcards also shows that key.",
    ),
    _verb(
        "limit",
        "get, set or clear run-time limits",
        [
            _verb(
                "get",
                "print a key's (or an actor's) run-time limit",
                c._cmd_limit_get,
                KEY,
                _actor("print the default limit"),
                JSON,
            ),
            _verb(
                "set",
                "set a key's (or an actor's) run-time limit",
                c._cmd_limit_set,
                KEY,
                _arg("limit N", "the limit, an integer >= 0", type=_limit_arg),
                _actor("set the default limit"),
                BROKER,
                usage=LIMIT_USAGE,
                description="Set KEY's run-time limit to N (0 halts it: new messages park, running ones "
                "finish), or with --actor, the default limit of actor NAME's keys.",
            ),
            _verb(
                "clear",
                "remove a key's (or an actor's) run-time limit",
                c._cmd_limit_clear,
                KEY,
                _actor("clear the default limit"),
            ),
        ],
    ),
    _verb(
        "release",
        "force the release of a key's holders",
        c._cmd_release,
        _arg("key KEY", "the guard key"),
        _switch("-y --yes", "do not ask for confirmation"),
        BROKER,
        description="Release every holder of KEY by force (unconfirmed hand-offs excepted) and hand the "
        "freed slots to its oldest waiters. Asks for confirmation unless --yes.",
    ),
    _verb(
        "functions",
        "list, load or prune the guard's Redis function libraries",
        [
            _verb(
                "list",
                "the libraries on the server, and the workers that run them",
                c._cmd_functions_list,
                JSON,
            ),
            _verb("load", "load this version's library (FUNCTION LOAD REPLACE)", c._cmd_functions_load),
            _verb(
                "prune",
                "delete other versions' libraries, unless a worker still runs one",
                c._cmd_functions_prune,
                _switch("--force", "delete them even while workers still run them"),
            ),
        ],
        description="The guard's scripts are one Redis function library per version (on a Redis Cluster, "
        "run this against each primary).",
    ),
    _verb(
        "ledger",
        "show or prune the idempotency ledger",
        [
            _verb(
                "prune",
                "delete finished rows older than --older-than",
                c._cmd_ledger_prune,
                _arg(
                    "--older-than DURATION",
                    "e.g. 30d, 12h, 15m, 90s (a bare number is seconds)",
                    type=_duration_arg,
                    required=True,
                ),
            ),
            _verb(
                "show",
                "show a key's ledger row",
                c._cmd_ledger_show,
                _arg("key KEY", "the idempotency key"),
                JSON,
            ),
            _verb(
                "list",
                "count rows by state and list the most recent of some",
                c._cmd_ledger_list,
                _arg(
                    "--state",
                    "list rows of this state (repeatable; default: in_progress and failed)",
                    action="append",
                    choices=["in_progress", "completed", "failed"],
                ),
                _arg("--limit N", "rows per state (default: 50)", type=_limit_arg, default=50),
                JSON,
            ),
        ],
    ),
    _verb(
        "serve",
        "serve the web dashboard (needs the web extra)",
        c._cmd_serve,
        _arg("--host", "the address to bind (default: %(default)s)", default="127.0.0.1"),
        _arg("--port", "the port to bind (default: the dashboard's, 8470)", type=int, default=None),
        BROKER,
        _arg(
            "--write-secret-file PATH",
            f"allow changes to a browser that gives the secret in this file (default: ${c.WRITE_SECRET_ENV})",
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
    ),
]


def _add(group: Any, arguments: list[Arg]) -> Any:
    for names, kw in arguments:
        group.add_argument(*names, **kw)
    return group


def _add_verbs(parser: argparse.ArgumentParser, dest: str, verbs: list[Verb], *parents: Any) -> None:
    """Add ``verbs``; their options (connection, or the ledger's) are accepted after them too."""
    common, ledger = parents
    metavar = "COMMAND" if dest == "command" else "ACTION"
    actions = parser.add_subparsers(dest=dest, metavar=metavar, required=True)
    for name, text, run, arguments, kw in verbs:
        parent = ledger if dest == "ledger_command" else [] if name == "ledger" else common
        verb = _add(actions.add_parser(name, parents=parent, help=text, **kw), arguments)
        if isinstance(run, list):
            _add_verbs(verb, f"{name}_command", run, *parents)
        else:
            verb.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See and steer dramatiq-guard's state: guard keys (found through the guard's indexes, "
        "never by scanning Redis) and the idempotency ledger.",
        epilog="Exit status: 0 ok, 1 operational error, 2 usage error.",
    )
    _add(parser.add_argument_group("connection"), CONNECTION)
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    ledger = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _add(common.add_argument_group("connection"), CONNECTION)
    _add(ledger, LEDGER)
    _add_verbs(parser, "command", VERBS, [common], [ledger])
    return parser


# -- running ------------------------------------------------------------------


def main(
    argv: Sequence[str] | None = None, *, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> int:
    """Run the command on ``argv`` (default: ``sys.argv[1:]``), confirmations read from ``stdin`` and
    output written to ``stdout`` (default: the process's); returns its exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    ctx = Context(args, stdin or sys.stdin, stdout or sys.stdout)
    try:
        run: Callable[[Context], int] = args.run
        return run(ctx)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 1
    except Exception as e:
        failure = _failure(e, ctx)
        if failure is None:
            raise
        print(f"{PROG}: error: {failure[1]}", file=sys.stderr)
        return failure[0]
    finally:
        ctx.close()


def _failure(e: Exception, ctx: Context) -> tuple[int, str] | None:
    """The exit status and the one line of an error the command reports, else None (a bug: raised)."""
    from redis.exceptions import NoPermissionError, RedisError

    from dramatiq_guard.errors import BackendRefused, BackendUnavailable

    if isinstance(e, (UsageError, OperationalError)):
        return 2 if isinstance(e, UsageError) else 1, str(e)
    if isinstance(e, (BackendRefused, NoPermissionError)):  # reached, but this user may not
        said = e if isinstance(e, BackendRefused) else f"refused: {e}"
        return 1, f"Redis at {_redacted(ctx.redis_url)}: {said}"
    if isinstance(e, (BackendUnavailable, RedisError)):
        return 1, f"cannot reach Redis at {_redacted(ctx.redis_url)}: {e}"
    import sqlalchemy as sa

    if isinstance(e, sa.exc.SQLAlchemyError) and ctx.ledger_url is not None:
        return 1, f"the ledger at {ctx.ledger_url}: {str(getattr(e, 'orig', None) or e).splitlines()[0]}"
    return None


def _redacted(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)
