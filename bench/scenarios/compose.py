"""Two guards on one actor against one: the round trips a message costs, and the drain rate (issue #33)."""

from __future__ import annotations

import importlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from bench.actors.traffic import PUBLISH_EVERY_S, read_traffic
from bench.core import Context, Figure, in_turns, median_run, scenario
from bench.scenarios import cost
from bench.scenarios.compose_actors import GUARDS, guard_count

#: Rounds of the drains (each row once per round, in turns).
ROUNDS = 5
#: The longest wait for a worker's guard threads to go quiet after a drain.
SETTLE_TIMEOUT_S = 10.0
SWEEP = "requests dramatiq-guard-sweep"
#: The guard's function library prefix, left out of the functions' names in the report.
_LIBRARY = re.compile(r"dramatiq_guard_[0-9a-f]+_")


def _busy(counts: Counter[str]) -> dict[str, int]:
    """The requests of every thread but the sweep's (which goes on, once a second, when all is done)."""
    return {k: v for k, v in counts.items() if k.startswith("requests ") and k != SWEEP}


def _settled(ctx: Context) -> Counter[str]:
    """The workers' published counts, once no thread but the sweep has sent anything for three publishes
    (a drain's last releases go out in batches, off the worker threads)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = read_traffic(ctx.client)
    while time.monotonic() < deadline:
        time.sleep(3 * PUBLISH_EVERY_S)
        now = read_traffic(ctx.client)
        if _busy(now) == _busy(last):
            return now
        last = now
    raise TimeoutError(f"the workers' guard traffic did not settle within {SETTLE_TIMEOUT_S:g} s")


#: Counts per message: ``requests <thread>`` and ``commands <name>`` (see bench.actors.traffic).
PerMessage = dict[str, float]


def _minus(a: PerMessage | Counter[str], b: PerMessage | Counter[str]) -> PerMessage:
    return {k: a.get(k, 0) - b.get(k, 0) for k in {*a, *b}}


def _drain(ctx: Context, pids: list[int], actor: Any, n: int) -> tuple[tuple[float, ...], PerMessage]:
    """One stopped-worker drain of ``n`` messages (:func:`bench.scenarios.cost._drain_once`): its rate,
    worker CPU and Redis commands per message, and the guard client's counts per message.

    The counts include the wake-up messages the drain starts with (the same actor's).
    """
    before = _settled(ctx)
    figures = cost._drain_once(ctx, pids, actor, n)
    messages = n + cost.PROCESSES * cost.THREADS
    return figures, {k: v / messages for k, v in _minus(_settled(ctx), before).items() if v}


def _sender(actor: Any) -> Callable[[int], object]:
    return lambda i: actor.send("count", 1, i)


def _median(drains: Sequence[tuple[tuple[float, ...], PerMessage]]) -> tuple[tuple[float, ...], PerMessage]:
    """The median drain by rate (:func:`bench.core.median_run`), with its counts."""
    at = median_run([(figures[0], float(i)) for i, (figures, _) in enumerate(drains)])[1]
    return drains[int(at)]


def _requests(counts: PerMessage) -> float:
    return sum(v for k, v in counts.items() if k.startswith("requests "))


def _breakdown(counts: PerMessage, prefix: str) -> str:
    parts = sorted(
        ((_LIBRARY.sub("", k.removeprefix(prefix)), v) for k, v in counts.items() if k.startswith(prefix)),
        key=lambda kv: -kv[1],
    )
    return ", ".join(f"{name} {value:.3g}" for name, value in parts if abs(value) >= 0.005) or "none"


@scenario("compose", title="Composed guards: two guards on one actor against one", order=41)
def compose(ctx: Context) -> list[Figure]:
    """The same backlog drained through actors with no guard, one guard, and two guards whose limits
    never bind (`bench/scenarios/compose_actors.py`): `concurrency` on one key (limit 1,000,000), then
    `concurrency` + `throttle` (1,000,000 per second, the same key), `mutex` (a key per message) +
    `concurrency`, and a list of two limits, `concurrency=[...]` (the one key, and a key per
    message). The guard has a Redis client of its own, whose every request each worker process
    counts (by thread: the worker threads, which acquire before the actor; the release thread, which
    releases finished messages in batches; the sweep) and by command.

    * round trips per message on the worker side: every request of the guard's client in the worker
      processes over a drain (acquires, releases, sweeps, hand-off confirmations), counted after the
      drain's last batch of releases went out, divided by its messages; and the extra round trips
      of each two-guard row over the one-guard row, with the commands that make them.
    * round trips per send on the sender side: as in the baseline, over a batch of sends before the
      worker starts (a send that reserves its slot does it in the broker's push, one script).
    * drain rate: as the `cost` scenario drains (N sent while the worker of 2 processes x 8 threads
      is stopped, from when it goes on to the last completion), the rows taking turns, 5 rounds,
      each row's median drain, after a warm-up drain of N / 10 each; the worker CPU and every Redis
      command per message (the broker's too) during that drain.
    """
    os.environ["BENCH_COMPOSE"] = "1"
    # The loader imported it inert (without BENCH_COMPOSE): import it again, armed.
    actors = importlib.reload(ctx.import_actors("bench.scenarios.compose_actors"))
    n, n_count = ctx.n(2000, 100), ctx.n(500, 50)
    sends = {row: ctx.count_calls(_sender(actor), n_count) for row, actor in actors.ACTORS.items()}
    worker = ctx.worker(
        "bench.scenarios.compose_actors",
        processes=cost.PROCESSES,
        threads=cost.THREADS,
        env={"BENCH_COMPOSE": "1"},
    )
    pids = worker.worker_pids
    rows = list(actors.ACTORS.items())
    if not ctx.quick:
        for _, actor in rows:
            cost._drain_once(ctx, pids, actor, max(1, n // 10), warm_up=True)
    runs: dict[str, list[tuple[tuple[float, ...], PerMessage]]] = {row: [] for row, _ in rows}
    for row, actor in in_turns(rows, 1 if ctx.quick else ROUNDS):
        runs[row].append(_drain(ctx, pids, actor, n))
    ctx.stop_workers()
    sized = (
        f"N={n} sent with the worker stopped, then {cost.PROCESSES}x{cost.THREADS} from a full queue to the "
        f"last completion; median of {len(runs['one'])} drains taking turns with the other rows"
    )
    medians = {row: _median(found) for row, found in runs.items()}
    figures: list[Figure] = []
    for row, _ in rows:
        label, options = GUARDS[row]
        (rate, cpu_ms, commands), counts = medians[row]
        vs = None if row == "one" else "compose/one"
        figures += [
            Figure(f"{row}_drain_rate", f"{label}: drain rate", rate, "msg/s", vs=vs and f"{vs}_drain_rate",
                   detail=sized),
            Figure(f"{row}_round_trips", f"{label}: guard round trips per message, worker side",
                   _requests(counts), vs=vs and f"{vs}_round_trips", compare="delta", better="lower",
                   detail=f"by thread: {_breakdown(counts, 'requests ')}; commands: "
                   f"{_breakdown(counts, 'commands ')} (the guard's client, that drain)"),
            Figure(f"{row}_send_round_trips", f"{label}: round trips per send, sender side",
                   sends[row].round_trips, vs=vs and f"{vs}_send_round_trips", compare="delta",
                   better="lower", detail=f"over {sends[row].calls} sends: {sends[row].breakdown()}"),
            Figure(f"{row}_cpu_ms", f"{label}: worker CPU per message", cpu_ms, "ms",
                   vs=vs and f"{vs}_cpu_ms", better="lower"),
            Figure(f"{row}_commands", f"{label}: Redis commands per message (every client)", commands,
                   vs=vs and f"{vs}_commands", compare="delta", better="lower"),
        ]  # fmt: skip
        if guard_count(options) == 2:
            one = medians["one"][1]
            extra, extra_sends = _minus(counts, one), sends[row].round_trips - sends["one"].round_trips
            figures += [
                Figure(f"{row}_extra_round_trips", f"{label}: extra round trips per message over one guard",
                       _requests(counts) - _requests(one), better="lower",
                       detail=f"worker side, the two rows' median drains: by thread "
                       f"{_breakdown(extra, 'requests ')}; commands {_breakdown(extra, 'commands ')}"),
                Figure(f"{row}_extra_round_trips_with_send",
                       f"{label}: extra round trips per message over one guard, with the send",
                       _requests(counts) - _requests(one) + extra_sends, better="lower",
                       detail=f"the worker side's and {extra_sends:+.2f} at the send"),
            ]  # fmt: skip
    return figures
