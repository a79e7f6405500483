"""An exclusive report job: the mutex's three ``on_busy`` modes and the standalone lock.

Run a worker, then send (from the repository root)::

    .venv/bin/dramatiq examples.report --processes 1 --threads 4
    .venv/bin/python -m examples.report

* ``nightly_report`` (``on_busy="drop"``): five sends during a run give one run; the other
  four are dropped (logged, counted as deduplicated).
* ``rebuild_report`` (``on_busy="wait"``): three sends run one after another, each worker
  thread waiting for the lock (woken by a push when it frees).
* the standalone :class:`~dramatiq_guard.lock.Lock` on the same key as ``nightly_report``
  tells a script whether its block ran.

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard
from dramatiq_guard.lock import Lock

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before any actor is declared
dramatiq.set_broker(broker)


@dramatiq.actor(mutex={"key": lambda day: "report", "on_busy": "drop"})
def nightly_report(day: str) -> None:
    lease = dramatiq_guard.current_lease()
    print(f"building the report of {day} (fencing token {lease.token})")
    time.sleep(5)  # the report's own work


@dramatiq.actor(mutex={"key": lambda n: "rebuild", "on_busy": "wait", "wait": 60_000})
def rebuild_report(n: int) -> None:
    print(f"rebuild {n} starts (token {dramatiq_guard.current_lease().token})")
    time.sleep(1)


def build_by_hand() -> str:
    return "built by hand"


if __name__ == "__main__":
    for _ in range(5):
        nightly_report.send("2024-06-01")  # one runs, four are dropped
    for n in range(3):
        rebuild_report.send(n)  # run one after another
    # A script sharing the report's lock: it runs only if no worker holds it.
    outcome = Lock("report", broker=broker, blocking=False).run(build_by_hand)
    print("the script ran:", outcome.ran, outcome.value)
