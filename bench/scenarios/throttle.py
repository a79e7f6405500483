"""A throttled backlog, side by side with Dramatiq's ``WindowRateLimiter`` and ``Retries`` (issue #33)."""

from __future__ import annotations

import importlib
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import NamedTuple, cast

from bench.core import Context, Figure, in_turns, median_run, scenario

PROCESSES, THREADS = 2, 8
JOB_S = 0.010  # as bench.scenarios.throttle_actors.JOB_S


class Delays(NamedTuple):
    """Start delays (ms) of the parked messages taken before their place opened, and of the others."""

    blocked: list[float]
    pushed: list[float]


class Drain(NamedTuple):
    """One drain: makespan / ideal first (what :func:`median_run` sorts by), then the rest."""

    ratio: float
    makespan_s: float
    delay_ms: float
    delay_p95_ms: float
    blocked_share: float
    blocked_ms: float
    pushed_ms: float
    pickups: float
    retries: float
    max_retries: int


def ideal_s(n: int, limit: int, period_s: float, job_s: float = JOB_S) -> float:
    """The shortest makespan of ``n`` starts at ``limit`` per ``period_s``: the first window admits at
    once, the last of ``ceil(n / limit)`` opens ``ceil(n / limit) - 1`` periods on, then its job runs."""
    return (math.ceil(n / limit) - 1) * period_s + job_s


def start_delays_ms(starts: Sequence[tuple[float, float]], limit: int, period_s: float) -> Delays:
    """How long after its place opened each parked start came, in ms, from ``(start, pickup)`` pairs.

    The k-th start (in time order) past the first ``limit`` took the place of the (k - limit)-th,
    which opened a period after that one started. Split by whether the message was taken off the
    broker before its place opened (a standby that blocked for it) or after (a hand-off's push).
    """
    ordered = sorted(starts)
    delays = Delays([], [])
    for k in range(limit, len(ordered)):
        opened = ordered[k - limit][0] + period_s
        start, picked = ordered[k]
        (delays.blocked if picked < opened else delays.pushed).append((start - opened) * 1000)
    return delays


def _drain_once(ctx: Context, actor: object, n: int, limit: int, period_s: float) -> Drain:
    name = cast(str, actor.actor_name)  # type: ignore[attr-defined]
    ctx.wake_up(actor.send, PROCESSES * THREADS)  # type: ignore[attr-defined]
    ctx.client.delete(f"bench:pickups:{name}")
    run_id = ctx.new_run_id()
    start = time.time()
    for _ in range(n):
        actor.send(run_id, n)  # type: ignore[attr-defined]
    makespan = ctx.wait_finish(run_id) - start
    lines = cast(list[bytes], ctx.client.lrange(f"bench:starts:{run_id}", 0, -1))
    starts = [(float(start), float(picked)) for start, picked in (line.split() for line in lines)]
    retries = [int(r) for r in cast(list[bytes], ctx.client.lrange(f"bench:retries:{run_id}", 0, -1))]
    split = start_delays_ms(starts, limit, period_s)
    delays = split.blocked + split.pushed or [0.0]
    return Drain(
        makespan / ideal_s(n, limit, period_s),
        makespan,
        statistics.median(delays),
        statistics.quantiles(delays, n=20)[-1] if len(delays) > 1 else delays[0],
        len(split.blocked) / len(delays),
        statistics.median(split.blocked or [0.0]),
        statistics.median(split.pushed or [0.0]),
        int(ctx.client.get(f"bench:pickups:{name}") or 0) / n,
        sum(retries) / n,
        max(retries),
    )


def _paced_floor(ctx: Context, actor: object, windows: int, limit: int, period_s: float) -> float:
    """The median start delay (ms) of unguarded messages sent ``limit`` at a time, one batch a period:
    what Dramatiq alone takes to start a message from the instant it is available."""
    run_id = ctx.new_run_id()
    first = time.time() + period_s
    for window in range(windows):
        time.sleep(max(0.0, first + window * period_s - time.time()))
        for _ in range(limit):
            actor.send(run_id, windows * limit, time.time())  # type: ignore[attr-defined]
    ctx.wait_finish(run_id)
    delays = [float(d) for d in cast(list[bytes], ctx.client.lrange(f"bench:paced:{run_id}", 0, -1))]
    return statistics.median(delays)


