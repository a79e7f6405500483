"""A model-checked core: an independent oracle, a Redis, a Redis Cluster and fakeredis in lockstep.

A Hypothesis :class:`~hypothesis.stateful.RuleBasedStateMachine` applies random operations of
the guard backend contract (``dramatiq_guard/backends/base.py``) to four backends at once, with
the same arguments: the oracle (``tests/model_oracle.py``: the contract written a second time, in
plain Python, apart from the Lua scripts; its docstring says why it is kept), a
:class:`~dramatiq_guard.backends.RedisBackend` on a private ``redis-server``, one on a private
one-node Redis Cluster, and the :class:`~dramatiq_guard.backends.MemoryBackend` (the same scripts
on fakeredis, a StubBroker's backend). The three that run the scripts must agree with the
oracle. It plays the processes around them too: workers whose holders release, renew or die,
callers that push a handed-off message and confirm it (in time, late, or never), or find it
parked by another guard on its way and withdraw it (while it may come back to its key's gate
from there, before or after the withdrawal), a broker that delivers every pushed copy and
messages as sent (without a reservation), workers that die after parking a copy they picked up
(the broker delivers it again), threads that block on a wake and take it (or die), and processes
of another route or that do not know a key's limit (``limit=None``).

Time is the test's (:class:`harness.FakeClock`): both servers run under libfaketime on a frozen
clock that the test moves, fakeredis reads the same clock (:func:`harness.fakeredis_clock`), and
the oracle is given it too, so a lease or a reservation lapses at once, without sleeping, at the
same millisecond everywhere. Every step first moves the clock on by :data:`TICK_MS` (a round trip
takes time), and some steps leap ahead by a lease, a reservation or a day.

After every step (:func:`~hypothesis.stateful.invariant`):

* the backends agree: every result (fencing tokens and generations included), and every key's
  state (live holders with their deadlines, waiters in order, reservations, limits, holder infos,
  the waiting-keys and limits indexes);
* a holder is added only while fewer than the limit in force hold the key (after a lowering,
  nobody is evicted: the limit is exceeded only by holders that were there before);
* the fencing tokens of a key (acquires, generations, wakes) strictly rise, each backend on its own;
* every parked message is queued, reserved, on its way (handed to a caller, on the broker, held by
  a blocked thread), or started, and never started twice;
* every Redis key of the namespace expires, except a key's run-time limit, the limits index, the
  waiting-keys index, and a key's queued state (waiters, payloads, reservations, meta, ready
  waiters, standbys, and the infos of ready waiters), which may stay only while something of the
  key is queued;
* on the standalone Redis, a waiting key's index entry is due (its score, when the sweeps look at
  it) no later than the key's earliest holder, ready-waiter or standby deadline.

At the end of each run (:meth:`GuardModel.teardown`) everything is drained: every parked message
must have started exactly once, and after a day nothing of the namespace is left in Redis.

Budget: ``DRAMATIQ_GUARD_MODEL_EXAMPLES`` runs (default 60) of up to
``DRAMATIQ_GUARD_MODEL_STEPS`` steps (default 30), derandomized (the same runs every time) unless
``DRAMATIQ_GUARD_MODEL_RANDOM=1``. docs/development.md ("Running the tests") gives the longer run for a
release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import redis
from harness import FakeClock, MarksFailure, RedisServer, fakeredis_clock, libfaketime, unavailable
from harness.topology import start_cluster_node
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from model_oracle import OracleBackend
from redis.cluster import RedisCluster

from dramatiq_guard.backends import (
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    MemoryBackend,
    RedisBackend,
    ReleaseResult,
    Stake,
    Waiter,
    Woken,
)
from dramatiq_guard.backends.values import ORIGINAL_GENERATION
from dramatiq_guard.bounds import MAX_PRIORITY
from dramatiq_guard.errors import BackendUnavailable

EXAMPLES = int(os.environ.get("DRAMATIQ_GUARD_MODEL_EXAMPLES", "60"))
STEPS = int(os.environ.get("DRAMATIQ_GUARD_MODEL_STEPS", "30"))
RANDOM = os.environ.get("DRAMATIQ_GUARD_MODEL_RANDOM", "") not in ("", "0")

#: The guard keys, and the default limit their actors declare.
DEFAULTS = {"a": 1, "b": 2}
KEYS = tuple(DEFAULTS)
MAIN, OTHER = "main", "other"  # two routes: this application's broker, and another's
NAMESPACE = "model"
TICK_MS = 1  # every step takes a millisecond (a round trip): tokens never run ahead of the clock
LEASE_MS = 30_000
HANDOFF_MS = 10_000  # the reservation; a wake waits half of it
CONFIRM_MS = 30_000  # how long a confirmed hand-off or standby may take to start
BLOCK_MS = 20_000  # how long a blocking waiter (or a standby picked up) waits
DAY_MS = 86_400_000  # the backends' stale_ttl_ms: how long a lapsed hand-off's generation is kept
LEAPS = (TICK_MS, HANDOFF_MS // 2, HANDOFF_MS, BLOCK_MS, LEASE_MS, DAY_MS)
#: A fixed start, so a derandomized run issues the same tokens every time.
START_MS = 1_893_456_000_000  # 2030-01-01T00:00:00Z
#: Keys of a guard key that may not expire, but exist only while something of it is queued
#: (``info`` holds a ready waiter's too: without a holder, it has no deadline to expire with).
QUEUED_STATE = {"waiters", "payloads", "reserved", "meta", "deadlines", "ready", "standbys", "info"}

#: A message's actor's priority: mostly the default; both ends of the range, and a few between.
PRIORITIES = st.sampled_from([0, 0, 0, -1, 3, -MAX_PRIORITY, MAX_PRIORITY])

#: Whether an operation's reply is lost (the script ran, the caller got an error): one time in six.
LOST = st.sampled_from([False] * 5 + [True])

T = TypeVar("T")

pytestmark = pytest.mark.redis


@dataclasses.dataclass
class Servers:
    """The test's clock and the two private servers that read it."""

    clock: FakeClock
    standalone: RedisServer
    cluster: RedisServer

    def clients(self) -> tuple[redis.Redis, RedisCluster]:
        return (
            redis.Redis(host=self.standalone.host, port=self.standalone.port),
            RedisCluster(host=self.cluster.host, port=self.cluster.port),
        )


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """The clock and two servers under libfaketime (a missing libfaketime fails the test with CI=true)."""
    if libfaketime() is None:
        unavailable("libfaketime is not installed (apt-get install libfaketime): the model needs it")
    clock = FakeClock(START_MS)
    with contextlib.ExitStack() as stack:
        stack.callback(clock.close)
        standalone = RedisServer(env=clock.server_env())
        stack.enter_context(standalone)
        cluster = start_cluster_node(clock)
        stack.callback(cluster.close)
        with standalone.client() as client:
            seconds, micros = client.time()
            assert int(seconds) * 1000 + int(micros) // 1000 == clock.now_ms, "Redis ignores the fake clock"
        yield Servers(clock, standalone, cluster)


