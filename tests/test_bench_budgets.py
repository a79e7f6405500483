"""The bench's budget table: a budget is met, missed, or out of reach when its floor misses it too."""

from __future__ import annotations

from bench.budgets import BUDGETS, render_budgets
from bench.core import Figure


def _figures(**values: float) -> dict[str, Figure]:
    return {name.replace("__", "/"): Figure(name, name, value) for name, value in values.items()}


def _row(lines: list[str], what: str) -> str:
    return next(line for line in lines if line.startswith(f"| {what} |"))


def test_a_ratio_budget_is_met_missed_or_out_of_reach_against_its_floor() -> None:
    what = "mutex=True: drain rate >= 0.75x unguarded"
    common = {"cost__plain_drain_rate": 1000.0}
    met = render_budgets(_figures(**common, cost__mutex_drain_rate=800.0, cost__floor_drain_rate=900.0))
    assert _row(met, what).endswith("| 0.80x | 0.90x | 0.89x | met |")
    missed = render_budgets(_figures(**common, cost__mutex_drain_rate=600.0, cost__floor_drain_rate=900.0))
    assert _row(missed, what).endswith("| **missed** |")
    out_of_reach = render_budgets(
        _figures(**common, cost__mutex_drain_rate=500.0, cost__floor_drain_rate=660.0)
    )
    assert _row(out_of_reach, what).endswith("| 0.76x | out of reach here: the floor is 0.66x |")


def test_an_upper_bound_on_cpu_reads_the_floor_the_other_way() -> None:
    what = "mutex=True: worker CPU per message <= 1.5x unguarded"
    lines = render_budgets(_figures(cost__plain_cpu_ms=0.3, cost__mutex_cpu_ms=0.6, cost__floor_cpu_ms=0.51))
    # 2.0x against a floor of 1.7x: the guard reaches 0.85x of what the machine allows.
    assert _row(lines, what).endswith("| 2.00x | 1.70x | 0.85x | out of reach here: the floor is 1.70x |")


def test_the_concurrency_row_is_judged_against_the_backlog_floor() -> None:
    what = "concurrency limit 1000 on one key: drain rate >= 0.75x unguarded"
    lines = render_budgets(
        _figures(
            cost__plain_drain_rate=1000.0,
            cost__wide_drain_rate=400.0,
            cost__floor_drain_rate=700.0,
            cost__backlog_floor_drain_rate=500.0,
        )
    )
    # Half of its messages park: the floor that moves a backlog (0.50x), not the plain one (0.70x).
    assert _row(lines, what).endswith("| 0.40x | 0.50x | 0.80x | out of reach here: the floor is 0.50x |")


def test_a_budget_whose_figures_were_not_measured_says_so() -> None:
    lines = render_budgets({})
    assert len([line for line in lines if line.endswith("| not measured in this run |")]) == len(BUDGETS)


def test_a_plain_figure_budget_is_judged_as_it_is() -> None:
    lines = render_budgets(_figures(dedup__lock_commands_per_send=6.0))
    assert _row(lines, "dedup: at most 6 Redis commands in the lock alone").endswith("| 6.00 | - | - | met |")


def test_the_runs_noise_is_read_off_the_unguarded_row_and_its_twin() -> None:
    lines = render_budgets(
        _figures(cost__plain_drain_rate=1000.0, cost__again_drain_rate=970.0, cost__plain_cpu_ms=0.5)
    )
    [noise] = [line for line in lines if line.startswith("Noise:")]
    assert "drain rate 0.97x" in noise and "CPU" not in noise  # the CPU twin was not measured
    assert not [line for line in render_budgets({}) if line.startswith("Noise:")]


def test_measurements_take_turns_and_none_always_follows_the_same_one() -> None:
    from bench.core import in_turns

    items = "abcdefg"
    turns = "".join(in_turns(items, 5))
    rounds = [turns[i : i + len(items)] for i in range(0, len(turns), len(items))]
    assert all(sorted(r) == sorted(items) for r in rounds) and len(rounds) == 5
    assert turns == "".join(in_turns(items, 5))  # the same order every run
    for item in items:
        followers = {r[r.index(item) + 1] for r in rounds if not r.endswith(item)}
        assert len(followers) > 1, f"{item} is always followed by {followers}"
    assert list(in_turns([1, 2], 0)) == []


def test_the_throttle_row_is_judged_on_its_makespan_and_its_start_delay() -> None:
    figures = _figures(throttle__throttle_makespan_ratio=1.02, throttle__throttle_start_delay_ms=12.5)
    lines = render_budgets(figures)
    assert _row(lines, "throttle: backlog drains in <= 1.03x its ideal").endswith("| 1.02 | - | - | met |")
    delay = "throttle: parked message starts <= 10 ms after its place opens (median)"
    assert _row(lines, delay).endswith("| 12.50 | - | - | **missed** |")


def test_one_run_per_key_is_missed_by_a_run_too_many_and_by_one_too_few() -> None:
    what = "debounce: one run per key of a burst"
    assert _row(render_budgets(_figures(debounce__runs_per_key=1.0)), what).endswith("| 1.00 | - | - | met |")
    for runs in (1.1, 0.9):
        lines = render_budgets(_figures(debounce__runs_per_key=runs))
        assert _row(lines, what).endswith("| **missed** |")


def test_a_two_guard_row_is_judged_on_its_extra_round_trips_on_the_worker_and_with_the_send() -> None:
    lines = render_budgets(
        _figures(compose__mutex_extra_round_trips=0.9, compose__mutex_extra_round_trips_with_send=1.9)
    )
    worker = "mutex + concurrency: <= 1 extra round trip per message over one guard (worker side)"
    assert _row(lines, worker).endswith("| 0.90 | - | - | met |")
    with_send = "mutex + concurrency: <= 1 extra round trip per message over one guard (send + worker)"
    assert _row(lines, with_send).endswith("| 1.90 | - | - | **missed** |")
