"""Guard events and their Prometheus exporter."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dramatiq_guard import events
from dramatiq_guard.metrics import GuardMetrics, exposition_handler


@pytest.fixture
def no_sink() -> Iterator[None]:
    previous = events.set_sink(None)
    yield
    events.set_sink(previous)


def test_events_are_no_ops_without_a_sink(no_sink: None) -> None:
    events.deduplicated("a")
    events.parked("a")
    events.handed_off("a")
    events.lease_lost("a")
    events.ledger_hit("a")
    events.acquired("a")
    events.released("a")
    events.throttle_window("a", 1, None)
    with events.lock_wait("a"):
        pass
    assert events.get_sink() is None


def test_guard_metrics_count_events_by_actor(no_sink: None) -> None:
    registry = CollectorRegistry()
    GuardMetrics().setup(registry)

    def value(name: str, actor: str = "a", **labels: str) -> float | None:
        return registry.get_sample_value(name, {"actor_name": actor, **labels})

    events.deduplicated("a")
    events.deduplicated("a")
    events.deduplicated("b")
    events.parked("a")
    events.handed_off("a")
    events.debounced("a")
    events.lease_lost("a")
    events.ledger_hit("a")
    events.acquired("a")
    events.acquired("a")
    events.released("a")
    with pytest.raises(RuntimeError), events.lock_wait("a"):
        assert value("dramatiq_guard_waiters") == 1
        raise RuntimeError  # a wait that raised is still counted
    with events.lock_wait("a"):
        pass

    assert value("dramatiq_guard_messages_deduplicated_total") == 2
    assert value("dramatiq_guard_messages_deduplicated_total", "b") == 1
    assert value("dramatiq_guard_messages_parked_total") == 1
    assert value("dramatiq_guard_messages_handed_off_total") == 1
    assert value("dramatiq_guard_messages_debounced_total") == 1
    assert value("dramatiq_guard_leases_lost_total") == 1
    assert value("dramatiq_guard_ledger_hits_total") == 1
    assert value("dramatiq_guard_holders") == 1
    assert value("dramatiq_guard_waiters") == 0
    assert value("dramatiq_guard_lock_waits_total") == 2
    assert value("dramatiq_guard_lock_wait_duration_milliseconds_count") == 2
    assert value("dramatiq_guard_lock_wait_duration_milliseconds_bucket", le="+Inf") == 2


def test_the_throttle_window_gauges_show_a_parked_messages_key(no_sink: None, redis_broker: Any) -> None:
    """A message that parks on a full window: its actor's gauges show the starts in the window and
    when the oldest leaves it (the key's oldest holder's deadline, in Unix time)."""
    import dramatiq

    import dramatiq_guard

    registry = CollectorRegistry()
    dramatiq_guard.install(redis_broker)
    GuardMetrics().setup(registry)
    ran = threading.Event()

    @dramatiq.actor(throttle={"limit": 1, "period": 60_000, "key": lambda: "partner"}, max_retries=0)
    def sync_order() -> None:
        ran.set()

    worker = dramatiq.Worker(redis_broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        first = sync_order.send()
        assert ran.wait(30)
        sync_order.send()  # parks: the window is full for a minute
        throttle = next(m for m in redis_broker.middleware if isinstance(m, dramatiq_guard.Throttle))
        state = throttle.backend(redis_broker).inspect("throttle:partner")
        assert [holder for holder, _ in state.holders] == [f"{first.message_id}:0"] and state.waiters
    finally:
        worker.stop()
    [(_, deadline)] = state.holders
    labels = {"actor_name": "sync_order"}
    assert registry.get_sample_value("dramatiq_guard_throttle_window_starts", labels) == 1
    assert (
        registry.get_sample_value("dramatiq_guard_throttle_next_open_timestamp_seconds", labels)
        == deadline / 1000
    )


ACTORS = """
import dramatiq
import redis
from dramatiq.results import Results
from dramatiq.results.backends.redis import RedisBackend as ResultsBackend
from harness import Gate, Recorder, broker_from_env, redis_url_from_env

import dramatiq_guard
from dramatiq_guard.metrics import GuardMetrics

broker = broker_from_env()
# No standbys (lookahead=0): every hand-off re-enqueues a parked message. The ledger's
# database: DRAMATIQ_GUARD_LEDGER_URL.
dramatiq_guard.install(broker, lookahead=0)
broker.add_middleware(GuardMetrics())
results = redis.Redis.from_url(redis_url_from_env(), socket_timeout=None)
broker.add_middleware(Results(backend=ResultsBackend(client=results)))
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(queue_name="{queue}", max_retries=0, dedup="until_executed")
def refresh(user_id):
    rec.record(actor="refresh")
    Gate.from_env("refresh").wait()


