"""A model-checked composition: ``mutex``, ``concurrency=[...]`` and ``throttle=[...]`` on one actor.

A Hypothesis :class:`~hypothesis.stateful.RuleBasedStateMachine` drives, in this process, a
:class:`~dramatiq.brokers.stub.StubBroker` with ``dramatiq_guard.install(broker, redis=<backend>)``
(a :class:`~dramatiq_guard.backends.RedisBackend` on a private ``redis-server``, again on a
one-node Redis Cluster owning every slot, and the :class:`~dramatiq_guard.backends.MemoryBackend`,
each in a run of its own) and two actors whose
guards share keys (docs/flow-control-design.md, "Composed guards"):

* ``call(tenant, doc)``: ``mutex`` per document (``on_busy="park"``), ``concurrency=[2 in all,
  1 per tenant]``, ``throttle=[2 per period to the partner]``;
* ``ping(tenant)``: ``concurrency`` 2 in all (the same key as ``call``'s), ``throttle=[1 per period
  per tenant, 2 per period to the partner (the same key as ``call``'s)]``.

Rules play a producer and a worker thread the way Dramatiq's worker runs the hooks
(``dramatiq/worker.py``: ``before_process_message``; on ``SkipMessage`` ``after_skip_message``;
else the actor runs, and ``after_process_message`` when it ends; then the ack): a message is
*sent* (random actor and arguments, through the enqueue gate); a worker *picks up* a message
from the broker's queue (any of them: several workers take them in any order); a running
message *finishes*; a running message's worker is *killed* (its leases are no longer renewed
and never released: they lapse; the message is not delivered again); the periodic *sweep* runs;
*time passes* (the test's clock: the servers run on it), by ticks and by leaps of a lease, a
throttle period or a pickup reservation, in steps of a third of a lease after each of which the
live runs' leases are renewed, as the renewer thread would.

After every step (:func:`~hypothesis.stateful.invariant`):

* **no limit exceeded**: no mutex or concurrency key has more running messages than its limit;
  no key's backend holds more live holders than its limit; no throttle key counts more starts
  than its limit in any window of its period (its limit never changes here, so that is the
  sliding-window check itself);
* **a start holds its place a period exactly**: while a throttle key lists a message that started,
  its deadline is its start plus the period (a hand-off's reservation is renewed from the start);
* **nothing lost, nothing started twice**: every message sent is on the broker, parked, running,
  or done; it is parked on at most one key, and not while running or done; it starts at most once;
  and while no reservation can have lapsed (less than ``pickup_ttl`` into the run), it is in
  exactly one of those places;
* **a parked message holds nothing**: a message parked (and with no copy on the broker) is no live
  holder of any key, its reservations (a send's, a hand-off's) given back, on the keys of every
  middleware (those after the one that parked it too: ``GuardBackend.give_back``).

At the end (:meth:`ComposedModel.teardown`) the work is drained: every run finishes, every message
on the broker is picked up, time moves on and the sweep runs until nothing is left; then every
message sent has started exactly once, no key has a waiter, and nothing of the guard is left in
Redis but what :func:`harness.guard_leftovers` allows.

Budget: ``DRAMATIQ_GUARD_COMPOSED_MODEL_EXAMPLES`` runs (default 25) of up to
``DRAMATIQ_GUARD_COMPOSED_MODEL_STEPS`` steps (default 60) per backend, derandomized unless
``DRAMATIQ_GUARD_COMPOSED_MODEL_RANDOM=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import SkipMessage
from harness import (
    FakeClock,
    MarksFailure,
    ModelBudget,
    SettableClock,
    fakeredis_clock,
    guard_leftovers,
    model_clock,
    redis_server_executable,
    unavailable,
)
from harness.topology import model_client
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import dramatiq_guard
from dramatiq_guard.backends import GuardBackend, KeyState, MemoryBackend, RedisBackend
from dramatiq_guard.middleware.base import execution_state
from dramatiq_guard.middleware.slots import SlotsMiddleware
from dramatiq_guard.middleware.slots.execution import Held
from dramatiq_guard.middleware.slots.throttle import Started
from dramatiq_guard.middleware.sweep import sweep_all

BUDGET = ModelBudget.from_env("COMPOSED", examples=25, steps=60)

LEASE_MS = 3_000  # lease_ttl: a killed run's slots are free this long after its last renewal
RENEW_MS = LEASE_MS // 3  # how often the renewer renews a live lease
PICKUP_MS = 10_000  # pickup_ttl: a send's reservation, a confirmed hand-off's
PERIOD_MS = 6_000  # the throttles' period
TICK_MS = 1  # every step takes a millisecond
LEAPS = (TICK_MS, RENEW_MS // 2, LEASE_MS + 1, PERIOD_MS, PICKUP_MS + 1)
BACKLOG = 7  # at most this many messages sent and not started: the other rules get their turns
TENANTS = ("t0", "t1")
DOCS = ("d0", "d1")
QUEUE = "default"
NAMESPACE = "dramatiq-guard"  # the default: harness.guard_leftovers looks there
START_MS = 1_893_456_000_000  # 2030-01-01T00:00:00Z

#: Each guard key's limit: running messages for mutex and concurrency keys, starts per period for
#: throttle keys.
LIMITS = {
    **{f"mutex:doc-{doc}": 1 for doc in DOCS},
    "concurrency:all": 2,
    **{f"concurrency:tenant-{tenant}": 1 for tenant in TENANTS},
    "throttle:partner": 2,
    **{f"throttle:ping-{tenant}": 1 for tenant in TENANTS},
}

Clock = FakeClock | SettableClock


def kind(key: str) -> str:
    """The capability of a guard key (its prefix)."""
    return key.partition(":")[0]


pytestmark = pytest.mark.redis


@dataclasses.dataclass(frozen=True)
class Sent:
    """A message sent: its actor's guard keys."""

    message_id: str
    keys: tuple[str, ...]


