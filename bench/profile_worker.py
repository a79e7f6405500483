"""Per-message cost of each guard on a worker, in one process: CPU, Redis commands, Python calls, hot spots.

Run it from the repository's root::

    .venv/bin/python -m bench.profile_worker               # N=2000 per row, 8 worker threads
    .venv/bin/python -m bench.profile_worker -n 500 --threads 1 --top 25 --rows mutex dedup

It starts a private ``redis-server`` (the tests' harness), and for each row sends N messages
to a real :class:`~dramatiq.brokers.redis.RedisBroker` while no worker runs, then starts an
in-process :class:`dramatiq.Worker` and drains them. The rows mirror ``bench/scenarios/cost.py``:

* ``plain``: an actor doing one INCR, no guard installed;
* ``floor``: the same with two no-op Lua script round trips (one before the work, one after);
* ``installed``: the plain actor, on a broker with the guard installed (nobody opts in);
* ``mutex``: ``mutex=True``, a key per message; ``dedup``: ``dedup="until_executed"``, a key
  per message; ``concurrency``: a limit of 1,000 on one key (N <= 1,000: nothing parks);
* ``wide``: the same limit with all N sent (beyond the first 1,000 they park at send, and go back
  to the broker as hand-offs and standbys while the drain runs);
* ``backlog``: the backlog floor of ``wide`` (``bench/scenarios/cost_actors.py``): the floor, the
  messages beyond the first 1,000 parked in a list, each pushed and confirmed by a finishing job.

Per message of the drain it prints: the process's CPU (``time.process_time``, every thread:
worker threads, consumers, the guard's release and renewal threads), the Redis commands the
drain ran (``INFO commandstats``, inside scripts too), the requests sent to it, the Python
function calls (all, and the guard's: calls of its functions and the calls they make, one level
down, which idle polling does not move: the figure to compare before and after a change), and under
cProfile the top functions by cumulative CPU time (``time.thread_time``: a blocked thread costs
nothing) among the guard's and Dramatiq's worker, broker and middleware functions, then the top
functions by their own CPU time. The profiled drain runs in a child process of its own, every
thread profiled from its start (``--top 0`` skips it); the CPU column is a drain without it.
Ratios are against the ``floor`` row; the drain rate of ``wide`` is also given against ``backlog``.
Timings are noisy on a shared machine: the call and command counts are not.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import logging
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.cli import LOGFORMAT
from dramatiq.worker import _WorkerMiddleware

from bench.core import TESTS_DIR

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from harness import RedisServer

_GUARD = "/dramatiq_guard/"
ROWS = ("plain", "floor", "installed", "mutex", "dedup", "concurrency", "wide", "backlog")
#: The limit of the concurrency rows' one key.
WIDE_LIMIT = 1000


def _server(client: redis.Redis) -> tuple[int, float]:
    """(commands run so far but INFO and FLUSHALL, the server's CPU seconds so far)."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    commands = sum(
        int(v["calls"]) for k, v in stats.items() if k.removeprefix("cmdstat_") not in {"info", "flushall"}
    )
    return commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _declare(url: str, row: str) -> tuple[RedisBroker, Any]:
    """A broker of its own for ``row`` (the guard installed but for plain and floor) and its actor."""
    broker = RedisBroker(url=url, namespace=f"profile-{row}")
    if row not in ("plain", "floor", "backlog"):
        import dramatiq_guard

        dramatiq_guard.install(broker)
    client = broker.client
    noop = client.register_script("return 1")

    def done(run_id: str, total: int) -> None:
        if int(client.incr(f"profile:done:{run_id}")) == total:
            client.rpush(f"profile:finished:{run_id}", "1")

    guards: dict[str, dict[str, Any]] = {
        "mutex": {"mutex": True},
        "dedup": {"dedup": "until_executed"},
        "concurrency": {"concurrency": {"limit": WIDE_LIMIT, "key": lambda *args: "wide"}},
    }
    guards["wide"] = guards["concurrency"]
    options = guards.get(row, {})

    if row == "floor":

        def work(run_id: str, total: int, i: int) -> None:
            noop()
            done(run_id, total)
            noop()

    elif row == "backlog":
        take_parked = client.register_script("return redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')")
        confirm_pushed = client.register_script("return redis.call('LREM', KEYS[1], 1, ARGV[1])")

        def work(run_id: str, total: int, i: int) -> None:
            noop()
            done(run_id, total)
            parked = take_parked(keys=["profile:backlog", "profile:pushing"])
            if parked is not None:
                broker.enqueue(dramatiq.Message.decode(parked))
                confirm_pushed(keys=["profile:pushing"], args=[parked])

    else:

        def work(run_id: str, total: int, i: int) -> None:
            done(run_id, total)

    actor = dramatiq.actor(actor_name=f"profile_{row}", broker=broker, max_retries=0, **options)(work)
    return broker, _Backlog(actor) if row == "backlog" else actor


