"""Sizing: bytes of Redis per holder, waiter and parked message, and a million parked messages.

``python -m bench.size [--messages N] [--keys K] [--priorities P]`` starts a private
``redis-server`` (loopback, no persistence) and measures, with the real scripts of
:class:`~dramatiq_guard.backends.RedisBackend`:

* bytes per key with one holder, per extra holder, per blocking waiter, per parked message (with
  a typical Dramatiq message as payload), and per drained key (its last fencing token, kept for
  ``stale_ttl_ms``): ``INFO memory`` ``used_memory`` deltas over many of each, divided;
* N parked messages (default a million) on K keys (default 2,000) whose one slot is held: the
  park rate (parks pipelined 200 per round trip, one client), Redis's memory then;
* the hand-off rate with those queues: a holder releases, the oldest parked message is handed
  its slot, re-enqueue confirmed and started (release, confirm_handoff, acquire: three round trips,
  one thread), and the median release;
* ``dramatiq-guard inspect`` (every key) and ``dramatiq-guard inspect KEY`` (one) wall times, and
  ``waiting_keys()``.

It prints a Markdown table (the figures in ``docs/benchmarks.md``, "Size").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from harness import RedisServer  # noqa: E402

from dramatiq_guard.backends import RedisBackend, Stake  # noqa: E402
from dramatiq_guard.backends.redis_client import run_scripts  # noqa: E402
from dramatiq_guard.backends.redis_layout import AcquireArgs  # noqa: E402

LEASE_MS = 3_600_000
BATCH = 200


def typical_message(i: int) -> bytes:
    """A Dramatiq message as a parked webhook delivery would carry it (JSON-encoded)."""
    message: dramatiq.Message[Any] = dramatiq.Message(
        queue_name="default",
        actor_name="deliver_webhook",
        args=(i % 2000, {"event": "invoice.paid", "id": f"evt_{i:012d}", "amount": 4200}),
        kwargs={},
        options={"concurrency_key": f"webhooks:{i % 2000}"},
    )
    return message.encode()


class Sizer:
    def __init__(self, server: RedisServer) -> None:
        self.client = server.client()
        self.backend = RedisBackend(self.client)
        self.priorities = 1  # the parks of each key spread over priorities 0 .. priorities - 1

    def used(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def per(self, count: int, do: Callable[[], object]) -> float:
        """Bytes of Redis per item: ``used_memory`` before and after ``do()`` made ``count`` of them."""
        before = self.used()
        do()
        return (self.used() - before) / count

    def park_all(self, keys: list[str], per_key: int, start: int = 0, payload: bool = True) -> float:
        """Park ``per_key`` messages on each key, pipelined BATCH per round trip; returns parks/s."""
        script = self.backend.scripts["acquire"]
        calls: list[Any] = []
        began = time.perf_counter()
        for j in range(start, start + per_key):
            for k, key in enumerate(keys):
                i = j * len(keys) + k
                holder = f"{key}:w{j}"
                own = AcquireArgs(
                    holder=holder,
                    ttl_ms=LEASE_MS,
                    mode="park" if payload else "block",
                    payload=typical_message(i) if payload else b"",
                    wait_ms=0 if payload else LEASE_MS,
                    info="deliver_webhook",
                    generation="",
                    fenced="1",
                    runner="",
                    priority=j % self.priorities,
                )
                args = self.backend._args(1, *own)
                calls.append((script, self.backend._keys(key), args))
                if len(calls) == BATCH:
                    run_scripts(self.client, self.backend.scripts, calls)
                    calls = []
        if calls:
            run_scripts(self.client, self.backend.scripts, calls)
        return len(keys) * per_key / (time.perf_counter() - began)

    def hold(self, keys: list[str], holders: int = 1, limit: int = 1) -> None:
        for key in keys:
            for h in range(holders):
                assert self.backend.acquire(Stake(key, f"{key}:h{h}", limit=limit, ttl_ms=LEASE_MS)).acquired


def cli(*args: str, url: str) -> float:
    """Wall time of ``dramatiq-guard <args>`` (output discarded)."""
    exe = Path(sys.executable).with_name("dramatiq-guard")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "dramatiq_guard.cli"]
    began = time.perf_counter()
    subprocess.run([*command, *args, "--redis", url], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.size", description=__doc__)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--handoffs", type=int, default=20_000)
    parser.add_argument("--priorities", type=int, default=1, help="spread each key's parks over N priorities")
    options = parser.parse_args(argv)
    rows: list[tuple[str, str, str]] = []
    payload = len(typical_message(0))

    with RedisServer() as server:
        sizer = Sizer(server)
        n = 10_000
        keys = [f"size:mutex:{i}" for i in range(n)]
        one = sizer.per(n, lambda: sizer.hold(keys))
        rows.append(("a key with one holder (a running mutex)", f"{one:.0f} B", f"{n:,} keys"))
        wide = [f"size:wide:{i}" for i in range(100)]
        sizer.hold(wide)
        more = sizer.per(100 * 99, lambda: sizer.hold(wide, 100, 100))
        rows.append(("each further holder of a key", f"{more:.0f} B", "100 keys x 99 more (limit 100)"))
        blocking = [f"size:block:{i}" for i in range(100)]
        sizer.hold(blocking)
        waiter = sizer.per(100 * 100, lambda: sizer.park_all(blocking, 100, payload=False))
        rows.append(("a blocking waiter (a thread waits)", f"{waiter:.0f} B", "100 keys x 100 waiters"))
        parked = [f"size:park:{i}" for i in range(100)]
        sizer.hold(parked)
        message = sizer.per(100 * 100, lambda: sizer.park_all(parked, 100))
        how = f"100 keys x 100 parked; payload {payload} B (a typical Dramatiq message)"
        rows.append(("a parked message", f"{message:.0f} B", how))
        held = sizer.used()
        for key in keys:
            assert sizer.backend.release(key, f"{key}:h0", limit=1).released
        left = one - (held - sizer.used()) / n
        how = f"the {n:,} keys above released; only their token stays"
        rows.append(("a drained key (its last token, kept stale_ttl_ms)", f"{left:.0f} B", how))

    with RedisServer() as server:
        sizer = Sizer(server)
        sizer.priorities = options.priorities
        keys = [f"webhooks:{i}" for i in range(options.keys)]
        per_key = options.messages // options.keys
        sizer.hold(keys)
        before = sizer.used()
        rate = sizer.park_all(keys, per_key)
        total = per_key * len(keys)
        memory = sizer.used() - before
        rss = int(sizer.client.info("memory")["used_memory_rss"]) / 2**20
        how = f"{per_key} per key, slots held; {options.priorities} priorities"
        rows.append(("parked messages", f"{total:,} on {len(keys):,} keys", how))
        rows.append(("park rate", f"{rate:,.0f} msg/s", f"pipelined {BATCH} per round trip, one client"))
        how = f"used_memory delta; RSS {rss:,.0f} MiB"
        measured = f"{memory / 2**20:,.0f} MiB ({memory / total:.0f} B/message)"
        rows.append(("Redis memory for them", measured, how))

        backend = sizer.backend
        holders = {key: f"{key}:h0" for key in keys}
        releases: list[float] = []
        began = time.perf_counter()
        for i in range(options.handoffs):
            key = keys[i % len(keys)]
            t0 = time.perf_counter()
            result = backend.release(key, holders[key], limit=1)
            releases.append(time.perf_counter() - t0)
            [handoff] = result.handoffs
            mid = handoff.waiter_id
            assert backend.confirm_handoff(key, mid, ttl_ms=60_000, generation=handoff.generation)
            assert backend.acquire(Stake(key, mid, limit=1, ttl_ms=LEASE_MS)).acquired
            holders[key] = mid
        elapsed = time.perf_counter() - began
        how = f"{options.handoffs:,} hand-offs (release, confirm, start: 3 round trips), one thread"
        rows.append(("hand-off rate", f"{options.handoffs / elapsed:,.0f} msg/s", how))
        median = statistics.median(releases) * 1000
        rows.append(("release with a hand-off (median)", f"{median:.3f} ms", f"queues of ~{per_key} parked"))
        t0 = time.perf_counter()
        waiting = backend.waiting_keys()
        listed = (time.perf_counter() - t0) * 1000
        rows.append(("waiting_keys()", f"{listed:.0f} ms", f"{len(waiting):,} keys"))
        every = cli("inspect", url=server.url)
        how = f"{len(waiting):,} keys, {total - options.handoffs:,} waiters"
        rows.append(("`dramatiq-guard inspect` (every key)", f"{every:.1f} s", how))
        single = cli("inspect", "webhooks:7", url=server.url)
        how = f"one key, {per_key} waiters; includes the CLI's start-up"
        rows.append(("`dramatiq-guard inspect webhooks:7`", f"{single:.2f} s", how))

    print("| what | measured | how |")
    print("|---|---|---|")
    for what, measured, how in rows:
        print(f"| {what} | {measured} | {how} |")


if __name__ == "__main__":
    main()
