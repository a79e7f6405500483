"""The throttle bench's ideal and start delays: when each parked start's place opened."""

from __future__ import annotations

import pytest

from bench.scenarios.throttle import ideal_s, start_delays_ms


def test_the_ideal_lets_the_first_window_in_at_once() -> None:
    assert ideal_s(2000, 100, 1.0, job_s=0.01) == pytest.approx(19.01)
    assert ideal_s(2001, 100, 1.0, job_s=0.0) == pytest.approx(20.0)  # a 21st window opens
    assert ideal_s(50, 100, 1.0, job_s=0.01) == pytest.approx(0.01)


def test_each_start_past_the_limit_takes_the_place_of_the_start_a_limit_before_it() -> None:
    # Limit 2 per second. a and b start at once; c's place opened at 1.0 (a's start + 1 s), d's at
    # 1.1 (b's); e's at c's start + 1 s. c was taken off the broker before its place opened (a
    # standby), d and e after. Unordered input: the delays follow the starts' order.
    starts = [(2.02, 2.015), (0.0, 0.0), (1.004, 0.5), (0.1, 0.1), (1.13, 1.12)]
    delays = start_delays_ms(starts, 2, 1.0)
    assert delays.blocked == pytest.approx([4.0])
    assert delays.pushed == pytest.approx([30.0, 16.0])


def test_no_start_is_parked_when_all_fit_in_the_first_window() -> None:
    assert start_delays_ms([(0.0, 0.0), (0.01, 0.0)], 2, 1.0) == ([], [])
