"""The dashboard's overview of many waiting keys: how long one page takes to render.

Budget (issue #15): the overview of 10,000 waiting keys renders in under a second,
paginated. Run just this one with ``python -m bench --only web``, or
``python -m bench.scenarios.web REDIS_URL [N]`` against a Redis of your own (it flushes
nothing but writes ``N`` guard keys under a namespace of its own and deletes them).
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

from bench.core import Context, Figure, scenario
from dramatiq_guard.backends import Stake


def fill(redis_url: str, namespace: str, n: int) -> None:
    """``n`` guard keys, each with one holder at its limit of 1 and one parked waiter."""
    from dramatiq_guard.backends import RedisBackend, Waiter

    backend = RedisBackend.from_url(redis_url, namespace=namespace)
    try:
        for i in range(n):
            key = f"concurrency:bench:{i}"
            backend.acquire(Stake(key, f"h{i}", limit=1, ttl_ms=600_000, info="deliver"))
            backend.acquire(Stake(key, f"w{i}", limit=1, ttl_ms=600_000), wait=Waiter(payload=b"{}"))
    finally:
        backend.close()


def measure(redis_url: str, namespace: str, repeats: int) -> tuple[list[float], int]:
    """Seconds per GET of the overview (first page, Werkzeug's test client), and its key count."""
    from werkzeug.test import Client

    from dramatiq_guard.backends import RedisBackend
    from dramatiq_guard.web import make_app

    backend = RedisBackend.from_url(redis_url, namespace=namespace)
    try:
        client = Client(make_app(backend))
        times = []
        total = 0
        for _ in range(repeats):
            start = time.perf_counter()
            response = client.get("/")
            body = response.get_data(as_text=True)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200 and "page 1 of" in body, body[:500]
            total = body.count('class="key"')
        return times, total
    finally:
        backend.close()


def drop(redis_url: str, namespace: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        batch = []
        for name in client.scan_iter(f"{namespace}:*", count=5000):  # the bench's own keys only
            batch.append(name)
            if len(batch) >= 5000:
                client.unlink(*batch)
                batch.clear()
        if batch:
            client.unlink(*batch)


@scenario("web", title="Dashboard overview of many waiting keys", order=90)
def web(ctx: Context) -> list[Figure]:
    """Time one overview page (50 rows) of N waiting keys, each with a holder and a parked waiter.

    The page reads both indexes, one summary per key (pipelined), sorts them all by what most
    needs a look, and renders the first page. Median of 5 renders.
    """
    n = ctx.n(10_000, 2_000)
    namespace = f"bench-web-{uuid.uuid4().hex[:8]}"
    fill(ctx.redis_url, namespace, n)
    try:
        times, _ = measure(ctx.redis_url, namespace, 5)
    finally:
        drop(ctx.redis_url, namespace)
    return [
        Figure(
            "overview_ms",
            f"overview of {n:,} waiting keys, first page",
            statistics.median(times) * 1000,
            "ms",
            better="lower",
            detail=(
                f"median of 5; min {min(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms; budget 1000 ms"
            ),
        )
    ]


if __name__ == "__main__":
    url = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    ns = f"bench-web-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    fill(url, ns, count)
    print(f"filled {count} keys in {time.perf_counter() - t0:.1f} s")
    try:
        seconds, shown = measure(url, ns, 5)
    finally:
        drop(url, ns)
    print(
        f"overview of {count} keys ({shown} rows shown): " + ", ".join(f"{s * 1000:.0f} ms" for s in seconds)
    )
