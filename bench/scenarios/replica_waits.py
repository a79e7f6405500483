"""The cost of replica waits: every decision waits for a replica's acknowledgement (Redis ``WAIT``).

Runs on a topology of its own (a primary and one replica on loopback,
:class:`harness.topology.ReplicatedRedis`), not on the bench's Redis. On its own, without the
rest of the bench: ``python -m bench.scenarios.replica_waits``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from harness.topology import ReplicatedRedis  # noqa: E402

from bench.core import Context, Figure, scenario  # noqa: E402
from dramatiq_guard.backends import RedisBackend, Stake  # noqa: E402

THREADS = 8


def _cycles(backend: RedisBackend, cycles: int, threads: int) -> tuple[float, float]:
    """Acquire/release cycles per second of ``threads`` threads, each on its own limit-1 keys,
    and the median cycle time (ms)."""
    times: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)

    def run() -> None:
        mine = []
        prefix = f"bench:waits:{uuid.uuid4().hex[:8]}"
        start.wait()
        for i in range(cycles):
            key, holder = f"{prefix}:{i % 64}", f"m{i}"
            began = time.perf_counter()
            backend.acquire(Stake(key, holder, limit=1, ttl_ms=60_000))
            backend.release(key, holder, limit=1)
            mine.append(time.perf_counter() - began)
        with lock:
            times.extend(mine)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    return threads * cycles / elapsed, statistics.median(times) * 1000


def measure(cycles: int) -> list[Figure]:
    figures: list[Figure] = []
    with ReplicatedRedis() as pair, pair.primary.client() as client:
        for threads in (1, THREADS):
            rates = {}
            for waits in (0, 1):
                backend = RedisBackend(client, replica_waits=waits, replica_wait_timeout_ms=1_000)
                _cycles(backend, max(10, cycles // 10), threads)  # warm up: scripts loaded, pools filled
                rates[waits] = _cycles(backend, cycles, threads)
            plain, waited = rates[0], rates[1]
            sized = f"{threads} thread(s) x {cycles} cycles, 64 keys each"
            figures += [
                Figure(
                    f"no_waits_{threads}t",
                    f"acquire+release, replica_waits=0, {threads} thread(s)",
                    plain[0],
                    "cycles/s",
                    detail=f"{sized}; median cycle {plain[1]:.3f} ms",
                ),
                Figure(
                    f"waits_{threads}t",
                    f"acquire+release, replica_waits=1, {threads} thread(s)",
                    waited[0],
                    "cycles/s",
                    vs=f"replica_waits/no_waits_{threads}t",
                    detail=f"{sized}; median cycle {waited[1]:.3f} ms",
                ),
            ]
    return figures


@scenario("replica_waits", title="Replica waits (WAIT 1 after every decision): their cost", order=70)
def replica_waits(ctx: Context) -> list[Figure]:
    """Acquire+release cycles of limit-1 keys on a primary with one replica (both private,
    loopback, no persistence), with ``replica_waits=0`` and ``replica_waits=1``, by 1 thread and
    by 8 threads of one process. With waits, each script is followed on its connection by
    ``WAIT 1 1000``: the reply comes once the replica acknowledged (no extra round trip, but the
    replica's acknowledgement is on the path of every decision).
    """
    return measure(ctx.n(3000, 300))


def main() -> None:
    for figure in measure(int(sys.argv[1]) if len(sys.argv) > 1 else 3000):
        ratio = ""
        if figure.vs:
            ratio = f" (vs {figure.vs.split('/')[1]})"
        print(f"| {figure.label} | {figure.value:,.0f} {figure.unit}{ratio} | {figure.detail} |")


if __name__ == "__main__":
    main()
