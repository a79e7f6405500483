"""dramatiq-guard's benchmark harness: named scenarios, run side by side in one run.

Run it from the repository root::

    .venv/bin/python -m bench            # every scenario, writes docs/benchmarks.md
    .venv/bin/python -m bench --quick    # small sizes, prints the report (the CI smoke)

One run starts one private ``redis-server`` on a free port, runs every
scenario against it in turn, and writes one report, so figures of different
scenarios are comparable, as ratios to the ``baseline`` scenario (plain
Dramatiq on a RedisBroker). Budgets are checked as those ratios, never as
timed tests.

Adding a scenario: drop a module into ``bench/scenarios/``; it is imported
automatically. Register a function with :func:`bench.core.scenario`; it gets a
:class:`bench.core.Context` and returns :class:`bench.core.Figure` objects::

    from bench.core import Context, Figure, scenario

    @scenario("dedup", title="Deduplicated sends", order=10)
    def dedup(ctx: Context) -> list[Figure]:
        \"\"\"What it measures and how (this docstring goes into the report).\"\"\"
        actors = ctx.import_actors("bench.actors.dedup")     # the worker-side module, imported here too
        rate = ctx.send_rate(lambda i: actors.job.send(i), ctx.n(5000, 300))
        calls = ctx.count_calls(lambda i: actors.job.send(i), ctx.n(500, 50))
        return [
            Figure("send_rate", "send rate", rate, "msg/s", vs="baseline/send_rate"),
            Figure("round_trips", "round trips per send", calls.round_trips, "",
                   vs="baseline/round_trips_per_send", compare="delta", better="lower"),
        ]

Worker-side actor modules live in ``bench/actors/`` and take the Redis URL from
``BENCH_REDIS_URL`` (``bench.actors.redis_url()``); completions are signalled to the
bench with :func:`bench.actors.cross_finish_line`, awaited by :meth:`Context.wait_finish`.
"""
