"""Prometheus metrics of the guards (the ``prometheus`` extra; the metrics: docs/metrics.md)."""

from __future__ import annotations

import os
import tempfile
from http.server import HTTPServer
from typing import Any

import dramatiq

from dramatiq_guard import events

#: The duration buckets of the lock-wait histogram, in milliseconds (Dramatiq's).
BUCKETS = (5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000, 30000, 60000, 600000)

#: The counters, by event (:mod:`dramatiq_guard.events`): metric and help. Each is labelled
#: ``actor_name``, but ``redis_state_lost`` ``reason``.
_COUNTERS = {
    "deduplicated": ("dramatiq_guard_messages_deduplicated", "Messages not enqueued or not run: duplicates."),
    "parked": ("dramatiq_guard_messages_parked", "Messages sent to the lockwait area."),
    "debounced": ("dramatiq_guard_messages_debounced", "Messages superseded by a later send of their key."),
    "handed_off": ("dramatiq_guard_messages_handed_off", "Waiting messages given a freed slot."),
    "lease_lost": ("dramatiq_guard_leases_lost", "Running messages that lost their lease."),
    "ledger_hit": ("dramatiq_guard_ledger_hits", "Completed idempotency keys that were not run again."),
    "lock_waited": ("dramatiq_guard_lock_waits", "Worker threads that blocked waiting for a lock."),
    "redis_state_lost": (
        "dramatiq_guard_redis_state_lost",
        "Times the guard's Redis was found to have lost state (restarted, flushed, a key vanished).",
    ),
}
#: The gauges: metric, help, whether labelled ``actor_name``, multiprocess mode.
_GAUGES: dict[str, tuple[str, str, bool, Any]] = {
    "holders": ("dramatiq_guard_holders", "Messages holding a guard slot or lock.", True, "livesum"),
    "waiters": ("dramatiq_guard_waiters", "Worker threads blocked waiting for a lock.", True, "livesum"),
    "throttle_starts": (
        "dramatiq_guard_throttle_window_starts",
        "Starts in the window of a throttle key of the actor, as a worker last read it.",
        True,
        "livemostrecent",
    ),
    "throttle_next_open": (
        "dramatiq_guard_throttle_next_open_timestamp_seconds",
        "When the next place in that window opens (its oldest start lapses), in Unix time.",
        True,
        "livemostrecent",
    ),
    "redis_evicting": (
        "dramatiq_guard_redis_evicting",
        "1 if the guard's Redis has a maxmemory-policy that evicts keys, else 0.",
        False,
        "livemax",
    ),
    "redis_persistent": (
        "dramatiq_guard_redis_persistent",
        "1 if the guard's Redis persists its data (AOF or RDB snapshots), else 0.",
        False,
        "livemin",
    ),
}


def use_multiproc_dir() -> None:
    """Make ``PROMETHEUS_MULTIPROC_DIR`` (default: Dramatiq's ``dramatiq_prom_db``, else
    ``<tmp>/dramatiq-prometheus``) and set it, before prometheus-client is first imported."""
    default = os.path.join(tempfile.gettempdir(), "dramatiq-prometheus")
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("dramatiq_prom_db") or default  # noqa: SIM112 (Dramatiq's name)
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


class GuardMetrics(dramatiq.Middleware):
    """Exports the guards' events as Prometheus metrics, served with Dramatiq's own.

    Parameters:
      serve(bool): Run an exposition server of its own (``DRAMATIQ_GUARD_PROM_HOST``:
        ``DRAMATIQ_GUARD_PROM_PORT``, 0.0.0.0:9192), without Dramatiq's Prometheus middleware.
    """

    def __init__(self, *, serve: bool = False) -> None:
        self.serve = serve
        self.registry: Any = None

    @property
    def forks(self) -> list[Any]:
        return [_run_exposition_server] if self.serve else []

    def after_process_boot(self, broker: dramatiq.Broker) -> None:
        use_multiproc_dir()  # prometheus-client chooses its value storage at import time
        self.setup()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        if events.get_sink() is self:
            events.set_sink(None)
        if self.serve and "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), os.environ["PROMETHEUS_MULTIPROC_DIR"])  # type: ignore[no-untyped-call]

    def setup(self, registry: Any = None) -> None:
        """Create the metrics in ``registry`` (default: a new one) and receive the guards' events.

        Parameters:
          registry(prometheus_client.CollectorRegistry|None): Where to register the metrics
            (in a multiprocess setup, values go to the multiprocess directory anyway).

        Raises:
          ImportError: If prometheus-client is not installed.
        """
        import prometheus_client as prom

        self.registry = registry if registry is not None else prom.CollectorRegistry()
        labels = ["actor_name"]
        self.counters = {
            event: prom.Counter(
                name, text, ["reason"] if event == "redis_state_lost" else labels, registry=self.registry
            )
            for event, (name, text) in _COUNTERS.items()
        }
        self.gauges = {
            which: prom.Gauge(
                name, text, labels if by_actor else (), registry=self.registry, multiprocess_mode=mode
            )
            for which, (name, text, by_actor, mode) in _GAUGES.items()
        }
        self.lock_wait_durations = prom.Histogram(
            "dramatiq_guard_lock_wait_duration_milliseconds",
            "How long worker threads blocked waiting for a lock.",
            labels,
            buckets=(*BUCKETS, float("inf")),
            registry=self.registry,
        )
        events.set_sink(self)

    # The event sink (dramatiq_guard.events.EventSink).

    def count(self, event: str, actor: str) -> None:
        self.counters[event].labels(actor).inc()  # for redis_state_lost, ``actor`` is the reason

    def redis_settings(self, evicting: bool | None, persistent: bool | None) -> None:
        for which, value in (("redis_evicting", evicting), ("redis_persistent", persistent)):
            if value is not None:
                self.gauges[which].set(int(value))

    def throttle_window(self, actor: str, starts: int, opens_at_ms: int | None) -> None:
        self.gauges["throttle_starts"].labels(actor).set(starts)
        self.gauges["throttle_next_open"].labels(actor).set(0 if opens_at_ms is None else opens_at_ms / 1000)

    def holders(self, actor: str, delta: int) -> None:
        self.gauges["holders"].labels(actor).inc(delta)

    def waiters(self, actor: str, delta: int) -> None:
        self.gauges["waiters"].labels(actor).inc(delta)

    def lock_waited(self, actor: str, duration_ms: float) -> None:
        self.counters["lock_waited"].labels(actor).inc()
        self.lock_wait_durations.labels(actor).observe(duration_ms)


def exposition_handler() -> Any:
    """The request handler of the exposition server: the metrics of every process of the directory."""
    import prometheus_client as prom
    from prometheus_client import multiprocess

    registry = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return prom.MetricsHandler.factory(registry)


def _run_exposition_server() -> int:
    """The exposition server's fork process (``GuardMetrics(serve=True)``)."""
    use_multiproc_dir()
    address = (
        os.environ.get("DRAMATIQ_GUARD_PROM_HOST", "0.0.0.0"),
        int(os.environ.get("DRAMATIQ_GUARD_PROM_PORT", "9192")),
    )
    httpd = HTTPServer(address, exposition_handler())
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.shutdown()
    return 0
