"""Chaos run (issue 12): two applications on one guard Redis, a worker SIGKILLed every 2 s.

Run it from the repository root (it needs ``redis-server`` on PATH, and RabbitMQ for app B)::

    .venv/bin/python -m bench.chaos                     # 300 messages per app, kills for 60 s
    .venv/bin/python -m bench.chaos --b-broker redis    # both apps on RedisBrokers
    .venv/bin/python -m bench.chaos --guard cluster --replica-waits 1   # a failover mid-run

What it does:

* one private ``redis-server``: db 0 is the guard's Redis (default namespace, shared by both
  applications), db 1 app A's RedisBroker, db 2 the records (db 3 app B's broker with
  ``--b-broker redis``);
* two applications, each an actor module written to a temporary directory, each with its own
  broker and ``dramatiq_guard.install(broker, redis=<db 0>)``: app A on a RedisBroker (concurrency
  limit 2 on ``a-shared``, limit 1 per customer on 3 customers, an ``until_executed`` dedup actor,
  limit 2 on ``both``, a throttle of 3 starts a second with a concurrency limit of 2 on one
  actor, ``a-throttle``, and a debounced actor on 3 keys, ``deb-0..2``), app B on RabbitMQ
  (limit 3 on ``b-own``, a parking mutex on ``b-mutex``, limit 2 on ``both``: the key the two
  applications share);
* two worker pools per application (``dramatiq <app> --processes 1 --threads 4``, each its own
  process group); messages are sent in bursts (``--burst`` per app at once, so keys fill up and
  messages park) over ``--send-for`` seconds, and every ``--interval`` seconds one worker process is
  SIGKILLed (round-robin over the pools) and its pool restarted in the background; after
  ``--kill-for`` seconds (and the last send) the kills stop and everything drains.

The debounced actor gets bursts of its own, beside the bursts above: every ``DEBOUNCE_EVERY_S``
during ``--send-for``, a burst of ``DEBOUNCE_SENDS`` sends per debounce key, each send numbered
(its ``n``, in order of sending). A burst is *lost* if no run of its last send, nor of a later
send of its key, ended; it *ran twice* if two runs started of its sends, *explained* if a kill
explains it (the same message again, as for any message; two of its messages: a kill between its
first send and the second run, a sweeper killed mid hand-off) or its sends were more than the
debounce ``wait`` apart (two bursts for the guard).

Every run of an actor pushes a start and an end record (with its pid and ``time.time()``). From
the records, the kill times and the guard Redis it reports: messages lost (sent, never ended),
messages run more than once (and whether each extra run is explained by a kill of the process that
ran it before: Dramatiq's at-least-once delivery on a crash), the highest number of live runs of
each key at once (a run lives from its start to its end, or to the death of its killed process)
against its limit, the most starts of the throttled key in any window of its period (less
0.1 s: a start is recorded a moment after its acquire) against its limit, dedup keys admitted
twice while a holder was outstanding, the time to drain, and the guard keys left in Redis. The
figures are printed as Markdown and written, with the records, the kills and every worker's log,
to ``--out`` (a temporary directory by default). The exit status is 1 if a message was lost, ran
again without a kill to explain it, a limit or a window was exceeded, a dedup key admitted a
second message, a debounce burst was lost or ran twice unexplained, or a guard key other than a
limit, a ``:gens:<waiter>`` record or a last fencing token (``:token``, with an expiry) was left.

With ``--guard cluster`` the guard's Redis is a Redis Cluster of 3 primaries with 1 replica each
(:class:`harness.topology.RedisCluster3x1`), both applications are on RabbitMQ (the RedisBroker is
not cluster safe), and ``--failover-at`` seconds after the first send the primary owning
``concurrency:both`` is SIGKILLed: its replica takes its slots over; ``--restore-after`` seconds
later the dead node is started again and rejoins as a replica (with ``--replica-waits 1`` the new
primary fails every decision closed until then: it has no replica). The report adds which guard
keys were on the failed primary, and for each, how long after the kill a run of it started again
(the waiters moving again).

Concurrency is measured from the records, not with ``harness.Recorder.track``: a run SIGKILLed
inside ``track()`` never decrements its counter, so that counter only grows under kills.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import json
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = ROOT / "tests"
if str(TESTS_DIR) not in sys.path:  # the test harness (``harness``) is shared with the tests
    sys.path.insert(0, str(TESTS_DIR))

from harness import DramatiqWorker, RedisServer, redis_broker_dead, redis_broker_pending  # noqa: E402
from harness.topology import RedisCluster3x1  # noqa: E402

GUARD_NS = "dramatiq-guard"
RECORDS_KEY = "chaos:records"
RABBITMQ_URL = os.environ.get("DRAMATIQ_GUARD_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")

# The limits of the keys the actors run under (a dedup key allows one outstanding message).
LIMITS = {
    "a-shared": 2,
    "customer-0": 1,
    "customer-1": 1,
    "customer-2": 1,
    "both": 2,
    "b-own": 3,
    "b-mutex": 1,
    "a-throttle": 2,
}
#: The throttled keys: (starts allowed, in any window of seconds). A start is recorded a moment after
#: its acquire, so windows are checked TOLERANCE_S shorter than the period.
WINDOWS = {"a-throttle": (3, 1.0)}
TOLERANCE_S = 0.1

#: The debounced actor of app A: its keys, its wait and max_wait (ms), how long a run takes (s),
#: how often each key gets a burst (s; a run may still execute when the next burst comes), and how
#: many sends a burst has. Its sends are numbered from DEBOUNCE_N, apart from the other messages.
DEBOUNCE_KEYS = ("deb-0", "deb-1", "deb-2")
DEBOUNCE_WAIT_MS, DEBOUNCE_MAX_WAIT_MS = 300, 1_000
DEBOUNCE_RUN_S, DEBOUNCE_EVERY_S, DEBOUNCE_SENDS = 0.5, 1.0, 4
DEBOUNCE_N = 100_000

APP_HEADER = """
import json
import os
import time

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage
from redis.cluster import ClusterNode, RedisCluster

import dramatiq_guard

{broker_setup}
broker.add_middleware(CurrentMessage())
dramatiq_guard.install(
    broker, redis={guard}, lease_ttl=3_000, pickup_ttl=10_000, sweep_interval=250,
    replica_waits={replica_waits}, route={route!r},
)
dramatiq.set_broker(broker)
records = redis.Redis.from_url({records_url!r})
OPTS = dict(broker=broker, queue_name={queue!r}, min_backoff=100, max_backoff=1_000)


