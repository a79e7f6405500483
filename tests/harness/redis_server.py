"""A private ``redis-server`` on a free loopback port, that a test may stop and restart.

The session's Redis (``redis_url``) is shared by every test of a run and must
never go away; a test that needs Redis to become unreachable (fail-closed
behaviour) or to restart uses its own :class:`RedisServer` (the
``private_redis`` fixture), and the bench uses one too.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

#: The ``redis-server`` (or ``valkey-server``) the tests start, if not the one on PATH; the
#: version matrix (``noxfile.py``) runs the same tests on other servers through it.
REDIS_SERVER_ENV = "DRAMATIQ_GUARD_TEST_REDIS_SERVER"


def redis_server_executable() -> str | None:
    """The server executable the tests start: ``$DRAMATIQ_GUARD_TEST_REDIS_SERVER``, else None."""
    return os.environ.get(REDIS_SERVER_ENV) or None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """``redis-server`` without persistence, on ``port`` (default: a free one).

    Keyspace notifications are on (``KA``) so :func:`harness.wait_until` can be
    woken by key changes. :meth:`stop` keeps the port, so :meth:`start` brings
    the same URL back (empty). ``args`` are more ``redis-server`` options, after
    the defaults (so they override them), e.g. ``("--maxmemory-policy", "allkeys-lru")``;
    ``env`` more environment variables for the server (e.g. :meth:`harness.FakeClock.server_env`).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        found = executable or redis_server_executable() or shutil.which("redis-server")
        if found is None:
            raise RuntimeError(
                f"redis-server is not on PATH (apt-get install redis-server) and ${REDIS_SERVER_ENV} is unset"
            )
        self.executable = found
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = tuple(args)
        self.env = dict(env or {})
        self._dir = Path(tempfile.mkdtemp(prefix="dramatiq-guard-redis-"))

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    def version(self) -> str:
        with self.client() as client:
            return str(client.info("server")["redis_version"])

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers; a taken port is retried on another (a few times)."""
        for attempt in range(5):
            self._spawn()
            try:
                self._wait_up(timeout)
                return self
            except RuntimeError:
                self.stop()
                if attempt == 4:
                    raise
                self.port = free_port()
        return self

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.executable,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self._dir),
                "--notify-keyspace-events", "KA",
                "--loglevel", "warning",
                *self.args,
            ],
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def _wait_up(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            if self.proc.poll() is not None:
                output = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"redis-server exited (status {self.proc.returncode}): {output}")
            try:
                with self.client(socket_connect_timeout=1) as client:
                    pid = int(client.info("server")["process_id"])
                if pid != self.proc.pid:  # someone else's server answered on that port
                    raise RuntimeError(f"port {self.port} is taken by another redis-server (pid {pid})")
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(pause)  # startup has no event to wait on; bounded back-off
                pause = min(pause * 2, 0.1)

    def stop(self) -> None:
        """Kill the server (SIGKILL: abrupt, like a crash). Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
