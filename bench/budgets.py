"""The performance budgets (DESIGN.md section 4, issue #13), read off one run's figures.

Each budget names the figure it judges (a ratio of two figures of the run, or one figure as
it is) and, where one was measured, the *floor*: the same ratio for unguarded code doing
only the round trips the guard needs (a no-op script, ``SELECT 1``) and nothing else. A
budget the floor itself misses cannot be met on the machine that ran the bench; the report
says so and shows how far the guard is from the floor instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from bench.core import Figure

__all__ = ["BUDGETS", "Budget", "render_budgets"]


@dataclasses.dataclass(frozen=True)
class Budget:
    """One budget: ``figure`` (over ``base``, if given) must be ``op`` ``limit``.

    Parameters:
      what: The budget, as DESIGN.md or the issue words it.
      figure: ``"<scenario>/<key>"`` of the figure judged.
      op: ``">="``, ``"<="`` or ``"=="``.
      limit: The bound.
      base: The figure ``figure`` is divided by (a ratio budget), or None (the figure as it is).
      floor: The floor's figure, divided by ``base`` as well, or None if none is measured.
    """

    what: str
    figure: str
    op: Literal[">=", "<=", "=="]
    limit: float
    base: str | None = None
    floor: str | None = None

    def meets(self, value: float) -> bool:
        if self.op == "==":
            return value == self.limit
        return value >= self.limit if self.op == ">=" else value <= self.limit


def _drain(guard: str, label: str, floor: str = "floor") -> list[Budget]:
    """The drain-rate and worker-CPU budgets of a guard's row, against the floor row ``floor``."""
    return [
        Budget(f"{label}: drain rate >= 0.75x unguarded", f"cost/{guard}_drain_rate", ">=", 0.75,
               "cost/plain_drain_rate", f"cost/{floor}_drain_rate"),
        Budget(f"{label}: worker CPU per message <= 1.5x unguarded", f"cost/{guard}_cpu_ms", "<=", 1.5,
               "cost/plain_cpu_ms", f"cost/{floor}_cpu_ms"),
    ]  # fmt: skip


def _composed(row: str, label: str) -> list[Budget]:
    """The budgets of a two-guard row of the compose scenario: on the worker side, and with the send."""
    return [
        Budget(f"{label}: <= 1 extra round trip per message over one guard (worker side)",
               f"compose/{row}_extra_round_trips", "<=", 1),
        Budget(f"{label}: <= 1 extra round trip per message over one guard (send + worker)",
               f"compose/{row}_extra_round_trips_with_send", "<=", 1),
    ]  # fmt: skip


#: Every budget the bench can judge, in DESIGN.md's order.
BUDGETS: tuple[Budget, ...] = (
    # A RedisBroker on the guard's Redis: the lock and the push in one script.
    Budget("dedup: accepted send >= 0.9x a plain send", "dedup/send_rate", ">=", 0.9,
           "dedup/plain_send_rate", "dedup/fused_floor_send_rate"),
    Budget("dedup: duplicate send >= 1.0x a plain send", "dedup/duplicate_send_rate", ">=", 1.0,
           "dedup/plain_send_rate", "dedup/held_floor_send_rate"),
    Budget("concurrency: a send under its limit >= 0.9x a plain send", "dedup/concurrency_send_rate", ">=",
           0.9, "dedup/plain_send_rate", "dedup/reserve_floor_send_rate"),
    Budget("dedup: one round trip per send, as a plain send", "dedup/round_trips_per_send", "<=", 1),
    # Other brokers: the lock alone, then the broker's push.
    Budget("dedup: at most 6 Redis commands in the lock alone", "dedup/lock_commands_per_send", "<=", 6),
    *_drain("dedup", 'dedup="until_executed"'),
    *_drain("mutex", "mutex=True"),
    # 3,000 messages at once to a limit of 1,000 park 2,000: its floor moves a backlog too.
    *_drain("wide", "concurrency limit 1000 on one key", floor="backlog_floor"),
    Budget("installed, nobody opts in: send >= 0.97x plain", "cost/installed_send_rate", ">=", 0.97,
           "cost/plain_send_rate"),
    Budget("installed, nobody opts in: drain >= 0.97x plain", "cost/installed_drain_rate", ">=", 0.97,
           "cost/plain_drain_rate"),
    Budget("ledger on PostgreSQL: drain >= 0.85x a plain insert", "ledger/postgres_ledger_rate", ">=", 0.85,
           "ledger/postgres_plain_rate", "ledger/postgres_floor_rate"),
    Budget("per-operation Redis time flat (<= 1.5x) from limit 8 to 10,000", "cost/op_server_us_limit_10000",
           "<=", 1.5, "cost/op_server_us_limit_8"),
    Budget("per-operation Redis time flat (<= 1.5x) from 10 to 100,000 waiters",
           "cost/op_server_us_waiters_100000", "<=", 1.5, "cost/op_server_us_waiters_10"),
    Budget("per-operation Redis time flat (<= 1.5x) from 10 to 100,000 ready waiters (threads blocking)",
           "cost/op_server_us_ready_100000", "<=", 1.5, "cost/op_server_us_ready_10"),
    Budget("per-operation Redis time flat (<= 1.5x) from limit 8 to 10,000, releases sending standbys",
           "cost/op_server_us_park_limit_10000", "<=", 1.5, "cost/op_server_us_park_limit_8"),
    Budget("idle sweep <= 100 Redis commands / s / process, 10,000 waiting keys", "cost/sweep_due_commands",
           "<=", 100),
    Budget("slot drain within 5 % of the unguarded floor", "slots/slot_floor_ratio", "<=", 1.05),
    Budget("at most 1.05 broker pickups per message", "slots/slot_pickups", "<=", 1.05),
    Budget('mutex hand-off median <= 1.0 ms (on_busy="wait")', "slots/handoff_wait_ms", "<=", 1.0),
    Budget('mutex hand-off median <= 1.0 ms (on_busy="park")', "slots/handoff_park_ms", "<=", 1.0),
    # Issue #33: the ideal is (ceil(N / limit) - 1) x period + the last job (the first window admits at once).
    Budget("throttle: backlog drains in <= 1.03x its ideal", "throttle/throttle_makespan_ratio", "<=", 1.03,
           floor="throttle/paced_makespan_ratio"),
    Budget("throttle: parked message starts <= 10 ms after its place opens (median)",
           "throttle/throttle_start_delay_ms", "<=", 10, floor="throttle/paced_start_delay_ms"),
    # Issue #33: a debounced burst of 10,000 sends from one producer.
    Budget("debounce: at most one round trip per send (a burst of one key)",
           "debounce/one_key_round_trips_per_send", "<=", 1),
    Budget("debounce: at most one round trip per send (a burst of 10 keys)",
           "debounce/10_keys_round_trips_per_send", "<=", 1),
    Budget("debounce: one run per key of a burst", "debounce/runs_per_key", "==", 1),
    # Issue #33: two guards on one actor cost at most one round trip per message more than one guard.
    *_composed("throttle", "concurrency + throttle"),
    *_composed("mutex", "mutex + concurrency"),
    *_composed("list", "concurrency=[two limits]"),
)  # fmt: skip


