"""The tour: a real ``dramatiq`` worker, and each guard doing its job, in a few seconds.

Run it from the repository root::

    .venv/bin/python -m examples.tour

It starts a ``dramatiq`` worker (2 processes x 4 threads) on the actors below, then, one
capability at a time, sends them work and prints what the guard did:

1. deduplication: a burst of 100 identical sends is enqueued once and runs once;
2. mutex: three runs of one report go one after another, with rising fencing tokens; sends
   that arrive while a nightly report runs are dropped;
3. concurrency slots: a customer's webhooks run 2 at a time while the rest wait outside the
   queue (the ``dramatiq-guard inspect`` view of that moment), then the limit is raised to 4;
4. idempotency ledger: a funds transfer sent twice moves the money once;
5. throttle: six calls to a partner API allowed two starts per half second start two by two,
   the rest parked until the window lets them in;
6. debounce: twenty saves of one draft in a burst run once, with the last one;

then prints the ``dramatiq-guard inspect`` view of what is left, and cleans up. Every promise
is checked as it goes: the tour exits 1 if one did not hold, 0 otherwise.

Where it runs (it says which):

* Redis: ``--redis URL``, else ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``,
  if it answers. Everything the tour puts there (queues, guard state, its journal) is under one
  namespace of its own, ``guard-tour-<random>:``, deleted at the end: it never touches your keys.
* Else a private ``redis-server`` on a free port, if one is on PATH (``--no-spawn`` forbids
  it), stopped at the end.
* Else in-process (``--in-process`` asks for it directly): a StubBroker, the in-memory guard
  backend (the ``stub`` extra: without it the tour says so in one line and exits 2) and a
  ``dramatiq.Worker`` in this process.

The ledger (and the transfer's accounts) is a SQLite file in a temporary directory.

How it knows what happened, without sleeping: the actors, and a sink of the guard's events
(:mod:`dramatiq_guard.events`: deduplicated, parked, handed off, ledger hits...), write records
to a journal, a Redis list per topic (in-process: a queue) that the tour blocks on, with a
timeout. Some jobs hold until the tour lets them go (:func:`declare`'s ``hold``), so the guard
can be watched while they run.

The actors mirror the examples: ``authorizations.py`` (dedup), ``report.py`` (mutex),
``webhooks.py`` (concurrency), ``transfer.py`` (ledger), ``partner_api.py`` (throttle) and
``debounce.py`` (debounce).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import dramatiq
import redis
import sqlalchemy as sa
from dramatiq.middleware import CurrentMessage

import dramatiq_guard
from dramatiq_guard import cli, events
from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.cli import commands as cli_commands
from dramatiq_guard.middleware.dedup import Deduplication, deduplicated_by
from dramatiq_guard.middleware.slots import Concurrency
from dramatiq_guard.resolve import REDIS_URL_ENV

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: How the tour tells its worker processes where to run (JSON: redis, namespace, ledger).
CONFIG_ENV = "DRAMATIQ_GUARD_TOUR"
PROCESSES, THREADS = 2, 4
QUEUE = "tour"
#: The most the tour waits for any one thing, in seconds.
TIMEOUT = 20.0

CUSTOMER = 7
DELIVERIES = 10
#: The throttle's calls, and its window: 2 starts per THROTTLE_PERIOD_MS.
CALLS, THROTTLE_PERIOD_MS = 6, 500
#: The debounced saves of one draft, and the quiet time after the last one that runs it.
SAVES, DEBOUNCE_WAIT_MS = 20, 300
accounts = sa.Table(
    "tour_accounts",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
)


class TourFailed(Exception):
    """Something did not happen as promised (or not in time): the tour exits 1."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise TourFailed(what)


# -- the journal: records from the actors and the guard's events, by topic --------------------


