"""What a guard costs per message, and how that cost grows with the work (a key's holders and waiters,
the number of waiting keys)."""

from __future__ import annotations

import importlib
import itertools
import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.core import SCRIPT_COMMANDS, Context, Figure, in_turns, median_run, scenario
from dramatiq_guard.backends import GuardBackend, RedisBackend, ReleaseResult, Stake, Waiter, redis_health
from dramatiq_guard.middleware.slots.standbys import DEFAULT_LOOKAHEAD
from dramatiq_guard.middleware.sweep import Member, sweep_all

PROCESSES, THREADS = 2, 8
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes have used (``/proc/<pid>/stat``)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _CLOCK_TICKS


def _commands(ctx: Context) -> int:
    """Every command the run's Redis executed so far (inside scripts too), but INFO and FLUSHALL."""
    stats = ctx.client.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k.removeprefix("cmdstat_") not in {"info", "flushall"}
    )


def _script_usec(ctx: Context) -> tuple[int, int]:
    """(calls, microseconds) of script calls so far: the server's own time for the guard's scripts."""
    stats = ctx.client.info("commandstats")
    found = [stats.get(f"cmdstat_{name}", {}) for name in SCRIPT_COMMANDS]
    return sum(int(s.get("calls", 0)) for s in found), sum(int(s.get("usec", 0)) for s in found)


class _Row:
    """One actor's figures: send rate, drain rate, worker CPU ms and Redis commands per message."""

    def __init__(self, name: str, label: str) -> None:
        self.name, self.label = name, label
        self.send = self.drain = self.cpu_ms = self.commands = 0.0


#: Repeats of the per-guard drains (interleaved: see :func:`_measure_interleaved`).
DRAIN_REPEATS = 5
#: Rounds of the send rates: a send run is short, and the guard installed with nobody opting in
#: is judged on a difference of a few percent, so more rounds steady its median.
SEND_REPEATS = 9


#: The arguments of the wake-up messages (below the warm-up's -1 ... -n // 10).
_WAKE_UPS = itertools.count(1_000_000)


def _drain_once(
    ctx: Context, pids: Sequence[int], actor: Any, n: int, *, warm_up: bool = False
) -> tuple[float, ...]:
    """(rate, worker CPU ms per message, Redis commands per message) of one drain of ``n`` messages.

    The worker's processes are stopped (SIGSTOP) while the ``n`` messages are sent, and the
    clock starts when they go on (SIGCONT): the drain rate is the worker's, from a full queue
    to its last completion, not bounded by the rate of one sending thread (a dedup or
    concurrency send waits for a round trip more than a plain one; the send rates have rows of
    their own). The commands are counted over the sends and the drain.
    Unless it is the warm-up, a few messages wake the worker's consumers first
    (:meth:`Context.wake_up`): the rows take turns on two workers, and without it the unguarded
    row read 1.06x to 1.5x slower than its twin in four runs.
    """
    if not warm_up:  # each with arguments of its own: a dedup or mutex key per message, as the rows'
        ctx.wake_up(lambda run_id, total: actor.send(run_id, total, -next(_WAKE_UPS)), PROCESSES * THREADS)
    run_id = ctx.new_run_id()
    commands = _commands(ctx)
    _signal(pids, signal.SIGSTOP)
    try:
        for i in range(n):
            actor.send(run_id, n, -1 - i if warm_up else i)
        cpu = _cpu_s(pids)
    finally:
        _signal(pids, signal.SIGCONT)
    start = time.time()
    end = ctx.wait_finish(run_id)
    return n / (end - start), (_cpu_s(pids) - cpu) * 1000 / n, (_commands(ctx) - commands) / n


def _signal(pids: Sequence[int], signum: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, signum)


#: The queue of the worker that has the guard installed and drains only an actor that opts into
#: nothing (the "installed, nobody opts in" row), apart from the worker of the guarded rows.
INSTALLED_QUEUE = "bench_cost_installed"

#: The workers of the per-guard drains: which kind of broker, on which queue.
_WORKERS = {
    "plain": {"BENCH_COST": "1", "BENCH_COST_GUARD": "", "BENCH_COST_QUEUE": ""},
    "guarded": {"BENCH_COST": "1", "BENCH_COST_GUARD": "1", "BENCH_COST_QUEUE": ""},
    "installed": {"BENCH_COST": "1", "BENCH_COST_GUARD": "1", "BENCH_COST_QUEUE": INSTALLED_QUEUE},
}


