"""One contending process of the lock throughput bench (``python -m bench.scenarios.lock_contend``).

Run by :mod:`bench.scenarios.lock` as ``python -m bench.scenarios.lock_contend KIND URL RUN_ID
THREADS SECONDS``; importing it does nothing. Each thread makes its own lock object, reports
ready, waits for the go (a push from the bench), then acquires (blocking) and releases the one
lock in a loop for ``SECONDS``, and pushes how many times it held it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import redis


def _contender(kind: str, url: str, run_id: str, seconds: float) -> None:
    client = redis.Redis.from_url(url, socket_timeout=None)
    cycle: Callable[[], None]
    if kind == "guard":
        from dramatiq_guard.lock import Lock

        guard_lock = Lock(f"bench-lock-{run_id}", redis=client)

        def cycle() -> None:
            guard_lock.acquire()
            guard_lock.release()

    else:
        # redis-py's defaults: a blocked acquire polls SET NX every 0.1 s.
        redispy_lock = client.lock(f"bench-redispy-lock-{run_id}", timeout=30)

        def cycle() -> None:
            redispy_lock.acquire()
            redispy_lock.release()

    client.rpush(f"bench:lock:{run_id}:ready", "1")
    client.blpop([f"bench:lock:{run_id}:go"], timeout=120)
    held = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        cycle()
        held += 1
    client.rpush(f"bench:lock:{run_id}:held", str(held))
    client.close()


def main(argv: list[str]) -> None:
    kind, url, run_id, threads, seconds = argv
    workers = [
        threading.Thread(target=_contender, args=(kind, url, run_id, float(seconds)))
        for _ in range(int(threads))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main(sys.argv[1:])
