"""A debounced burst of sends from one producer: its round trips, its send rate, its runs (issue #33)."""

from __future__ import annotations

import importlib
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from bench.core import CallCounts, Context, Figure, in_turns, scenario
from bench.scenarios.debounce_actors import QUEUE, runs_key
from dramatiq_guard.backends import RedisBackend

PROCESSES, THREADS = 2, 8
#: The debounce wait, and the keys of the few-keys row (the sends go round them in turn).
WAIT_MS, FEW_KEYS = 500, 10
#: Rounds of the bursts (each row once per round, in turns).
ROUNDS = 5


class Run(NamedTuple):
    """A run of a burst: when it started, after its key's last send, and whether it had that send."""

    delay_ms: float
    last: bool


class Burst(NamedTuple):
    """One burst: its send rate, and the runs it made (one per key, if all went well)."""

    rate: float
    keys: int
    runs: list[Run]


def _await_runs(ctx: Context, backend: RedisBackend, run_id: str, keys: int, timeout: float) -> list[bytes]:
    """The runs of burst ``run_id`` (at least ``keys`` of them), once nothing of it is pending.

    Nothing is pending when no key has a parked run left (the backend's waiting keys) and the
    debounced actor's queue holds no message (a run handed off, not yet acked).
    """
    found: list[bytes] = []
    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(ctx.redis_url, socket_timeout=None) as client:
        while time.monotonic() < deadline:
            item = client.blpop([runs_key(run_id)], timeout=0.1)
            if item is not None:
                found.append(item[1])
            elif (
                len(found) >= keys
                and not backend.waiting_keys()
                and not client.hlen(f"dramatiq:{QUEUE}.msgs")
            ):
                return found
    raise TimeoutError(f"debounce burst {run_id}: {len(found)} runs of {keys} keys after {timeout:g} s")


def _burst(ctx: Context, backend: RedisBackend, actor: Any, n: int, keys: int, *, debounced: bool) -> Burst:
    """``n`` sends of ``actor`` over ``keys`` keys in turn (send ``i`` has key ``i % keys``), from this
    thread; for the debounced actor, then its runs. The plain actor's queue is emptied after."""
    run_id = ctx.new_run_id()
    last_sent: dict[int, float] = {}
    start = time.perf_counter()
    for i in range(n):
        actor.send(run_id, i % keys, i)
        last_sent[i % keys] = time.time()
    rate = n / (time.perf_counter() - start)
    if not debounced:
        ctx.client.delete(f"dramatiq:{actor.queue_name}", f"dramatiq:{actor.queue_name}.msgs")
        return Burst(rate, keys, [])
    runs = []
    for line in _await_runs(ctx, backend, run_id, keys, timeout=60):
        started, key, index = line.split()
        runs.append(Run((float(started) - last_sent[int(key)]) * 1000, int(index) >= n - keys))
    return Burst(rate, keys, runs)


def _round_trips(counts: CallCounts, what: str) -> list[Figure]:
    return [
        Figure(
            f"{what}_round_trips_per_send",
            f"Redis round trips per send ({what.replace('_', ' ')})",
            counts.round_trips,
            vs="baseline/round_trips_per_send",
            compare="delta",
            better="lower",
            detail=f"requests written by the sender, over {counts.calls} sends; "
            f"{counts.background_round_trips:.2f} by its other threads",
        ),
        Figure(
            f"{what}_commands_per_send",
            f"Redis commands per send ({what.replace('_', ' ')})",
            counts.commands,
            vs="baseline/commands_per_send",
            compare="delta",
            better="lower",
            detail=f"INFO commandstats, inside scripts too: {counts.breakdown()}",
        ),
    ]


def _delays(bursts: Sequence[Burst]) -> list[float]:
    return sorted(run.delay_ms for burst in bursts for run in burst.runs)


