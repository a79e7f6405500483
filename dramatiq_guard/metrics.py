"""Prometheus metrics of the guards (the ``prometheus`` extra: ``pip install dramatiq-guard[prometheus]``).

Add :class:`GuardMetrics` to the broker, next to Dramatiq's own
:class:`~dramatiq.middleware.prometheus.Prometheus` middleware::

    from dramatiq.middleware.prometheus import Prometheus
    from dramatiq_guard.metrics import GuardMetrics

    broker.add_middleware(Prometheus())
    broker.add_middleware(GuardMetrics())

It works the way Dramatiq's middleware does: in each worker process, after
boot, it points prometheus-client at the same multiprocess directory
(``PROMETHEUS_MULTIPROC_DIR``, else Dramatiq's ``dramatiq_prom_db``
directory), so the guard's metrics are served by Dramatiq's exposition
server (``dramatiq_prom_host``:``dramatiq_prom_port``, 9191 by default)
together with Dramatiq's own. Without Dramatiq's middleware, use
``GuardMetrics(serve=True)``: it runs an exposition server of its own (a
``dramatiq`` fork process) on ``DRAMATIQ_GUARD_PROM_HOST``:``DRAMATIQ_GUARD_PROM_PORT``
(``0.0.0.0:9192`` by default). In a process that is not a ``dramatiq``
worker, call :meth:`GuardMetrics.setup` with a registry of your own.

The metrics, each labelled ``actor_name``:

====================================================  =========  ==========================================
``dramatiq_guard_messages_deduplicated_total``        counter    not enqueued / not run: a duplicate
``dramatiq_guard_messages_parked_total``              counter    sent to the lockwait area
``dramatiq_guard_messages_handed_off_total``          counter    waiters given a freed slot
``dramatiq_guard_lock_waits_total``                   counter    worker threads that blocked for a lock
``dramatiq_guard_lock_wait_duration_milliseconds``    histogram  how long they blocked
``dramatiq_guard_leases_lost_total``                  counter    running messages that lost their lease
``dramatiq_guard_ledger_hits_total``                  counter    completed idempotency keys not run again
``dramatiq_guard_holders``                            gauge      messages holding a slot or lock now
``dramatiq_guard_waiters``                            gauge      worker threads blocked for a lock now
====================================================  =========  ==========================================

Two more are about the guard's Redis, not an actor
(:mod:`dramatiq_guard.backends.redis_health`):

====================================================  =========  ==========================================
``dramatiq_guard_redis_state_lost_total``             counter    state lost, by ``reason``: ``restart``,
                                                                 ``flush``, ``vanished`` (a waiting key)
``dramatiq_guard_redis_evicting``                     gauge      1 if its ``maxmemory-policy`` evicts keys
``dramatiq_guard_redis_persistent``                   gauge      1 if it persists (AOF or RDB snapshots)
====================================================  =========  ==========================================

The two gauges are set by each worker process when it first checks its
Redis (and again after a restart of it); a setting that could not be read
(an ACL that forbids ``CONFIG``) leaves its gauge unset.

The gauges count what live worker processes do (``livesum``): a process that
dies stops counting. Parked messages belong to no process, so they have no
gauge here; ``parked_total - handed_off_total`` is their trend, and
``dramatiq-guard inspect`` shows them exactly.

The middlewares report through :mod:`dramatiq_guard.events`, which does
nothing until this middleware is set up.
"""

from __future__ import annotations

import logging
import os
import tempfile
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import dramatiq

from dramatiq_guard import events

logger = logging.getLogger(__name__)

#: The duration buckets of the lock-wait histogram, in milliseconds (Dramatiq's).
BUCKETS = (5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000, 30000, 60000, 600000)

_COUNTERS = {
    "deduplicated": ("dramatiq_guard_messages_deduplicated", "Messages not enqueued or not run: duplicates."),
    "parked": ("dramatiq_guard_messages_parked", "Messages sent to the lockwait area."),
    "handed_off": ("dramatiq_guard_messages_handed_off", "Waiting messages given a freed slot."),
    "lease_lost": ("dramatiq_guard_leases_lost", "Running messages that lost their lease."),
    "ledger_hit": ("dramatiq_guard_ledger_hits", "Completed idempotency keys that were not run again."),
}


def multiproc_dir() -> str:
    """The prometheus-client multiprocess directory the worker processes write to.

    ``PROMETHEUS_MULTIPROC_DIR`` if set, else Dramatiq's (``dramatiq_prom_db``,
    default ``<tmp>/dramatiq-prometheus``).
    """
    default = os.path.join(tempfile.gettempdir(), "dramatiq-prometheus")
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("dramatiq_prom_db") or default  # noqa: SIM112 (Dramatiq's name)


