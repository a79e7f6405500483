"""``dramatiq-guard serve`` in a process of its own, for the dashboard's tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

from .redis_server import free_port


@contextlib.contextmanager
def serving(
    redis_url: str, args: Sequence[str] = (), *, env: Mapping[str, str | None] = {}
) -> Iterator[tuple[subprocess.Popen[str], int, str]]:
    """Run ``dramatiq-guard serve --port <free> *args`` on ``redis_url``: ``(process, port, first line)``.

    ``env``: environment variables to set, or to unset (None). On leaving, the
    process is stopped as by Ctrl-C (the command exits 0: checked), else killed.
    """
    port = free_port()
    environ = {**os.environ, "DRAMATIQ_GUARD_REDIS_URL": redis_url}
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_guard.cli", "serve", "--port", str(port), *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc, port, proc.stdout.readline()
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: waitress stops, the command exits 0
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
