"""The ``dramatiq-guard`` command on guard state made by a real ``dramatiq`` worker."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from dramatiq_guard.cli import main

ACTORS = """
import dramatiq
import dramatiq_guard
from harness import Gate, Recorder, broker_from_env

broker = broker_from_env()
dramatiq_guard.install(broker)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(queue_name="{queue}", max_retries=0, mutex={"key": lambda n: "report", "on_busy": "park"})
def report(n):
    rec.record(n=n)
    if n == 1:
        Gate.from_env("hold").wait()
"""


def _cli(redis_url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(["--redis", redis_url, *argv], stdout=out)
    return status, out.getvalue() + capsys.readouterr().out


def test_forced_release_hands_the_key_to_a_parked_waiter(
    redis_url: str,
    actor_module: Callable[..., Any],
    dramatiq_worker: Callable[..., Any],
    recorder: Any,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = actor_module(ACTORS.replace("{queue}", unique_name), name="cli_worker_actors")
    dramatiq_worker("cli_worker_actors", processes=1, threads=2)
    first = module.report.send(1)
    assert recorder.take_one()["n"] == 1  # the first holds the mutex, held at the gate
    second = module.report.send(2)  # the key is full: parked at enqueue

    status, out = _cli(redis_url, capsys, "inspect", "mutex:report", "--json")
    assert status == 0
    [key] = json.loads(out)["keys"]
    assert [h["holder"] for h in key["holders"]] == [first.message_id]
    assert key["holders"][0]["lease_left_ms"] > 0
    assert key["waiters"]["ids"] == [second.message_id]
    assert key["waiters"]["parked"] == 1
    status, out = _cli(redis_url, capsys, "inspect")  # found through the index
    assert status == 0 and "mutex:report" in out

    status, out = _cli(
        redis_url, capsys, "release", "mutex:report", "--yes", "--broker", "cli_worker_actors:broker"
    )
    assert status == 0
    assert "released 1 holder(s)" in out
    assert "1 parked message(s) re-enqueued" in out
    assert recorder.take_one()["n"] == 2  # the waiter ran while the released holder is still inside

    recorder.gate("hold").open()
    status, out = _cli(redis_url, capsys, "inspect", "mutex:report", "--json")
    assert status == 0
    assert json.loads(out)["keys"][0]["waiters"]["count"] == 0
