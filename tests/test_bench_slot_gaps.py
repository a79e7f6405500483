"""The slots bench's hand-off gaps: a freed slot's idle time, to a blocked standby or to a late one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios.slots import handoff_gaps


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="ascii")


def test_each_start_after_the_first_slots_takes_the_earliest_freed_slot(tmp_path: Path) -> None:
    # Two slots. a and b run first; c was picked up (blocked) before a ended, d only after b ended.
    _write(tmp_path / "1.txt", ["P 0.0 a", "P 0.0 b", "P 0.005 c", "J 0.000 0.010 r a", "J 0.001 0.011 r c"])
    _write(tmp_path / "2.txt", ["P 0.014 d", "J 0.0005 0.012 r b", "J 0.015 0.025 r d", "J 0.0 0.01 other x"])
    gaps = handoff_gaps(str(tmp_path), {"r"}, slots=2)
    # Sorted starts: a 0.000, b 0.0005, c 0.001 (before any end: no freed slot to pair), d 0.015.
    # d takes the earliest freed slot (a's, ended 0.010): a gap of 5 ms, and it was late.
    assert (gaps.count, gaps.blocked) == (1, 0)
    assert gaps.late_mean_ms == pytest.approx(5.0)


def test_a_standby_picked_up_before_the_slot_freed_counts_as_blocked(tmp_path: Path) -> None:
    _write(
        tmp_path / "1.txt",
        [
            "P 0.0 a",
            "J 0.000 0.010 r a",
            "P 0.002 b",  # picked up while a ran: blocked on the slot
            "J 0.0105 0.020 r b",
            "J 0.023 0.030 r c",  # its pickup after b ended
            "P 0.022 c",
        ],
    )
    gaps = handoff_gaps(str(tmp_path), {"r"}, slots=1)
    assert (gaps.count, gaps.blocked) == (2, 1)
    assert gaps.blocked_mean_ms == pytest.approx(0.5)
    assert gaps.late_mean_ms == pytest.approx(3.0)
    assert gaps.mean_ms == pytest.approx(1.75)