class Journal:
    """Records by topic; :meth:`take` blocks until they arrive (at most ``timeout``)."""

    def record(self, topic: str, **fields: Any) -> None:
        raise NotImplementedError

    def take(self, topic: str, n: int = 1, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        raise NotImplementedError

    def pending(self, topic: str) -> int:
        """How many records of ``topic`` were not taken yet."""
        raise NotImplementedError

    def _timeout(self, topic: str, n: int, got: list[dict[str, Any]], timeout: float) -> TourFailed:
        return TourFailed(f"waited {timeout:g}s for {n} record(s) of {topic!r}, got {len(got)}: {got}")


class RedisJournal(Journal):
    """A Redis list per topic (RPUSH / BLPOP), under the tour's namespace."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def record(self, topic: str, **fields: Any) -> None:
        self.client.rpush(f"{self.prefix}:{topic}", json.dumps(fields))

    def take(self, topic: str, n: int = 1, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: list[dict[str, Any]] = []
        while len(got) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(topic, n, got, timeout)
            # At most 1 s per BLPOP: under redis-py's socket timeout.
            item = self.client.blpop([f"{self.prefix}:{topic}"], timeout=min(remaining, 1.0))
            if item is not None:
                got.append(json.loads(item[1]))
        return got

    def pending(self, topic: str) -> int:
        return int(self.client.llen(f"{self.prefix}:{topic}"))


class MemoryJournal(Journal):
    """A queue per topic, for the in-process mode."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def _queue(self, topic: str) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._queues.setdefault(topic, queue.Queue())

    def record(self, topic: str, **fields: Any) -> None:
        self._queue(topic).put(fields)

    def take(self, topic: str, n: int = 1, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: list[dict[str, Any]] = []
        while len(got) < n:
            try:
                got.append(self._queue(topic).get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                raise self._timeout(topic, n, got, timeout) from None
        return got

    def pending(self, topic: str) -> int:
        return self._queue(topic).qsize()


class JournalSink:
    """A :mod:`dramatiq_guard.events` sink: each guard decision of this process goes to the journal.

    Topics: ``deduplicated:<actor>``, ``parked:<actor>``, ``handed_off:<actor>``,
    ``lease_lost:<actor>``, ``ledger_hit:<actor>``, and ``waiting:<actor>`` when a worker
    thread starts waiting for a lock.
    """

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def count(self, event: str, actor: str) -> None:
        self.journal.record(f"{event}:{actor}")

    def holders(self, actor: str, delta: int) -> None:
        pass

    def waiters(self, actor: str, delta: int) -> None:
        if delta > 0:
            self.journal.record(f"waiting:{actor}")

    def lock_waited(self, actor: str, duration_ms: float) -> None:
        pass


# -- the actors -----------------------------------------------------------------------------


@dataclasses.dataclass
class Actors:
    refresh_authorizations: dramatiq.Actor[Any, Any]
    rebuild_report: dramatiq.Actor[Any, Any]
    nightly_report: dramatiq.Actor[Any, Any]
    deliver_webhook: dramatiq.Actor[Any, Any]
    transfer: dramatiq.Actor[Any, Any]
    call_partner: dramatiq.Actor[Any, Any]
    save_draft: dramatiq.Actor[Any, Any]


def declare(journal: Journal) -> Actors:
    """Declare the tour's actors on the global broker (after ``dramatiq_guard.install``)."""

    def hold(name: str) -> None:
        """Wait until the tour lets this job go on, so the guard can be watched while it runs."""
        journal.take(f"go:{name}")

    # examples/authorizations.py: a burst of identical refreshes is enqueued once.
    @dramatiq.actor(queue_name=QUEUE, max_retries=0, dedup={"strategy": "until_executed", "key": ["user_id"]})
    def refresh_authorizations(user_id: int, reason: str) -> None:
        journal.record("refresh", user_id=user_id, reason=reason)
        hold("refresh")

    # examples/report.py: one rebuild at a time; the others wait for the lock (woken by a push).
    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=0,
        mutex={"key": lambda n: "report", "on_busy": "wait", "wait": 30_000},
    )
    def rebuild_report(n: int) -> None:
        lease = dramatiq_guard.current_lease()
        journal.record("rebuild", kind="start", n=n, token=lease.token)
        hold("rebuild")
        journal.record("rebuild", kind="end", n=n, token=lease.token)

    # examples/report.py: a nightly report that is already running makes new sends no-ops.
    @dramatiq.actor(queue_name=QUEUE, max_retries=0, mutex=True)  # key: all arguments; busy: drop
    def nightly_report(day: str) -> None:
        journal.record("nightly", kind="start", day=day, token=dramatiq_guard.current_lease().token)
        hold("nightly")
        journal.record("nightly", kind="end", day=day)

    # examples/webhooks.py: at most 2 deliveries at a time per customer; the rest park.
    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=0,
        concurrency={"limit": 2, "key": lambda customer_id, n: f"webhooks:{customer_id}"},
    )
    def deliver_webhook(customer_id: int, n: int) -> None:
        journal.record("webhooks", kind="start", n=n)
        hold("webhooks")
        journal.record("webhooks", kind="end", n=n)

    # examples/transfer.py: the money moves in one transaction with the ledger row.
    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=3,
        min_backoff=100,
        idempotency_key=lambda transfer_id, *_: transfer_id,
    )
    def transfer(transfer_id: str, source_id: int, destination_id: int, amount: int) -> dict[str, Any]:
        session = dramatiq_guard.ledger_session()  # commits together with the ledger row
        balance = accounts.c.balance
        session.execute(
            sa.update(accounts).where(accounts.c.id == source_id).values(balance=balance - amount)
        )
        session.execute(
            sa.update(accounts).where(accounts.c.id == destination_id).values(balance=balance + amount)
        )
        journal.record("transfer", transfer_id=transfer_id)
        return {"transfer_id": transfer_id, "amount": amount}

    # examples/partner_api.py: two starts per half second; each records when it started (the
    # backend's clock, as the throttle counts it).
    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=0,
        throttle={"limit": 2, "period": THROTTLE_PERIOD_MS, "key": lambda n: "partner-api"},
    )
    def call_partner(n: int) -> None:
        broker = dramatiq.get_broker()
        throttle = next(m for m in broker.middleware if isinstance(m, dramatiq_guard.Throttle))
        message = CurrentMessage.get_current_message()
        assert message is not None
        holder = throttle.holder_of(message)
        state = throttle.backend(broker).inspect("throttle:partner-api")
        [since] = [since for h, since, _ in state.holder_info if h == holder]
        journal.record("throttle", n=n, since=since)

    # examples/debounce.py: a burst of saves of one draft runs once, with the last save.
    @dramatiq.actor(
        queue_name=QUEUE,
        max_retries=0,
        debounce={"wait": DEBOUNCE_WAIT_MS, "max_wait": 10 * DEBOUNCE_WAIT_MS, "key": ["doc_id"]},
    )
    def save_draft(doc_id: int, version: int) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        journal.record("debounce", version=version, message_id=message.message_id)

    return Actors(
        refresh_authorizations, rebuild_report, nightly_report, deliver_webhook, transfer, call_partner,
        save_draft,
    )  # fmt: skip


