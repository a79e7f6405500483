"""The guard middlewares listed by dotted path, the way django_dramatiq builds a broker.

django_dramatiq's ``DRAMATIQ_BROKER["MIDDLEWARE"]`` is a list of dotted paths; it imports each
one and calls it with no arguments, then passes the instances to the broker's constructor. This
does the same (django_dramatiq itself is not a dependency) with a StubBroker, whose guards use
the in-memory backend, and checks each guard does its job when made that way.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard.middleware.dedup import deduplicated_by
from dramatiq_guard.testing import join

#: As a Django settings module would list them (docs/django.md).
GUARD_MIDDLEWARE = [
    "dramatiq_guard.middleware.slots.Mutex",
    "dramatiq_guard.middleware.slots.Concurrency",
    "dramatiq_guard.middleware.dedup.Deduplication",
    "dramatiq_guard.middleware.idempotency.Idempotency",
    "dramatiq_guard.metrics.GuardMetrics",
]

DRAMATIQ_MIDDLEWARE = [
    "dramatiq.middleware.AgeLimit",
    "dramatiq.middleware.TimeLimit",
    "dramatiq.middleware.Callbacks",
    "dramatiq.middleware.Pipelines",
    *GUARD_MIDDLEWARE,  # before Retries, as install() places them
    "dramatiq.middleware.Retries",
]


def import_string(path: str) -> Any:
    """What django.utils.module_loading.import_string does."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture
def broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_global_broker: None
) -> Iterator[StubBroker]:
    monkeypatch.setenv("DRAMATIQ_GUARD_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    made = StubBroker(middleware=[import_string(path)() for path in DRAMATIQ_MIDDLEWARE])
    dramatiq.set_broker(made)
    worker = dramatiq.Worker(made, worker_timeout=50)
    worker.start()
    yield made
    worker.stop()
    made.close()


@pytest.mark.parametrize("path", GUARD_MIDDLEWARE)
def test_each_guard_middleware_is_constructible_with_no_arguments(path: str) -> None:
    middleware = import_string(path)()
    assert isinstance(middleware, dramatiq.Middleware)


def test_guards_made_from_dotted_paths_do_their_jobs(broker: StubBroker) -> None:
    lock = threading.Lock()
    ran: list[tuple[str, Any]] = []
    running = {"now": 0, "peak": 0}
    release = threading.Event()

    @dramatiq.actor(dedup="until_executed", max_retries=0)
    def refresh(user_id: int) -> None:
        release.wait(30)
        ran.append(("refresh", user_id))

    @dramatiq.actor(concurrency=1, max_retries=0)
    def deliver(n: int) -> None:
        with lock:
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        with lock:
            running["now"] -= 1
            ran.append(("deliver", n))

    @dramatiq.actor(mutex=True, max_retries=0)
    def report() -> None:
        ran.append(("report", None))

    @dramatiq.actor(idempotency_key=lambda transfer_id: transfer_id, max_retries=0)
    def transfer(transfer_id: str) -> str:
        ran.append(("transfer", transfer_id))
        return transfer_id

    first = refresh.send(42)
    assert deduplicated_by(refresh.send(42)) == first.message_id  # dedup: not enqueued twice
    release.set()
    for n in range(4):
        deliver.send(n)
    report.send()
    transfer.send("t-1")
    join(broker, "default", timeout=30_000)
    transfer.send("t-1")  # the ledger: completed, not run again
    join(broker, "default", timeout=30_000)

    assert sorted(name for name, _ in ran) == ["deliver"] * 4 + ["refresh", "report", "transfer"]
    assert running["peak"] == 1
