"""How often a client may guess the write secret: failed unlocks per client address.

A client that gave ``failures`` wrong secrets within ``window_s`` is refused
(429) until the oldest leaves the window, without its secret being compared; a
right secret clears its record. In this process only, for at most
``max_clients`` addresses (the least recent forgotten).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable


class UnlockLimit:
    """Failed unlocks per client address (``REMOTE_ADDR``).

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
        self.failures = int(failures)
        self.window_s = float(window_s)
        self.max_clients = int(max_clients)
        self.clock = clock
        self._failed: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> int:
        """Seconds until ``client`` may try again (rounded up), or 0 if it may try now."""
        now = self.clock()
        with self._lock:
            times = self._failed.get(client)
            if times is None or len(times) < self.failures:
                return 0
            wait = times[0] + self.window_s - now
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, client: str) -> None:
        """Count a wrong secret from ``client``."""
        now = self.clock()
        with self._lock:
            times = self._failed.get(client)
            if times is None:
                times = self._failed[client] = collections.deque(maxlen=self.failures)
            times.append(now)
            self._failed.move_to_end(client)
            while len(self._failed) > self.max_clients:
                self._failed.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures: it gave the right secret."""
        with self._lock:
            self._failed.pop(client, None)

    def __len__(self) -> int:
        """How many client addresses are remembered."""
        with self._lock:
            return len(self._failed)