def record(phase, key, n, run_id, message_id):
    fields = dict(app={app!r}, n=n, key=key, phase=phase, run=run_id, mid=message_id)
    records.rpush({records_key!r}, json.dumps(dict(fields, pid=os.getpid(), ts=time.time())))


def run(key, n, seconds):
    message_id = CurrentMessage.get_current_message().message_id
    run_id = records.incr("chaos:run-ids")
    record("start", key, n, run_id, message_id)
    time.sleep(seconds)  # the job's work
    record("end", key, n, run_id, message_id)
"""

APP_A = """
@dramatiq.actor(concurrency={"limit": 2, "key": lambda n, s: "a-shared"}, **OPTS)
def a_shared(n, s):
    run("a-shared", n, s)


@dramatiq.actor(concurrency={"limit": 1, "key": lambda n, s, c: f"customer-{c}"}, **OPTS)
def a_customer(n, s, c):
    run(f"customer-{c}", n, s)


@dramatiq.actor(dedup={"strategy": "until_executed", "key": lambda n, s, u: f"user-{u}"}, **OPTS)
def a_dedup(n, s, u):
    run(f"user-{u}", n, s)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n, s: "both"}, **OPTS)
def a_both(n, s):
    run("both", n, s)


@dramatiq.actor(
    throttle={"limit": 3, "period": 1_000, "key": lambda n, s: "a-throttle"},
    concurrency={"limit": 2, "key": lambda n, s: "a-throttle"},
    **OPTS,
)
def a_throttled(n, s):
    run("a-throttle", n, s)
"""
# Its key is its second argument: sends of one key make a burst (a send numbered n, with key k).
APP_A += f"""

@dramatiq.actor(
    debounce={{"wait": {DEBOUNCE_WAIT_MS}, "max_wait": {DEBOUNCE_MAX_WAIT_MS}, "key": lambda n, k: k}},
    **OPTS,
)
def a_debounced(n, k):
    run(k, n, {DEBOUNCE_RUN_S})
"""

APP_B = """
@dramatiq.actor(concurrency={"limit": 3, "key": lambda n, s: "b-own"}, **OPTS)
def b_own(n, s):
    run("b-own", n, s)


@dramatiq.actor(mutex={"key": lambda n, s: "b-mutex", "on_busy": "park"}, **OPTS)
def b_mutex(n, s):
    run("b-mutex", n, s)


@dramatiq.actor(concurrency={"limit": 2, "key": lambda n, s: "both"}, **OPTS)
def b_both(n, s):
    run("both", n, s)