def _measure_interleaved(ctx: Context, rows: list[tuple[_Row, Any, str]], n: int) -> None:
    """Drain every row's actor on its worker (:data:`_WORKERS`), the three running at once.

    Plain Dramatiq; the guard installed, for the guarded rows; and the guard installed with
    nobody opting in, a worker of its own, so that its row measures what installing costs an
    actor that opts into nothing, not what the guarded rows leave behind in their worker.
    The rows take turns (:func:`~bench.core.in_turns`), one drain each per round, for
    :data:`DRAIN_REPEATS` rounds; each row reports its median-rate drain. A slow spell of the
    machine (they come and go on a shared one) then falls on every row alike instead of on
    whichever rows happened to run during it.
    The idle workers cost next to nothing (their consumers block on Redis); the CPU counted is
    the draining worker's.
    """
    ctx.flush()
    pids = {}
    for kind, env in _WORKERS.items():
        worker = ctx.worker("bench.scenarios.cost_actors", processes=PROCESSES, threads=THREADS, env=env)
        pids[kind] = worker.worker_pids
    for _, actor, kind in rows:
        _drain_once(ctx, pids[kind], actor, max(1, n // 10), warm_up=True)
    runs: dict[str, list[tuple[float, ...]]] = {row.name: [] for row, _, _ in rows}
    for row, actor, kind in in_turns(rows, 1 if ctx.quick else DRAIN_REPEATS):
        runs[row.name].append(_drain_once(ctx, pids[kind], actor, n))
    for row, _, _ in rows:
        row.drain, row.cpu_ms, row.commands = median_run(runs[row.name])
    ctx.stop_workers()


def _sender(actor: Any, n: int) -> Callable[[int], object]:
    return lambda i: actor.send("send", n, i)


def _per_guard(ctx: Context) -> list[Figure]:
    os.environ["BENCH_COST"] = "1"
    os.environ.pop("BENCH_COST_GUARD", None)
    module = importlib.reload(ctx.import_actors("bench.scenarios.cost_actors"))
    plain_tick, module_floor, backlog_floor = module.tick, module.floor_tick, module.backlog_floor
    os.environ["BENCH_COST_GUARD"] = "1"
    os.environ["BENCH_COST_QUEUE"] = INSTALLED_QUEUE
    installed_tick = importlib.reload(module).tick  # the reloads below replace the module's names
    del os.environ["BENCH_COST_QUEUE"]
    guarded = importlib.reload(module)
    n = ctx.n(3000, 300)
    rows = [
        (_Row("plain", "unguarded (no guard installed)"), plain_tick),
        (_Row("again", "unguarded again (the same actor, a row of its own: this run's noise)"), plain_tick),
        (_Row("floor", "floor: unguarded + 2 no-op script round trips"), module_floor),
        (_Row("installed", "guard installed, nobody opts in"), installed_tick),
        (_Row("dedup", 'dedup="until_executed", a new key per message'), guarded.dedup_tick),
        (_Row("mutex", "mutex=True, a key per message, never busy"), guarded.mutex_tick),
        (_Row("wide", f"concurrency limit {guarded.WIDE_LIMIT} on one key"), guarded.wide_tick),
        (
            _Row(
                "backlog_floor",
                f"backlog floor: the floor, messages beyond the first {guarded.WIDE_LIMIT} parked in a list, "
                "each pushed and confirmed by a finishing job",
            ),
            backlog_floor,
        ),
    ]
    unguarded = {"plain", "again", "floor", "backlog_floor"}  # drained on the worker without the guard

    def worker_of(name: str) -> str:
        return "plain" if name in unguarded else "installed" if name == "installed" else "guarded"

    unsent = {"backlog_floor"}  # a floor of the drain only: its sends are not a guard's
    sends: dict[str, list[float]] = {row.name: [] for row, _ in rows if row.name not in unsent}
    sent_rows = [(row, actor) for row, actor in rows if row.name not in unsent]
    for row, actor in in_turns(sent_rows, 1 if ctx.quick else SEND_REPEATS):  # the rows take turns here too
        sends[row.name].append(ctx.send_rate(_sender(actor, n), n, repeats=1))
    for row, _ in sent_rows:
        row.send = statistics.median(sends[row.name])
    _measure_interleaved(ctx, [(row, actor, worker_of(row.name)) for row, actor in rows], n)
    os.environ.pop("BENCH_COST_GUARD", None)
    sized = (
        f"N={n} sent with the worker stopped, then {PROCESSES}x{THREADS} from a full queue to the last "
        f"completion, median of {1 if ctx.quick else DRAIN_REPEATS} drains taking turns with the other rows, "
        "after a warm-up; every actor does one INCR"
    )
    figures = []
    for row, _ in rows:
        vs = None if row.name == "plain" else "cost"
        if row.name in sends:
            sent = f"N={n}, no worker running; median of {len(sends[row.name])}, the rows taking turns"
            figures.append(
                Figure(
                    f"{row.name}_send_rate",
                    f"{row.label}: send rate",
                    row.send,
                    "msg/s",
                    vs=vs and "cost/plain_send_rate",
                    detail=sent,
                )
            )
        figures += [
            Figure(
                f"{row.name}_drain_rate",
                f"{row.label}: drain rate",
                row.drain,
                "msg/s",
                vs=vs and "cost/plain_drain_rate",
                detail=sized,
            ),
            Figure(
                f"{row.name}_cpu_ms",
                f"{row.label}: worker CPU per message",
                row.cpu_ms,
                "ms",
                vs=vs and "cost/plain_cpu_ms",
                better="lower",
                detail="user + system time of the worker processes over the drain",
            ),
            Figure(
                f"{row.name}_commands",
                f"{row.label}: Redis commands per message",
                row.commands,
                vs=vs and "cost/plain_commands",
                compare="delta",
                better="lower",
                detail="every command Redis ran during the drain (sends, broker, guard, inside scripts too)",
            ),
        ]
    return figures


#: Measured passes of each point of the scaling curves (the median pass is reported, after a
#: warm-up of a tenth): one pass moved by up to half from run to run on a busy two-core machine.
CURVE_PASSES = 3


def _op_us(
    ctx: Context, limit: int, waiters: int, cycles: int, *, send_ahead: int = 0, ready: bool = False
) -> tuple[float, float]:
    """(server µs per script call, client µs per operation): ``limit`` holders, ``waiters`` parked.

    The pass of ``cycles`` cycles with the median Redis time of :data:`CURVE_PASSES`, after an
    unmeasured pass of a tenth as many (see :func:`_cycles` for a cycle).
    """
    ctx.flush()
    backend = RedisBackend.from_url(ctx.redis_url, handoff_ttl_ms=600_000)
    try:
        one_pass = _cycles(ctx, backend, "curve", limit, waiters, send_ahead=send_ahead, ready=ready)
        one_pass(max(1, cycles // 10))  # a warm-up, outside the figures
        return median_run([one_pass(cycles) for _ in range(CURVE_PASSES)])
    finally:
        backend.close()
        ctx.flush()


def _cycles(
    ctx: Context,
    backend: RedisBackend,
    key: str,
    limit: int,
    waiters: int,
    *,
    send_ahead: int = 0,
    ready: bool = False,
) -> Callable[[int], tuple[float, float]]:
    """Set ``key`` up with ``limit`` holders and ``waiters`` parked; return a pass of cycles on it.

    A pass of ``count`` cycles returns (server µs per script call, client µs per operation).
    One cycle: a holder releases (the oldest waiter is handed its slot), the hand-off is
    confirmed, and a new message parks at the back: the holders and the waiters stay as many.
    With ``send_ahead`` (as an ``on_busy="park"`` worker releases, standbys on): the first
    waiters are confirmed standbys, the release hands the slot to the oldest by a push and sends
    the waiter that enters the window ahead, whose send is confirmed. With ``ready``, the waiters
    are ready ones (threads blocking for a slot, as ``on_busy="wait"``): the release hands the
    slot to the oldest by a push, nothing is confirmed, and a new ready waiter queues at the back.
    """
    ttl, payload = 600_000, b"x" * 200
    for h in range(limit):
        assert backend.acquire(Stake(key, f"h{h}", limit=limit, ttl_ms=ttl)).acquired
    wait = Waiter(wait_ms=ttl) if ready else Waiter(payload=payload)
    for w in range(waiters):
        backend.acquire(Stake(key, f"w{w}", limit=limit, ttl_ms=ttl), wait=wait)
    if send_ahead:
        for standby in backend.send_standbys(key, limit=limit, count=send_ahead)[1]:
            assert standby.payload is not None
            backend.confirm_standby(key, standby.waiter_id, standby.payload, ttl_ms=ttl)
    holders = [f"h{h}" for h in range(limit)]
    done = itertools.count()  # cycles run so far, over the passes: each new waiter's name

    def one_pass(count: int) -> tuple[float, float]:
        calls, usec = _script_usec(ctx)
        start = time.perf_counter()
        for _ in range(count):
            i = next(done)
            released = backend.release(key, holders[i % limit], limit=limit, send_ahead=send_ahead)
            [handoff] = released.handoffs
            if ready or send_ahead:
                assert handoff.payload is None  # a ready waiter or a standby, woken by a push
            if send_ahead:
                [standby] = released.standbys
                assert standby.payload is not None
                backend.confirm_standby(key, standby.waiter_id, standby.payload, ttl_ms=ttl)
            elif not ready:
                assert backend.confirm_handoff(
                    key, handoff.waiter_id, ttl_ms=ttl, generation=handoff.generation
                )
            holders[i % limit] = handoff.waiter_id
            backend.acquire(Stake(key, f"n{i}", limit=limit, ttl_ms=ttl), wait=wait)
        elapsed = time.perf_counter() - start
        calls_after, usec_after = _script_usec(ctx)
        return (usec_after - usec) / (calls_after - calls), elapsed * 1e6 / ((2 if ready else 3) * count)

    return one_pass


def _functions_against_scripts(ctx: Context) -> list[Figure]:
    """The same hand-off cycles as functions (FCALL) and as scripts (EVALSHA), passes taking turns.

    What a Redis that refuses functions costs (redis_scripts.py): its scripts set the prelude up
    on every call. Two keys on one Redis, one backend each, limit 8 and 1,000 parked waiters.
    """
    cycles = ctx.n(2000, 200)
    ctx.flush()
    as_functions = RedisBackend.from_url(ctx.redis_url, handoff_ttl_ms=600_000)
    as_scripts = RedisBackend.from_url(ctx.redis_url, handoff_ttl_ms=600_000)
    as_scripts.scripts.functions = False  # as on a server that refuses functions
    try:
        kinds = [
            ("functions", _cycles(ctx, as_functions, "functions", 8, 1000)),
            ("scripts", _cycles(ctx, as_scripts, "scripts", 8, 1000)),
        ]
        for _, one_pass in kinds:
            one_pass(max(1, cycles // 10))  # a warm-up, outside the figures
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in kinds}
        for name, one_pass in in_turns(kinds, 1 if ctx.quick else CURVE_PASSES):
            runs[name].append(one_pass(cycles))
    finally:
        as_functions.close()
        as_scripts.close()
        ctx.flush()
    detail = (
        f"{cycles} cycles of release (hand-off) + confirm + park on a key of limit 8 with 1,000 waiters, "
        f"the median of {len(runs['scripts'])} passes taking turns; script usec / calls (INFO commandstats)"
    )
    functions, scripts = median_run(runs["functions"]), median_run(runs["scripts"])
    return [
        Figure(
            "op_server_us_functions",
            "per operation, Redis time: as functions (FCALL, the library loaded once)",
            functions[0],
            "µs",
            better="lower",
            detail=detail,
        ),
        Figure(
            "op_server_us_scripts",
            "per operation, Redis time: as scripts (EVALSHA, a Redis that refuses functions)",
            scripts[0],
            "µs",
            vs="cost/op_server_us_functions",
            better="lower",
            detail=detail,
        ),
    ]


def _curve_figures(
    name: str,
    what: str,
    measured: tuple[float, float],
    cycles: int,
    first: str | None,
    cycle: str = "release (hand-off) + confirm + park",
) -> list[Figure]:
    """The Redis time and round trip of one point of a scaling curve (``first``: its first point)."""
    server, client = measured
    detail = (
        f"{cycles} cycles of {cycle}, the median of {CURVE_PASSES} passes after a warm-up; "
        "script usec / calls (FCALL, INFO commandstats)"
    )
    return [
        Figure(
            f"op_server_us_{name}",
            f"per operation, Redis time: {what}",
            server,
            "µs",
            vs=first and f"cost/op_server_us_{first}",
            better="lower",
            detail=detail,
        ),
        Figure(
            f"op_client_us_{name}",
            f"per operation, round trip: {what}",
            client,
            "µs",
            vs=first and f"cost/op_client_us_{first}",
            better="lower",
        ),
    ]


def _curves(ctx: Context) -> list[Figure]:
    cycles = ctx.n(2000, 200)
    limits = (8, 100, 1000, 10_000) if not ctx.quick else (8, 1000)
    waiter_counts = (10, 1000, 100_000) if not ctx.quick else (10, 1000)
    figures = []
    for limit in limits:
        first = None if limit == limits[0] else f"limit_{limits[0]}"
        measured = _op_us(ctx, limit, 10, cycles)
        figures += _curve_figures(f"limit_{limit}", f"limit {limit:,}, 10 waiters", measured, cycles, first)
    for waiters in waiter_counts:
        first = None if waiters == waiter_counts[0] else f"waiters_{waiter_counts[0]}"
        measured = _op_us(ctx, 8, waiters, cycles)
        figures += _curve_figures(
            f"waiters_{waiters}", f"limit 8, {waiters:,} waiters", measured, cycles, first
        )
    # Threads blocking for a slot (on_busy="wait"): a hand-off looks for a ready one in the window.
    for waiters in waiter_counts:
        first = None if waiters == waiter_counts[0] else f"ready_{waiter_counts[0]}"
        measured = _op_us(ctx, 8, waiters, cycles, ready=True)
        figures += _curve_figures(
            f"ready_{waiters}",
            f"limit 8, {waiters:,} ready waiters (threads blocking)",
            measured,
            cycles,
            first,
            cycle="release (hand-off by a push) + a new ready waiter",
        )
    # As an on_busy="park" worker releases: with the default lookahead, standbys sent ahead.
    for limit in limits:
        first = None if limit == limits[0] else f"park_limit_{limits[0]}"
        measured = _op_us(ctx, limit, 1000, cycles, send_ahead=DEFAULT_LOOKAHEAD)
        figures += _curve_figures(
            f"park_limit_{limit}",
            f"limit {limit:,}, 1,000 waiters, releases sending standbys (lookahead {DEFAULT_LOOKAHEAD})",
            measured,
            cycles,
            first,
        )
    return figures


class _SweepAll:
    """A sweep member that claims every key (as the slots middleware does its own)."""

    prompt_prefix = None

    def __init__(self, backend: GuardBackend) -> None:
        self._backend = backend

    def backend(self, broker: Any) -> GuardBackend:
        return self._backend

    def claims(self, key: str) -> bool:
        return True

    def sweep_limit(self, key: str) -> int:
        return 1

    def swept(self, broker: Any, key: str, result: ReleaseResult) -> None:
        assert not result.handoffs, "nothing is due in an idle sweep"


class _EveryKeyBackend(RedisBackend):
    """How the sweep worked before: every waiting key at every pass."""

    due_keys = GuardBackend.due_keys  # the waiting keys


def _idle_sweep(ctx: Context) -> list[Figure]:
    """Commands per process per pass (one pass a second) of the sweep and state watch, idle keys."""
    keys, processes, passes = ctx.n(10_000, 1000), 10, ctx.n(5, 2)
    ctx.flush()
    setup = RedisBackend.from_url(ctx.redis_url)
    for k in range(keys):  # a live holder (its lease ends in 10 minutes) and one parked waiter
        setup.acquire(Stake(f"idle{k}", "h", limit=1, ttl_ms=600_000))
        setup.acquire(Stake(f"idle{k}", "w", limit=1, ttl_ms=600_000), wait=Waiter(payload=b"x" * 200))
    setup.close()
    figures = []
    for name, cls, label in [
        ("due", RedisBackend, "now (due keys only)"),
        ("every", _EveryKeyBackend, "before (every waiting key, every pass)"),
    ]:
        backends = [cls.from_url(ctx.redis_url) for _ in range(processes if name == "due" else 2)]
        members: list[list[Member]] = [[(_SweepAll(b), None)] for b in backends]  # type: ignore[list-item]
        watches = [
            redis_health.StateWatch(b, keys_every_s=redis_health.KEYS_EVERY_S if name == "due" else 0)
            for b in backends
        ]
        for b, m, w in zip(
            backends, members, watches, strict=True
        ):  # a first pass: the watch's first full check
            sweep_all(b, m)
            w.check()
        count = passes if name == "due" else 1
        before = _commands(ctx)
        for _ in range(count):
            for b, m, w in zip(backends, members, watches, strict=True):
                sweep_all(b, m)
                w.check()
        per_pass = (_commands(ctx) - before) / (len(backends) * count)
        for b in backends:
            b.close()
        figures.append(
            Figure(
                f"sweep_{name}_commands",
                f"idle sweep + state watch, {keys:,} waiting keys: Redis commands / process / s, {label}",
                per_pass,
                vs=None if name == "due" else "cost/sweep_due_commands",
                better="lower",
                detail=f"{len(backends)} processes x {count} passes (sweep_interval 1 s) after a first; "
                "the watch's full check of every key (amortized: at most 50 keys/s) is not in these passes",
            )
        )
    ctx.flush()
    return figures


@scenario("cost", title="What a guard costs per message, and how it grows with the work", order=45)
def cost(ctx: Context) -> list[Figure]:
    """The per-guard cost table, the scaling curves and the idle sweep (``bench/scenarios/cost_actors.py``).

    * per guard: the same actor (one INCR to count its completion) unguarded, unguarded with
      two no-op script round trips (the floor of a guard that waits for one round trip before
      the actor and one after), the unguarded row again (its twin: how far the run's noise
      alone moves a ratio), on a broker with the guard installed but no option, and with
      each guard; and the backlog floor, for the concurrency row: 3,000 messages at once to a
      limit of 1,000 park 2,000, and each parked message is pushed by a job that ends (a hand-off)
      and confirmed; the floor does that with the least a backlog held in Redis needs (the
      floor's two round trips, the second of which moves the oldest parked message out of a
      list into a list of those being pushed; then the push, then a third round trip to confirm
      it). Send rate (N sends, no worker; not for the backlog floor),
      drain rate on a real worker (2 processes x 8 threads; the N messages sent while its
      processes are stopped, then from when they go on to the last completion: the worker's
      rate, not the sender's; median of 5 drains after a warm-up; a plain worker, one with the
      guard installed for the guarded rows and one with the guard installed where nobody opts in
      (the "installed" row alone) run side by side and the rows take turns, in a new order each
      round; before each drain,
      16 messages wake the worker's consumers, outside the figures), the worker processes' CPU
      per message, and every Redis command per message during the sends and the drain. Ratios
      against the unguarded row.
    * scaling: one key with L holders and W parked waiters; a cycle releases a holder (its slot
      handed to the oldest waiter), confirms the hand-off and parks a new message, so L and W
      stay put. The Redis time per script call (INFO commandstats) and the round trip per
      operation (the median of three passes after a warm-up), for L = 8 / 100 / 1,000 /
      10,000 (W = 10) and W = 10 / 1,000 / 100,000 (L = 8).
      The same W with ready waiters instead (threads blocking for a slot, as
      ``on_busy="wait"``): a release hands its slot to the oldest by a push and a new one
      queues. And L again with 1,000 waiters, the release sending standbys ahead as an
      ``on_busy="park"`` worker's does. Flat means O(log n): a ratio near 1 against the smallest.
    * functions against scripts: the same cycles (L = 8, W = 1,000) on two keys, one backend
      running the scripts as functions (FCALL, the default) and one as scripts (EVALSHA, as on a
      Redis that refuses functions), passes taking turns: the Redis time of setting the prelude
      up on every call.
    * idle sweep: 10,000 keys, each with a live holder and a parked waiter; 10 processes' sweep
      passes (and their state watch), the commands per process per pass (one pass a second),
      side by side with the sweep as it was (every waiting key at every pass, 2 processes).
    """
    return _per_guard(ctx) + _curves(ctx) + _functions_against_scripts(ctx) + _idle_sweep(ctx)
