"""The baseline: plain Dramatiq on a RedisBroker, no guard."""

from __future__ import annotations

from bench.core import Context, Figure, scenario

PROCESSES, THREADS = 2, 8


@scenario("baseline", title="Plain Dramatiq on a RedisBroker (no guard)", order=0)
def baseline(ctx: Context) -> list[Figure]:
    """Plain Dramatiq 2 on a RedisBroker, trivial actors (``bench/actors/plain.py``).

    * send rate: ``actor.send(i)`` N times from one thread, no worker running.
    * commands / round trips per send: INFO commandstats deltas (every command Redis ran,
      including those inside the broker's Lua script) and the requests this process wrote,
      over a separate batch of sends.
    * drain rate: a real ``dramatiq`` worker (2 processes x 8 threads) is started and ready;
      the clock runs from the first of N sends to the moment the N-th completion happened
      (the actor that completes last pushes its time to a Redis list the bench BLPOPs).
      Each completion costs one INCR, in every scenario alike.
    """
    actors = ctx.import_actors("bench.actors.plain")
    n_send = ctx.n(5000, 300)
    n_count = ctx.n(500, 50)
    n_drain = ctx.n(5000, 300)

    send_rate = ctx.send_rate(lambda i: actors.noop.send(i), n_send)
    calls = ctx.count_calls(lambda i: actors.noop.send(i), n_count)

    ctx.flush()
    ctx.worker("bench.actors.plain", processes=PROCESSES, threads=THREADS)
    drain_rate = ctx.drain_rate(lambda run_id, total, i: actors.tick.send(run_id, total), n_drain)
    ctx.stop_workers()

    sized = f"N={n_send}, median of {ctx.repeats}"
    return [
        Figure("send_rate", "send rate", send_rate, "msg/s", detail=sized),
        Figure(
            "commands_per_send",
            "Redis commands per send",
            calls.commands,
            better="lower",
            detail=f"over {calls.calls} sends: {calls.breakdown()}",
        ),
        Figure(
            "round_trips_per_send",
            "Redis round trips per send",
            calls.round_trips,
            better="lower",
            detail=f"requests written by the sender, over {calls.calls} sends",
        ),
        Figure(
            "drain_rate",
            f"drain rate ({PROCESSES} processes x {THREADS} threads)",
            drain_rate,
            "msg/s",
            detail=f"N={n_drain}, first send to last completion, median of {ctx.repeats}",
        ),
    ]