class GuardMetrics(dramatiq.Middleware):
    """Exports the guards' events as Prometheus metrics (see the module docstring).

    Constructible with no arguments (django_dramatiq lists middleware by
    dotted path).

    Parameters:
      serve(bool): Run an exposition server of its own (for brokers without
        Dramatiq's Prometheus middleware, which serves these metrics too).
    """

    def __init__(self, *, serve: bool = False) -> None:
        self.serve = serve
        self.registry: Any = None

    @property
    def forks(self) -> list[Any]:
        return [_run_exposition_server] if self.serve else []

    def after_process_boot(self, broker: dramatiq.Broker) -> None:
        # Before prometheus-client is first imported in this process: it
        # chooses its value storage at import time.
        path = multiproc_dir()
        os.makedirs(path, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
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
          registry(prometheus_client.CollectorRegistry|None): Where to
            register the metrics. In a multiprocess setup the values are
            written to the multiprocess directory whatever the registry.

        Raises:
          ImportError: If prometheus-client is not installed.
        """
        import prometheus_client as prom

        self.registry = registry if registry is not None else prom.CollectorRegistry()
        labels = ["actor_name"]
        self.counters = {
            event: prom.Counter(name, help_text, labels, registry=self.registry)
            for event, (name, help_text) in _COUNTERS.items()
        }
        self.lock_waits = prom.Counter(
            "dramatiq_guard_lock_waits",
            "Worker threads that blocked waiting for a lock.",
            labels,
            registry=self.registry,
        )
        self.lock_wait_durations = prom.Histogram(
            "dramatiq_guard_lock_wait_duration_milliseconds",
            "How long worker threads blocked waiting for a lock.",
            labels,
            buckets=(*BUCKETS, float("inf")),
            registry=self.registry,
        )
        self._make_gauges(prom, labels)
        events.set_sink(self)

    def _make_gauges(self, prom: Any, labels: list[str]) -> None:
        """The gauges (and the counter of lost state) of :meth:`setup`."""
        self.holder_gauge = prom.Gauge(
            "dramatiq_guard_holders",
            "Messages holding a guard slot or lock.",
            labels,
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.redis_state_lost = prom.Counter(
            "dramatiq_guard_redis_state_lost",
            "Times the guard's Redis was found to have lost state (restarted, flushed, a key vanished).",
            ["reason"],
            registry=self.registry,
        )
        self.redis_evicting = prom.Gauge(
            "dramatiq_guard_redis_evicting",
            "1 if the guard's Redis has a maxmemory-policy that evicts keys, else 0.",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.redis_persistent = prom.Gauge(
            "dramatiq_guard_redis_persistent",
            "1 if the guard's Redis persists its data (AOF or RDB snapshots), else 0.",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.waiter_gauge = prom.Gauge(
            "dramatiq_guard_waiters",
            "Worker threads blocked waiting for a lock.",
            labels,
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    # The event sink (dramatiq_guard.events.EventSink).

    def count(self, event: str, actor: str) -> None:
        if event == "redis_state_lost":
            self.redis_state_lost.labels(actor).inc()  # the reason, not an actor
            return
        self.counters[event].labels(actor).inc()

    def redis_settings(self, evicting: bool | None, persistent: bool | None) -> None:
        if evicting is not None:
            self.redis_evicting.set(int(evicting))
        if persistent is not None:
            self.redis_persistent.set(int(persistent))

    def holders(self, actor: str, delta: int) -> None:
        self.holder_gauge.labels(actor).inc(delta)

    def waiters(self, actor: str, delta: int) -> None:
        self.waiter_gauge.labels(actor).inc(delta)

    def lock_waited(self, actor: str, duration_ms: float) -> None:
        self.lock_waits.labels(actor).inc()
        self.lock_wait_durations.labels(actor).observe(duration_ms)


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        import prometheus_client as prom
        from prometheus_client import multiprocess

        registry = prom.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        output = prom.generate_latest(registry)
        self.send_response(200)
        self.send_header("content-type", prom.CONTENT_TYPE_LATEST)
        self.end_headers()
        self.wfile.write(output)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


def _run_exposition_server() -> int:
    """The exposition server's fork process (``GuardMetrics(serve=True)``)."""
    path = multiproc_dir()
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    address = (
        os.environ.get("DRAMATIQ_GUARD_PROM_HOST", "0.0.0.0"),
        int(os.environ.get("DRAMATIQ_GUARD_PROM_PORT", "9192")),
    )
    httpd = HTTPServer(address, _MetricsHandler)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.shutdown()
    return 0
