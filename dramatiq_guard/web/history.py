"""The dashboard's small charts: holders and waiters per key, since the page server started.

Kept in this process only: per key a ring of ``(time, holders, waiters)``,
sampled when a page reads the key, bounded whatever readers ask for (a key with
neither holders nor waiters starts no ring; at most ``max_keys`` rings).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

Sample = tuple[float, int, int]


class History:
    """Per key, the last ``size`` samples of (time, holders, waiters), in this process.

    Parameters:
      size(int): Samples kept per key (default 120: 10 minutes at one per 5 s).
      interval_s(float): At most one sample per key per this many seconds.
      max_keys(int): Keys remembered at most (default 2,000, 40 pages of the overview); the
        least recently sampled are forgotten.
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
        self.size = size
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self._samples: collections.OrderedDict[str, collections.deque[Sample]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, rows: Iterable[tuple[str, int, int]]) -> None:
        """Sample ``(key, holders, waiters)`` rows (skipping keys sampled less than ``interval_s`` ago).

        A row of a key not remembered yet, with neither holders nor waiters, is skipped.
        """
        now = self.clock()
        with self._lock:
            for key, holders, waiters in rows:
                ring = self._samples.get(key)
                if ring is None:
                    if not (holders or waiters):
                        continue
                    ring = self._samples[key] = collections.deque(maxlen=self.size)
                elif ring and now - ring[-1][0] < self.interval_s:
                    continue
                ring.append((now, holders, waiters))
                self._samples.move_to_end(key)
            while len(self._samples) > self.max_keys:
                self._samples.popitem(last=False)

    def __len__(self) -> int:
        """How many keys are remembered."""
        with self._lock:
            return len(self._samples)

    def of(self, key: str) -> list[Sample]:
        """The samples of ``key``, oldest first."""
        with self._lock:
            return list(self._samples.get(key, ()))


def sparkline(samples: list[Sample], *, width: int = 120, height: int = 24) -> dict[str, str] | None:
    """SVG polyline points for holders and waiters (numbers only), or None with fewer than 2 samples."""
    if len(samples) < 2:
        return None
    start, end = samples[0][0], samples[-1][0]
    span = max(end - start, 1e-9)
    top = max(1, max(max(h, w) for _, h, w in samples))

    def points(index: int) -> str:
        return " ".join(
            f"{(t - start) / span * width:.1f},{height - 1 - s[index] / top * (height - 2):.1f}"
            for s in samples
            for t in (s[0],)
        )

    return {"holders": points(1), "waiters": points(2), "max": str(top)}
