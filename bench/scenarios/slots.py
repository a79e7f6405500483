"""Concurrency slots and mutex hand-off, side by side with what Dramatiq users do today."""

from __future__ import annotations

import collections
import dataclasses
import glob
import importlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Collection
from typing import cast

from bench.core import SCRIPT_COMMANDS, Context, Figure, in_turns, median_run, scenario

PROCESSES, THREADS = 2, 8
LIMIT, JOB_S = 8, 0.010
#: Drains of the slot drain and of its floor, taking turns: one drain against the floor moves by
#: several hundredths from run to run (1.03-1.18x in 40 drains on 2026-11-26), and the budget is 1.05x.
SLOT_DRAIN_REPEATS = 5


def _scripts(ctx: Context) -> int:
    """How many Lua script calls (FCALL, EVALSHA, ...) the run's Redis has executed, from every client."""
    stats = ctx.client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in SCRIPT_COMMANDS)


def _drain(ctx: Context, actor: object, name: str, n: int) -> tuple[float, float, float]:
    """The median run of :attr:`Context.repeats` drains (by makespan): see :func:`_drain_once`.

    One drain's makespan moves by a tenth of the ideal from run to run on a two-core machine.
    """
    return median_run([_drain_once(ctx, actor, name, n) for _ in range(ctx.repeats)])