@scenario("debounce", title="Debounce: a burst of sends of one key, from one producer", order=43)
def debounce(ctx: Context) -> list[Figure]:
    """A debounced actor (`debounce={"wait": 500, "key": ...}`, `bench/scenarios/debounce_actors.py`)
    sent N = 10,000 times in a row from one producer thread (this process), with one key, and with
    10 keys in turn (1,000 sends each); a real worker (2 processes x 8 threads, the guard installed
    with its defaults: a sweep every second) runs the bursts' runs.

    * round trips and commands per send: as in the baseline (requests the sending thread wrote;
      INFO commandstats deltas, the commands inside the script too), over a batch of sends of one
      key, and of 10 keys, before the worker starts.
    * send rate: N sends of the debounced actor over the time they took, against N sends of an
      actor without options on the same broker (its queue not consumed): the three bursts (plain,
      one key, 10 keys) take turns, 5 rounds, medians. The worker runs meanwhile.
    * runs: after each debounced burst, the runs the worker made, counted until no key of the
      burst has a parked run left and the actor's queue is empty: one per key is the promise,
      each with its key's last send (its arguments carry the send's index). (A producer stalled
      for longer than the wait in the middle of a burst would make two bursts of it, and two
      runs, rightly: the sends go on at thousands a second, a stall of 500 ms is the machine's.)
    * last send to the run's start: the run's `time.time()` on entry minus the producer's right
      after its key's last send returned, against the wait. A worker's sweep hands the run to the
      broker when it is due if one of its passes (every `sweep_interval`, 1 s) followed the send, else
      at its next pass; the worker's consumers, idle since the last run, look at their queue less and
      less often, up to once a second (see `Context.wake_up`): the run starts up to about a second
      after it is due (docs/debounce.md, "Timing").
    """
    os.environ["BENCH_DEBOUNCE"] = str(WAIT_MS)
    # The loader imported it inert (without BENCH_DEBOUNCE): import it again, armed.
    actors = importlib.reload(ctx.import_actors("bench.scenarios.debounce_actors"))
    n, n_count = ctx.n(10_000, 300), ctx.n(1000, 100)
    one = ctx.count_calls(lambda i: actors.debounced.send("count", 0, i), n_count)
    few = ctx.count_calls(lambda i: actors.debounced.send("count", i % FEW_KEYS, i), n_count)
    ctx.worker(
        "bench.scenarios.debounce_actors",
        processes=PROCESSES,
        threads=THREADS,
        env={"BENCH_DEBOUNCE": os.environ["BENCH_DEBOUNCE"]},
        queues=[QUEUE],  # not the plain actor's: its sends are only sent
    )
    backend = RedisBackend.from_url(ctx.redis_url)
    rows: list[tuple[str, Any, int, bool]] = [
        ("plain", actors.plain, 1, False),
        ("one", actors.debounced, 1, True),
        ("few", actors.debounced, FEW_KEYS, True),
    ]
    if ctx.quick:  # each debounced burst waits a second or so for its runs: one of them will do
        del rows[1]
    bursts: dict[str, list[Burst]] = {name: [] for name, *_ in rows}
    try:
        for name, actor, keys, debounced in in_turns(rows, 1 if ctx.quick else ROUNDS):
            bursts[name].append(_burst(ctx, backend, actor, n, keys, debounced=debounced))
    finally:
        backend.close()
    ctx.stop_workers()
    done = [burst for name in ("one", "few") for burst in bursts.get(name, [])]
    keys = sum(burst.keys for burst in done)
    runs = [run for burst in done for run in burst.runs]
    delays = _delays(done)
    sized = f"N={n}, one producer thread, median of {len(bursts['plain'])} bursts taking turns"
    labels = {
        "plain": "send rate, plain (an actor without options, same broker)",
        "one": "send rate, debounced burst of one key",
        "few": f"send rate, debounced burst of {FEW_KEYS} keys in turn",
    }
    keys_of = {"plain": "plain", "one": "one_key", "few": f"{FEW_KEYS}_keys"}
    rates = [
        Figure(f"{keys_of[name]}_send_rate", labels[name], statistics.median(b.rate for b in found), "msg/s",
               vs="baseline/send_rate" if name == "plain" else "debounce/plain_send_rate", detail=sized)
        for name, found in bursts.items()
    ]  # fmt: skip
    return [
        *_round_trips(one, "one_key"),
        *_round_trips(few, f"{FEW_KEYS}_keys"),
        *rates,
        Figure("runs_per_key", "runs per key of a burst", len(runs) / keys, better="lower",
               detail=f"{len(runs)} runs for {keys} keys in {len(done)} bursts ({len(bursts.get('one', []))} "
               f"of one key, {len(bursts['few'])} of {FEW_KEYS})"),
        Figure("last_send_runs", "runs with their key's last send", sum(r.last for r in runs) / len(runs),
               detail="the share of runs whose arguments are their key's last send's"),
        Figure("run_delay_ms", "last send to the run's start (median)", statistics.median(delays), "ms",
               better="lower", detail=f"wait {WAIT_MS} ms, sweep every 1 s; over {len(delays)} runs"),
        Figure("run_delay_max_ms", "last send to the run's start (max)", delays[-1], "ms", better="lower",
               detail=f"{delays[-1] - WAIT_MS:.0f} ms after the run was due"),
    ]  # fmt: skip