# --- what the processes around the backends hold --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Copy:
    """A copy of a parked message given to a caller (to push), or on the broker."""

    key: str
    mid: str
    payload: bytes
    generation: int | None
    route: str  # the caller's, whose broker the copy goes to
    standby: bool  # sent ahead (confirm_standby) rather than handed off (confirm_handoff)


@dataclasses.dataclass(frozen=True)
class Thread:
    """A worker thread blocked on a key: a blocking acquirer, or a standby it picked up (``copy``)."""

    key: str
    mid: str
    copy: Copy | None
    runner: str  # the thread: the holder's runner once it is handed the slot


class ReplyLost(BackendUnavailable):
    """The operation ran on every backend, but its caller got an error instead of its reply
    (``ReplicasBehind``, or a connection lost after the script was sent): ``results`` is what it
    did, for the model's bookkeeping only; the caller goes its error path."""

    def __init__(self, results: Sequence[Any]) -> None:
        super().__init__("the reply was lost after the operation ran")
        self.results = list(results)


@dataclasses.dataclass(frozen=True)
class Swept:
    """A sweep's result, compared by its hand-offs only.

    Its ``released`` (whether a lapsed holder was reclaimed) may differ: on Redis, holders
    that lapsed before the key's last deadline went are gone by expiry, with nothing to reclaim.
    """

    result: ReleaseResult


def _handoffs(handoffs: Sequence[Handoff]) -> tuple[tuple[str, bytes | None, int | None], ...]:
    return tuple((h.waiter_id, h.payload, h.generation) for h in handoffs)


def copy_of(handoff: Handoff, route: str, *, standby: bool) -> Copy:
    """The copy a hand-off (or a standby send) gives a caller of ``route`` to push."""
    assert handoff.payload is not None
    return Copy(handoff.key, handoff.waiter_id, handoff.payload, handoff.generation, route, standby)


def seen_at(state: KeyState, now: int) -> tuple[object, set[tuple[str, int, str | None]]]:
    """A key's state as the backends must agree on it at ``now``: live holders only (on Redis,
    lapsed ones may have expired already) with their deadlines; and their infos apart.

    A ready waiter's info is kept on Redis in the holders' info hash, which expires with the
    holders: if they all lapsed before it was handed a slot, Redis no longer knows it (the
    oracle does), though it still records when the waiter took the slot (its runner,
    kept apart, needs the entry). So Redis's infos need only be among the oracle's, an info Redis
    lost (None) matching the oracle's entry of the same holder and time (:func:`infos_agree`).
    """
    live = {holder for holder, deadline in state.holders if deadline > now}
    return (
        (
            sorted((holder, deadline) for holder, deadline in state.holders if holder in live),
            state.waiters,
            sorted(state.reserved),
            state.limit,
        ),
        {info for info in state.holder_info if info[0] in live},
    )


def infos_agree(known: set[tuple[str, int, str | None]], infos: set[tuple[str, int, str | None]]) -> bool:
    """Whether Redis's holder infos ``known`` are among the oracle's ``infos`` (see :func:`seen_at`)."""
    times = {(holder, since) for holder, since, _ in infos}
    return all(info in infos or (info[2] is None and info[:2] in times) for info in known)


def _normal(result: object) -> object:
    """A result as the backends must agree on it (holders as a set: equal deadlines tie either way)."""
    if isinstance(result, AcquireResult):
        return (
            result.acquired, result.token, frozenset(result.holders), result.limit, result.parked,
            _handoffs(result.handoffs), result.standby, result.stale, result.running, result.lapses_in_ms,
        )  # fmt: skip
    if isinstance(result, ReleaseResult):
        return (result.released, _handoffs(result.handoffs), _handoffs(result.standbys))
    if isinstance(result, Swept):
        return _handoffs(result.result.handoffs)
    if isinstance(result, Woken):
        return (result.token, result.reserved_ms)
    if isinstance(result, tuple):
        return tuple(_handoffs(part) for part in result)
    return result