"""

# A RedisBroker requeues a dead worker's unacked messages only in its maintenance (by default one
# dispatch in a thousand) once the worker's heartbeat is older than heartbeat_timeout (60 s).
REDIS_BROKER = (
    "from dramatiq.brokers.redis import RedisBroker\n"
    "broker = RedisBroker(url={url!r}, heartbeat_timeout=5_000, maintenance_chance=100_000)"
)
RABBITMQ_BROKER = (
    "from dramatiq.brokers.rabbitmq import RabbitmqBroker\n"
    "broker = RabbitmqBroker(url={url!r}, confirm_delivery=True)"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300, help="messages sent per application")
    parser.add_argument("--send-for", type=float, default=50.0, help="seconds over which they are sent")
    parser.add_argument("--burst", type=int, default=30, help="messages per app sent at once (keys fill up)")
    parser.add_argument("--kill-for", type=float, default=60.0, help="seconds of kills, from the first send")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two kills")
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="seconds allowed to drain")
    parser.add_argument("--b-broker", choices=["rabbitmq", "redis"], default="rabbitmq")
    parser.add_argument(
        "--guard",
        choices=["single", "cluster"],
        default="single",
        help="the guard's Redis: one server, or a 3x1 Redis Cluster failed over mid-run (apps on RabbitMQ)",
    )
    parser.add_argument("--replica-waits", type=int, default=0, help="install(replica_waits=...)")
    parser.add_argument("--failover-at", type=float, default=25.0, help="seconds after the first send")
    parser.add_argument("--restore-after", type=float, default=3.0, help="seconds the failed node stays down")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument(
        "--out", help="directory for the records, kills, logs and report (default: a temp dir)"
    )
    return parser.parse_args(argv)


# --- the applications -----------------------------------------------------------------------


@dataclasses.dataclass
class App:
    name: str  # "a" or "b"
    module: str
    queue: str
    broker_kind: str  # "redis" or "rabbitmq"
    broker_url: str
    actors: ModuleType | None = None


def write_apps(
    directory: Path,
    server: RedisServer,
    b_broker: str,
    run_tag: str,
    cluster: RedisCluster3x1 | None = None,
    replica_waits: int = 0,
) -> tuple[App, App]:
    base = server.url.rsplit("/", 1)[0]
    # The guard's own client, its calls bounded below the 3 s lease (docs/failure-model.md, "A silent Redis").
    guard = repr(f"{base}/0?socket_timeout=2&socket_connect_timeout=2")
    records_url = f"{base}/2"
    a = App("a", f"chaos_app_a_{run_tag}", "chaos_a", "redis", f"{base}/1")
    if cluster is not None:  # every node as a startup node, so a client finds the cluster after a failover
        nodes = ", ".join(f"ClusterNode({n.host!r}, {n.port})" for n in cluster.nodes)
        guard = f"RedisCluster(startup_nodes=[{nodes}], socket_timeout=2, socket_connect_timeout=2)"
        a = App("a", f"chaos_app_a_{run_tag}", f"chaos_a_{run_tag}", "rabbitmq", RABBITMQ_URL)
    if b_broker == "rabbitmq":
        b = App("b", f"chaos_app_b_{run_tag}", f"chaos_b_{run_tag}", "rabbitmq", RABBITMQ_URL)
    else:
        b = App("b", f"chaos_app_b_{run_tag}", "chaos_b", "redis", f"{base}/3")
    for app, body in ((a, APP_A), (b, APP_B)):
        template = REDIS_BROKER if app.broker_kind == "redis" else RABBITMQ_BROKER
        header = APP_HEADER.format(
            broker_setup=template.format(url=app.broker_url),
            guard=guard,
            replica_waits=replica_waits,
            # Two applications on one RabbitMQ vhost would have the same route (docs/failure-model.md,
            # "Two applications on one guard Redis"): named apart.
            route=None if cluster is None else f"chaos-{app.name}",
            records_url=records_url,
            records_key=RECORDS_KEY,
            queue=app.queue,
            app=app.name,
        )
        (directory / f"{app.module}.py").write_text(header + "\n" + body)
    return a, b


# --- worker pools ---------------------------------------------------------------------------


@dataclasses.dataclass
class Kill:
    pool: str
    pid: int
    sent_at: float  # time.time() just before the SIGKILL
    dead_at: float  # time.time() once the process was seen dead


class Pool:
    """One ``dramatiq <app> --processes 1 --threads 4``, restarted in the background after a kill."""

    def __init__(self, name: str, app: App, env: dict[str, str], cwd: Path, logs: Path) -> None:
        self.name = name
        self.app = app
        self.env = env
        self.cwd = cwd
        self.logs = logs
        self.worker: DramatiqWorker | None = None
        self.pid = 0
        self.pids: list[int] = []
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.incarnation = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._boot, name=f"pool-{self.name}", daemon=True)
        self._thread.start()

    def _boot(self, previous: DramatiqWorker | None = None) -> None:
        try:
            if previous is not None:
                previous.stop(timeout=10)
                self._save_log(previous)
            worker = DramatiqWorker(self.app.module, processes=1, threads=4, env=self.env, cwd=self.cwd)
            self.worker = worker
            self.incarnation += 1
            worker.start()
            self.pid = worker.wait_ready(180)[0]
            self.pids.append(self.pid)
            self.ready.set()
        except BaseException as exc:  # reported by the driver
            self.error = exc

    def kill(self) -> Kill:
        """SIGKILL the worker process, wait until it is dead, and restart the pool in the background."""
        assert self.worker is not None and self.ready.is_set()
        self.ready.clear()
        sent_at = time.time()
        pid = self.worker.kill_worker(self.pid, timeout=30)
        kill = Kill(self.name, pid, sent_at, time.time())
        self._thread = threading.Thread(target=self._boot, args=(self.worker,), daemon=True)
        self._thread.start()
        return kill

    def wait_ready(self, timeout: float) -> None:
        if not self.ready.wait(timeout) or self.error is not None:
            raise RuntimeError(f"pool {self.name} did not come up: {self.error!r}")

    def stop(self) -> int | None:
        if self._thread is not None:
            self._thread.join(200)
        if self.worker is None:
            return None
        status: int | None = self.worker.stop(timeout=30)
        self._save_log(self.worker)
        return status

    def _save_log(self, worker: DramatiqWorker) -> None:
        pid = worker.worker_pids[0] if worker.worker_pids else worker.pid
        (self.logs / f"{self.name}-{pid}.log").write_text(worker.log)


# --- sending --------------------------------------------------------------------------------


@dataclasses.dataclass
class Sent:
    app: str
    n: int
    actor: str
    key: str
    mid: str
    deduplicated_by: str | None
    called_at: float
    returned_at: float
    error: str | None = None
    burst: int | None = None  # a debounced send's burst (its round; with its key, the burst)


def plan(app: str, n: int, rng: random.Random) -> tuple[str, tuple[Any, ...], str]:
    """Message ``n`` of ``app``: (actor, args, key). Durations are 0.2-0.8 s."""
    seconds = round(rng.uniform(0.2, 0.8), 3)
    slot = n % 10
    if app == "a":
        if slot < 3:
            return "a_shared", (n, seconds), "a-shared"
        if slot < 6:
            return "a_customer", (n, seconds, n % 3), f"customer-{n % 3}"
        if slot < 8:  # 6 and 7 share a user: 7 is sent right after 6, and is usually deduplicated
            user = (n // 10) % 4
            return "a_dedup", (n, seconds, user), f"user-{user}"
        if slot < 9:
            return "a_both", (n, seconds), "both"
        return "a_throttled", (n, seconds / 4), "a-throttle"  # short: the window binds, not the slots
    if slot < 6:
        return "b_own", (n, seconds), "b-own"
    if slot < 8:
        return "b_mutex", (n, seconds), "b-mutex"
    return "b_both", (n, seconds), "both"


def send_one(app: App, n: int, rng: random.Random) -> Sent:
    import dramatiq_guard

    assert app.actors is not None
    actor_name, args, key = plan(app.name, n, rng)
    called = time.time()
    try:
        message = getattr(app.actors, actor_name).send(*args)
    except Exception as exc:
        return Sent(app.name, n, actor_name, key, "", None, called, time.time(), repr(exc))
    by = dramatiq_guard.deduplicated_by(message)
    return Sent(app.name, n, actor_name, key, message.message_id, by, called, time.time())


def send_all(args: argparse.Namespace, apps: Sequence[App], out: list[Sent]) -> None:
    """Send ``args.messages`` per application in bursts of ``args.burst``, evenly over
    ``args.send_for`` seconds, apps interleaved."""
    rngs = {app.name: random.Random(f"{args.seed}-{app.name}") for app in apps}
    bursts = -(-args.messages // args.burst)
    start = time.monotonic()
    for n in range(args.messages):
        pause = start + (n // args.burst) * args.send_for / bursts - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        for app in apps:
            out.append(send_one(app, n, rngs[app.name]))


def send_debounced(args: argparse.Namespace, app: App, out: list[Sent]) -> None:
    """Every DEBOUNCE_EVERY_S over ``args.send_for`` seconds, a burst of DEBOUNCE_SENDS sends of the
    debounced actor per debounce key, numbered from DEBOUNCE_N in order of sending."""
    assert app.actors is not None
    numbers = itertools.count(DEBOUNCE_N)
    start = time.monotonic()
    for burst in range(max(1, int(args.send_for / DEBOUNCE_EVERY_S))):
        pause = start + burst * DEBOUNCE_EVERY_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        for key in DEBOUNCE_KEYS:
            for n in itertools.islice(numbers, DEBOUNCE_SENDS):
                called, error, mid = time.time(), None, ""
                try:
                    mid = app.actors.a_debounced.send(n, key).message_id
                except Exception as exc:
                    error = repr(exc)
                out.append(
                    Sent(app.name, n, "a_debounced", key, mid, None, called, time.time(), error, burst)
                )


def bursts_of(sent: Iterable[Sent]) -> dict[tuple[str, int], list[Sent]]:
    """The debounced sends by burst, (key, round), each burst's sends accepted, in order."""
    bursts: dict[tuple[str, int], list[Sent]] = defaultdict(list)
    for s in sorted(sent, key=lambda s: s.n):
        if s.burst is not None and s.error is None:
            bursts[(s.key, s.burst)].append(s)
    return bursts


