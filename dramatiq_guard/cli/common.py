"""What every command of ``dramatiq-guard`` shares: constants, errors, argument types, the context."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, TextIO

from dramatiq_guard.resolve import DEFAULT_REDIS_URL, REDIS_URL_ENV, open_backend

if TYPE_CHECKING:
    from dramatiq_guard.backends.redis import RedisBackend

PROG = "dramatiq-guard"
DEFAULT_NAMESPACE = "dramatiq-guard"
LEDGER_URL_ENV = "DRAMATIQ_GUARD_LEDGER_URL"


class UsageError(Exception):
    """A bad argument value found after parsing (exit status 2)."""


class OperationalError(Exception):
    """The command could not do its work (exit status 1)."""


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
