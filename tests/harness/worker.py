"""A real ``dramatiq`` CLI worker in a subprocess, watched through its log.

Readiness and exits are detected from the CLI's own log lines, read by a
thread as they are written (no polling, no cooperation needed from the actor
module, works for any broker):

* ``[PID n] ... [dramatiq.WorkerProcess(i)] [INFO] Worker process is ready for action.``
  once per worker process: :meth:`DramatiqWorker.wait_ready` returns when all
  ``processes`` have logged it, and the ``n`` are :attr:`DramatiqWorker.worker_pids`;
* ``Worker with PID n exited unexpectedly (code c)``: logged by the CLI's main
  process when a worker process dies; the CLI then stops the other worker
  processes and exits with status 1 (that is Dramatiq's behaviour: one dead
  worker process takes the whole worker down). Recorded in
  :attr:`DramatiqWorker.unexpected_exits` when it appears, but never waited
  for: the CLI can lose it. Its main process logs through a pipe read by a
  log-watcher thread, which stops as soon as the main process sets its stop
  event, without draining the pipes; and a worker's closed pipe aborts the
  watcher's pass over the ready pipes. When nothing else has to shut down
  (one worker process, or an idle second one), the main process logs the
  line, sets the event and exits before the watcher reads it.
  :meth:`DramatiqWorker.kill_worker` therefore waits on the process itself.

The worker runs in its own session (process group), so :meth:`DramatiqWorker.stop`
can always reap every process it started: SIGTERM to the main process (the
CLI forwards it; in-flight actors get ``shutdown_timeout_ms``), then SIGKILL
to the whole group after ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from .waiting import WaitTimeout

READY_RE = re.compile(
    r"\[PID (?P<pid>\d+)\] \[[^\]]*\] \[dramatiq\.WorkerProcess\((?P<index>\d+)\)\] \[INFO\] "
    r"Worker process is ready for action\."
)
UNEXPECTED_EXIT_RE = re.compile(r"Worker with PID (?P<pid>\d+) exited unexpectedly \(code (?P<code>-?\d+)\)")


class WorkerFailed(AssertionError):
    """The worker did not boot, or died; the message carries its log."""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a killed child not yet reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in {"Z", "X"}


@contextlib.contextmanager
def _watch_pid(pid: int) -> Iterator[Callable[[float], bool]]:
    """Watch ``pid`` from before it is signalled; yield ``wait_dead(timeout) -> bool``.

    A pidfd (Linux >= 5.3) is opened first, so the wait is woken by the exit
    itself and cannot be fooled by a reused pid; it becomes readable when the
    process exits, whether or not its parent has reaped it yet. Without
    pidfds, :func:`pid_alive` is polled (a zombie counts as dead).
    """
    fd: int | None = None
    with contextlib.suppress(AttributeError, OSError):  # no pidfd_open, or the pid is gone
        fd = os.pidfd_open(pid)

    def wait_dead(timeout: float) -> bool:
        if fd is not None:
            readable, _, _ = select.select([fd], [], [], max(timeout, 0.0))
            return bool(readable)
        deadline = time.monotonic() + timeout
        pause = 0.001
        while pid_alive(pid):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.1)
        return True

    try:
        yield wait_dead
    finally:
        if fd is not None:
            os.close(fd)


class DramatiqWorker:
    """``python -m dramatiq <modules> --processes N --threads M`` in a subprocess.

    Parameters:
      modules: The broker module (``module`` or ``module:broker``), then any
        further modules to import, exactly as the CLI takes them.
      processes, threads: The CLI's ``--processes`` and ``--threads``.
      env: The complete environment of the subprocess (default: this process's).
      queues: The CLI's ``--queues`` (default: all).
      extra_args: More CLI arguments.
      shutdown_timeout_ms: The CLI's ``--worker-shutdown-timeout`` (default 5 s,
        not the CLI's 10 minutes).
      cwd: The subprocess's working directory.

    Attributes:
      worker_pids: The worker processes' pids, in worker index order (filled by :meth:`wait_ready`).
      unexpected_exits: ``(pid, code)`` for each worker process the CLI saw die unexpectedly.
    """

    def __init__(
        self,
        modules: str | Sequence[str],
        *,
        processes: int = 1,
        threads: int = 1,
        env: Mapping[str, str] | None = None,
        queues: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        shutdown_timeout_ms: int = 5000,
        cwd: str | Path | None = None,
    ) -> None:
        self.modules = [modules] if isinstance(modules, str) else list(modules)
        self.processes = processes
        self.threads = threads
        self.env = dict(os.environ if env is None else env)
        self.queues = list(queues) if queues else None
        self.extra_args = list(extra_args)
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self.cwd = str(cwd) if cwd is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.worker_pids: list[int] = []
        self.unexpected_exits: list[tuple[int, int]] = []
        self._lines: list[str] = []
        self._ready: dict[int, int] = {}
        self._cond = threading.Condition()
        self._eof = False
        self._reader: threading.Thread | None = None
        self._terminated = False

    @property
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "dramatiq", *self.modules]
        cmd += ["--processes", str(self.processes), "--threads", str(self.threads)]
        cmd += ["--worker-shutdown-timeout", str(self.shutdown_timeout_ms)]
        if self.queues:
            cmd += ["--queues", *self.queues]
        return cmd + self.extra_args

    @property
    def pid(self) -> int:
        """The CLI's main process."""
        assert self.proc is not None, "worker not started"
        return self.proc.pid

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> DramatiqWorker:
        """Spawn the CLI (returns at once; see :meth:`wait_ready`)."""
        assert self.proc is None, "worker already started"
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(
            target=self._read, name=f"dramatiq-worker-log-{self.pid}", daemon=True
        )
        self._reader.start()
        return self

    def wait_ready(self, timeout: float = 60.0) -> list[int]:
        """Wait until every worker process logged that it is ready; return their pids.

        Raises:
          WorkerFailed: The CLI exited first, or ``timeout`` passed; with the log.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._ready) < self.processes:
                if self._eof:
                    raise WorkerFailed(f"dramatiq worker exited before it was ready:\n{self.log}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerFailed(
                        f"dramatiq worker not ready after {timeout:g}s "
                        f"({len(self._ready)}/{self.processes} processes):\n{self.log}"
                    )
                self._cond.wait(remaining)
            self.worker_pids = [self._ready[i] for i in sorted(self._ready)]
        return list(self.worker_pids)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the CLI's main process to exit; return its status.

        Raises:
          WaitTimeout: Still running after ``timeout`` seconds.
        """
        assert self.proc is not None, "worker not started"
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise WaitTimeout(f"dramatiq worker still running after {timeout:g}s") from None

    def kill_worker(self, pid: int | None = None, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int:
        """Send ``sig`` (default SIGKILL) to one worker process and wait until it is dead.

        ``pid`` defaults to the first worker process. Waits on the process
        itself (a pidfd, else ``/proc``), not on the CLI's "exited
        unexpectedly" log line: the CLI may never write that line (see the
        module docstring). The CLI then stops the other worker processes and
        exits. Returns the pid.

        Raises:
          WaitTimeout: The process is still alive after ``timeout`` seconds.
        """
        if pid is None:
            pid = (self.worker_pids or self.wait_ready())[0]
        with _watch_pid(pid) as wait_dead:
            os.kill(pid, sig)
            if not wait_dead(timeout):
                raise WaitTimeout(f"worker process {pid} alive {timeout:g}s after signal {sig}:\n{self.log}")
        return pid

    def terminate(self) -> None:
        """Ask the CLI to stop gracefully (SIGTERM, once) without waiting; :meth:`stop` waits.

        Lets several workers shut down side by side (the ``dramatiq_worker`` fixture's teardown).
        A second SIGTERM would make dramatiq's worker processes exit at once, so it is sent once.
        """
        if self.proc is None or self._terminated or self.proc.poll() is not None:
            return
        self._terminated = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Stop gracefully (SIGTERM), then SIGKILL the whole process group after ``timeout``.

        Returns the main process's exit status (None if it was never started).
        Idempotent.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._killpg()
                self.proc.wait(10)
        # Worker processes orphaned by a dead main process must not outlive the test.
        self._killpg()
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode

    def _killpg(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> DramatiqWorker:
        if self.proc is None:
            self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- the log --------------------------------------------------------------------------

    @property
    def log(self) -> str:
        """Everything the CLI wrote so far (stdout and stderr, all processes)."""
        with self._cond:
            return "".join(self._lines)

    def wait_for_log(self, pattern: str, timeout: float = 30.0, *, start: int = 0) -> re.Match[str]:
        """Wait until a log line matches the regex ``pattern``; return the match.

        ``start`` skips the first lines (use ``len(worker.log_lines())`` to wait only
        for new ones).

        Raises:
          WaitTimeout: No such line within ``timeout`` seconds (or the log ended).
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        index = start
        with self._cond:
            while True:
                while index < len(self._lines):
                    match = regex.search(self._lines[index])
                    index += 1
                    if match:
                        return match
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    why = "the worker's log ended" if self._eof else f"{timeout:g}s passed"
                    raise WaitTimeout(f"no log line matching {pattern!r} ({why}):\n{''.join(self._lines)}")
                self._cond.wait(remaining)

    def log_lines(self) -> list[str]:
        with self._cond:
            return list(self._lines)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            with self._cond:
                self._lines.append(line)
                if match := READY_RE.search(line):
                    self._ready[int(match["index"])] = int(match["pid"])
                elif match := UNEXPECTED_EXIT_RE.search(line):
                    self.unexpected_exits.append((int(match["pid"]), int(match["code"])))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()
        self.proc.stdout.close()