def burst_fates(bursts: dict[tuple[str, int], list[Sent]], ended: set[int]) -> dict[tuple[str, int], str]:
    """Each burst's fate, from the sends numbered ``ended`` that ran to their end: ``"last"`` (its
    last send ran), ``"later"`` (a later send of its key ran, superseding it), or ``"lost"``."""
    ended_by_key: dict[str, int] = {}
    for (key, _), sends in bursts.items():
        for s in sends:
            if s.n in ended:
                ended_by_key[key] = max(ended_by_key.get(key, -1), s.n)
    fates = {}
    for (key, round_), sends in bursts.items():
        last = sends[-1].n
        fates[(key, round_)] = (
            "last" if last in ended else "later" if ended_by_key.get(key, -1) > last else "lost"
        )
    return fates


# --- the run --------------------------------------------------------------------------------


@dataclasses.dataclass
class Timeline:
    first_send: float = 0.0
    last_send: float = 0.0
    kills_stopped: float = 0.0
    all_ended: float | None = None
    guard_clean: float | None = None
    skipped_ticks: int = 0
    failover_at: float | None = None  # time.time() of the primary's SIGKILL
    promoted_at: float | None = None  # when its replica served the slot
    restored_at: float | None = None  # when the dead node was back, as a replica
    failed_keys: list[str] = dataclasses.field(default_factory=list)  # guard keys on that primary


#: The guard key whose primary is failed over, and the guard keys the chaos uses (to tell which
#: lived on that primary).
FAILOVER_KEY = "concurrency:both"
GUARD_KEYS = {
    **{f"concurrency:{k}": k for k in LIMITS if k != "b-mutex"},
    "mutex:b-mutex": "b-mutex",
    **{f"debounce:{k}": k for k in DEBOUNCE_KEYS},
    **{f"dedup:user-{u}": f"user-{u}" for u in range(4)},
}


def fail_over(cluster: RedisCluster3x1, args: argparse.Namespace, timeline: Timeline) -> None:
    """At ``--failover-at``, SIGKILL the primary of FAILOVER_KEY; ``--restore-after`` later, restart it."""
    time.sleep(max(0.0, timeline.first_send + args.failover_at - time.time()))
    failed = cluster.owner_of(FAILOVER_KEY)
    timeline.failed_keys = sorted(
        record_key for guard_key, record_key in GUARD_KEYS.items() if cluster.owner_of(guard_key) is failed
    )
    timeline.failover_at = time.time()
    print(f"chaos: killed the guard primary on port {failed.port}", file=sys.stderr, flush=True)
    promoted = cluster.fail_over(FAILOVER_KEY)
    timeline.promoted_at = time.time()
    print(f"chaos: its replica on port {promoted.port} took over", file=sys.stderr, flush=True)
    time.sleep(args.restore_after)
    cluster.restore_failed()
    timeline.restored_at = time.time()
    print("chaos: the failed node is back, as a replica", file=sys.stderr, flush=True)


def kill_phase(
    pools: Sequence[Pool], interval: float, until: float, sender: threading.Thread
) -> tuple[list[Kill], int]:
    """Every ``interval`` s, SIGKILL the next ready pool's worker (round-robin), until ``until``
    (time.monotonic()) and the sender is done."""
    kills: list[Kill] = []
    skipped = 0
    turn = 0
    tick = time.monotonic() + interval
    while time.monotonic() < until or sender.is_alive():
        time.sleep(max(0.0, tick - time.monotonic()))
        tick += interval
        for pool in pools:
            if pool.error is not None:
                raise RuntimeError(f"pool {pool.name} failed to restart: {pool.error!r}")
        ready = [pools[(turn + i) % len(pools)] for i in range(len(pools))]
        ready = [p for p in ready if p.ready.is_set()]
        if not ready:
            skipped += 1
            continue
        kills.append(ready[0].kill())
        turn = (pools.index(ready[0]) + 1) % len(pools)
        print(f"chaos: killed {kills[-1].pool} pid {kills[-1].pid}", file=sys.stderr, flush=True)
    return kills, skipped


class Records:
    """The records the actors push, read incrementally."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.items: list[dict[str, Any]] = []
        self.started: set[tuple[str, int]] = set()
        self.ended: set[tuple[str, int]] = set()

    def refresh(self) -> None:
        new = self.client.lrange(RECORDS_KEY, len(self.items), -1)
        for raw in new:
            record = json.loads(raw)
            self.items.append(record)
            (self.ended if record["phase"] == "end" else self.started).add((record["app"], record["n"]))


def wait_for(predicate: Any, timeout: float, pause: float = 0.2) -> float | None:
    """Poll ``predicate`` until true; return the time.time() it was, or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.time()
        if time.monotonic() > deadline:
            return None
        time.sleep(pause)


#: The namespace-wide keys that stay: the limits and waiting-keys indexes, the layout record, and the
#: live workers' records (expiring a minute after the last one stopped).
KEPT = ("limits", "waiting", "layout", "processes")


def guard_keys(client: Any) -> dict[str, list[tuple[str, str, int]]]:
    """The guard's keys by kind: ``kept`` (limits, the waiting index, the layout record, the live
    workers' records), ``gens`` (a waiter's
    generation record, expiring a day after its last write), ``tokens`` (a
    key's last fencing token, expiring a day after it was issued), ``other``; each as (key, type,
    ttl in ms, -1 for none). ``client``: a Redis or RedisCluster client."""
    found: dict[str, list[tuple[str, str, int]]] = {"kept": [], "gens": [], "tokens": [], "other": []}
    for raw in sorted(client.scan_iter(f"{GUARD_NS}:*".encode())):
        key = raw.decode()
        kind = "other"
        if key.endswith(":limit") or key in {f"{GUARD_NS}:{name}" for name in KEPT}:
            kind = "kept"
        elif "}:gens:" in key and int(client.pttl(raw)) >= 0:
            kind = "gens"
        elif key.endswith(":token") and int(client.pttl(raw)) >= 0:
            kind = "tokens"
        type_ = client.type(raw)
        type_name = type_.decode() if isinstance(type_, bytes) else str(type_)
        found[kind].append((key, type_name, int(client.pttl(raw))))
    return found


