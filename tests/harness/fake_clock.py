"""A wall clock that a test sets, shared by a private ``redis-server`` and the in-memory backend.

The guard's backends read the wall clock of the server (Redis ``TIME``, in
Lua too) or of the process (:class:`~dramatiq_guard.backends.MemoryBackend`'s
``clock``). To make a lease or a reservation lapse without sleeping, a test
starts its own ``redis-server`` under libfaketime (Debian's ``libfaketime``
package) reading a *frozen* time from a file, and moves that time forward by
rewriting the file; the memory backend is given :meth:`FakeClock.ns`, which
reads the same time. Both backends then see exactly the same microsecond, so
their deadlines agree to the millisecond.

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

import datetime
import glob
import os
import tempfile
from pathlib import Path

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


def _find(patterns: tuple[str, ...]) -> str | None:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def libfaketime() -> str | None:
    """The path of libfaketime, or None if it is not installed (``apt-get install libfaketime``)."""
    return _find(LIBFAKETIME_GLOBS)


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
