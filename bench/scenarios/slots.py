"""Concurrency slots and mutex hand-off, side by side with what Dramatiq users do today."""

from __future__ import annotations

import importlib
import itertools
import os
import statistics
import time
from typing import cast

from bench.core import Context, Figure, in_turns, median_run, scenario

PROCESSES, THREADS = 2, 8
LIMIT, JOB_S = 8, 0.010
#: Drains of the slot drain and of its floor, taking turns: one drain against the floor moves by
#: several hundredths from run to run (1.03-1.18x in 40 drains on 2026-11-26), and the budget is 1.05x.
SLOT_DRAIN_REPEATS = 5


def _scripts(ctx: Context) -> int:
    """How many Lua script calls (EVALSHA, EVAL) the run's Redis has executed, from every client."""
    stats = ctx.client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))


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


def _drain_once(ctx: Context, actor: object, name: str, n: int) -> tuple[float, float, float]:
    """(makespan / ideal, pickups per message, script calls per message) of ``n`` sends of ``actor``.

    Script calls count the broker's (enqueue, fetch, ack) and the guard's, from the sender
    and the workers alike.
    """
    ctx.wake_up(actor.send, PROCESSES * THREADS)  # type: ignore[attr-defined]
    ctx.client.delete(f"bench:pickups:{name}")
    run_id = ctx.new_run_id()
    scripts = _scripts(ctx)
    start = time.time()
    for _ in range(n):
        actor.send(run_id, n)  # type: ignore[attr-defined]
    makespan = ctx.wait_finish(run_id) - start
    scripts = _scripts(ctx) - scripts
    ideal = n * JOB_S / LIMIT
    pickups = int(ctx.client.get(f"bench:pickups:{name}") or 0) / n
    return makespan / ideal, pickups, scripts / n


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
    env = {"BENCH_SLOTS": "1"}
    ctx.worker(
        "bench.scenarios.slots_actors", processes=PROCESSES, threads=THREADS, env=env, queues=["bench_slots"]
    )
    ctx.worker("bench.scenarios.slots_actors", processes=1, threads=LIMIT, env=env, queues=["bench_floor"])
    _warm_up(ctx, actors.slot_job, "slot_job", n)
    _warm_up(ctx, actors.floor_job, "floor_job", n)
    slot_runs: list[tuple[float, float, float]] = []
    floor_runs: list[tuple[float, float, float]] = []
    drains = [(actors.slot_job, "slot_job", slot_runs), (actors.floor_job, "floor_job", floor_runs)]
    rounds = 1 if ctx.quick else SLOT_DRAIN_REPEATS
    for actor, name, runs in in_turns(drains, rounds):
        runs.append(_drain_once(ctx, actor, name, n))
    slot_ratio, slot_pickups, slot_scripts = median_run(slot_runs)
    floor_ratio, _, floor_scripts = median_run(floor_runs)
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