def rabbitmq_depth(url: str, queue: str, *, delete: bool = False) -> int:
    """Messages ready on RabbitMQ ``queue`` and its delay and dead-letter queues (deleted with ``delete``)."""
    import pika
    from dramatiq.common import dq_name, xq_name

    connection = pika.BlockingConnection(pika.URLParameters(url))
    total = 0
    try:
        channel = connection.channel()
        for name in (queue, dq_name(queue), xq_name(queue)):
            with contextlib.suppress(Exception):
                total += channel.queue_declare(name, passive=True).method.message_count
            if delete:
                channel = connection.channel() if channel.is_closed else channel
                channel.queue_delete(name)
    finally:
        connection.close()
    return total


def broker_left(app: App) -> dict[str, int]:
    """What the app's broker still holds after the drain: pending (queued, delayed, unacked) and dead."""
    if app.broker_kind == "rabbitmq":
        return {"pending_or_dead": rabbitmq_depth(app.broker_url, app.queue)}
    client = redis.Redis.from_url(app.broker_url)
    try:
        return {
            "pending": redis_broker_pending(client, [app.queue]),
            "dead": redis_broker_dead(client, [app.queue]),
        }
    finally:
        client.close()


def worker_env(app_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(app_dir), str(TESTS_DIR), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclasses.dataclass
class Outcome:
    sent: list[Sent]
    records: list[dict[str, Any]]
    kills: list[Kill]
    timeline: Timeline
    leftovers: dict[str, list[tuple[str, str, int]]]
    broker_left: dict[str, dict[str, int]]
    worker_status: dict[str, int | None]


def run(args: argparse.Namespace, out: Path) -> Outcome:
    run_tag = uuid.uuid4().hex[:8]
    app_dir = out / "apps"
    logs = out / "logs"
    app_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        cluster = stack.enter_context(RedisCluster3x1()) if args.guard == "cluster" else None
        apps = write_apps(app_dir, server, args.b_broker, run_tag, cluster, args.replica_waits)
        sys.path.insert(0, str(app_dir))
        for app in apps:
            app.actors = importlib.import_module(app.module)
        env = worker_env(app_dir)
        pools = [Pool(f"{app.name}{i}", app, env, app_dir, logs) for i in (1, 2) for app in apps]
        try:
            return drive(args, server, apps, pools, logs, cluster)
        finally:
            for pool in pools:
                pool.stop()
            for app in apps:
                if app.broker_kind == "rabbitmq":
                    with contextlib.suppress(Exception):
                        rabbitmq_depth(app.broker_url, app.queue, delete=True)
    raise AssertionError("not reached")


def drive(
    args: argparse.Namespace,
    server: RedisServer,
    apps: Sequence[App],
    pools: Sequence[Pool],
    logs: Path,
    cluster: RedisCluster3x1 | None = None,
) -> Outcome:
    guard: Any = server.client(db=0) if cluster is None else cluster.client(socket_timeout=2)
    records = Records(server.client(db=2))
    for pool in pools:
        pool.start()
    for pool in pools:
        pool.wait_ready(180)
    timeline = Timeline(first_send=time.time())
    sent: list[Sent] = []
    debounced: list[Sent] = []
    sender = threading.Thread(target=send_all, args=(args, apps, sent))
    sender.start()
    debouncer = threading.Thread(target=send_debounced, args=(args, apps[0], debounced))
    debouncer.start()
    failover = None
    if cluster is not None:
        failover = threading.Thread(target=fail_over, args=(cluster, args, timeline), daemon=True)
        failover.start()
    kills, timeline.skipped_ticks = kill_phase(pools, args.interval, time.monotonic() + args.kill_for, sender)
    sender.join()
    debouncer.join()
    sent += debounced
    if failover is not None:
        failover.join()
    timeline.last_send = max(s.returned_at for s in sent)
    timeline.kills_stopped = time.time()
    print(f"chaos: kills stopped after {len(kills)} kills; draining", file=sys.stderr, flush=True)
    expected = {
        (s.app, s.n) for s in sent if s.error is None and s.deduplicated_by is None and s.burst is None
    }
    bursts = bursts_of(sent)

    def all_ended() -> bool:
        records.refresh()
        ended = {n for app, n in records.ended if app == apps[0].name}
        # Every debounced run that started ends too (one cut by a kill is delivered again).
        debounced_runs = {(app, n) for app, n in records.started if n >= DEBOUNCE_N}
        return (
            expected | debounced_runs <= records.ended and "lost" not in burst_fates(bursts, ended).values()
        )

    timeline.all_ended = wait_for(all_ended, args.drain_timeout)

    def clean() -> bool:
        return not guard_keys(guard)["other"]

    timeline.guard_clean = wait_for(clean, 60.0)
    leftovers = guard_keys(guard)
    status = {pool.name: pool.stop() for pool in pools}
    records.refresh()
    return Outcome(
        sent=sent,
        records=records.items,
        kills=kills,
        timeline=timeline,
        leftovers=leftovers,
        broker_left={app.name: broker_left(app) for app in apps},
        worker_status=status,
    )


# --- analysis -------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    app: str
    n: int
    key: str
    pid: int
    start: float
    end: float | None
    mid: str


def runs_of(records: Iterable[dict[str, Any]]) -> list[Run]:
    runs: dict[int, Run] = {}
    for r in records:
        if r["phase"] == "start":
            runs[r["run"]] = Run(r["app"], r["n"], r["key"], r["pid"], r["ts"], None, r["mid"])
        else:
            runs[r["run"]].end = r["ts"]
    return sorted(runs.values(), key=lambda run: run.start)


def live_until(run: Run, kills_by_pid: dict[int, Kill]) -> float | None:
    """Until when a run lived: its end, else the death of its killed process (None: neither)."""
    if run.end is not None:
        return run.end
    kill = kills_by_pid.get(run.pid)
    return kill.dead_at if kill is not None and kill.dead_at >= run.start else None


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    events = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda e: (e[0], e[1])
    )
    live = best = 0
    for _, step in events:
        live += step
        best = max(best, live)
    return best


def concurrency(runs: Sequence[Run], kills_by_pid: dict[int, Kill]) -> dict[str, int]:
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        if run.key in LIMITS:
            until = live_until(run, kills_by_pid)
            intervals[run.key].append((run.start, until if until is not None else float("inf")))
    return {key: max_overlap(intervals.get(key, [])) for key in LIMITS}