@dataclasses.dataclass
class Setup:
    """One side of the tour (the tour's process, or a worker process): broker, guard, actors."""

    broker: dramatiq.Broker
    backend: GuardBackend
    concurrency: Concurrency
    deduplication: Deduplication
    journal: Journal
    actors: Actors


def build(redis_url: str | None, namespace: str, ledger_url: str) -> Setup:
    """The broker (Redis under ``namespace``, or a StubBroker), the guard, the sink and the actors."""
    broker: dramatiq.Broker
    backend: GuardBackend | None = None
    journal: Journal
    if redis_url is None:
        from dramatiq.brokers.stub import StubBroker

        broker = StubBroker()
        broker.emit_after("process_boot")
        journal = MemoryJournal()
    else:
        from dramatiq.brokers.redis import RedisBroker

        redis_broker = RedisBroker(url=redis_url, namespace=f"{namespace}:broker")
        # The guard's keys under the tour's namespace (the default is "dramatiq-guard").
        backend = RedisBackend(redis_broker.client, namespace=namespace)
        journal = RedisJournal(redis_broker.client, f"{namespace}:journal")
        broker = redis_broker
    middleware = dramatiq_guard.install(broker, redis=backend, ledger=ledger_url)
    broker.add_middleware(CurrentMessage())  # the throttled actor reads its own start
    dramatiq.set_broker(broker)
    events.set_sink(JournalSink(journal))
    actors = declare(journal)
    concurrency = next(m for m in middleware if isinstance(m, Concurrency))
    deduplication = next(m for m in middleware if isinstance(m, Deduplication))
    return Setup(broker, concurrency.backend(broker), concurrency, deduplication, journal, actors)