@dramatiq.actor(
    queue_name="{queue}",
    max_retries=0,
    store_results=True,
    concurrency={"limit": 1, "key": lambda n: "export"},
)
def export(n):
    rec.record(actor="export", n=n)
    if n == 0:
        Gate.from_env("export").wait()
    return n


@dramatiq.actor(queue_name="{queue}", max_retries=0, store_results=True)
def produce():
    # A job that enqueues others: its enqueue-time decisions are the worker's.
    sent = [refresh.send(1) for _ in range(3)]
    exports = [export.send(n) for n in range(3)]
    return {
        "deduplicated": sum(dramatiq_guard.deduplicated_by(m) is not None for m in sent),
        "exports": [m.message_id for m in exports],
    }


@dramatiq.actor(queue_name="{queue}", max_retries=0, store_results=True, idempotency_key=lambda key: key)
def pay(key):
    rec.record(actor="pay", key=key)
    return f"paid {key}"
"""


def _scrape(multiproc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], float]:
    """Scrape the exposition handler the way Prometheus does: ``{(sample name, actor): value}``."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc_dir))
    server = HTTPServer(("127.0.0.1", 0), exposition_handler())
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as response:
            text = response.read().decode()
    finally:
        thread.join(30)
        server.server_close()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dramatiq_guard_") and "le" not in sample.labels:
                samples[sample.name, sample.labels.get("actor_name", "")] = sample.value
    return samples


def test_a_real_run_exports_the_guards_decisions(
    tmp_path: Path,
    actor_module: Callable[..., Any],
    dramatiq_worker: Callable[..., Any],
    recorder: Any,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real decisions on a real worker (2 processes): deduplicated sends, parked messages,
    hand-offs and a ledger hit, found in the exporter with the right values."""
    multiproc_dir = tmp_path / "prometheus"
    multiproc_dir.mkdir()
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    monkeypatch.setenv("DRAMATIQ_GUARD_LEDGER_URL", ledger_url)
    module = actor_module(ACTORS.replace("{queue}", unique_name), name="metrics_actors")
    dramatiq_worker(
        "metrics_actors",
        processes=2,
        threads=2,
        env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir), "DRAMATIQ_GUARD_LEDGER_URL": ledger_url},
    )

    # In a worker: 3 identical sends while the first is queued or held (2 deduplicated), and
    # 3 sends to a key with a limit of 1 whose first holds it (2 parked at enqueue).
    produced = module.produce.send().get_result(block=True, timeout=30_000)
    assert produced["deduplicated"] == 2
    running = recorder.take(2)
    assert sorted(r["actor"] for r in running) == ["export", "refresh"]
    assert next(r["n"] for r in running if r["actor"] == "export") == 0

    samples = _scrape(multiproc_dir, monkeypatch)
    assert samples["dramatiq_guard_messages_deduplicated_total", "refresh"] == 2
    assert samples["dramatiq_guard_messages_parked_total", "export"] == 2
    assert samples["dramatiq_guard_holders", "export"] == 1  # export 0, held at its gate
    assert ("dramatiq_guard_messages_handed_off_total", "export") not in samples

    # Freed, the slot goes to export 1, then to export 2: two hand-offs.
    recorder.gate("refresh").open()
    recorder.gate("export").open()
    for message_id in produced["exports"]:
        message = module.export.message(0).copy(message_id=message_id)
        message.get_result(block=True, timeout=30_000)  # stored after the slot was released
    assert sorted(r["n"] for r in recorder.take(2)) == [1, 2]

    # The same idempotency key twice: the second returns the stored result without running.
    assert module.pay.send("k-1").get_result(block=True, timeout=30_000) == "paid k-1"
    assert module.pay.send("k-1").get_result(block=True, timeout=30_000) == "paid k-1"
    assert recorder.take_one()["actor"] == "pay"

    samples = _scrape(multiproc_dir, monkeypatch)
    assert samples["dramatiq_guard_messages_deduplicated_total", "refresh"] == 2
    assert samples["dramatiq_guard_messages_parked_total", "export"] == 2
    assert samples["dramatiq_guard_messages_handed_off_total", "export"] == 2
    assert samples["dramatiq_guard_ledger_hits_total", "pay"] == 1
    assert samples["dramatiq_guard_holders", "export"] == 0
    assert ("dramatiq_guard_leases_lost_total", "export") not in samples
    assert recorder.pending() == 0  # the duplicate payment never ran