def window_peaks(runs: Sequence[Run]) -> dict[str, int]:
    """Per throttled key, the most starts in any window of its period (less TOLERANCE_S)."""
    peaks = {}
    for key, (_, period) in WINDOWS.items():
        starts = sorted(run.start for run in runs if run.key == key)
        first, best = 0, 0
        for last, at in enumerate(starts):
            while starts[first] <= at - (period - TOLERANCE_S):
                first += 1
            best = max(best, last - first + 1)
        peaks[key] = best
    return peaks


def explain(earlier: Run, later: Run, kills_by_pid: dict[int, Kill]) -> str | None:
    """Why ``later`` ran the message again, if a kill explains it: ``earlier``'s process was killed
    after ``earlier`` started and before ``later`` started."""
    kill = kills_by_pid.get(earlier.pid)
    if kill is None or not earlier.start <= kill.sent_at <= later.start:
        return None
    if earlier.end is None:
        return "killed mid-run"
    return f"killed {kill.sent_at - earlier.end:.3f} s after its end (before the ack)"


def reruns(runs: Sequence[Run], kills_by_pid: dict[int, Kill]) -> list[dict[str, Any]]:
    by_message: dict[tuple[str, int], list[Run]] = defaultdict(list)
    for run in runs:
        by_message[(run.app, run.n)].append(run)
    found = []
    for (app, n), message_runs in sorted(by_message.items()):
        for earlier, later in itertools.pairwise(message_runs):
            found.append(
                {
                    "app": app,
                    "n": n,
                    "key": later.key,
                    "mid": later.mid,
                    "pids": [earlier.pid, later.pid],
                    "explained_by": explain(earlier, later, kills_by_pid),
                }
            )
    return found


