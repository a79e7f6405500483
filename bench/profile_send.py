"""Per-send cost of a guarded send on the producer: Python calls, Redis commands, hot spots.

Run it from the repository's root::

    .venv/bin/python -m bench.profile_send                 # N=2000 per row
    .venv/bin/python -m bench.profile_send -n 500 --top 25 --rows accepted limited

It starts a private ``redis-server`` (the tests' harness) and a :class:`~dramatiq.brokers.redis.RedisBroker`
on it with the guard installed, as ``bench/scenarios/dedup.py`` declares its actors, and for each
row sends N messages under cProfile (no worker runs; the sending thread only):

* ``plain``: an actor without a guard, on the same broker;
* ``accepted``: ``dedup="until_executed"``, a new key each send (a lock taken and the message pushed);
* ``duplicate``: the same actor, one key: the first send takes the lock, the others are dropped;
* ``limited``: ``concurrency={"limit": 10, ...}`` over 1,000 keys: a slot reserved at each send.

Per send it prints the Python function calls (deterministic: the figure to compare before and
after a change), the Redis commands the server ran (``INFO commandstats``, inside scripts too) and
the arguments of the guard's script calls, the server's time in the commands (``usec``) and this
process's CPU per send in a pass not profiled (both noisy on a shared machine, unlike the counts),
then under ``--top`` the top functions by call count.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from bench.core import TESTS_DIR

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from harness import RedisServer

ROWS = ("plain", "accepted", "duplicate", "limited")


def _commands(client: redis.Redis) -> tuple[int, float]:
    """Commands run so far, and the server's time in them (µs), INFO left out."""
    stats = {k: v for k, v in client.info("commandstats").items() if k.removeprefix("cmdstat_") != "info"}
    return sum(int(v["calls"]) for v in stats.values()), sum(float(v["usec"]) for v in stats.values())


def _declare(url: str) -> tuple[RedisBroker, dict[str, Callable[[int], Any]]]:
    import dramatiq_guard

    broker = RedisBroker(url=url, namespace="profile-send")
    dramatiq_guard.install(broker)

    def never(i: int) -> None:
        """Never runs: no worker consumes its queue."""

    plain = dramatiq.actor(actor_name="plain", broker=broker, max_retries=0)(never)
    guarded = dramatiq.actor(actor_name="guarded", broker=broker, max_retries=0, dedup="until_executed")(
        never
    )
    limited = dramatiq.actor(
        actor_name="limited",
        broker=broker,
        max_retries=0,
        concurrency={"limit": 10, "key": lambda i: f"k{i % 1000}"},
    )(never)
    return broker, {
        "plain": lambda i: plain.send(i),
        "accepted": lambda i: guarded.send(i),
        "duplicate": lambda i: guarded.send(-1),
        "limited": lambda i: limited.send(i),
    }


def _measure(
    client: redis.Redis, send: Callable[[int], Any], n: int
) -> tuple[tuple[float, ...], pstats.Stats]:
    """(Python calls, Redis commands, arguments of the guard's script calls) per send, and the profile."""
    sent_args: list[int] = []
    execute: Callable[..., Any] = client.execute_command  # untyped in redis-py

    def counting(*command: Any, **options: Any) -> Any:
        if command and command[0] in ("FCALL", "EVALSHA"):
            sent_args.append(len(command) - 3)
        return execute(*command, **options)

    client.execute_command = counting  # type: ignore[method-assign]  # over 50 sends, not profiled
    try:
        for i in range(50):
            send(20_000 + i)
    finally:
        del client.execute_command
    cpu = time.process_time()  # this process's CPU, not profiled: the client's cost (Redis runs apart)
    for i in range(n):
        send(n + i)
    cpu_us = (time.process_time() - cpu) * 1e6 / n
    before = _commands(client)
    profile = cProfile.Profile()
    profile.enable()
    for i in range(n):
        send(i)
    profile.disable()
    after = _commands(client)
    commands, server_us = ((a - b) / n for a, b in zip(after, before, strict=True))
    stats = pstats.Stats(profile)
    per_send = (stats.total_calls / n, commands, sum(sent_args) / 50, server_us, cpu_us)  # type: ignore[attr-defined]
    return per_send, stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=2000, help="sends per row, at most 4,000 (limited: 10 a key)")
    parser.add_argument("--top", type=int, default=0, help="functions listed per row, by call count")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--filter", default="", help="list only functions whose path or name matches")
    args = parser.parse_args(argv)
    os.environ.setdefault("DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS", "1")
    logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))  # noqa: SIM115
    n = min(args.n, 4000)
    reports: dict[str, str] = {}
    table: dict[str, tuple[float, ...]] = {}
    with RedisServer() as server:
        broker, sends = _declare(server.url)
        for row in args.rows:  # a warm-up: scripts loaded, the one-step probe made, caches filled
            for i in range(20):
                sends[row](10_000 + i)
        for row in args.rows:
            table[row], stats = _measure(broker.client, sends[row], n)
            if args.top:
                out = io.StringIO()
                stats.stream = out  # type: ignore[attr-defined]
                stats.sort_stats("ncalls").print_stats(args.filter, args.top)
                reports[row] = out.getvalue()
        broker.close()
    print(f"\nper send, N={n}, the sending thread only")
    print(
        f"{'row':<10} {'py calls':>9} {'x plain':>8} {'commands':>9} {'script args':>11} {'redis µs':>9} "
        f"{'CPU µs':>7} {'x plain':>8}"
    )
    plain = table.get("plain")
    for row, (calls, commands, script_args, server_us, cpu_us) in table.items():
        ratio = f"{calls / plain[0]:.2f}" if plain else "-"
        cpu_ratio = f"{cpu_us / plain[4]:.2f}" if plain else "-"
        print(
            f"{row:<10} {calls:9.1f} {ratio:>8} {commands:9.2f} {script_args:11.1f} {server_us:9.1f} "
            f"{cpu_us:7.1f} {cpu_ratio:>8}"
        )
    for row, report in reports.items():
        print(f"\n===== {row}: functions by calls (N sends)")
        print(report.strip())


if __name__ == "__main__":
    main()