class _Backlog:
    """Sends the backlog row's actor as a limit of :data:`WIDE_LIMIT` would: the rest parks in a list."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.actor_name, self._sent = actor, actor.actor_name, 0

    def send(self, run_id: str, total: int, i: int) -> None:
        self._sent = 1 if i == 0 else self._sent + 1
        if self._sent <= WIDE_LIMIT:
            self.actor.send(run_id, total, i)
        else:
            self.actor.broker.client.rpush("profile:backlog", self.actor.message(run_id, total, i).encode())


def _profile_threads() -> list[cProfile.Profile]:
    """Profile every thread started from now on (one profile each, from its start); the profiles."""
    profiles: list[cProfile.Profile] = []
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]  # runs run(), overridden or not

    def profiled(self: threading.Thread) -> None:
        profile = cProfile.Profile(
            time.thread_time
        )  # CPU time: a thread blocked on a socket or a lock costs none
        profiles.append(profile)
        profile.enable()
        try:
            bootstrap(self)
        finally:
            profile.disable()

    threading.Thread._bootstrap_inner = profiled  # type: ignore[attr-defined]
    return profiles


class _Snapshot:
    """What :class:`pstats.Stats` reads of a profile, taken without stopping it (daemon threads run on)."""

    def __init__(self, profile: cProfile.Profile) -> None:
        profile.snapshot_stats()
        self.stats = profile.stats

    def create_stats(self) -> None:
        pass


def _wait_finish(client: redis.Redis, run_id: str, what: str, timeout: float = 600.0) -> None:
    """Wait for the last message of ``run_id`` (in short polls: a client's socket timeout may be short)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.TimeoutError):
            if client.blpop([f"profile:finished:{run_id}"], timeout=1) is not None:
                return
    raise RuntimeError(f"{what}: the drain did not finish in {timeout:g} s")


def _drain(broker: RedisBroker, actor: Any, n: int, threads: int) -> tuple[float, float, float, float]:
    """Send ``n`` messages, then drain them on a new Worker.

    Returns (this process's CPU µs, Redis commands, the Redis server's CPU µs) per message of the
    drain, and its rate (messages per second, from the worker's start to the last completion).
    """
    client = broker.client
    run_id = uuid.uuid4().hex
    for i in range(n):
        actor.send(run_id, n, i)
    (commands, server_cpu), cpu = _server(client), time.process_time()
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    started = time.perf_counter()
    worker.start()
    try:
        _wait_finish(client, run_id, actor.actor_name)
        rate = n / (time.perf_counter() - started)
        cpu = time.process_time() - cpu
        commands_after, server_cpu_after = _server(client)
    finally:
        worker.stop()
        broker.middleware[:] = [m for m in broker.middleware if not isinstance(m, _WorkerMiddleware)]
    return cpu * 1e6 / n, (commands_after - commands) / n, (server_cpu_after - server_cpu) * 1e6 / n, rate


def _hot_spots(profiles: list[cProfile.Profile], n: int, top: int) -> tuple[tuple[float, float, float], str]:
    """((Python calls, Redis round trips, the guard's calls) per message, the top functions).

    The guard's calls: of its functions, and those they make (builtins, redis-py, ...), not the
    calls those make in turn. Unlike the total, idle polling does not move them.
    """
    stats = pstats.Stats(_Snapshot(profiles[0]))  # type: ignore[arg-type]
    for profile in profiles[1:]:
        stats.add(_Snapshot(profile))  # type: ignore[arg-type]
    sent = sum(
        calls
        for (path, _, name), (_, calls, *_) in stats.stats.items()  # type: ignore[attr-defined]
        if name == "send_packed_command" and path.endswith("redis/connection.py")
    )
    guard = 0  # calls of the guard's functions, and calls they make (to anything, one level down)
    for (path, _, _), (_, calls, _, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if _GUARD in path:
            guard += calls
        else:
            guard += sum(c[1] for (caller, _, _), c in callers.items() if _GUARD in caller)
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats("dramatiq_guard|dramatiq/(worker|broker|middleware)", top)
    stats.sort_stats("tottime").print_stats(top)
    return (stats.total_calls / n, sent / n, guard / n), out.getvalue()  # type: ignore[attr-defined]


def _profile_row(url: str, row: str, n: int, threads: int, top: int) -> None:
    """The child of one row's profiled drain: every thread profiled from the start, none warmed up."""
    profiles = _profile_threads()
    broker, actor = _declare(url, row)
    _drain(broker, actor, n, threads)
    (calls, round_trips, guard), report = _hot_spots(profiles, n, top)
    print(f"{calls:.1f} {round_trips:.3f} {guard:.2f}")
    print(report)
    sys.stdout.flush()
    os._exit(0)  # the guard's daemon threads are profiled still: no exit-time flush to wait for


def _row_n(row: str, n: int) -> int:
    return min(n, WIDE_LIMIT) if row == "concurrency" else n


def _print_table(table: dict[str, list[float]], threads: int, repeats: int) -> None:
    """Print each row's figures per message (``table``: row -> CPU, server µs, commands, requests,
    Python calls, the guard's calls, drain rate)."""
    print(f"\nper message of a drain, {threads} worker threads; CPU: the median of {repeats} drains")
    print(
        f"{'row':<12} {'CPU µs':>7} {'x floor':>7} {'redis µs':>8} {'commands':>8} {'requests':>8} "
        f"{'py calls':>8} {'x floor':>7} {'guard calls':>11} {'drain/s':>8}"
    )
    floor = table.get("floor")
    for row, (cpu, server_us, commands, round_trips, calls, guard, rate) in table.items():
        cpu_ratio = f"{cpu / floor[0]:.2f}" if floor else "-"
        calls_ratio = f"{calls / floor[4]:.2f}" if floor and floor[4] else "-"
        print(
            f"{row:<12} {cpu:7.0f} {cpu_ratio:>7} {server_us:8.0f} {commands:8.2f} {round_trips:8.2f} "
            f"{calls:8.0f} {calls_ratio:>7} {guard:11.1f} {rate:8.0f}"
        )
    if "wide" in table and "backlog" in table:
        print(f"wide's drain rate: {table['wide'][6] / table['backlog'][6]:.2f}x backlog's (medians)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=2000, help="messages per row (at most 1,000 for concurrency)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads")
    parser.add_argument("--top", type=int, default=15, help="functions listed per row (0: no cProfile pass)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="unprofiled drains per row (the median is shown)"
    )
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument(
        "--profile-row", choices=ROWS, help=argparse.SUPPRESS
    )  # the child of a profiled drain
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS", "1")
    # As the ``dramatiq`` command sets logging up (INFO), into the void: what is logged costs as there.
    logging.basicConfig(level=logging.INFO, format=LOGFORMAT, stream=open(os.devnull, "w"))  # noqa: SIM115
    if args.profile_row:
        _profile_row(args.url, args.profile_row, _row_n(args.profile_row, args.n), args.threads, args.top)
    table: dict[str, list[float]] = {}
    reports: dict[str, str] = {}
    with RedisServer() as server:
        declared = {row: _declare(server.url, row) for row in args.rows}
        for broker, actor in declared.values():  # a warm-up: scripts loaded, threads started once
            _drain(broker, actor, 50, args.threads)
        runs: dict[str, list[tuple[float, float, float, float]]] = {row: [] for row in args.rows}
        for _ in range(args.repeats):  # the rows take turns, so a slow spell falls on all of them
            for row, (broker, actor) in declared.items():
                runs[row].append(_drain(broker, actor, _row_n(row, args.n), args.threads))
        for broker, _ in declared.values():
            broker.close()
        for row in args.rows:
            calls = round_trips = guard = 0.0
            if args.top:
                child = subprocess.run(
                    [sys.executable, "-m", "bench.profile_worker", "--profile-row", row, "--url", server.url,
                     "-n", str(args.n), "--threads", str(args.threads), "--top", str(args.top)],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                first, _, reports[row] = child.stdout.partition("\n")
                calls, round_trips, guard = map(float, first.split())
            cpu, commands, server_us, rate = (statistics.median(r[i] for r in runs[row]) for i in range(4))
            table[row] = [cpu, server_us, commands, round_trips, calls, guard, rate]
    _print_table(table, args.threads, args.repeats)
    for row, report in reports.items():
        print(f"\n===== {row}: CPU time by function (every thread, one profiled drain of N)")
        print(report.strip())


if __name__ == "__main__":
    main()
