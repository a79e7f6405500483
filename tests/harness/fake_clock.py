"""A wall clock that a test sets, shared by a private ``redis-server``, fakeredis and the model's oracle.

The guard's backends read the wall clock of the server (Redis ``TIME``, in
Lua too). To make a lease or a reservation lapse without sleeping, a test
starts its own ``redis-server`` under libfaketime (Debian's ``libfaketime``
package) reading a *frozen* time from a file, and moves that time forward by
rewriting the file. The in-memory backend's server is fakeredis, in this
process: :func:`fakeredis_clock` makes it read the same time (see there), and
the model test's oracle is given :meth:`FakeClock.ns`. Every backend then sees
exactly the same microsecond, so their deadlines agree to the millisecond.

How the server is started (:meth:`FakeClock.server_env`):

* ``FAKETIME_TIMESTAMP_FILE`` + ``FAKETIME_NO_CACHE=1``: the time is read from
  the file at every call, so a rewrite takes effect on the next command. The
  file holds an absolute UTC time (``TZ=UTC``): frozen, not ticking.
* ``FAKETIME_DONT_FAKE_MONOTONIC=1``: the server's event loop (its timers)
  keeps the real monotonic clock; only the wall clock (``TIME``, key
  expiry) is the test's.
* glibc's ``libc_malloc_debug.so.0`` is preloaded before libfaketime:
  Debian's ``redis-server`` uses jemalloc, whose initialisation calls
  ``clock_gettime`` while libfaketime initialises (which allocates), and the
  two deadlock at start-up. With glibc's allocator in front (the debug
  library only forwards to it unless ``MALLOC_CHECK_`` is set), they do not.
  The server is otherwise the real one, running the real scripts.
* The file's time is ``<ms>.500500`` s: libfaketime parses the fraction as a
  double, so a whole millisecond could come out one microsecond short (and
  be the previous millisecond); half-way through it never does.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Where Debian (and most distributions) install the two libraries.
LIBFAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
)
MALLOC_SHIM_GLOBS = (
    "/lib/*/libc_malloc_debug.so.0",
    "/usr/lib/*/libc_malloc_debug.so.0",
    "/lib64/libc_malloc_debug.so.0",
    "/usr/lib64/libc_malloc_debug.so.0",
)
#: What the clock reads within its millisecond (see the module docstring).
SUB_MS_NS = 500_500


#: The modules of fakeredis that read the wall clock (``time.time``) for what the guard uses:
#: ``TIME`` (the scripts' clock, server_mixin) and each command's "now" (key expiry, and the
#: timeout of a blocking command: _socket/_base, which sets it on every database per command).
#: Each imports the ``time`` module and calls ``time.time()`` (fakeredis 2.41).
FAKEREDIS_CLOCK_MODULES = ("fakeredis.commands_mixins.server_mixin", "fakeredis._socket._base")


class _FrozenTime:
    """The :mod:`time` module, but for ``time()``, which reads a test's clock."""

    def __init__(self, now_s: Callable[[], float]) -> None:
        self._now_s = now_s

    def time(self) -> float:
        return self._now_s()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def fakeredis_clock(now_ms: Callable[[], int]) -> Iterator[None]:
    """Make every fakeredis server of this process run on ``now_ms`` (ms since the epoch), frozen.

    As a real ``redis-server`` under a :class:`FakeClock` would: ``TIME`` reads
    ``<ms>.000500`` s (:data:`SUB_MS_NS`, rounded to its microsecond, as Redis
    does), and key expiry compares with ``<ms>`` itself, so a key whose
    ``PEXPIREAT`` is that millisecond is not expired yet (Redis expires after
    it). A blocking command with a timeout never times out on a frozen clock:
    a test waits with a timeout of 0 (``wait_for_handoff(timeout_ms=0)`` pops).

    Raises:
      AttributeError: If fakeredis no longer reads ``time.time`` in these modules.
    """
    modules = [importlib.import_module(name) for name in FAKEREDIS_CLOCK_MODULES]
    clocks = {
        "fakeredis.commands_mixins.server_mixin": _FrozenTime(
            lambda: (now_ms() * 1000 + SUB_MS_NS // 1000) / 1e6
        ),
        "fakeredis._socket._base": _FrozenTime(lambda: now_ms() / 1000),
    }
    originals = {module: module.time for module in modules}  # AttributeError if fakeredis changed
    try:
        for module in modules:
            module.time = clocks[module.__name__]  # type: ignore[attr-defined]
        yield
    finally:
        for module, original in originals.items():
            module.time = original  # type: ignore[attr-defined]


def _find(patterns: tuple[str, ...]) -> str | None:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def libfaketime() -> str | None:
    """The path of libfaketime, or None if it is not installed (``apt-get install libfaketime``)."""
    return _find(LIBFAKETIME_GLOBS)


class SettableClock:
    """A clock in whole milliseconds moved only by :meth:`advance`, for the in-memory backend alone
    (through :func:`fakeredis_clock`) where libfaketime is not installed: no server reads it."""

    def __init__(self, start_ms: int) -> None:
        self.now_ms = start_ms

    def advance(self, ms: int) -> None:
        """Move the time forward by ``ms``."""
        self.now_ms += ms

    def ns(self) -> int:
        """The time in ns since the epoch, as :meth:`FakeClock.ns` gives it."""
        return self.now_ms * 1_000_000 + SUB_MS_NS


class FakeClock:
    """A frozen wall clock in whole milliseconds, moved only by :meth:`advance`.

    Parameters:
      start_ms(int): The time it starts at, in ms since the epoch.

    Raises:
      RuntimeError: If libfaketime is not installed.
    """

    def __init__(self, start_ms: int) -> None:
        library = libfaketime()
        if library is None:
            raise RuntimeError("libfaketime is not installed (apt-get install libfaketime)")
        shim = _find(MALLOC_SHIM_GLOBS)
        self.preload = f"{shim}:{library}" if shim else library
        self._dir = Path(tempfile.mkdtemp(prefix="dramatiq-guard-clock-"))
        self.path = self._dir / "faketime"
        self._ms = 0
        self.set(start_ms)

    @property
    def now_ms(self) -> int:
        """The time, in ms since the epoch."""
        return self._ms

    def ns(self) -> int:
        """The time in ns since the epoch, as the server reads it (a ``clock`` for ``MemoryBackend``)."""
        return self._ms * 1_000_000 + SUB_MS_NS

    def set(self, ms: int) -> None:
        """Set the time; it never goes back (a server's expiries and tokens assume so).

        Raises:
          ValueError: If ``ms`` is before the current time.
        """
        if ms < self._ms:
            raise ValueError(f"the clock does not go back ({ms} < {self._ms})")
        self._ms = ms
        moment = datetime.datetime.fromtimestamp(ms // 1000, tz=datetime.timezone.utc)
        text = f"{moment:%Y-%m-%d %H:%M:%S}.{ms % 1000:03d}{SUB_MS_NS // 1000:03d}{SUB_MS_NS % 1000:03d}\n"
        partial = self._dir / "faketime.new"
        partial.write_text(text)
        os.replace(partial, self.path)  # atomic: the server never reads half a file

    def advance(self, ms: int) -> None:
        """Move the time forward by ``ms``."""
        self.set(self._ms + ms)

    def server_env(self) -> dict[str, str]:
        """The environment that makes a ``redis-server`` read this clock (see the module docstring)."""
        return {
            "LD_PRELOAD": self.preload,
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "TZ": "UTC",
        }

    def close(self) -> None:
        """Remove the clock's file."""
        for name in ("faketime", "faketime.new"):
            (self._dir / name).unlink(missing_ok=True)
        self._dir.rmdir()


@contextlib.contextmanager
def model_clock(start_ms: int) -> Iterator[FakeClock | SettableClock]:
    """A model test's clock from ``start_ms``: a :class:`FakeClock` where libfaketime is installed
    (servers can read it), else a :class:`SettableClock` (the in-memory backend alone)."""
    if libfaketime() is None:
        yield SettableClock(start_ms)
        return
    clock = FakeClock(start_ms)
    try:
        yield clock
    finally:
        clock.close()