def worker_broker() -> None:
    """What the tour's worker runs: ``dramatiq examples.tour:worker_broker`` (set up by the tour)."""
    config = os.environ.get(CONFIG_ENV)
    if not config:
        raise SystemExit(f"{CONFIG_ENV} is not set: run the tour with `python -m examples.tour`")
    values = json.loads(config)
    build(values["redis"], values["namespace"], values["ledger"])


# -- where it runs ----------------------------------------------------------------------------


def redacted(url: str) -> str:
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


def answers(url: str) -> bool:
    """True if a Redis answers PING at ``url`` within a second or two."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of the tour's own: no persistence, a free port, stopped at the end."""

    def __init__(self, executable: str, directory: Path) -> None:
        self.executable = executable
        self.directory = directory
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        """Start it and wait for its "Ready to accept connections" line (another port if taken)."""
        output: list[str] = []
        for _ in range(3):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    self.executable,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.directory),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            lines = LineReader(self.proc.stdout)
            output = []
            for line in lines.until(time.monotonic() + TIMEOUT):
                output.append(line)
                if "Ready to accept connections" in line:
                    return self
            self.stop()
        raise TourFailed("the private redis-server did not start:\n" + "".join(output[-10:]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class LineReader:
    """The lines of a stream, read by a daemon thread; :meth:`until` yields them up to a deadline.

    The last 200 lines are kept in :attr:`tail`.
    """

    def __init__(self, stream: IO[str] | None) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        if stream is not None:
            for line in stream:
                self.tail.append(line)
                self.lines.put(line)
        self.lines.put(None)

    def until(self, deadline: float) -> Iterator[str]:
        """Lines as they come, until the stream ends or the deadline passes."""
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                return
            if line is None:
                return
            yield line


class Worker:
    """The ``dramatiq`` CLI on ``examples.tour:worker_broker``, in a process group of its own."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.proc: subprocess.Popen[str] | None = None
        self.log: LineReader | None = None
        self.argv = ["dramatiq", "examples.tour:worker_broker", "--processes", str(PROCESSES)]
        self.argv += ["--threads", str(THREADS)]

    def start(self) -> None:
        """Start it and wait until every worker process logged that it is ready."""
        env = {**os.environ, CONFIG_ENV: json.dumps(self.config), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *self.argv, "--worker-shutdown-timeout", "5000"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.log = LineReader(self.proc.stdout)
        ready = 0
        for line in self.log.until(time.monotonic() + 30):
            ready += "Worker process is ready for action." in line
            if ready == PROCESSES:
                return
        raise TourFailed(f"the worker did not start:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (running actors get 5 s), then SIGKILL the whole group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        return "".join(list(self.log.tail)[-lines:]) if self.log is not None else "(no log)"


class TailHandler(logging.Handler):
    """Keeps the last 200 log lines (the in-process worker's log, shown if the tour fails)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.setFormatter(logging.Formatter("[%(threadName)s] [%(name)s] [%(levelname)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.tail.append(self.format(record) + "\n")


class InProcessWorker:
    """A ``dramatiq.Worker`` in this process (the in-process mode); its log is kept, not printed."""

    def __init__(self, broker: dramatiq.Broker) -> None:
        self.worker = dramatiq.Worker(broker, worker_threads=PROCESSES * THREADS, worker_timeout=100)
        self.handler = TailHandler()

    def start(self) -> None:
        root = logging.getLogger()
        root.addHandler(self.handler)
        root.setLevel(logging.INFO)
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop(timeout=10_000)
        logging.getLogger().removeHandler(self.handler)

    def log_tail(self, lines: int = 30) -> str:
        return "".join(list(self.handler.tail)[-lines:])


# -- the tour ---------------------------------------------------------------------------------


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclasses.dataclass
class Tour:
    setup: Setup
    redis_url: str | None
    namespace: str
    ledger_url: str

    @property
    def journal(self) -> Journal:
        return self.setup.journal

    @property
    def actors(self) -> Actors:
        return self.setup.actors

    def go(self, name: str, n: int = 1) -> None:
        """Let ``n`` held jobs of ``name`` go on."""
        for _ in range(n):
            self.journal.record(f"go:{name}")

    def inspect(self, pattern: str | None = None) -> None:
        """Print the ``dramatiq-guard inspect`` view of the tour's guard state."""
        argv = ["inspect"] if pattern is None else ["inspect", pattern]
        out = io.StringIO()
        if self.redis_url is not None:
            where = "" if self.redis_url == DEFAULT_REDIS_URL else f"--redis {redacted(self.redis_url)} "
            say(f"   $ dramatiq-guard {where}--namespace {self.namespace} {' '.join(argv)}")
            status = cli.main(["--redis", self.redis_url, "--namespace", self.namespace, *argv], stdout=out)
            expect(status == 0, f"dramatiq-guard inspect exited {status}")
        else:
            # The in-memory backend lives in this process, out of the command's reach: run the
            # command's own code on it.
            say(f"   dramatiq-guard {' '.join(argv)} (the in-memory backend, in this process):")
            ctx = cli.Context(cli.build_parser().parse_args(argv), sys.stdin, out)
            ctx._backend = self.setup.backend  # type: ignore[assignment]  # a MemoryBackend: a RedisBackend
            cli_commands._cmd_inspect(ctx)
        for line in out.getvalue().splitlines():
            say(f"     {line}")

    # -- 1 -----------------------------------------------------------------------------------

    def deduplication(self) -> None:
        say('1. Deduplication: refresh_authorizations, dedup="until_executed" on user_id')
        refresh = self.actors.refresh_authorizations
        sent = [refresh.send(42, reason=f"membership change {i}") for i in range(100)]
        self.setup.deduplication.flush()  # confirm the lock now, not in the background
        enqueued = [m for m in sent if deduplicated_by(m) is None]
        expect(len(enqueued) == 1, f"{len(enqueued)} of 100 identical sends were enqueued")
        holder = enqueued[0].message_id
        folded = {deduplicated_by(m) for m in sent[1:]}
        expect(folded == {holder}, f"the duplicates were deduplicated by {folded}, not {holder}")
        say("   100 sends for user 42 in a burst: 1 enqueued, 99 deduplicated (send() returned normally,")
        say(f"   and deduplicated_by(message) names the one enqueued: {holder})")
        [run] = self.journal.take("refresh")
        self.go("refresh")
        expect(run["reason"] == "membership change 0", f"the run was not the first send's: {run}")
        say("   the worker ran it once")

    # -- 2 -----------------------------------------------------------------------------------

    def mutex(self) -> None:
        say('2. Mutex: rebuild_report, a mutex on the key "report" with on_busy="wait"')
        for n in range(3):
            self.actors.rebuild_report.send(n)
        self.journal.take("rebuild")  # one holds the lock...
        self.journal.take("waiting:rebuild_report", 2)  # ...two worker threads wait for it
        say("   3 sends: one runs, two worker threads wait for the lock")
        self.go("rebuild", 3)
        records = self.journal.take("rebuild", 5)
        kinds = [r["kind"] for r in records]
        expect(kinds == ["end", "start", "end", "start", "end"], f"runs overlapped: {records}")
        tokens = [r["token"] for r in records if r["kind"] == "end"]
        expect(tokens == sorted(set(tokens)), f"fencing tokens did not rise: {tokens}")
        order = ", ".join(str(r["n"]) for r in records if r["kind"] == "end")
        say(f"   they ran one after another (rebuild {order}), each handed the lock by the one before;")
        say(f"   fencing tokens rising: {' < '.join(map(str, tokens))}")

        say("   nightly_report, mutex=True (a busy lock drops the message):")
        self.actors.nightly_report.send("2024-06-01")
        [first] = self.journal.take("nightly")
        for _ in range(4):
            self.actors.nightly_report.send("2024-06-01")
        self.journal.take("deduplicated:nightly_report", 4)
        self.go("nightly")
        self.journal.take("nightly")
        expect(self.journal.pending("nightly") == 0, "a dropped nightly report ran")
        say("   4 more sends while it ran: all 4 dropped by the workers (acked, counted as deduplicated);")
        say(f"   it ran once (token {first['token']})")

    # -- 3 -----------------------------------------------------------------------------------

    def concurrency(self) -> None:
        say('3. Concurrency slots: deliver_webhook, a limit of 2 per customer (key "webhooks:<customer>")')
        deliver = self.actors.deliver_webhook
        for n in range(DELIVERIES):
            deliver.send(CUSTOMER, n)
        parked = len(self.journal.take("parked:deliver_webhook", DELIVERIES - 2))
        records = self.journal.take("webhooks", 2)
        state = self.setup.backend.inspect(f"concurrency:webhooks:{CUSTOMER}")
        expect(len(state.holders) == 2, f"{len(state.holders)} deliveries hold a slot, with a limit of 2")
        say(f"   {DELIVERIES} deliveries to customer {CUSTOMER}: 2 run, {parked} parked outside the queue")
        self.inspect(f"concurrency:webhooks:{CUSTOMER}")

        key = self.setup.concurrency.key_for(deliver, CUSTOMER, 0)
        self.setup.concurrency.set_limit(key, 4)
        records += self.journal.take("webhooks", 2)
        expect(all(r["kind"] == "start" for r in records), f"a held delivery ended: {records}")
        say(f'   Concurrency.set_limit("{key}", 4): 2 waiters handed a slot at once, 4 running')
        say(f"   (from a shell: dramatiq-guard limit set concurrency:{key} 4 --broker <module:broker>)")

        self.go("webhooks", DELIVERIES)
        records += self.journal.take("webhooks", 2 * DELIVERIES - 4)
        running = peak = 0
        for record in records:
            running += 1 if record["kind"] == "start" else -1
            peak = max(peak, running)
        started = sorted(r["n"] for r in records if r["kind"] == "start")
        expect(started == list(range(DELIVERIES)), f"not every delivery ran once: {started}")
        expect(peak == 4, f"{peak} deliveries ran at once, with a limit of 4")
        say(f"   all {DELIVERIES} delivered, each once: never more than 2 at once, then never more than 4")

    # -- 4 -----------------------------------------------------------------------------------

    def ledger(self, engine: sa.Engine) -> None:
        say("4. Idempotency ledger: transfer, idempotency_key=transfer_id (SQLite)")
        before = balances(engine)
        for _ in range(2):
            self.actors.transfer.send("t-1", 1, 2, 10)
        self.journal.take("ledger_hit:transfer")
        after = balances(engine)
        expect(after == {1: before[1] - 10, 2: before[2] + 10}, f"balances went from {before} to {after}")
        ledger = dramatiq_guard.Ledger(self.ledger_url)
        record = ledger.get("t-1")
        ledger.dispose()
        expect(record is not None and record.state == "completed", f"ledger row of t-1: {record}")
        assert record is not None
        say('   transfer("t-1", 1 -> 2, 10) sent twice: it ran once; the other message found t-1')
        say("   completed (a ledger hit) and returned the stored result without running")
        moves = f"account 1 {before[1]} -> {after[1]}, account 2 {before[2]} -> {after[2]}"
        say(f"   balances moved once: {moves}")
        say(f"   ledger row t-1: {record.state}, attempts {record.attempts}, result {record.result}")

    # -- 5 -----------------------------------------------------------------------------------

    def throttle(self) -> None:
        say(f'5. Throttle: call_partner, 2 starts per {THROTTLE_PERIOD_MS} ms (key "partner-api")')
        for n in range(CALLS):
            self.actors.call_partner.send(n)
        records = self.journal.take("throttle", CALLS)
        starts = sorted(r["since"] for r in records)
        expect(sorted(r["n"] for r in records) == list(range(CALLS)), f"not every call ran once: {records}")
        crowded = [b - a for a, b in zip(starts, starts[2:], strict=False) if b - a < THROTTLE_PERIOD_MS]
        expect(not crowded, f"3 starts within {THROTTLE_PERIOD_MS} ms: {starts}")
        gaps = ", ".join(f"+{b - starts[0]} ms" for b in starts)
        say(f"   {CALLS} sends at once: 2 started, the rest parked until the window let them in;")
        say(f"   starts (on the guard's clock, from the first): {gaps}")

    # -- 6 -----------------------------------------------------------------------------------

    def debounce(self) -> None:
        say(f"6. Debounce: save_draft, a wait of {DEBOUNCE_WAIT_MS} ms per draft (key: doc_id)")
        sent = [self.actors.save_draft.send(1, version) for version in range(SAVES)]
        last = sent[-1]
        runs = [self.journal.take("debounce")[0]]
        while runs[-1]["message_id"] != last.message_id:  # a producer paused over the wait: a run each
            runs += self.journal.take("debounce")
        superseded = len(self.journal.take("debounced:save_draft", SAVES - len(runs)))
        expect(runs[-1]["version"] == SAVES - 1, f"the last run was not the last save's: {runs}")
        say(f"   {SAVES} saves of draft 1 in a burst: {len(runs)} run, {superseded} superseded (each send")
        say("   returned normally; a superseded one is logged and counted, messages_debounced_total)")
        quiet = f"once the draft was quiet for {DEBOUNCE_WAIT_MS} ms"
        say(f"   the last save ran, with version {SAVES - 1}, {quiet}")


def balances(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.id: row.balance for row in conn.execute(sa.select(accounts))}


def choose_redis(args: argparse.Namespace, stack: contextlib.ExitStack, tmp: Path) -> str | None:
    """The Redis URL to run on (saying which), or None for the in-process mode."""
    if args.in_process:
        say("Where: in-process, as asked (--in-process): a StubBroker, the in-memory guard backend,")
        say(f"       and a dramatiq.Worker with {PROCESSES * THREADS} threads in this process")
        return None
    source = (
        "--redis" if args.redis else "DRAMATIQ_GUARD_REDIS_URL" if os.environ.get(REDIS_URL_ENV) else None
    )
    url = args.redis or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
    if answers(url):
        say(f"Where: the Redis at {redacted(url)} ({source or 'it answers'})")
        return url
    executable = None if args.no_spawn else shutil.which("redis-server")
    if executable is not None:
        server = PrivateRedis(executable, tmp).start()
        stack.callback(server.stop)
        assert server.proc is not None
        say(f"Where: no Redis answers at {redacted(url)}; started a private redis-server at {server.url}")
        say(f"       (pid {server.proc.pid}; stopped at the end)")
        return server.url
    why = "--no-spawn" if args.no_spawn else "no redis-server on PATH"
    say(f"Where: no Redis answers at {redacted(url)} and {why}: in-process, on a StubBroker with")
    say(f"       the in-memory guard backend and a dramatiq.Worker with {PROCESSES * THREADS} threads")
    return None


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key under ``namespace:`` (the tour's own, so a SCAN of that prefix is safe)."""
    deleted = 0
    with redis.Redis.from_url(url) as client:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{namespace}:*", count=500):
            batch.append(key)
            if len(batch) == 500:
                deleted += int(client.delete(*batch))
                batch = []
        if batch:
            deleted += int(client.delete(*batch))
    return deleted


def run(args: argparse.Namespace) -> None:
    started = time.monotonic()
    say("dramatiq-guard tour")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dramatiq-guard-tour-")))
        redis_url = choose_redis(args, stack, tmp)
        namespace = f"guard-tour-{uuid.uuid4().hex[:8]}"
        ledger_url = f"sqlite:///{tmp / 'tour.sqlite3'}"
        if redis_url is not None:
            say(f'       everything the tour writes there is under "{namespace}:", deleted at the end')
            stack.callback(
                lambda: say(f"Cleanup: {delete_namespace(redis_url, namespace)} Redis keys deleted")
            )

        engine = sa.create_engine(ledger_url)
        stack.callback(engine.dispose)
        accounts.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.insert(accounts), [{"id": 1, "balance": 100}, {"id": 2, "balance": 0}])
        dramatiq_guard.Ledger(ledger_url).create_all()
        say(f"Ledger: SQLite {tmp / 'tour.sqlite3'} (accounts 1 and 2 hold 100 and 0)")

        setup = build(redis_url, namespace, ledger_url)
        stack.callback(setup.broker.close)
        stack.callback(events.set_sink, None)
        worker: Worker | InProcessWorker
        if redis_url is None:
            worker = InProcessWorker(setup.broker)
        else:
            worker = Worker({"redis": redis_url, "namespace": namespace, "ledger": ledger_url})
        stack.callback(worker.stop)
        try:
            worker.start()
            if isinstance(worker, Worker):
                assert worker.proc is not None
                say(f"Worker: {' '.join(worker.argv)} (pid {worker.proc.pid}): ready")
            else:
                say(f"Worker: dramatiq.Worker(broker, worker_threads={PROCESSES * THREADS}): started")
            say()
            tour = Tour(setup, redis_url, namespace, ledger_url)
            steps: list[Callable[[], None]] = [
                tour.deduplication,
                tour.mutex,
                tour.concurrency,
                lambda: tour.ledger(engine),
                tour.throttle,
                tour.debounce,
            ]
            for step in steps:
                step()
                say()
            say("What is left: a run-time limit is the only guard state that outlives the work")
            tour.inspect(f"concurrency:webhooks:{CUSTOMER}")
        except TourFailed as e:
            say(f"\nThe tour FAILED: {e}\nThe worker's log ends with:\n{worker.log_tail()}")
            raise
    say(f"Done in {time.monotonic() - started:.1f} s.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.tour",
        description="Start a dramatiq worker and show each dramatiq-guard capability doing its job.",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        help=f"the Redis to use (default: $DRAMATIQ_GUARD_REDIS_URL, else {DEFAULT_REDIS_URL})",
    )
    parser.add_argument(
        "--no-spawn",
        action="store_true",
        help="never start a private redis-server: without Redis, run in-process",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run in-process (StubBroker, in-memory backend, dramatiq.Worker) without looking for Redis",
    )
    args = parser.parse_args(argv)
    try:
        run(args)
    except TourFailed:
        return 1
    except dramatiq_guard.ConfigurationError as e:  # e.g. in-process without the stub extra: one line
        print(f"python -m examples.tour: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
