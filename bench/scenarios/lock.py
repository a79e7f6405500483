"""Lock throughput under contention: ``dramatiq_guard.Lock`` side by side with redis-py's ``Lock``."""

from __future__ import annotations

import os
import subprocess
import sys

import redis

from bench.core import ROOT, TESTS_DIR, Context, Figure, scenario

PROCESSES, THREADS = 2, 8


def _contend(ctx: Context, kind: str, seconds: float) -> tuple[float, list[int]]:
    """Acquisitions per second of one lock by PROCESSES x THREADS contenders, and each one's count."""
    run_id = ctx.new_run_id()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")) if p
    )
    command = [sys.executable, "-m", "bench.scenarios.lock_contend", kind, ctx.redis_url, run_id]
    procs = [
        subprocess.Popen([*command, str(THREADS), str(seconds)], cwd=ROOT, env=env) for _ in range(PROCESSES)
    ]
    contenders = PROCESSES * THREADS
    try:
        with redis.Redis.from_url(ctx.redis_url, socket_timeout=None) as client:
            for _ in range(contenders):
                if client.blpop([f"bench:lock:{run_id}:ready"], timeout=120) is None:
                    raise TimeoutError("the lock contenders did not start")
            client.rpush(f"bench:lock:{run_id}:go", *(["1"] * contenders))
            counts = []
            for _ in range(contenders):
                item = client.blpop([f"bench:lock:{run_id}:held"], timeout=120 + seconds)
                if item is None:
                    raise TimeoutError("the lock contenders did not finish")
                counts.append(int(item[1]))
    finally:
        for proc in procs:
            if proc.wait(timeout=60) != 0:
                raise RuntimeError(f"a lock contender exited with {proc.returncode}")
    return sum(counts) / seconds, sorted(counts)


@scenario("lock", title="Lock throughput under contention", order=45)
def lock(ctx: Context) -> list[Figure]:
    """Acquire/release throughput of one lock, 16 contending threads over 2 processes.

    Each thread loops for S seconds: a blocking acquire, then a release (no work in between),
    with its own lock object. For ``dramatiq_guard.Lock`` a blocked thread waits in the key's
    FIFO and is handed the lock by a push; redis-py's ``Lock`` (its defaults) polls SET NX
    every 0.1 s, so the releasing thread, trying again at once, usually wins the lock back.
    Fairness: the share of all acquisitions made by the busiest thread (1/16 is fair).
    """
    seconds = ctx.n(3, 1)
    guard_rate, guard_counts = _contend(ctx, "guard", seconds)
    redispy_rate, redispy_counts = _contend(ctx, "redispy", seconds)

    def busiest(counts: list[int]) -> float:
        return max(counts) / max(1, sum(counts))

    sized = f"{PROCESSES}x{THREADS} threads, {seconds} s"
    return [
        Figure(
            "guard_lock_rate",
            "dramatiq_guard.Lock acquire/release",
            guard_rate,
            "ops/s",
            vs="lock/redispy_lock_rate",
            detail=f"{sized}; busiest thread {busiest(guard_counts):.0%} of acquisitions",
        ),
        Figure(
            "redispy_lock_rate",
            "redis-py Lock acquire/release (polling, sleep 0.1 s)",
            redispy_rate,
            "ops/s",
            detail=f"{sized}; busiest thread {busiest(redispy_counts):.0%} of acquisitions",
        ),
        Figure(
            "guard_lock_busiest_share",
            "dramatiq_guard.Lock: busiest thread's share of acquisitions",
            busiest(guard_counts),
            better="lower",
        ),
        Figure(
            "redispy_lock_busiest_share",
            "redis-py Lock: busiest thread's share of acquisitions",
            busiest(redispy_counts),
            better="lower",
        ),
    ]