@scenario("throttle", title="Throttle: a backlog drained at the limit", order=42)
def throttle(ctx: Context) -> list[Figure]:
    """A backlog of N messages to one key throttled to L starts per period P, sent at once to a
    running worker of 2 processes x 8 threads (``bench/scenarios/throttle_actors.py``), each job 10 ms.

    * makespan (first send to last completion; the median of 3 drains, after a warm-up of N / 10
      on each row) over the ideal `(ceil(N / L) - 1) x P + 10 ms`: the first window admits at once, so
      the last of N / L windows opens N / L - 1 periods after the first send. (The issue's
      `N / L x P` is a period longer: a drain that lost most of a period would still meet it.)
    * start delay of each parked message: its start minus the moment its place opened, the start
      of the message that held the place plus P (the k-th start in time order took the place of
      the (k - L)-th); median and p95. Starts are the jobs' own clock readings on entry.
      Split by the pickup's time (when the worker thread took the message): a standby taken before
      its place opened, that blocked for it and was handed it by a push, or a message taken after
      (a hand-off re-enqueued on the broker, or a standby not taken in time): their share and medians.
    * broker pickups per message (a first middleware counts every message taken).
    * The same work under Dramatiq's `WindowRateLimiter(limit=L, window=P)` with `Retries`: the
      message raises `RateLimitExceeded` and is retried with a 100 ms - 2 s backoff (tuned down
      from Dramatiq's 15 s default minimum, as users of this pattern do; `max_retries` raised so
      that none dies): its makespan over the same ideal, retries burned per message, the most
      retries one message burned (Dramatiq's default `max_retries` is 20), pickups per message.
      Its window is whole seconds: the quick run's throttle period of 250 ms is 1 s for it.
    * The floor of the start delay: Dramatiq alone, no guard, the producer sending L messages at the
      start of each period (20 periods) to the same idle-between-windows worker; the median of each
      message's start minus its send. A throttled start cannot beat what the worker takes to start
      a message that is there to take (the guard's standbys and its reset of the consumers' back-off
      can). The makespan's floor follows from it: each window's places open a period after the
      starts they follow, so a start delay d delays the last window by `(ceil(N / L) - 1) x d`.

    The two take turns, one drain each per repeat, on the same worker; each drain has a key of its own.
    """
    limit, period_ms = ctx.n(100, 50), ctx.n(1000, 250)
    n, n_window = ctx.n(2000, 200), ctx.n(2000, 150)
    os.environ["BENCH_THROTTLE"] = f"{limit},{period_ms}"
    # The loader imported it inert (without BENCH_THROTTLE): import it again, armed.
    actors = importlib.reload(ctx.import_actors("bench.scenarios.throttle_actors"))
    ctx.worker(
        "bench.scenarios.throttle_actors",
        processes=PROCESSES,
        threads=THREADS,
        env={"BENCH_THROTTLE": os.environ["BENCH_THROTTLE"]},
    )
    period_s, window_s = period_ms / 1000, max(1, period_ms // 1000)
    rows: list[tuple[object, int, float, list[Drain]]] = [
        (actors.throttled_job, n, period_s, []),
        (actors.window_job, n_window, window_s, []),
    ]
    for actor, size, period, _ in [] if ctx.quick else rows:
        _drain_once(ctx, actor, max(limit, size // 10), limit, period)  # warm-up
    for actor, size, period, runs in in_turns(rows, ctx.repeats):
        runs.append(_drain_once(ctx, actor, size, limit, period))
    throttled, window = (median_run(runs) for *_, runs in rows)
    floor_ms = _paced_floor(ctx, actors.paced_job, ctx.n(20, 3), limit, period_s)
    ctx.stop_workers()
    how = f"limit {limit} per {period_ms} ms, {PROCESSES}x{THREADS}, median of {ctx.repeats}"
    how_window = f"limit {limit} per {window_s} s, {PROCESSES}x{THREADS}, median of {ctx.repeats}"
    ideal, ideal_window = ideal_s(n, limit, period_s), ideal_s(n_window, limit, window_s)
    return [
        Figure("throttle_makespan_ratio", "throttle drain makespan / ideal", throttled.ratio,
               vs="throttle/window_makespan_ratio", better="lower",
               detail=f"N={n}, {how}; {throttled.makespan_s:.2f} s against {ideal:.2f} s"),
        Figure("throttle_start_delay_ms", "throttle: start after the place opened (median)",
               throttled.delay_ms, "ms", better="lower", detail=f"{n - limit} parked starts of that drain"),
        Figure("paced_makespan_ratio", "floor: the ideal with Dramatiq's own start delay in each window, "
               "/ ideal", (ideal + (math.ceil(n / limit) - 1) * floor_ms / 1000) / ideal, better="lower",
               detail=f"{math.ceil(n / limit) - 1} windows after the first, each {floor_ms:.1f} ms late"),
        Figure("paced_start_delay_ms", "floor: Dramatiq alone starts a message sent when its place opens "
               "(median)", floor_ms, "ms", better="lower",
               detail=f"no guard; {limit} sent at the start of each of {ctx.n(20, 3)} periods"),
        Figure("throttle_start_delay_p95_ms", "throttle: start after the place opened (p95)",
               throttled.delay_p95_ms, "ms", better="lower"),
        Figure("throttle_blocked_share", "throttle: parked starts taken before their place opened (standbys)",
               throttled.blocked_share, detail=f"median delay {throttled.blocked_ms:.1f} ms for those, "
               f"{throttled.pushed_ms:.1f} ms for the others (taken off the broker after it opened)"),
        Figure("throttle_pickups", "broker pickups per message (throttle)", throttled.pickups,
               better="lower"),
        Figure("window_makespan_ratio", "WindowRateLimiter + Retries makespan / ideal", window.ratio,
               better="lower",
               detail=f"N={n_window}, {how_window}; {window.makespan_s:.2f} s against {ideal_window:.2f} s"),
        Figure("window_retries", "retries burned per message (WindowRateLimiter)", window.retries,
               better="lower", detail=f"at most {window.max_retries} for one message"),
        Figure("window_pickups", "broker pickups per message (WindowRateLimiter)", window.pickups,
               vs="throttle/throttle_pickups", better="lower"),
    ]  # fmt: skip
