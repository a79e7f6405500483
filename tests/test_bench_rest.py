"""The bench waits for a rested machine before a full run (bench/run.py, ``--rest``)."""

from __future__ import annotations

from bench.run import wait_for_rest


def test_it_waits_until_the_load_is_below_the_bound() -> None:
    loads = iter([2.0, 1.0, 0.3])
    looked: list[float] = []

    def load() -> float:
        looked.append(value := next(loads))
        return value

    assert wait_for_rest(0.5, every_s=0.001, load=load) > 0
    assert looked == [2.0, 1.0, 0.3]


def test_a_rested_machine_and_no_bound_wait_for_nothing() -> None:
    assert wait_for_rest(0.5, load=lambda: 0.1) == 0
    assert wait_for_rest(0, load=lambda: 9.0) == 0


def test_it_waits_at_most_its_bound_on_a_machine_that_never_rests() -> None:
    assert wait_for_rest(0.5, at_most_s=0.05, every_s=0.01, load=lambda: 9.0) >= 0.05