def _warm_up(ctx: Context, actor: object, name: str, n: int) -> None:
    """A first, unmeasured drain of ``n // 10`` messages on a worker just started.

    A worker's first messages pay for its connections and script loads; the figures are
    about a worker that has been running, as production workers have.
    """
    _drain_once(ctx, actor, name, max(1, n // 10))


def _drain_once(
    ctx: Context, actor: object, name: str, n: int, run_ids: list[str] | None = None
) -> tuple[float, float, float]:
    """(makespan / ideal, pickups per message, script calls per message) of ``n`` sends of ``actor``.

    Script calls count the broker's (enqueue, fetch, ack) and the guard's, from the sender
    and the workers alike. The drain's run id is appended to ``run_ids``, if given.
    """
    ctx.wake_up(actor.send, PROCESSES * THREADS)  # type: ignore[attr-defined]
    ctx.client.delete(f"bench:pickups:{name}")
    run_id = ctx.new_run_id()
    if run_ids is not None:
        run_ids.append(run_id)
    scripts = _scripts(ctx)
    start = time.time()
    for _ in range(n):
        actor.send(run_id, n)  # type: ignore[attr-defined]
    makespan = ctx.wait_finish(run_id) - start
    scripts = _scripts(ctx) - scripts
    ideal = n * JOB_S / LIMIT
    pickups = int(ctx.client.get(f"bench:pickups:{name}") or 0) / n
    return makespan / ideal, pickups, scripts / n


@dataclasses.dataclass(frozen=True)
class HandoffGaps:
    """How long freed slots stayed idle in some drains (see :func:`handoff_gaps`), in ms."""

    count: int
    mean_ms: float
    blocked: int
    blocked_mean_ms: float
    late_mean_ms: float


def handoff_gaps(directory: str, run_ids: Collection[str], slots: int = LIMIT) -> HandoffGaps:
    """The gaps from a job's end to the next job's start in the drains ``run_ids`` (the span files).

    Per drain, the k-th start after the first ``slots`` is paired with the earliest end before
    it not paired yet: the slot that freed first is the one taken. The next job was *blocked*
    if a worker thread had picked up its message before the slot freed (a standby blocking
    for it); if not, the slot waited for a thread to pick it up (a standby still on the
    broker, or fetched by a process whose threads were all busy). See ``slots_actors``.
    """
    jobs: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    pickups: dict[str, list[float]] = collections.defaultdict(list)
    for path in glob.glob(os.path.join(directory, "*.txt")):
        with open(path, encoding="ascii") as f:
            for line in f:
                kind, *fields = line.split()
                if kind == "J" and fields[2] in run_ids:
                    jobs[fields[2]].append((float(fields[0]), float(fields[1]), fields[3]))
                elif kind == "P":
                    pickups[fields[1]].append(float(fields[0]))
    blocked: list[float] = []
    late: list[float] = []
    for spans in jobs.values():
        starts = sorted(spans)
        ends = sorted(end for _, end, _ in spans)
        freed: collections.deque[float] = collections.deque()
        taken = 0
        for start, _, message_id in starts[slots:]:
            while taken < len(ends) and ends[taken] <= start:
                freed.append(ends[taken])
                taken += 1
            if not freed:
                continue
            free_at = freed.popleft()
            picked = max((t for t in pickups[message_id] if t <= start), default=start)
            (blocked if picked < free_at else late).append((start - free_at) * 1000)
    every = blocked + late
    return HandoffGaps(
        count=len(every),
        mean_ms=statistics.fmean(every) if every else 0.0,
        blocked=len(blocked),
        blocked_mean_ms=statistics.fmean(blocked) if blocked else 0.0,
        late_mean_ms=statistics.fmean(late) if late else 0.0,
    )


def _handoff_ms(ctx: Context, actor: object, n: int) -> float:
    """Median ms from one holder's end to the next holder's start, over ``n`` sequential runs."""
    run_id = ctx.new_run_id()
    for _ in range(n):
        actor.send(run_id, n)  # type: ignore[attr-defined]
    ctx.wait_finish(run_id)
    spans = sorted(
        tuple(map(float, cast(bytes, raw).decode().split(",")))
        for raw in ctx.client.lrange(f"bench:spans:{run_id}", 0, -1)
    )
    gaps = [(nxt[0] - cur[1]) * 1000 for cur, nxt in itertools.pairwise(spans)]
    return statistics.median(gaps)


@scenario("slots", title="Concurrency slots and mutex hand-off", order=40)
def slots(ctx: Context) -> list[Figure]:
    """Slot drain and hand-off latency (``bench/scenarios/slots_actors.py``), 2 processes x 8 threads.

    * slot drain: N messages of 10 ms on one key with limit 8, sent at once to a running
      worker, after a warm-up drain of N / 10 on each worker started; makespan (first send to
      last completion; the median of the repeats: 5 for the slot drain and its floor, 3 for the
      others) over the ideal N x 10 ms / 8, and
      broker pickups per message (a first middleware counts every message taken), for
      ``concurrency=8`` (with standbys, the default, and without: ``lookahead=0``, a worker of
      its own) and for Dramatiq's ``ConcurrentRateLimiter`` (RateLimitExceeded retried with a
      100 ms - 2 s backoff). The floor: the same jobs unguarded on a worker of exactly 8
      threads (1 x 8), the makespan Dramatiq itself reaches with 8 at a time on this machine;
      its worker runs beside the guarded one (each on a queue of its own) and the two drains
      take turns, one each per repeat. Each drain is preceded by 16 messages that wake the
      worker's consumers (an idle Dramatiq consumer polls less and less often, up to once a
      second), outside the figures.
    * hand-off gaps of the slot drain and its floor: every job's span and every pickup, written
      by the workers to files (:func:`handoff_gaps`); the mean gap from a job's end to the next
      start, and for the slot drain the share of freed slots whose next holder was a standby a
      thread was already blocked on, with the mean gap to those and to the others.
    * hand-off: M messages on one mutex key, each 2 ms; the median gap from one holder's end
      to the next one's start, for ``on_busy="wait"``, ``"park"`` (with a standby, and
      without) and redis-py's ``Lock`` (which polls every 0.1 s).
    """
    os.environ["BENCH_SLOTS"] = "1"
    # The loader imported it inert (without BENCH_SLOTS): import it again, armed.
    actors = importlib.reload(ctx.import_actors("bench.scenarios.slots_actors"))
    n = ctx.n(2000, 400)
    m = ctx.n(200, 40)
    ctx.flush()
    # Without standbys first (lookahead=0), on a worker of its own.
    env = {"BENCH_SLOTS": "1", "BENCH_SLOTS_LOOKAHEAD": "0"}
    ctx.worker("bench.scenarios.slots_actors", processes=PROCESSES, threads=THREADS, env=env)
    _warm_up(ctx, actors.slot_job, "slot_job", n)
    plain_ratio, plain_pickups, _ = _drain(ctx, actors.slot_job, "slot_job", n)
    plain_park_ms = _handoff_ms(ctx, actors.handoff_park, m)
    ctx.stop_workers()
    # The guarded worker and the floor's (1 x 8) run side by side, each on its own queue, and
    # the slot drain and the floor take turns: a slow spell of the machine falls on both alike.
    spans_dir = tempfile.mkdtemp(prefix="bench-slot-spans-")
    env = {"BENCH_SLOTS": "1", "BENCH_SLOTS_SPANS": spans_dir}
    ctx.worker(
        "bench.scenarios.slots_actors", processes=PROCESSES, threads=THREADS, env=env, queues=["bench_slots"]
    )
    ctx.worker("bench.scenarios.slots_actors", processes=1, threads=LIMIT, env=env, queues=["bench_floor"])
    _warm_up(ctx, actors.slot_job, "slot_job", n)
    _warm_up(ctx, actors.floor_job, "floor_job", n)
    slot_runs: list[tuple[float, float, float]] = []
    floor_runs: list[tuple[float, float, float]] = []
    slot_ids: list[str] = []
    floor_ids: list[str] = []
    drains = [
        (actors.slot_job, "slot_job", slot_runs, slot_ids),
        (actors.floor_job, "floor_job", floor_runs, floor_ids),
    ]
    rounds = 1 if ctx.quick else SLOT_DRAIN_REPEATS
    for actor, name, runs, run_ids in in_turns(drains, rounds):
        runs.append(_drain_once(ctx, actor, name, n, run_ids))
    slot_ratio, slot_pickups, slot_scripts = median_run(slot_runs)
    floor_ratio, _, floor_scripts = median_run(floor_runs)
    slot_gaps, floor_gaps = handoff_gaps(spans_dir, slot_ids), handoff_gaps(spans_dir, floor_ids)
    shutil.rmtree(spans_dir, ignore_errors=True)
    crl_ratio, crl_pickups, _ = _drain(ctx, actors.crl_job, "crl_job", n)
    wait_ms = _handoff_ms(ctx, actors.handoff_wait, m)
    park_ms = _handoff_ms(ctx, actors.handoff_park, m)
    redispy_ms = _handoff_ms(ctx, actors.handoff_redispy, m)
    ctx.stop_workers()
    drained = f"N={n} x 10 ms, limit {LIMIT}, {PROCESSES}x{THREADS}, median of {rounds} after a warm-up"
    drained_alone = (
        f"N={n} x 10 ms, limit {LIMIT}, {PROCESSES}x{THREADS}, median of {ctx.repeats} after a warm-up"
    )
    return [
        Figure(
            "slot_makespan_ratio",
            "slot drain makespan / ideal",
            slot_ratio,
            vs="slots/crl_makespan_ratio",
            better="lower",
            detail=drained,
        ),
        Figure(
            "floor_makespan_ratio",
            "unguarded floor: the same drain on exactly 8 threads (1 x 8), makespan / ideal",
            floor_ratio,
            better="lower",
            detail=f"N={n} x 10 ms, no guard, 1x{LIMIT}, median of {rounds} after a warm-up",
        ),
        Figure(
            "slot_floor_ratio",
            "slot drain makespan / unguarded floor",
            slot_ratio / floor_ratio,
            better="lower",
            detail="what the guard adds over what this machine allows",
        ),
        Figure(
            "slot_gap_ms",
            "slot drain: mean gap from a job's end to the next start (a freed slot idle)",
            slot_gaps.mean_ms,
            "ms",
            vs="slots/floor_gap_ms",
            better="lower",
            detail=f"{slot_gaps.count} freed slots of the {rounds} drains; the k-th start after the first "
            f"{LIMIT} paired with the earliest end before it",
        ),
        Figure(
            "floor_gap_ms", "unguarded floor: the same mean gap", floor_gaps.mean_ms, "ms", better="lower"
        ),
        Figure(
            "slot_gap_blocked_share",
            "slot drain: freed slots whose next holder was blocked on it (a standby picked up before)",
            slot_gaps.blocked / slot_gaps.count if slot_gaps.count else 0.0,
            detail=f"mean gap {slot_gaps.blocked_mean_ms:.2f} ms to those, {slot_gaps.late_mean_ms:.2f} ms "
            "to the others (a standby on the broker, or fetched by a process whose threads were all busy)",
        ),
        Figure(
            "slot_scripts",
            "Redis script calls per message (slots)",
            slot_scripts,
            vs="slots/floor_scripts",
            compare="delta",
            better="lower",
            detail="the broker's and the guard's, every client, during the drain",
        ),
        Figure(
            "floor_scripts",
            "Redis script calls per message (unguarded floor: the broker's own)",
            floor_scripts,
            better="lower",
        ),
        Figure(
            "slot_pickups", "broker pickups per message (slots)", slot_pickups, better="lower", detail=drained
        ),
        Figure(
            "slot_nolookahead_makespan_ratio",
            "slot drain makespan / ideal, without standbys (lookahead=0)",
            plain_ratio,
            vs="slots/slot_makespan_ratio",
            better="lower",
            detail=drained_alone,
        ),
        Figure(
            "slot_nolookahead_pickups",
            "broker pickups per message (slots, without standbys)",
            plain_pickups,
            better="lower",
        ),
        Figure("crl_makespan_ratio", "ConcurrentRateLimiter makespan / ideal", crl_ratio, better="lower"),
        Figure(
            "crl_pickups", "broker pickups per message (ConcurrentRateLimiter)", crl_pickups, better="lower"
        ),
        Figure(
            "handoff_wait_ms",
            'mutex hand-off, on_busy="wait" (median)',
            wait_ms,
            "ms",
            vs="slots/handoff_redispy_ms",
            better="lower",
        ),
        Figure(
            "handoff_park_ms",
            'mutex hand-off, on_busy="park" (median)',
            park_ms,
            "ms",
            vs="slots/handoff_redispy_ms",
            better="lower",
        ),
        Figure(
            "handoff_park_nolookahead_ms",
            'mutex hand-off, on_busy="park" without a standby (median)',
            plain_park_ms,
            "ms",
            vs="slots/handoff_park_ms",
            better="lower",
        ),
        Figure("handoff_redispy_ms", "redis-py Lock hand-off (median)", redispy_ms, "ms", better="lower"),
    ]
