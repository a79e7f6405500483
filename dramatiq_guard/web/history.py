"""What the dashboard remembers in this process: its charts' samples and the failed unlocks.

Both are rings per name (a key, a client address), bounded whatever readers ask
for: at most ``size`` entries per name and ``max_names`` names, the least
recently written forgotten.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

Sample = tuple[float, int, int]
T = TypeVar("T")


class Rings(Generic[T]):
    """Per name, the last ``size`` entries, for the ``max_names`` names most recently written."""

    def __init__(self, size: int, max_names: int, clock: Callable[[], float]) -> None:
        self.size = size
        self.max_names = max_names
        self.clock = clock
        self._rings: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _add(self, name: str, entry: T) -> None:
        """Append ``entry`` to ``name``'s ring (made if new); the lock held."""
        ring = self._rings.get(name)
        if ring is None:
            ring = self._rings[name] = collections.deque(maxlen=self.size)
        ring.append(entry)
        self._rings.move_to_end(name)
        while len(self._rings) > self.max_names:
            self._rings.popitem(last=False)

    def of(self, name: str) -> list[T]:
        """The entries of ``name``, oldest first."""
        with self._lock:
            return list(self._rings.get(name, ()))

    def __len__(self) -> int:
        """How many names are remembered."""
        with self._lock:
            return len(self._rings)


class History(Rings[Sample]):
    """Per key, the last ``size`` samples of (time, holders, waiters), sampled when a page reads it.

    Parameters:
      size(int): Samples kept per key (default 120: 10 minutes at one per 5 s).
      interval_s(float): At most one sample per key per this many seconds.
      max_keys(int): Keys remembered at most (default 2,000, 40 pages of the overview).
      clock(Callable[[], float]): The clock (``time.monotonic``).
    """

    def __init__(
        self,
        *,
        size: int = 120,
        interval_s: float = 5.0,
        max_keys: int = 2_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(size, max_keys, clock)
        self.interval_s = interval_s

    def record(self, rows: Iterable[tuple[str, int, int]]) -> None:
        """Sample ``(key, holders, waiters)`` rows (skipping keys sampled less than ``interval_s`` ago).

        A row of a key not remembered yet, with neither holders nor waiters, is skipped.
        """
        now = self.clock()
        with self._lock:
            for key, holders, waiters in rows:
                ring = self._rings.get(key)
                if (not ring and not (holders or waiters)) or (ring and now - ring[-1][0] < self.interval_s):
                    continue
                self._add(key, (now, holders, waiters))


class UnlockLimit(Rings[float]):
    """How often a client may guess the write secret: failed unlocks per client address (``REMOTE_ADDR``).

    Past ``failures`` within ``window_s``, its unlocks get a 429 (the secret not compared).

    Parameters:
      failures(int): Wrong secrets a client may give within ``window_s``.
      window_s(float): The sliding window, in seconds.
      max_clients(int): Client addresses remembered at most.
      clock(Callable[[], float]): The clock, in seconds (``time.monotonic``).

    Raises:
      ValueError: If a number is not positive.
    """

    def __init__(
        self,
        *,
        failures: int = 5,
        window_s: float = 60.0,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("failures", failures), ("window_s", window_s), ("max_clients", max_clients)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"UnlockLimit's {name} must be a positive number, got {value!r}")
        super().__init__(int(failures), int(max_clients), clock)
        self.window_s = float(window_s)

    def retry_after(self, client: str) -> int:
        """Seconds until ``client`` may try again (rounded up), or 0 if it may try now."""
        times = self.of(client)
        wait = times[0] + self.window_s - self.clock() if len(times) >= self.size else 0
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, client: str) -> None:
        """Count a wrong secret from ``client``."""
        with self._lock:
            self._add(client, self.clock())

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures: it gave the right secret."""
        with self._lock:
            self._rings.pop(client, None)


def sparkline(samples: list[Sample], *, width: int = 120, height: int = 24) -> dict[str, str] | None:
    """SVG polyline points for holders and waiters (numbers only), or None with fewer than 2 samples."""
    if len(samples) < 2:
        return None
    start, end = samples[0][0], samples[-1][0]
    span = max(end - start, 1e-9)
    top = max(1, max(max(h, w) for _, h, w in samples))

    def points(index: int) -> str:
        return " ".join(
            f"{(s[0] - start) / span * width:.1f},{height - 1 - s[index] / top * (height - 2):.1f}"
            for s in samples
        )

    return {"holders": points(1), "waiters": points(2), "max": str(top)}