def keys_of(actor_name: str, args: tuple[Any, ...]) -> tuple[str, ...]:
    """The guard keys of a message of the model's actors, as their options give them."""
    if actor_name == "call":
        tenant, doc = args
        return (f"mutex:doc-{doc}", "concurrency:all", f"concurrency:tenant-{tenant}", "throttle:partner")
    (tenant,) = args
    return ("concurrency:all", f"throttle:ping-{tenant}", "throttle:partner")


def window_overflows(starts: list[int], limit: int, period_ms: int) -> list[list[int]]:
    """The windows ``(t - period, t]`` ending at a start that hold more than ``limit`` starts."""
    ordered = sorted(starts)
    return [window for t in ordered if len(window := [s for s in ordered if t - period_ms < s <= t]) > limit]


def test_window_overflows_counts_a_sliding_window() -> None:
    assert window_overflows([0, 10, 5_999], 3, 6_000) == []
    assert window_overflows([0, 10, 6_000, 6_005], 2, 6_000) == [[10, 6_000, 6_005]]
    assert window_overflows([0, 6_000], 1, 6_000) == []


class ComposedModel(MarksFailure, RuleBasedStateMachine):
    """A StubBroker with the guards installed on ``backend``, its producer, worker and sweep."""

    def __init__(self, clock: Clock, make_backend: Callable[[], GuardBackend]) -> None:
        super().__init__()
        self.clock = clock
        self.started_at = clock.now_ms
        self.backend = make_backend()
        self.broker = StubBroker()
        self.broker.declare_queue(QUEUE)
        dramatiq_guard.install(
            self.broker, redis=self.backend, lease_ttl=LEASE_MS, pickup_ttl=PICKUP_MS, sweep_interval=1_000
        )
        self.slots = [m for m in self.broker.middleware if isinstance(m, SlotsMiddleware)]
        self.actors = self.declare_actors()
        self.sent: dict[str, Sent] = {}
        self.running: dict[str, MessageProxy] = {}
        self.done: set[str] = set()
        self.killed: set[str] = set()
        self.started: Counter[str] = Counter()
        self.starts: dict[str, list[int]] = {key: [] for key in LIMITS if key.startswith("throttle:")}
        self.started_on: dict[tuple[str, str], int] = {}  # (throttle key, holder) -> when it started
        self.snapshot: dict[str, KeyState] | None = None  # each key's state, until the next step

    def declare_actors(self) -> dict[str, dramatiq.Actor[Any, Any]]:
        def call(tenant: str, doc: str) -> None: ...

        def ping(tenant: str) -> None: ...

        return {
            "call": dramatiq.actor(
                broker=self.broker,
                max_retries=0,
                mutex={"key": lambda tenant, doc: f"doc-{doc}", "on_busy": "park"},
                concurrency=[
                    {"limit": 2, "key": lambda tenant, doc: "all"},
                    {"limit": 1, "key": lambda tenant, doc: f"tenant-{tenant}"},
                ],
                throttle=[{"limit": 2, "period": PERIOD_MS, "key": lambda tenant, doc: "partner"}],
            )(call),
            "ping": dramatiq.actor(
                broker=self.broker,
                max_retries=0,
                concurrency={"limit": 2, "key": lambda tenant: "all"},
                throttle=[
                    {"limit": 1, "period": PERIOD_MS, "key": lambda tenant: f"ping-{tenant}"},
                    {"limit": 2, "period": PERIOD_MS, "key": lambda tenant: "partner"},
                ],
            )(ping),
        }

    # --- the processes ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One tick, then the body: a step of a rule."""
        self.clock.advance(TICK_MS)
        self.snapshot = None
        with self.marking_failure():
            yield
        self.snapshot = None

    @property
    def queue(self) -> Any:
        return self.broker.queues[QUEUE]

    def on_broker(self) -> list[str]:
        """The message ids of the copies on the broker (its queue and delay queue), in order."""
        delayed = self.broker.queues[f"{QUEUE}.DQ"].queue
        return [Message.decode(data).message_id for data in itertools.chain(self.queue.queue, delayed)]

    def send(self, actor_name: str, args: tuple[Any, ...]) -> None:
        """``actor.send(*args)``, with the next message id (not a random one: a run is replayed)."""
        message = self.actors[actor_name].message(*args).copy(message_id=f"m{len(self.sent):03d}")
        message = self.broker.enqueue(message)
        self.sent[message.message_id] = Sent(message.message_id, keys_of(actor_name, args))

    def pick_up(self, index: int) -> None:
        """A worker thread takes the ``index``-th message on the queue and runs the guards' hooks."""
        data = self.queue.queue[index]
        del self.queue.queue[index]
        message = MessageProxy(Message.decode(data))
        try:
            self.broker.emit_before("process_message", message)
        except SkipMessage:
            self.broker.emit_after("skip_message", message)
            self.ack(message)
            return
        assert not message.failed, message
        self.start(message)

    def start(self, message: MessageProxy) -> None:
        mid = message.message_id
        self.started[mid] += 1
        assert self.started[mid] == 1, f"{mid} started twice"
        assert mid not in self.done, f"{mid} started after it was done"
        self.running[mid] = message
        state = execution_state(message).data
        for started in state.values():
            if isinstance(started, Started):
                self.starts[started.key].append(self.clock.now_ms)
                self.started_on[started.key, f"{mid}:0"] = self.clock.now_ms
        held = {h.lease.key for h in state.values() if isinstance(h, Held)}
        throttled = {s.key for s in state.values() if isinstance(s, Started)}
        assert held | throttled == set(self.sent[mid].keys), f"{mid} started holding {held | throttled}"

    def ack(self, message: MessageProxy) -> None:
        self.broker.emit_before("ack", message)
        self.queue.task_done()
        self.broker.emit_after("ack", message)

    def finish(self, mid: str) -> None:
        message = self.running.pop(mid)
        self.broker.emit_after("process_message", message, result=None)
        self.ack(message)
        self.done.add(mid)

    def kill(self, mid: str) -> None:
        """The run's worker dies: its leases are never renewed again, nor released; no ack."""
        message = self.running.pop(mid)
        for held in execution_state(message).data.values():
            if isinstance(held, Held):
                held.lease.unregister()
        self.done.add(mid)
        self.killed.add(mid)

    def live_leases(self) -> list[tuple[str, str, int]]:
        return [
            (held.lease.key, held.lease.holder, held.lease.ttl_ms)
            for message in self.running.values()
            for held in execution_state(message).data.values()
            if isinstance(held, Held)
        ]

    def advance(self, ms: int) -> None:
        """Move the clock on by ``ms``, renewing the live runs' leases every third of a lease."""
        while ms > 0:
            leap = min(ms, RENEW_MS)
            self.clock.advance(leap)
            ms -= leap
            leases = self.live_leases()
            if leases:
                renewed = self.backend.renew_many(leases)
                assert all(renewed), f"a live run lost its lease: {list(zip(leases, renewed, strict=True))}"

    def sweep(self) -> None:
        sweep_all(self.backend, [(m, self.broker) for m in self.slots])

    # --- rules -------------------------------------------------------------------------------

    def backlog(self) -> int:
        return sum(1 for mid in self.sent if not self.started[mid])

    @precondition(lambda self: self.backlog() < BACKLOG)
    @rule(tenant=st.sampled_from(TENANTS), doc=st.sampled_from(DOCS))
    def call_is_sent(self, tenant: str, doc: str) -> None:
        with self.step():
            self.send("call", (tenant, doc))

    @precondition(lambda self: self.backlog() < BACKLOG)
    @rule(tenant=st.sampled_from(TENANTS))
    def ping_is_sent(self, tenant: str) -> None:
        with self.step():
            self.send("ping", (tenant,))

    @precondition(lambda self: self.queue.queue)
    @rule(data=st.data())
    def a_worker_picks_up_a_message(self, data: st.DataObject) -> None:
        with self.step():
            index = data.draw(st.integers(0, len(self.queue.queue) - 1), label="index")
            self.pick_up(index)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def a_run_finishes(self, data: st.DataObject) -> None:
        with self.step():
            self.finish(data.draw(st.sampled_from(sorted(self.running)), label="run"))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def a_worker_is_killed(self, data: st.DataObject) -> None:
        with self.step():
            self.kill(data.draw(st.sampled_from(sorted(self.running)), label="run"))

    @rule()
    def the_sweep_runs(self) -> None:
        with self.step():
            self.sweep()

    @rule(ms=st.sampled_from(LEAPS))
    def time_passes(self, ms: int) -> None:
        with self.step():
            self.advance(ms)

    # --- invariants ----------------------------------------------------------------------------

    def states(self) -> dict[str, KeyState]:
        """The state of every guard key of the model and every waiting key (read once a step)."""
        if self.snapshot is None:
            keys = sorted(set(LIMITS) | set(self.backend.waiting_keys()))
            self.snapshot = {key: self.backend.inspect(key) for key in keys}
        return self.snapshot

    def live_holders(self, key: str) -> list[str]:
        now = self.clock.now_ms
        return [holder for holder, deadline in self.states()[key].holders if deadline > now]

    def parked(self) -> dict[str, list[str]]:
        """Each parked message's keys (a throttle's waiter is ``<message id>:<retries>``)."""
        keys: dict[str, list[str]] = {}
        for key, state in self.states().items():
            for waiter, _, is_parked in state.waiters:
                assert is_parked, f"{waiter} blocks on {key}: nothing here blocks"
                mid = waiter.rpartition(":")[0] if key.startswith("throttle:") else waiter
                keys.setdefault(mid, []).append(key)
        return keys

    @invariant()
    def no_limit_is_exceeded(self) -> None:
        with self.marking_failure():
            running = Counter(key for mid in self.running for key in self.sent[mid].keys)
            for key, limit in LIMITS.items():
                if not key.startswith("throttle:"):
                    assert running[key] <= limit, f"{running[key]} running on {key} (limit {limit})"
                holders = self.live_holders(key)
                assert len(holders) <= limit, f"{key} held by {holders} (limit {limit})"
            for key, starts in self.starts.items():
                bad = window_overflows(starts, LIMITS[key], PERIOD_MS)
                assert not bad, f"{key}: {len(bad[0])} starts in a period (limit {LIMITS[key]}): {bad[0]}"

    @invariant()
    def a_start_holds_its_place_for_a_period_exactly(self) -> None:
        """A throttle's start counts from when it started (a hand-off's reservation renewed to a
        period from then), never renewed nor released: while listed, its deadline is start + period."""
        with self.marking_failure():
            for key in self.starts:
                for holder, deadline in self.states()[key].holders:
                    at = self.started_on.get((key, holder))
                    assert at is None or deadline == at + PERIOD_MS, f"{holder} started at {at}: {deadline}"

    @invariant()
    def nothing_is_lost_parked_twice_or_started_twice(self) -> None:
        with self.marking_failure():
            parked, on_broker = self.parked(), Counter(self.on_broker())
            for mid, keys in parked.items():
                assert mid in self.sent, f"{mid} parked on {keys} was never sent"
                assert len(keys) == 1, f"{mid} is parked on {keys}"
                assert not self.started[mid], f"{mid} is parked on {keys} and started"
            for mid in self.sent:
                places = (mid in parked) + on_broker[mid] + (mid in self.running) + (mid in self.done)
                assert places >= 1, f"{mid} is lost"
                if self.clock.now_ms - self.started_at < PICKUP_MS:  # no reservation lapsed yet
                    assert places == 1, (
                        f"{mid}: parked on {parked.get(mid)}, {on_broker[mid]} on the broker, "
                        f"running {mid in self.running}, done {mid in self.done}"
                    )

    @invariant()
    def a_parked_message_holds_nothing(self) -> None:
        with self.marking_failure():
            on_broker = set(self.on_broker())
            parked = {mid: keys for mid, keys in self.parked().items() if mid not in on_broker}
            for key in LIMITS:
                for holder in self.live_holders(key):
                    mid = holder.rpartition(":")[0] if key.startswith("throttle:") else holder
                    assert mid not in parked, f"{mid}, parked on {parked[mid]}, holds a place of {key}"

    # --- the end -------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if not self.failed:
                self.drain()
        finally:
            for mid in list(self.running):  # stop renewing what a failed run left
                self.kill(mid)
            self.backend.close()

    def drain(self) -> None:
        """Finish every run, pick up every message, move time on and sweep, until all started."""
        for _ in range(10 + 2 * len(self.sent)):
            while self.running or self.queue.queue:
                for mid in sorted(self.running):
                    self.finish(mid)
                while self.queue.queue:
                    self.pick_up(0)
                    self.snapshot = None
                    self.no_limit_is_exceeded()
            if all(self.started[mid] for mid in self.sent):
                break
            self.advance(max(PICKUP_MS, PERIOD_MS, LEASE_MS) + 1)
            self.sweep()
            self.snapshot = None
            self.nothing_is_lost_parked_twice_or_started_twice()
        never = sorted(mid for mid in self.sent if not self.started[mid])
        assert not never, f"never started: {never}; parked: {self.parked()}"
        assert all(n == 1 for n in self.started.values()), self.started
        self.snapshot = None
        self.no_limit_is_exceeded()
        assert self.backend.waiting_keys() == [], self.backend.waiting_keys()
        self.advance(max(PICKUP_MS, PERIOD_MS, LEASE_MS) + 1)  # the last starts and leases lapse
        self.sweep()
        client: Any = self.backend.client  # type: ignore[attr-defined]
        assert guard_leftovers(client, namespace=NAMESPACE) == []


