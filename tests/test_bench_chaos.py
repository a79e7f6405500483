"""The chaos run's reading of its debounced bursts (``bench/chaos.py``), on records made up here."""

from __future__ import annotations

from bench.chaos import DEBOUNCE_N, DEBOUNCE_WAIT_MS, Kill, Run, Sent, debounce_figures


def _sends(key: str, burst: int, first: int, count: int, at: float, apart: float = 0.001) -> list[Sent]:
    return [
        Sent(
            "a",
            DEBOUNCE_N + n,
            "a_debounced",
            key,
            f"m{n}",
            None,
            at + i * apart,
            at + i * apart,
            None,
            burst,
        )
        for i, n in enumerate(range(first, first + count))
    ]


def _run(key: str, n: int, pid: int, start: float, end: float | None) -> Run:
    return Run("a", DEBOUNCE_N + n, key, pid, start, end, f"m{n}")


def test_each_bursts_fate_and_why_one_ran_twice() -> None:
    sent = [
        *_sends("deb-0", 0, 0, 3, at=0.0),  # its last (2) runs twice: its first process was killed
        *_sends("deb-0", 1, 3, 2, at=10.0),  # superseded by burst 2, whose last (6) ran
        *_sends("deb-0", 2, 5, 2, at=10.5),
        *_sends("deb-1", 0, 7, 2, at=0.0),  # neither ran: lost
        *_sends("deb-2", 0, 9, 2, at=0.0),  # both of its sends ran, one right after the other: unexplained
        *_sends("deb-2", 1, 11, 2, at=20.0, apart=DEBOUNCE_WAIT_MS / 1000 + 0.5),  # two bursts, really
        Sent("a", 0, "a_shared", "a-shared", "x", None, 0.0, 0.0),  # not a debounced send
    ]
    runs = [
        _run("deb-0", 2, pid=1, start=1.0, end=None),
        _run("deb-0", 2, pid=2, start=7.0, end=10.2),  # burst 1 came while it ran
        _run("deb-0", 6, pid=2, start=12.0, end=12.5),
        _run("deb-2", 9, pid=2, start=0.3, end=0.8),
        _run("deb-2", 10, pid=2, start=0.9, end=1.4),
        _run("deb-2", 11, pid=2, start=20.3, end=20.8),
        _run("deb-2", 12, pid=2, start=21.2, end=21.7),
        _run("deb-2", 13, pid=3, start=30.0, end=None),  # started, never ended (not even sent here)
    ]
    kills = [Kill("a1", pid=1, sent_at=2.0, dead_at=2.1)]

    got = debounce_figures(sent, runs, kills)

    assert (got["bursts"], got["sends"], got["send_errors"], got["runs"]) == (6, 13, 0, 8)
    assert (got["last_send_ran"], got["superseded_by_a_later_burst"], got["lost"]) == (4, 1, ["deb-1#0"])
    assert got["superseded"] == 13 - 6  # the sends that never ran: 0, 1, 3, 4, 5, 7, 8
    assert (got["runs_without_end"], got["started_never_ended"]) == (2, [DEBOUNCE_N + 13])
    assert got["sent_during_a_run"] == 1  # not burst 2: the run killed at 2.1 s ran no longer
    why = {(t["key"], t["burst"]): t["explained_by"] for t in got["ran_twice"]}
    assert why[("deb-0", 0)] == "killed mid-run"
    assert why[("deb-2", 0)] is None and why[("deb-2", 1)].endswith("two bursts")
    assert got["ran_twice_unexplained"] == [
        {"key": "deb-2", "burst": 0, "n": [DEBOUNCE_N + 9, DEBOUNCE_N + 10], "explained_by": None}
    ]