#: Two identical measurements of one run (the unguarded row and its twin), whose ratio says how far
#: the run's noise alone moves a ratio: (what, twin, first).
NOISE: tuple[tuple[str, str, str], ...] = (
    ("send rate", "cost/again_send_rate", "cost/plain_send_rate"),
    ("drain rate", "cost/again_drain_rate", "cost/plain_drain_rate"),
    ("worker CPU per message", "cost/again_cpu_ms", "cost/plain_cpu_ms"),
)


def _value(figures: Mapping[str, Figure], name: str, base: str | None) -> float | None:
    figure = figures.get(name)
    if figure is None:
        return None
    if base is None:
        return figure.value
    denominator = figures.get(base)
    if denominator is None or denominator.value == 0:
        return None
    return figure.value / denominator.value


def _fmt(value: float, ratio: bool) -> str:
    return f"{value:.2f}x" if ratio else f"{value:,.2f}"


def render_budgets(figures: Mapping[str, Figure]) -> list[str]:
    """The report's budget table: each budget, its figure, the floor, and the verdict."""
    out = [
        "## Budgets",
        "",
        "Read off the figures above (`bench/budgets.py`). *Floor*: the same ratio for unguarded code",
        "doing only the round trips the guard needs (no-op script calls, `SELECT 1`) and nothing else;",
        "a budget the floor misses is out of reach on this machine, and *of the floor* says how much",
        "of what the machine allows the guard reaches (1.00x: all of it).",
        "",
        "| budget | measured | floor | of the floor | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for budget in BUDGETS:
        ratio = budget.base is not None
        value = _value(figures, budget.figure, budget.base)
        if value is None:
            out.append(f"| {budget.what} | n/a | | | not measured in this run |")
            continue
        floor = _value(figures, budget.floor, budget.base) if budget.floor else None
        share = ""
        if floor:
            share = f"{value / floor:.2f}x" if budget.op == ">=" else f"{floor / value:.2f}x"
        if budget.meets(value):
            verdict = "met"
        elif floor is not None and not budget.meets(floor):
            verdict = f"out of reach here: the floor is {_fmt(floor, ratio)}"
        else:
            verdict = "**missed**"
        out.append(
            f"| {budget.what} | {_fmt(value, ratio)} | {_fmt(floor, ratio) if floor is not None else '-'} "
            f"| {share or '-'} | {verdict} |"
        )
    twins = [(what, _value(figures, twin, first)) for what, twin, first in NOISE]
    measured = [f"{what} {ratio:.2f}x" for what, ratio in twins if ratio is not None]
    if measured:
        out += [
            "",
            "Noise: the unguarded row measured twice in this run, taking turns with the others, "
            f"compares to itself as {', '.join(measured)}; a verdict that close to its bound is not "
            "the guard's doing.",
        ]
    return out