@contextlib.contextmanager
def quiet_install() -> Iterator[None]:
    """No warnings of ``install()`` about the private server (no persistence, the client's
    timeouts): each run installs anew, and they would fill a failure's report."""
    loggers = [logging.getLogger(name) for name in ("dramatiq_guard.install", "dramatiq_guard.backends")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@pytest.fixture(scope="module")
def clock() -> Iterator[Clock]:
    with model_clock(START_MS) as clock:
        yield clock


@pytest.fixture(params=["redis", "cluster", "memory"])
def make_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Callable[[], GuardBackend]]:
    """A maker of a fresh backend on ``clock``: a RedisBackend on a private server (standalone, or a
    one-node Cluster owning every slot), or a MemoryBackend."""
    if request.param == "memory":
        with fakeredis_clock(lambda: clock.now_ms), quiet_install():
            yield lambda: MemoryBackend(namespace=NAMESPACE)
        return
    if not isinstance(clock, FakeClock):
        unavailable("libfaketime is not installed (apt-get install libfaketime): the Redis run needs it")
    if redis_server_executable() is None and shutil.which("redis-server") is None:
        unavailable("redis-server is not installed: the composed model runs on a private one")
    with model_client(clock, cluster=request.param == "cluster") as client, quiet_install():

        def fresh() -> GuardBackend:
            client.flushall()
            # On the Cluster a drained key's index entry lasts index_grace_ms (docs/redis.md, "The two
            # indexes"): none here, one client, so the end's waiting_keys() == [] holds there too.
            return RedisBackend(client, namespace=NAMESPACE, index_grace_ms=0)

        yield fresh


@pytest.mark.timeout(900)  # a failure is shrunk, which takes minutes: let it finish and print
def test_composed_guards_keep_every_limit(clock: Clock, make_backend: Callable[[], GuardBackend]) -> None:
    """Random sends, pickups, finishes, kills, sweeps and time (module docstring)."""

    BUDGET.run(ComposedModel, clock, make_backend)