class GuardModel(MarksFailure, RuleBasedStateMachine):
    """The backends in lockstep, the processes around them, and what must hold (module docstring)."""

    def __init__(self, servers: Servers) -> None:
        super().__init__()
        self.clock = servers.clock
        self.redis_client, self.cluster_client = servers.clients()
        self.redis_client.flushall()
        self.cluster_client.flushall()
        self.backends: list[tuple[str, GuardBackend]] = [
            ("oracle", OracleBackend(handoff_ttl_ms=HANDOFF_MS, clock=self.clock.ns)),
            ("redis", RedisBackend(self.redis_client, namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS)),
            ("cluster", RedisBackend(
                self.cluster_client, namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS, index_grace_ms=0
            )),
            ("memory", MemoryBackend(namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS)),
        ]  # fmt: skip
        for _, backend in self.backends:
            backend.route = MAIN
        oracle = self.backends[0][1]
        assert isinstance(oracle, OracleBackend)
        self.oracle = oracle
        self.priorities: dict[str, int] = {}  # message -> its actor's priority (0 if not drawn)
        memory = self.backends[3][1]
        assert isinstance(memory, MemoryBackend)
        #: Every Redis the scripts run on (fakeredis's: the memory backend's own), the standalone ones.
        self.standalones: tuple[Any, ...] = (self.redis_client, memory.client)
        self.clients: tuple[Any, ...] = (self.redis_client, self.cluster_client, memory.client)
        self.ids = (f"m{n}" for n in itertools.count())
        self.running: dict[str, str] = {}  # holder -> key: acquired, and not released nor dead
        self.runners: dict[str, str] = {}  # running holder -> the worker thread it runs on, if it has one
        self.threads_made = (f"t{n}" for n in itertools.count())  # worker threads' runner ids
        self.threads: dict[str, Thread] = {}  # blocked on a wake
        self.pending: list[Copy] = []  # handed to a caller, not pushed yet
        self.owed: list[Copy] = []  # pushed, confirmation not sent yet
        self.broker: list[Copy] = []  # pushed, not picked up yet
        self.away: list[Copy] = []  # parked by another guard on the way, not back at its key's gate yet
        self.withdrawals: list[Copy] = []  # parked by another guard, not withdrawn from its key yet
        self.parked: dict[str, str] = {}  # every message that parked -> its key
        # Messages of which a copy parked after pickup and was never acked (its worker died, or the
        # acquire's reply was lost): only these may keep a record that the ack would have taken.
        self.unacked_parks: set[str] = set()
        self.started: Counter[str] = Counter()
        self.top: dict[tuple[str, str], int] = {}  # (backend, key) -> the highest token seen
        self.seen: dict[tuple[str, str], set[int]] = {}  # (backend, key) -> every token seen
        self.wake_floor: dict[tuple[str, str, str], int] = {}  # (backend, key, waiter) -> top at its wake

    # --- running operations on every backend --------------------------------------------------

    def live_holders(self, key: str) -> set[str]:
        now = self.clock.now_ms
        return {holder for holder, deadline in self.oracle.inspect(key).holders if deadline > now}

    def limit_in_force(self, key: str) -> int:
        limit = self.oracle.get_limit(key)
        return DEFAULTS[key] if limit is None else limit

    def call(
        self, key: str, operation: Callable[[GuardBackend], T], *, route: str = MAIN, lost: bool = False
    ) -> list[T]:
        """One tick, then ``operation`` on every backend (as a process of ``route``); the results agree.

        Raises:
          ReplyLost: With ``lost``, after the operation ran everywhere (its results agreed).
        """
        self.clock.advance(TICK_MS)
        before = self.live_holders(key)
        queue = self.oracle.queue(key)
        results: list[T] = []
        for _, backend in self.backends:
            backend.route = route
            try:
                results.append(operation(backend))
            finally:
                backend.route = MAIN
        expected = _normal(results[0])
        for (name, _), result in zip(self.backends[1:], results[1:], strict=True):
            assert _normal(result) == expected, f"{name} disagrees with the oracle:\n{result}\n{results[0]}"
        after = self.live_holders(key)
        if after - before:
            assert len(after) <= self.limit_in_force(key), (
                f"{sorted(after - before)} joined {sorted(before)} over the limit {self.limit_in_force(key)}"
            )
        self.check_order(key, queue, results[0], route)
        if lost:
            raise ReplyLost(results)
        return results

    def check_order(
        self, key: str, queue: list[tuple[str, bool, bool, str | None]], result: object, route: str
    ) -> None:
        """A waiter handed a slot passed over no waiter still queued ahead of it (by priority, then
        FIFO), except: a ready one passes the others among the first ``limit`` (its thread starts at
        once), and a parked one of another route (and the parked ones behind it) waits for its route."""
        handoffs: tuple[Handoff, ...] = ()
        if isinstance(result, AcquireResult | ReleaseResult):
            handoffs = result.handoffs
        elif isinstance(result, Swept):
            handoffs = result.result.handoffs
        left = {waiter for waiter, *_ in self.oracle.queue(key)}
        ready = {waiter for waiter, is_ready, _, _ in queue if is_ready}
        left_before = {waiter for waiter, *_ in queue}  # not a reservation requeued by this operation
        for handoff in handoffs:
            stopped = False
            ahead = (
                [entry[0] for entry in queue].index(handoff.waiter_id)
                if handoff.waiter_id in left_before
                else 0
            )
            for waiter, _, parked, owner in queue[:ahead]:
                stopped = stopped or (parked and bool(owner) and owner != route)
                excused = (handoff.waiter_id in ready and waiter not in ready) or (parked and stopped)
                assert waiter not in left or excused, f"{handoff.waiter_id} handed {key!r} before {waiter}"

    def check_tokens(self, key: str, results: Sequence[object]) -> None:
        """The tokens each backend issued strictly rise (a wake's: above what was seen before it)."""
        for (name, _), result in zip(self.backends, results, strict=True):
            tokens: list[int] = []
            handoffs: tuple[Handoff, ...] = ()
            if isinstance(result, AcquireResult):
                handoffs = result.handoffs
            elif isinstance(result, ReleaseResult):
                handoffs = result.handoffs + result.standbys
            elif isinstance(result, tuple):
                handoffs = result[0] + result[1]
            tokens = [h.generation for h in handoffs if h.generation is not None]
            if isinstance(result, AcquireResult) and result.token is not None:
                tokens.append(result.token)
            top = self.top.get((name, key), 0)
            seen = self.seen.setdefault((name, key), set())
            for handoff in handoffs:
                if handoff.payload is None:
                    self.wake_floor[(name, key, handoff.waiter_id)] = top
            for token in tokens:
                assert token > top, f"{name}: token {token} of {key!r} after {top}"
                top = token
                seen.add(token)
            self.top[(name, key)] = top

    def absorb(
        self, key: str, results: Sequence[AcquireResult | ReleaseResult], route: str, *, lost: bool = False
    ) -> None:
        """Take the hand-offs and standbys of an operation (the oracle's: they all agree).

        ``lost``: its reply never reached the caller, so nobody delivers them: the reservations
        lapse, and the waiters are back in their places (the standbys park again).
        """
        self.check_tokens(key, results)
        if lost:
            return
        first = results[0]
        for handoff in first.handoffs:
            self.runners.pop(handoff.waiter_id, None)  # a slot handed on: no thread runs it yet
            if handoff.payload is not None:
                self.pending.append(copy_of(handoff, route, standby=False))
        if isinstance(first, ReleaseResult):
            self.pending += [copy_of(sent, route, standby=True) for sent in first.standbys]

    def started_now(self, key: str, mid: str, runner: str | None = None) -> None:
        """``mid`` holds ``key`` and runs (on ``runner``, a worker thread, if known)."""
        self.running[mid] = key
        if runner is None:
            self.runners.pop(mid, None)
        else:
            self.runners[mid] = runner
        if mid in self.parked:
            self.started[mid] += 1

    def acquire(
        self,
        key: str,
        mid: str,
        *,
        wait: Waiter | None,
        route: str = MAIN,
        generation: int | None = None,
        info: str | None = None,
        starts: bool = True,
        runner: str | None = None,
        lost: bool = False,
    ) -> AcquireResult:
        """``acquire`` everywhere; ``starts``: an acquired message starts (not a running holder's renewal).

        ``runner``: the worker thread acquiring, None at enqueue time.

        Raises:
          ReplyLost: With ``lost`` (its hand-offs are nobody's to deliver).
        """
        try:
            results = self.call(
                key,
                lambda b: b.acquire(
                    Stake(key, mid, DEFAULTS[key], LEASE_MS, info=info, generation=generation, runner=runner,
                          priority=self.priorities.get(mid, 0)),
                    wait,
                ),
                route=route,
                lost=lost,
            )  # fmt: skip
        except ReplyLost as e:
            self.absorb(key, e.results, route, lost=True)
            raise
        self.absorb(key, results, route)
        result = results[0]
        if result.acquired and starts:
            self.started_now(key, mid, runner)
        return result

    def sweep(self, key: str, limit: int | None, route: str, *, lost: bool = False) -> None:
        results = self.call(key, lambda b: Swept(b.sweep(key, limit=limit)), route=route)
        self.absorb(key, [swept.result for swept in results], route, lost=lost)

    def take_back(self, key: str, mid: str, route: str) -> None:
        """What a caller told its acquire failed does (``send()``, a Lock): leave the key as ``mid``.
        Nothing of ``mid`` is left there for its retry to trip on."""
        results = self.call(key, lambda b: b.take_back(key, mid, limit=DEFAULTS[key]), route=route)
        assert all(result is not None for result in results)
        self.absorb(key, [result for result in results if result is not None], route)
        state = self.oracle.inspect(key)
        assert mid not in {holder for holder, _ in state.holders}, f"{mid} still holds {key!r}"
        assert mid not in {waiter for waiter, _, _ in state.waiters} | set(state.reserved), mid

    def release(
        self,
        key: str,
        mid: str,
        *,
        send_ahead: int = 0,
        route: str = MAIN,
        known: bool = True,
        lost: bool = False,
    ) -> None:
        """A release; ``lost``: its caller got an error (the message is done all the same)."""
        limit = DEFAULTS[key] if known else None
        results = self.call(
            key, lambda b: b.release(key, mid, limit=limit, send_ahead=send_ahead), route=route
        )
        self.absorb(key, results, route, lost=lost)
        self.running.pop(mid, None)
        self.runners.pop(mid, None)

    # --- rules: messages and holders -------------------------------------------------------------

    @rule(
        key=st.sampled_from(KEYS),
        mode=st.sampled_from(["now", "park", "block"]),
        route=st.sampled_from([MAIN, MAIN, OTHER]),
        lost=LOST,
        lock=st.booleans(),
        priority=PRIORITIES,
    )
    def a_message_arrives(
        self, key: str, mode: str, route: str, lost: bool, lock: bool, priority: int
    ) -> None:
        """A new message acquires: without waiting or blocking its worker thread, or parking its
        payload at enqueue time (no thread: a reservation anyone may take up).

        ``lost``: the reply is lost. A send (``park``) or a Lock (``lock``) takes back what it may
        have got (a new holder has nothing else in the key); a worker does not (another copy of its
        message may hold the key): its message fails and is retried, and what it got lapses.
        """
        with self.marking_failure():
            mid = next(self.ids)
            self.priorities[mid] = priority
            wait = {
                "now": None,
                "park": Waiter(payload=f"msg:{mid}".encode()),
                "block": Waiter(wait_ms=BLOCK_MS),
            }[mode]
            runner = None if mode == "park" else next(self.threads_made)
            try:
                result = self.acquire(key, mid, wait=wait, route=route, info=mode, runner=runner, lost=lost)
            except ReplyLost:
                if mode == "park" or lock:
                    self.take_back(key, mid, route)
                return
            if result.parked and mode == "park":
                self.parked[mid] = key
            elif result.parked:
                assert runner is not None
                self.threads[mid] = Thread(key, mid, None, runner)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), send_ahead=st.sampled_from([0, 0, 1, 2, 8]), foreign=st.booleans(), lost=LOST)
    def a_holder_releases(self, data: st.DataObject, send_ahead: int, foreign: bool, lost: bool) -> None:
        """A holder releases (maybe sending waiters ahead); ``foreign``: forced by another route's
        process; ``lost``: its reply is lost (what it handed on and sent ahead is nobody's to deliver)."""
        with self.marking_failure():
            mid = data.draw(st.sampled_from(sorted(self.running)))
            key = self.running[mid]
            if foreign:
                self.release(key, mid, send_ahead=send_ahead, route=OTHER, known=False, lost=lost)
            else:
                self.release(key, mid, send_ahead=send_ahead, lost=lost)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), again=st.booleans(), lost=LOST)
    def a_holder_renews(self, data: st.DataObject, again: bool, lost: bool) -> None:
        """A holder renews its lease (``again``: by acquiring again, which is re-entrant).

        ``lost``: the reply is lost. A renewal is simply not counted (the lease is lost on time if
        no later one answers); a holder whose acquire failed stops (its job fails): it does not
        release, and its lease lapses.
        """
        with self.marking_failure():
            mid = data.draw(st.sampled_from(sorted(self.running)))
            key = self.running[mid]
            if again:
                try:
                    result = self.acquire(
                        key, mid, wait=None, starts=False, runner=self.runners.get(mid), lost=lost
                    )
                except ReplyLost:
                    self.running.pop(mid)
                    self.runners.pop(mid, None)
                    return
                if not result.acquired:
                    self.running.pop(mid)  # its lease had lapsed and the slot was taken
                    self.runners.pop(mid, None)
            else:
                with contextlib.suppress(ReplyLost):
                    self.call(key, lambda b: b.renew(key, mid, ttl_ms=LEASE_MS), lost=lost)

    @precondition(lambda self: self.runners)
    @rule(data=st.data(), mode=st.sampled_from(["now", "park", "block"]))
    def a_running_message_is_delivered_again(self, data: st.DataObject, mode: str) -> None:
        """A second copy of a running message reaches another worker thread (RabbitMQ redelivers on
        a lost connection): while the first holds the key, it is refused as running, and nothing
        changes; it acquires only once the first's lease lapsed (its worker died, say)."""
        with self.marking_failure():
            mid = data.draw(st.sampled_from(sorted(self.runners)))
            key = self.running[mid]
            deadline = dict(self.oracle.inspect(key).holders).get(mid)
            waits = {
                "now": None,
                "park": Waiter(payload=f"msg:{mid}".encode()),
                "block": Waiter(wait_ms=BLOCK_MS),
            }
            runner = next(self.threads_made)
            result = self.acquire(key, mid, wait=waits[mode], runner=runner, starts=False)
            if deadline is not None and deadline > self.clock.now_ms:
                assert result.running and not result.acquired and not result.parked, result
                return
            # The first's lease lapsed (its worker died, say): that run is over, and this copy is
            # a message of its own now: it runs, waits, or parks, and its run is counted afresh
            # (a run after a lapsed lease is the at-least-once the lapse explains, not a second
            # start of one delivery).
            self.running.pop(mid)
            self.runners.pop(mid)
            self.started.pop(mid, None)
            if result.acquired:
                self.running[mid] = key
                self.runners[mid] = runner
                if mid in self.parked:
                    self.started[mid] = 1
            elif result.parked and mode == "block":
                self.threads[mid] = Thread(key, mid, None, runner)
            elif result.parked:
                self.parked[mid] = key

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def a_holder_dies(self, data: st.DataObject) -> None:
        """A holder's process dies: it never releases, its lease lapses in time."""
        with self.marking_failure():
            mid = data.draw(st.sampled_from(sorted(self.running)))
            self.running.pop(mid)
            self.runners.pop(mid, None)

    # --- rules: time, sweeps and limits ----------------------------------------------------------

    @rule(ms=st.sampled_from(LEAPS))
    def time_passes(self, ms: int) -> None:
        """The clock leaps: past a wake, a reservation, a blocking wait, a lease, or a day.

        Before a day passes, everything in flight is delivered: the contract promises nothing
        of a copy that waits longer than ``stale_ttl_ms`` (a day), which may start then.
        """
        with self.marking_failure():
            if ms >= DAY_MS:
                self.deliver_everything()
            self.clock.advance(ms)

    @rule(key=st.sampled_from(KEYS), known=st.booleans(), route=st.sampled_from([MAIN, OTHER]), lost=LOST)
    def a_process_sweeps(self, key: str, known: bool, route: str, lost: bool) -> None:
        """A sweep, by a process that knows the key's limit or not (``limit=None``), of either route
        (``lost``: its reply is lost)."""
        with self.marking_failure():
            limit = DEFAULTS[key] if known else None
            self.sweep(key, limit, route, lost=lost)

    @rule(
        key=st.sampled_from(KEYS),
        limit=st.sampled_from([None, 0, 1, 2, 3]),
        known=st.booleans(),
        lost=LOST,
    )
    def the_limit_changes(self, key: str, limit: int | None, known: bool, lost: bool) -> None:
        """An operator sets, raises, lowers, zeroes or clears a key's run-time limit (``lost``: the
        reply is lost; the limit is set all the same, and what it handed on lapses)."""
        with self.marking_failure():
            self.set_limit(key, limit, DEFAULTS[key] if known else None, lost=lost)

    def set_limit(self, key: str, limit: int | None, default: int | None, *, lost: bool = False) -> None:
        results = self.call(key, lambda b: b.set_limit(key, limit, default=default))
        self.absorb(key, results, MAIN, lost=lost)
        for _, backend in self.backends:
            assert backend.get_limit(key) == limit

    @rule(
        key=st.sampled_from(KEYS),
        count=st.sampled_from([1, 2, 3, 8]),
        route=st.sampled_from([MAIN, OTHER]),
        lost=LOST,
    )
    def waiters_are_sent_ahead(self, key: str, count: int, route: str, lost: bool) -> None:
        """A process sends the oldest parked waiters ahead as standbys (``lost``: the reply is lost,
        nothing is sent: the standbys park again, the hand-offs lapse)."""
        with self.marking_failure():
            results = self.call(
                key, lambda b: b.send_standbys(key, limit=DEFAULTS[key], count=count), route=route
            )
            self.check_tokens(key, results)
            if lost:
                return
            handoffs, sent = results[0]
            self.pending += [copy_of(h, route, standby=False) for h in handoffs if h.payload is not None]
            self.pending += [copy_of(standby, route, standby=True) for standby in sent]

    # --- rules: the callers of hand-offs, the broker ---------------------------------------------

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), lost=st.booleans())
    def a_caller_pushes(self, data: st.DataObject, lost: bool) -> None:
        """A caller pushes a copy it was handed to its broker (``lost``: it died before the push)."""
        copy = data.draw(st.sampled_from(self.pending))
        self.pending.remove(copy)
        if not lost:
            self.broker.append(copy)
            self.owed.append(copy)

    @precondition(lambda self: self.owed)
    @rule(data=st.data(), how=st.sampled_from(["in time", "late", "never", "lost"]))
    def a_caller_confirms(self, data: st.DataObject, how: str) -> None:
        """A pushed copy is confirmed in time, after its reservation lapsed, or never (its caller died);
        or its confirmation's reply is lost (the caller logs it: the copy is on the broker)."""
        with self.marking_failure():
            copy = data.draw(st.sampled_from(self.owed))
            self.owed.remove(copy)
            if how == "never":
                return
            if how == "late":
                self.clock.advance(HANDOFF_MS)
            with contextlib.suppress(ReplyLost):
                self.confirm(copy, lost=how == "lost")

    def confirm(self, copy: Copy, *, lost: bool = False) -> None:
        key, mid, generation = copy.key, copy.mid, copy.generation
        if copy.standby:
            self.call(
                key,
                lambda b: b.confirm_standby(key, mid, copy.payload, ttl_ms=CONFIRM_MS, generation=generation),
                route=copy.route,
                lost=lost,
            )
        else:
            self.call(
                key,
                lambda b: b.confirm_handoff(key, mid, ttl_ms=CONFIRM_MS, generation=generation),
                route=copy.route,
                lost=lost,
            )

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def another_guard_parks_a_copy(self, data: st.DataObject) -> None:
        """A caller pushes a copy through the enqueue gate, and another guard of the actor parks it
        there (in that guard's lockwait area, outside these keys): the caller owes its key a
        withdrawal of that hand-off or send (``cancel_wait`` with its generation)."""
        copy = data.draw(st.sampled_from(self.pending))
        self.pending.remove(copy)
        self.away.append(copy)
        self.withdrawals.append(copy)

    @precondition(lambda self: self.withdrawals)
    @rule(data=st.data(), lost=LOST)
    def a_caller_withdraws_a_copy_parked_elsewhere(self, data: st.DataObject, lost: bool) -> None:
        """``lost``: the withdrawal's reply is lost (the caller logs it)."""
        with self.marking_failure():
            copy = data.draw(st.sampled_from(self.withdrawals))
            self.withdrawals.remove(copy)
            self.withdraw(copy, lost=lost)

    def withdraw(self, copy: Copy, *, lost: bool = False) -> None:
        key, mid, generation = copy.key, copy.mid, copy.generation
        results = self.call(
            key,
            lambda b: b.cancel_wait(key, mid, limit=DEFAULTS[key], generation=generation),
            route=copy.route,
        )
        self.absorb(key, results, copy.route, lost=lost)

    @precondition(lambda self: self.away)
    @rule(data=st.data(), lost=LOST)
    def a_copy_comes_back_from_the_other_guard(self, data: st.DataObject, lost: bool) -> None:
        """The other guard hands the message on: its enqueue reaches this key's gate again, before
        or after the withdrawal. It reserves a slot and goes to the broker, or parks in its place.

        ``lost``: the gate's acquire raised after it ran. A copy of a hand-off is not taken back (its
        entry may be its only place); the other guard's hand-off of it failed, so it waits there
        again and comes back later (parked here meanwhile, it is stale then, and the stored copy runs).
        """
        with self.marking_failure():
            copy = data.draw(st.sampled_from(self.away))
            self.away.remove(copy)
            try:
                self.come_back(copy, lost=lost)
            except ReplyLost as e:
                if e.results[0].parked:
                    self.parked.setdefault(copy.mid, copy.key)
                self.away.append(copy)

    def come_back(self, copy: Copy, *, lost: bool = False) -> None:
        """At the gate, the copy acquires with the generation it carries: stale, it is dropped;
        refused as running (a copy of it runs), it goes to the broker without a slot."""
        wait = Waiter(payload=copy.payload)
        result = self.acquire(
            copy.key,
            copy.mid,
            wait=wait,
            route=copy.route,
            generation=copy.generation,
            starts=False,
            lost=lost,
        )
        if result.acquired or result.running:
            self.broker.append(dataclasses.replace(copy, standby=False))

    @rule(key=st.sampled_from(KEYS), route=st.sampled_from([MAIN, MAIN, OTHER]))
    def a_message_goes_to_the_broker_as_sent(self, key: str, route: str) -> None:
        """A message reaches the broker without a reservation (a delayed one, say): its copy is the
        original (:data:`ORIGINAL_GENERATION`); a worker decides it at pickup."""
        mid = next(self.ids)
        self.broker.append(Copy(key, mid, f"msg:{mid}".encode(), ORIGINAL_GENERATION, route, standby=False))

    @precondition(lambda self: self.broker)
    @rule(data=st.data(), block=st.booleans(), dies=st.booleans(), lost=LOST)
    def a_worker_picks_up_a_copy(self, data: st.DataObject, block: bool, dies: bool, lost: bool) -> None:
        """A worker of the copy's route gets it and acquires with its generation, parking if refused.

        ``block``: with a wait, so a standby blocks in its place instead of parking again.
        ``dies``: a worker whose copy parked dies before the broker's ack: the broker delivers
        the same copy again (it must not start beside the stored one's hand-off).
        ``lost``: the acquire's reply is lost (see :meth:`pick_up`).
        """
        with self.marking_failure():
            copy = data.draw(st.sampled_from(self.broker))
            self.broker.remove(copy)
            self.pick_up(copy, BLOCK_MS if block else 0, dies=dies, lost=lost)

    def pick_up(
        self, copy: Copy, wait_ms: int, *, dies: bool = False, runner: str | None = None, lost: bool = False
    ) -> None:
        """A worker thread (``runner``: a new one unless given) acquires for the copy it picked up.

        Refused as running (its message runs, or waits, on another thread: a thread that died
        blocking for it, whose entry has not lapsed), it is retried: back to the broker.

        ``lost``: the acquire raised after it ran. The worker takes nothing back (another copy of
        the message may hold the key): the message fails and Retries sends the same copy again. A
        slot it got keeps that copy out until its lease lapses; a park made the stored payload the
        copy that runs (the retried one is stale).
        """
        wait = Waiter(payload=copy.payload, wait_ms=wait_ms)
        runner = runner or next(self.threads_made)
        try:
            result = self.acquire(
                copy.key, copy.mid, wait=wait, route=copy.route, generation=copy.generation, runner=runner,
                lost=lost,
            )  # fmt: skip
        except ReplyLost as e:
            if e.results[0].parked and not e.results[0].standby:
                self.parked.setdefault(copy.mid, copy.key)
                self.unacked_parks.add(copy.mid)
            self.broker.append(copy)
            return
        if result.running:
            self.broker.append(copy)
        elif result.standby:
            self.threads[copy.mid] = Thread(copy.key, copy.mid, copy, runner)
        elif result.parked:
            self.parked.setdefault(copy.mid, copy.key)  # an original that parked after pickup
            if dies:
                self.unacked_parks.add(copy.mid)
                self.broker.append(copy)
            else:  # the broker acked the copy (after_ack): it cannot come back
                key, mid = copy.key, copy.mid
                self.call(key, lambda b: b.forget_parked_copy(key, mid))

    # --- rules: blocked threads ------------------------------------------------------------------

    @precondition(lambda self: self.threads)
    @rule(data=st.data(), lost=LOST)
    def a_thread_takes_its_wake(self, data: st.DataObject, lost: bool) -> None:
        """A blocked thread looks for its wake (the push that handed it the slot, with its token).

        ``lost``: the reply is lost (the wake, if any, was popped). The thread's wait raises: a
        blocking waiter leaves the queue (giving back a slot it was handed), a standby's message
        fails and Retries sends its copy again.
        """
        with self.marking_failure():
            thread = self.threads[data.draw(st.sampled_from(sorted(self.threads)))]
            try:
                self.take_wake(thread, lost=lost)
            except ReplyLost:
                del self.threads[thread.mid]
                for name, _ in self.backends:
                    self.wake_floor.pop((name, thread.key, thread.mid), None)
                if thread.copy is not None:
                    self.broker.append(thread.copy)
                else:
                    key, mid = thread.key, thread.mid
                    results = self.call(key, lambda b: b.cancel_wait(key, mid, limit=DEFAULTS[key]))
                    self.absorb(key, results, MAIN)

    def take_wake(self, thread: Thread, *, lost: bool = False) -> None:
        key, mid = thread.key, thread.mid
        results = self.call(key, lambda b: b.wait_for_handoff(key, mid, timeout_ms=0), lost=lost)
        if results[0] is None:
            return
        for (name, _), woken in zip(self.backends, results, strict=True):
            assert woken is not None
            floor = self.wake_floor.pop((name, key, mid), None)
            assert floor is not None, f"{name}: {mid} woken without a hand-off"
            assert woken.token > floor and woken.token not in self.seen[(name, key)]
            self.seen[(name, key)].add(woken.token)
        del self.threads[mid]
        self.started_now(key, mid, thread.runner)

    @precondition(lambda self: self.threads)
    @rule(data=st.data(), dies=st.booleans(), dies_after_park=st.booleans(), lost=LOST)
    def a_thread_gives_up(self, data: st.DataObject, dies: bool, dies_after_park: bool, lost: bool) -> None:
        """A blocked thread gives up: it parks its message again (or cancels its wait), or it dies.

        A thread that dies holding a message it picked up leaves it unacknowledged: the broker
        delivers the same copy again; so does one that dies after parking it again, before the ack
        (``dies_after_park``).
        """
        with self.marking_failure():
            thread = self.threads.pop(data.draw(st.sampled_from(sorted(self.threads))))
            if dies:
                if thread.copy is not None:
                    self.broker.append(thread.copy)
            elif thread.copy is not None:
                self.pick_up(thread.copy, 0, dies=dies_after_park, runner=thread.runner, lost=lost)
            else:
                key, mid = thread.key, thread.mid
                results = self.call(key, lambda b: b.cancel_wait(key, mid, limit=DEFAULTS[key]))
                self.absorb(key, results, MAIN, lost=lost)

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def the_backends_agree_on_every_key(self) -> None:
        with self.marking_failure():
            now = self.clock.now_ms
            for key in KEYS:
                states = [seen_at(backend.inspect(key), now) for _, backend in self.backends]
                (expected, infos), *others = states
                for (name, _), (seen, known) in zip(self.backends[1:], others, strict=True):
                    assert seen == expected, (
                        f"{name} disagrees with the oracle on {key!r}:\n{seen}\n{expected}"
                    )
                    assert infos_agree(known, infos), f"{name} disagrees on {key!r}'s infos: {known} {infos}"
            for name, backend in self.backends[1:]:
                assert sorted(backend.waiting_keys()) == sorted(self.oracle.waiting_keys()), name
                assert backend.limit_keys() == self.oracle.limit_keys(), name

    @invariant()
    def every_parked_message_is_somewhere_and_started_at_most_once(self) -> None:
        with self.marking_failure():
            assert all(count == 1 for count in self.started.values()), self.started
            carried = {copy.mid for copy in itertools.chain(self.pending, self.broker, self.away)}
            carried |= {thread.mid for thread in self.threads.values() if thread.copy is not None}
            queued = set()
            for key in KEYS:
                state = self.oracle.inspect(key)
                queued |= {waiter for waiter, _, _ in state.waiters} | set(state.reserved)
            for mid in self.parked:
                assert self.started[mid] or mid in queued or mid in carried, f"{mid} is lost"

    @invariant()
    def every_redis_key_expires(self) -> None:
        with self.marking_failure():
            states = {key: self.oracle.inspect(key) for key in KEYS}
            queued = {key for key, state in states.items() if state.waiters or state.reserved}
            for client in self.clients:
                for name in self.stored(client):
                    if name in (f"{NAMESPACE}:waiting", f"{NAMESPACE}:limits"):
                        continue
                    key, _, suffix = name[len(NAMESPACE) + 2 :].rpartition("}:")
                    if suffix == "limit":
                        continue
                    if suffix in QUEUED_STATE and key in queued:
                        continue
                    assert client.pttl(name) >= 0, f"{name} never expires"  # -1: no expiry

    @invariant()
    def the_ready_waiters_are_indexed_by_their_places(self) -> None:
        """On Redis, `ready` holds exactly the ready waiters (`deadlines`), each by its place in `waiters`."""
        with self.marking_failure():
            for client in self.clients:
                for key in KEYS:
                    prefix = f"{NAMESPACE}:{{{key}}}:"
                    ready: Any = client.zrange(prefix + "ready", 0, -1, withscores=True)
                    deadlines: Any = client.zrange(prefix + "deadlines", 0, -1)
                    places = {w: client.zscore(prefix + "waiters", w) for w in deadlines}
                    assert dict(ready) == places, key

    @invariant()
    def a_waiting_key_is_due_no_later_than_its_earliest_deadline(self) -> None:
        """The standalone index's score (when the sweeps look at the key) never passes a deadline."""
        with self.marking_failure():
            for client in self.standalones:
                entries: Any = client.zrange(f"{NAMESPACE}:waiting", 0, -1, withscores=True)
                for member, due in entries:
                    key = member.decode() if isinstance(member, bytes) else member
                    for suffix in ("holders", "deadlines", "standbys"):
                        first: Any = client.zrange(f"{NAMESPACE}:{{{key}}}:{suffix}", 0, 0, withscores=True)
                        if first:
                            assert due <= first[0][1], f"{key!r} is due at {due}, after its {suffix} {first}"

    @staticmethod
    def stored(client: redis.Redis | RedisCluster) -> list[str]:
        names: Any = client.keys(f"{NAMESPACE}:*")
        return sorted(name.decode() if isinstance(name, bytes) else name for name in names)

    # --- the end: everything drains -------------------------------------------------------------

    def deliver_everything(self) -> None:
        """Threads take their wakes (or die), copies parked elsewhere are withdrawn and come back,
        copies are pushed, confirmed and picked up, holders release."""
        for copy in self.withdrawals:
            self.withdraw(copy)
        self.withdrawals.clear()
        for copy in self.away:
            self.come_back(copy)
        self.away.clear()
        for thread in list(self.threads.values()):
            self.take_wake(thread)
        for thread in self.threads.values():  # the others die: their copies are delivered again
            if thread.copy is not None:
                self.broker.append(thread.copy)
        self.threads.clear()
        self.broker += self.pending
        self.owed += self.pending
        self.pending.clear()
        for copy in self.owed:
            self.confirm(copy)
        self.owed.clear()
        # A copy refused as running (its message holds the key on another thread, or did and the
        # holder's lease has not lapsed) goes back to the broker: it is picked up next round.
        picked, self.broker = self.broker, []
        for copy in picked:
            self.pick_up(copy, 0)
        for mid, key in sorted(self.running.items()):
            self.release(key, mid)

    def teardown(self) -> None:
        """Drain every key; every parked message must have started exactly once, and Redis empties."""
        try:
            if not self.failed:
                self.drain()
        finally:
            self.redis_client.close()
            self.cluster_client.close()

    def drain(self) -> None:
        for key in KEYS:
            self.set_limit(key, None, DEFAULTS[key])
        # Each round starts at least one waiter of a key: enough rounds for every message there is.
        for _ in range(20 + len(self.parked) + len(self.broker) + len(self.pending) + len(self.away)):
            self.deliver_everything()
            if not (self.pending or self.broker or self.oracle.waiting_keys()):
                break
            self.clock.advance(LEASE_MS + BLOCK_MS)
            for key in KEYS:
                for route in (MAIN, OTHER):
                    self.sweep(key, DEFAULTS[key], route)
        self.the_backends_agree_on_every_key()
        never = sorted(mid for mid in self.parked if not self.started[mid])
        assert not never, f"parked messages never started: {never}"
        self.every_parked_message_is_somewhere_and_started_at_most_once()
        for client in self.clients:
            for name in self.stored(client):
                record: Any = client.get(name) if "}:gens:" in name else None
                if (
                    record is not None
                    and (record.decode() if isinstance(record, bytes) else record)[:1] == "~"
                ):
                    # Kept for the parked copy only: its ack takes it, so only an unacked one is left.
                    waiter = name.rpartition("}:gens:")[2]
                    assert waiter in self.unacked_parks, f"{name} outlived the work of an acked copy"
        self.clock.advance(DAY_MS + 1)
        for client in self.clients:
            assert self.stored(client) == [], f"left in Redis after a day: {self.stored(client)}"


@pytest.mark.timeout(900)  # a failure is shrunk, which takes minutes: let it finish and print
def test_the_backends_follow_the_model(servers: Servers) -> None:
    """Random operations and faults on the four backends in lockstep (module docstring)."""

    class OnTheseServers(GuardModel):
        def __init__(self) -> None:
            super().__init__(servers)

    with fakeredis_clock(lambda: servers.clock.now_ms):
        run_state_machine_as_test(
            OnTheseServers,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                derandomize=not RANDOM,
                database=None,
                print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
