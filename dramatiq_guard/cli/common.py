"""What every command of ``dramatiq-guard`` shares: constants, errors, argument types, the context."""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING, Any, TextIO

from dramatiq_guard.admin import parse_limit
from dramatiq_guard.bounds import MAX_COUNT, MAX_RETENTION_MS
from dramatiq_guard.resolve import DEFAULT_REDIS_URL, REDIS_URL_ENV, open_backend

if TYPE_CHECKING:
    from dramatiq_guard.backends.redis import RedisBackend

PROG = "dramatiq-guard"
DEFAULT_NAMESPACE = "dramatiq-guard"
LEDGER_URL_ENV = "DRAMATIQ_GUARD_LEDGER_URL"

_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


class UsageError(Exception):
    """A bad argument value found after parsing (exit status 2)."""


class OperationalError(Exception):
    """The command could not do its work (exit status 1)."""


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


class Context:
    """What a command runs with: the parsed arguments, the streams, the backend (made on first use)."""

    def __init__(self, args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self._backend: RedisBackend | None = None
        self.ledger: Any = None
        self.ledger_url: str | None = None

    @property
    def redis_url(self) -> str:
        url: str | None = getattr(self.args, "redis", None)
        return url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL

    @property
    def backend(self) -> RedisBackend:
        if self._backend is None:
            namespace = getattr(self.args, "namespace", None) or DEFAULT_NAMESPACE
            try:
                backend = open_backend(self.redis_url, namespace)
            except ValueError as e:
                raise UsageError(f"bad Redis URL or namespace: {e}") from None
            from dramatiq_guard.backends.redis_health import check_layout
            from dramatiq_guard.errors import BackendRefused, LayoutTooNew

            try:  # state of a newer version would be misread (and nothing is recorded: a read)
                check_layout(backend, record=False)
            except LayoutTooNew as e:
                backend.close()
                raise OperationalError(str(e)) from None
            except BackendRefused:
                pass  # a user of another namespace (functions load): each call is refused if it may not
            self._backend = backend
        return self._backend

    def print(self, text: str = "") -> None:
        print(text, file=self.stdout)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        if self.ledger is not None:
            self.ledger.dispose()