def dedup_violations(sent: Sequence[Sent], runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Dedup messages admitted while an earlier admitted message of the same key had not ended for
    good (``until_executed``): the new send returned before the earlier message's last end."""
    last_end: dict[tuple[str, int], float] = {}
    for run in runs:
        if run.end is not None:
            last_end[(run.app, run.n)] = max(run.end, last_end.get((run.app, run.n), 0.0))
    admitted = sorted(
        (s for s in sent if s.actor == "a_dedup" and s.error is None and s.deduplicated_by is None),
        key=lambda s: s.called_at,
    )
    found = []
    previous: dict[str, Sent] = {}
    for s in admitted:
        before = previous.get(s.key)
        end = last_end.get((before.app, before.n)) if before is not None else None
        if before is not None and end is not None and s.returned_at < end:
            found.append({"key": s.key, "n": s.n, "while": before.n, "by_s": end - s.returned_at})
        previous[s.key] = s
    return found


def app_figures(
    app: str, outcome: Outcome, runs: Sequence[Run], kills_by_pid: dict[int, Kill]
) -> dict[str, Any]:
    sent = [s for s in outcome.sent if s.app == app and s.burst is None]
    runs = [run for run in runs if run.key not in DEBOUNCE_KEYS]
    accepted = {s.n for s in sent if s.error is None and s.deduplicated_by is None}
    ended = {run.n for run in runs if run.app == app and run.end is not None}
    started = Counter(run.n for run in runs if run.app == app)
    again = [r for r in reruns([run for run in runs if run.app == app], kills_by_pid)]
    return {
        "sent": len(sent),
        "send_errors": sum(1 for s in sent if s.error is not None),
        "deduplicated": sum(1 for s in sent if s.deduplicated_by is not None),
        "deduplicated_but_ran": sorted({s.n for s in sent if s.deduplicated_by is not None} & set(started)),
        "completed": len(accepted & ended),
        "lost": sorted(accepted - ended),
        "runs": sum(started.values()),
        "runs_without_end": sum(1 for run in runs if run.app == app and run.end is None),
        "run_more_than_once": len({(r["n"]) for r in again}),
        "extra_runs": again,
        "unexplained_extra_runs": [r for r in again if r["explained_by"] is None],
    }


def debounce_figures(sent: Sequence[Sent], runs: Sequence[Run], kills: Sequence[Kill]) -> dict[str, Any]:
    """The debounced actor's bursts: their fates (:func:`burst_fates`), the bursts that ran twice and
    why, and how many came while a run of their key executed."""
    kills_by_pid = {kill.pid: kill for kill in kills}
    bursts = bursts_of(sent)
    mine = [run for run in runs if run.key in DEBOUNCE_KEYS]
    ended = {run.n for run in mine if run.end is not None}
    fates = burst_fates(bursts, ended)
    runs_of_n: dict[int, list[Run]] = defaultdict(list)
    for run in mine:
        runs_of_n[run.n].append(run)
    twice, during_run = [], 0
    for (key, round_), sends in sorted(bursts.items()):
        first = sends[0].called_at
        if any(r.key == key and r.start <= first <= (live_until(r, kills_by_pid) or 0.0) for r in mine):
            during_run += 1
        started = sorted((r for s in sends for r in runs_of_n[s.n]), key=lambda r: r.start)
        gap = max((b.called_at - a.returned_at for a, b in itertools.pairwise(sends)), default=0.0)
        for earlier, later in itertools.pairwise(started):
            why = explain(earlier, later, kills_by_pid) if earlier.n == later.n else None
            if earlier.n != later.n and gap * 1000 >= DEBOUNCE_WAIT_MS:
                why = f"its sends were {gap:.3f} s apart: two bursts"
            elif earlier.n != later.n and any(first <= k.sent_at <= later.start for k in kills):
                why = "a kill between its first send and the second run (a sweeper's hand-off cut)"
            twice.append({"key": key, "burst": round_, "n": [earlier.n, later.n], "explained_by": why})
    accepted = [s for sends in bursts.values() for s in sends]
    return {
        "keys": len(DEBOUNCE_KEYS),
        "bursts": len(bursts),
        "sends": sum(1 for s in sent if s.burst is not None),
        "send_errors": sum(1 for s in sent if s.burst is not None and s.error is not None),
        "runs": len(mine),
        "runs_without_end": sum(1 for run in mine if run.end is None),
        # A run cut by a kill is delivered again (at least once): a message started never ended is lost.
        "started_never_ended": sorted({run.n for run in mine} - ended),
        "superseded": sum(1 for s in accepted if not runs_of_n.get(s.n)),
        "last_send_ran": sum(1 for fate in fates.values() if fate == "last"),
        "superseded_by_a_later_burst": sum(1 for fate in fates.values() if fate == "later"),
        "lost": sorted(f"{key}#{round_}" for (key, round_), fate in fates.items() if fate == "lost"),
        "sent_during_a_run": during_run,
        "ran_twice": twice,
        "ran_twice_unexplained": [t for t in twice if t["explained_by"] is None],
    }


LOG_EVENTS = {
    "parked_after_pickup": re.compile(r"\[INFO\] Parked .* after pickup"),
    "stale_copies_skipped": re.compile(r"a stale copy"),
    "second_copies_deferred": re.compile(r"\[WARNING\] Deferred .* another copy of it holds"),
    "cli_saw_worker_die": re.compile(r"exited unexpectedly"),
    "warnings": re.compile(r"\[WARNING\]"),
    "errors": re.compile(r"\[ERROR\]|\[CRITICAL\]"),
    "tracebacks": re.compile(r"^Traceback"),
}
# Expected: the private Redis does not persist (every boot); Dramatiq's own lines about a message
# parked after pickup (skipped) and about a killed worker process (its CLI may also lose that one);
# a copy of a killed holder's message, delivered again before the holder's lease lapsed, deferred.
LOG_EXPECTED = re.compile(
    r"does not persist its data|Failed to send 'SIGTERM'|Message .* was skipped\.|exited unexpectedly"
    r"|Deferred .* another copy of it holds"
)


def log_summary(logs: Path) -> dict[str, dict[str, Any]]:
    """Per application: counts of the notable lines of its workers' logs, and the distinct
    unexpected WARNING/ERROR lines (ids and times stripped)."""
    summary: dict[str, dict[str, Any]] = {}
    for path in sorted(logs.glob("*.log")):
        app = summary.setdefault(path.name[0], {**dict.fromkeys(LOG_EVENTS, 0), "unexpected": Counter()})
        for line in path.read_text(errors="replace").splitlines():
            for name, pattern in LOG_EVENTS.items():
                if pattern.search(line) and not (
                    name in {"warnings", "errors"} and LOG_EXPECTED.search(line)
                ):
                    app[name] += 1
            if re.search(r"\[(WARNING|ERROR|CRITICAL)\]", line) and not LOG_EXPECTED.search(line):
                app["unexpected"][re.sub(r"[0-9a-f-]{36}|\d+", "#", line.split("] ", 4)[-1])[:200]] += 1
    return summary


def moved_again(runs: Sequence[Run], timeline: Timeline) -> dict[str, float | None]:
    """For each key of the failed primary, seconds from its kill to the first run of the key that
    started after it (None: none did)."""
    if timeline.failover_at is None:
        return {}
    at = timeline.failover_at
    return {
        key: min((run.start - at for run in runs if run.key == key and run.start > at), default=None)
        for key in timeline.failed_keys
    }


def analyse(outcome: Outcome, logs: Path) -> dict[str, Any]:
    kills_by_pid = {kill.pid: kill for kill in outcome.kills}
    runs = runs_of(outcome.records)
    t = outcome.timeline
    return {
        "failover": None
        if t.failover_at is None
        else {
            "failed_keys": t.failed_keys,
            "at_s": t.failover_at - t.first_send,
            "promoted_after_s": None if t.promoted_at is None else t.promoted_at - t.failover_at,
            "restored_after_s": None if t.restored_at is None else t.restored_at - t.failover_at,
            "moved_again_s": moved_again(runs, t),
        },
        "apps": {app: app_figures(app, outcome, runs, kills_by_pid) for app in ("a", "b")},
        "debounce": debounce_figures(outcome.sent, runs, outcome.kills),
        "max_concurrency": concurrency(runs, kills_by_pid),
        "limits": LIMITS,
        "window_peaks": window_peaks(runs),
        "dedup_admitted_while_held": dedup_violations(outcome.sent, runs),
        "kills": len(outcome.kills),
        "kills_per_pool": Counter(kill.pool for kill in outcome.kills),
        "kill_phase_s": t.kills_stopped - t.first_send,
        "skipped_ticks": t.skipped_ticks,
        "drain_s": None if t.all_ended is None else max(0.0, t.all_ended - t.kills_stopped),
        "last_send_to_all_ended_s": None if t.all_ended is None else t.all_ended - t.last_send,
        "last_end_after_kills_s": max((r.end for r in runs if r.end), default=0.0) - t.kills_stopped,
        "guard_clean_after_kills_s": None if t.guard_clean is None else t.guard_clean - t.kills_stopped,
        "leftovers": outcome.leftovers,
        "broker_left": outcome.broker_left,
        "worker_exit_status": outcome.worker_status,
        "logs": log_summary(logs),
    }


# --- the report -----------------------------------------------------------------------------


def app_table(result: dict[str, Any]) -> list[str]:
    apps, logs = result["apps"], result["logs"]
    lines = ["| | app A | app B |", "|---|---:|---:|"]
    rows = [
        ("messages sent", "sent"),
        ("send errors", "send_errors"),
        ("deduplicated at send (not expected to run)", "deduplicated"),
        ("completed (at least once)", "completed"),
        ("runs (starts)", "runs"),
        ("runs cut by a kill (no end)", "runs_without_end"),
        ("messages run more than once", "run_more_than_once"),
    ]
    lines += [f"| {label} | {apps['a'][key]} | {apps['b'][key]} |" for label, key in rows]
    counted = [
        ("**lost** (sent, never completed)", "lost"),
        ("extra runs **not** explained by a kill", "unexplained_extra_runs"),
        ("deduplicated yet ran", "deduplicated_but_ran"),
    ]
    lines += [f"| {label} | {len(apps['a'][key])} | {len(apps['b'][key])} |" for label, key in counted]
    events = [
        ("workers' log: parked after pickup", "parked_after_pickup"),
        ("workers' log: stale copies skipped", "stale_copies_skipped"),
        ("workers' log: second copies deferred (a holder's lease not lapsed yet)", "second_copies_deferred"),
        ("workers' log: a worker process exited unexpectedly", "cli_saw_worker_die"),
        ("workers' log: other warnings", "warnings"),
        ("workers' log: other errors", "errors"),
        ("workers' log: tracebacks", "tracebacks"),
    ]
    none: dict[str, int] = {}
    lines += [
        f"| {label} | {logs.get('a', none).get(key, 0)} | {logs.get('b', none).get(key, 0)} |"
        for label, key in events
    ]
    return lines


def key_table(result: dict[str, Any]) -> list[str]:
    lines = ["| key | limit | max live runs at once |", "|---|---:|---:|"]
    for key, limit in result["limits"].items():
        lines.append(f"| `{key}` | {limit} | {result['max_concurrency'][key]} |")
    lines += [
        "",
        "| throttled key | starts allowed per window | most starts in any window |",
        "|---|---:|---:|",
    ]
    for key, (limit, period) in WINDOWS.items():
        lines.append(f"| `{key}` | {limit} per {period:g} s | {result['window_peaks'][key]} |")
    return lines


def debounce_table(result: dict[str, Any]) -> list[str]:
    d = result["debounce"]
    return [
        f"| debounced actor (app A): {d['keys']} keys, `wait` {DEBOUNCE_WAIT_MS} ms, `max_wait` "
        f"{DEBOUNCE_MAX_WAIT_MS} ms, runs of {DEBOUNCE_RUN_S:g} s; a burst of {DEBOUNCE_SENDS} sends per "
        f"key every {DEBOUNCE_EVERY_S:g} s | |",
        "|---|---:|",
        f"| bursts sent | {d['bursts']} |",
        f"| sends (send errors) | {d['sends']} ({d['send_errors']}) |",
        f"| sends superseded (never ran) | {d['superseded']} |",
        f"| runs (starts) | {d['runs']} |",
        f"| runs cut by a kill (no end) | {d['runs_without_end']} |",
        f"| bursts whose last send ran | {d['last_send_ran']} |",
        f"| bursts superseded by a later one of their key, which ran | {d['superseded_by_a_later_burst']} |",
        f"| bursts that came while a run of their key executed | {d['sent_during_a_run']} |",
        f"| **lost** bursts (neither ran) | {len(d['lost'])} |",
        f"| runs started and **never** run to their end | {len(d['started_never_ended'])} |",
        f"| bursts run twice (explained by a kill, or sends a `wait` apart) | {len(d['ran_twice'])} |",
        f"| bursts run twice **not** explained | {len(d['ran_twice_unexplained'])} |",
    ]


def seconds(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.1f} s"


def failover_lines(failover: dict[str, Any] | None) -> list[str]:
    if failover is None:
        return []
    moved = ", ".join(
        f"`{key}` {'never' if s is None else f'{s:.1f} s'}" for key, s in failover["moved_again_s"].items()
    )
    return [
        f"Failover: the guard primary owning `{FAILOVER_KEY}` was SIGKILLed {failover['at_s']:.1f} s after "
        f"the first send; its replica served the slots {seconds(failover['promoted_after_s'], 'never')} "
        f"later; the dead node was back as a replica {seconds(failover['restored_after_s'], 'never')} "
        f"after the kill. Keys on that primary: {', '.join(f'`{k}`' for k in failover['failed_keys'])}. "
        f"First run of each that started after the kill (waiters moving again): {moved or 'none'}.",
        "",
    ]


def render(result: dict[str, Any], command: str, b_broker: str) -> str:
    left = result["leftovers"]
    kept = ", ".join(f"`{k}`" for k, _, _ in left["kept"]) or "none"
    lines = [
        f"Command: `{command}`; app B on {'RabbitMQ' if b_broker == 'rabbitmq' else 'a RedisBroker'}.",
        "",
        *failover_lines(result.get("failover")),
        f"Kills: {result['kills']} in {result['kill_phase_s']:.1f} s ({dict(result['kills_per_pool'])}), "
        f"{result['skipped_ticks']} ticks skipped (no pool ready).",
        "",
        *app_table(result),
        "",
        *key_table(result),
        "",
        *debounce_table(result),
        "",
        "Dedup messages admitted while an earlier one of their key was outstanding: "
        f"{len(result['dedup_admitted_while_held'])}.",
        "",
        "Drain: every message completed "
        f"{seconds(result['last_send_to_all_ended_s'], 'NOT within the timeout')} after the last send, "
        f"{seconds(result['drain_s'], 'NOT within the timeout')} after the kills stopped; the guard's Redis "
        "held nothing but limits and `:gens:` records "
        f"{seconds(result['guard_clean_after_kills_s'], 'NOT within 60 s more')} after the kills stopped.",
        "",
        f"Guard keys left after the drain, but limits ({kept}), {len(left['tokens'])} keys' last fencing "
        f"tokens (expiring a day after their last token) and {len(left['gens'])} `:gens:<waiter>` records "
        "(one per message a worker parked after pickup, or whose hand-off lapsed; each expiring a day "
        "after its last write):",
        "",
        *([f"- `{k}` ({kind}, ttl {ttl / 1000:.0f} s)" for k, kind, ttl in left["other"]] or ["- none"]),
        "",
        f"Brokers after the drain: {result['broker_left']}; workers' exit status: "
        f"{result['worker_exit_status']}.",
    ]
    return "\n".join(lines) + "\n"


def dump(out: Path, outcome: Outcome, result: dict[str, Any], report: str) -> None:
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in outcome.records))
    (out / "sent.jsonl").write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in outcome.sent))
    (out / "kills.json").write_text(json.dumps([dataclasses.asdict(k) for k in outcome.kills], indent=1))
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(report)


@contextlib.contextmanager
def output_dir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        yield Path(tempfile.mkdtemp(prefix="dramatiq-guard-chaos-"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # This process only sends: the guard's notes about the private Redis (no persistence) are expected.
    logging.getLogger("dramatiq_guard").setLevel(logging.ERROR)
    command = "python -m bench.chaos" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    with output_dir(args.out) as out:
        outcome = run(args, out)
        result = analyse(outcome, out / "logs")
        report = render(result, command, args.b_broker)
        dump(out, outcome, result, report)
    sys.stdout.write(report)
    print(f"chaos: records, kills, logs and report in {out}", file=sys.stderr)
    a, b = result["apps"]["a"], result["apps"]["b"]
    failed = (
        a["lost"]
        or b["lost"]
        or a["unexplained_extra_runs"]
        or b["unexplained_extra_runs"]
        or any(result["max_concurrency"][k] > v for k, v in LIMITS.items())
        or any(result["window_peaks"][k] > limit for k, (limit, _) in WINDOWS.items())
        or result["dedup_admitted_while_held"]
        or result["debounce"]["lost"]
        or result["debounce"]["started_never_ended"]
        or result["debounce"]["ran_twice_unexplained"]
        or result["leftovers"]["other"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
