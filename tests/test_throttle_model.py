"""A model-checked throttle: the backend operations the ``throttle`` option makes, on the test's clock.

A Hypothesis :class:`~hypothesis.stateful.RuleBasedStateMachine` plays what the
:class:`~dramatiq_guard.Throttle` middleware does with one throttle key, operation by operation
(``dramatiq_guard/middleware/slots/throttle.py`` and the slots it builds on), against a
:class:`~dramatiq_guard.backends.RedisBackend` on a private ``redis-server``, again on a one-node
Redis Cluster owning every slot, and against the :class:`~dramatiq_guard.backends.MemoryBackend`
(fakeredis), each in a run of its own:

* a producer *sends* a message (``before_push``): it acquires with its encoded message as a
  parking :class:`~dramatiq_guard.backends.Waiter` and the ``pickup_ttl`` as its ttl: it reserves
  a place and goes to the broker, or parks; a failed start is *retried* (Retries sends it again,
  as a new holder ``<message id>:<retries>``, decided when its backoff is due);
* a worker thread picks up a copy from the broker and acquires with the copy's generation, its
  own runner, ``ttl = period`` and a parking waiter (blocking as a standby or not): acquired, it
  starts, and its place lasts until ``start + period`` (never renewed, never released); refused,
  it parks again (the broker acks the copy: ``forget_parked_copy``), blocks as a standby,
  is stale (dropped) or runs elsewhere (deferred: back to the broker);
* a standby thread takes its wake and starts (the throttle then renews the start to
  ``now + period``: the reservation becomes the start), checks the key again, gives up
  (parking again), or dies (the broker delivers its copy again);
* a courier (the process that got a hand-off or a standby send) pushes the copy and confirms it
  for ``pickup_ttl``, or dies before pushing, or after pushing and before confirming;
* the periodic sweep sweeps the key; the key's timer sweeps it and sends the next waiters ahead
  (``send_standbys``);
* an operator sets the run-time limit (0 included) or clears it;
* the clock moves, by ticks and by leaps of up to a period, a hand-off's reservation, a
  standby's wait.

Time is the test's (:class:`harness.FakeClock`): each ``redis-server`` runs under libfaketime on a
frozen clock that the test moves, and fakeredis reads the same clock
(:func:`harness.fakeredis_clock`). Every operation first moves the clock on by :data:`TICK_MS`.

After every step (:func:`~hypothesis.stateful.invariant`):

* **the window**: the starts (each one's time on the test's clock, when its acquire, or for a
  woken standby its renewal, made it start) never number more than the limit in force in any
  window of ``period``, where a lowered limit evicts nobody: a start's place was taken when it
  became a holder of the key (its acquire at send, its hand-off, or the acquire that started it),
  and the starts of a window all held their places at the latest of those moments, so they number
  at most the limit in force then (:func:`window_overflows`);
* **each start, as the backend records it**: right after it starts, the holder's recorded
  acquire time (``inspect().holder_info``) lies between when its place was taken and its start,
  and for as long as the key lists it, its deadline is exactly ``start + period`` (never renewed,
  never released);
* **nothing is lost or started twice**: every attempt sent either started once, or is queued or
  reserved in the key, handed to a courier, on the broker, or held by a standby thread.

At the end of each run (:meth:`ThrottleModel.teardown`) the limit is cleared and the clock moved
on by periods, with every copy delivered and picked up and the key swept, until every attempt sent
has started exactly once.

Budget: ``DRAMATIQ_GUARD_THROTTLE_MODEL_EXAMPLES`` runs (default 40) of up to
``DRAMATIQ_GUARD_THROTTLE_MODEL_STEPS`` steps (default 40) per backend, derandomized unless
``DRAMATIQ_GUARD_THROTTLE_MODEL_RANDOM=1`` (e.g. 500 runs of 100 steps for a longer look).
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from harness import (
    FakeClock,
    MarksFailure,
    ModelBudget,
    fakeredis_clock,
    libfaketime,
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

from dramatiq_guard.backends import (
    AcquireResult,
    GuardBackend,
    Handoff,
    MemoryBackend,
    RedisBackend,
    Stake,
    Waiter,
)
from dramatiq_guard.backends.values import ORIGINAL_GENERATION
from dramatiq_guard.claim import entry_ms

BUDGET = ModelBudget.from_env("THROTTLE", examples=40, steps=40)

KEY = "throttle:partner"
DEFAULT = 2  # the limit the actor declares
PERIOD_MS = 1_000
PICKUP_MS = 60_000  # the slots' pickup_ttl: a place reserved at send, a confirmed hand-off
HANDOFF_MS = 10_000  # the backend's handoff_ttl: an unconfirmed hand-off's reservation
STANDBY_MS = entry_ms(5_000)  # a standby's entry while it blocks (standby_wait 5 s)
MAX_RETRIES = 1
BACKLOG = 6  # at most this many attempts sent and not started: the other rules get their turns
TICK_MS = 1
LEAPS = (
    TICK_MS, 7, PERIOD_MS // 4, PERIOD_MS // 2, PERIOD_MS - 2, PERIOD_MS, PERIOD_MS + 1,
    STANDBY_MS, HANDOFF_MS,
)  # fmt: skip
LIMITS = (None, 0, 1, 2, 3)
NAMESPACE = "throttle-model"
ACTOR = "sync_order"
START_MS = 1_893_456_000_000  # 2030-01-01T00:00:00Z

#: What the courier of a hand-off or standby send does: push and confirm it at once (mostly), later,
#: or die before the push, or after it and before the confirmation.
COURIER = st.sampled_from(["now"] * 6 + ["later", "dies", "dies after push"])

T = TypeVar("T")

pytestmark = pytest.mark.redis


@dataclasses.dataclass(frozen=True)
class Copy:
    """A copy of an attempt: handed to a courier, or on the broker."""

    holder: str  # f"{message_id}:{retries}"
    payload: bytes
    generation: int  # a hand-off's or standby send's, or ORIGINAL_GENERATION as sent
    standby: bool  # sent ahead (confirm_standby) rather than handed off (confirm_handoff)


@dataclasses.dataclass(frozen=True)
class Thread:
    """A worker thread blocked as the standby of ``copy``'s attempt."""

    copy: Copy
    runner: str


@dataclasses.dataclass(frozen=True)
class Start:
    """An attempt started at ``at`` (test's clock); its place in the key was taken at ``placed``."""

    holder: str
    at: int
    placed: int


def window_overflows(
    starts: list[Start], limit_at: Callable[[int], int], period_ms: int
) -> list[tuple[list[Start], int]]:
    """The windows of ``period_ms`` holding more starts than allowed, with the limit they break.

    The starts of a window ``(t - period, t]`` all held their places at the latest moment one of
    them took its place (each holds it from then until its start plus a period, past ``t``), and
    a holder is added only while fewer than the limit in force hold the key: so they number at
    most the limit in force at that moment. (After a lowering nobody is evicted: the starts whose
    places were taken before it count against the limit of their time.) Windows ending at a start
    are the only ones to check: any other holds no more starts than one of them.
    """
    ordered = sorted(starts, key=lambda s: s.at)
    bad = []
    for end in ordered:
        window = [s for s in ordered if end.at - period_ms < s.at <= end.at]
        allowed = limit_at(max(s.placed for s in window))
        if len(window) > allowed:
            bad.append((window, allowed))
    return bad


def test_window_overflows_counts_a_lowered_limit_from_when_places_were_taken() -> None:
    """The check itself: a lowering evicts nobody, but binds every place taken after it."""
    limits = {0: 3, 500: 1}

    def limit_at(t: int) -> int:
        return limits[max(at for at in limits if at <= t)]

    three_then_lowered = [Start("a", 0, 0), Start("b", 10, 0), Start("c", 600, 100)]
    assert window_overflows(three_then_lowered, limit_at, 1_000) == []
    taken_after = [Start("a", 0, 0), Start("b", 10, 0), Start("c", 600, 550)]
    assert [len(window) for window, _ in window_overflows(taken_after, limit_at, 1_000)] == [3]
    assert window_overflows([Start("a", 0, 0), Start("b", 1_000, 1_000)], lambda t: 1, 1_000) == []


class ThrottleModel(MarksFailure, RuleBasedStateMachine):
    """The throttle's operations on one key of ``backend``, the processes around it, and the window."""

    def __init__(self, clock: FakeClock, make_backend: Callable[[], GuardBackend]) -> None:
        super().__init__()
        self.clock = clock
        self.backend = make_backend()
        self.messages = (f"m{n}" for n in itertools.count())
        self.runners = (f"t{n}" for n in itertools.count())
        self.sent: set[str] = set()  # every attempt sent
        self.retried: set[str] = set()  # started attempts whose retry was sent
        self.starts: list[Start] = []
        self.started: Counter[str] = Counter()
        self.placed: dict[str, int] = {}  # holder -> when its latest reservation was taken
        self.limits: list[tuple[int, int]] = [(0, DEFAULT)]  # (since, limit in force)
        self.pending: list[Copy] = []  # handed to a courier, not pushed yet
        self.broker: list[Copy] = []
        self.threads: dict[str, Thread] = {}  # holder -> its standby thread
        self.courier = "now"  # what the courier of this step's hand-offs does (COURIER)

    # --- operations ----------------------------------------------------------------------------

    @property
    def now(self) -> int:
        return self.clock.now_ms

    def call(self, operation: Callable[[GuardBackend], T]) -> T:
        """One tick, then ``operation``; a holder added joins fewer than the limit in force (and its
        place is taken now)."""
        self.clock.advance(TICK_MS)
        before = self.live_holders()
        result = operation(self.backend)
        added = self.live_holders() - before
        for holder in added:
            self.placed[holder] = self.now
        if added:
            assert len(self.live_holders()) <= self.limit_at(self.now), (
                f"{sorted(added)} joined {sorted(before)} over the limit {self.limit_at(self.now)}"
            )
        return result

    def live_holders(self) -> set[str]:
        return {holder for holder, deadline in self.backend.inspect(KEY).holders if deadline > self.now}

    def limit_at(self, t: int) -> int:
        return next(limit for since, limit in reversed(self.limits) if since <= t)

    def absorb(self, handoffs: tuple[Handoff, ...], standbys: tuple[Handoff, ...] = ()) -> None:
        """The parked attempts handed a place (or sent ahead) go to the courier that got them, which
        does what :attr:`courier` says. (A blocking standby woken by a hand-off holds its place now:
        its thread takes the wake.)"""
        for handoff in handoffs + standbys:
            if handoff.payload is None:
                continue
            assert handoff.generation is not None
            copy = Copy(handoff.waiter_id, handoff.payload, handoff.generation, handoff in standbys)
            self.courier_acts(copy, self.courier)

    def courier_acts(self, copy: Copy, how: str) -> None:
        if how == "now":
            self.deliver(copy)
        elif how == "later":
            self.pending.append(copy)
        elif how == "dies after push":
            self.broker.append(copy)
        # "dies": its reservation lapses, or its standby send; the waiter waits again

    def acquire(
        self, copy: Copy | None, holder: str, ttl_ms: int, wait: Waiter, runner: str | None
    ) -> AcquireResult:
        generation = None if copy is None else copy.generation
        stake = Stake(KEY, holder, DEFAULT, ttl_ms, info=ACTOR, generation=generation, runner=runner)
        result = self.call(lambda b: b.acquire(stake, wait))
        if result.acquired and runner is not None:  # a worker's acquire: it starts
            self.start(holder, self.placed[holder])  # now, unless it held a reservation
        self.absorb(result.handoffs)  # (after: the courier's confirmations take time)
        return result

    def start(self, holder: str, placed: int) -> None:
        """``holder`` starts now: its place lasts a period from now, as the backend records it."""
        state = self.backend.inspect(KEY)
        assert dict(state.holders).get(holder) == self.now + PERIOD_MS, (holder, self.now, state)
        [since] = [since for h, since, _ in state.holder_info if h == holder]
        assert placed <= since <= self.now, f"{holder} recorded at {since}, placed at {placed}, at {self.now}"
        self.starts.append(Start(holder, self.now, placed))
        self.started[holder] += 1

    def send(self, holder: str) -> None:
        """``before_push``: reserve a place for ``pickup_ttl`` and go to the broker, or park."""
        self.sent.add(holder)
        payload = f"msg:{holder}".encode()
        result = self.acquire(None, holder, PICKUP_MS, Waiter(payload=payload), runner=None)
        assert result.acquired or result.parked, result
        if result.acquired:
            self.broker.append(Copy(holder, payload, ORIGINAL_GENERATION, standby=False))

    def pick_up(self, copy: Copy, *, block: bool, runner: str | None = None) -> None:
        """A worker thread acquires for a copy it picked up (``block``: it may block as a standby)."""
        runner = runner or next(self.runners)
        wait = Waiter(payload=copy.payload, wait_ms=STANDBY_MS if block else 0)
        result = self.acquire(copy, copy.holder, PERIOD_MS, wait, runner)
        if result.standby:
            self.threads[copy.holder] = Thread(copy, runner)
        elif result.parked:  # parked again after pickup; the broker acks the copy
            self.call(lambda b: b.forget_parked_copy(KEY, copy.holder))
        elif result.running:  # another copy of it holds, or blocks for, its place: deferred
            self.broker.append(copy)
        # stale: a newer copy of it runs instead; acquired: it started

    def sweep(self) -> None:
        """The periodic sweep of the key."""
        self.absorb(self.call(lambda b: b.sweep(KEY, limit=DEFAULT)).handoffs)

    def timer_fires(self, count: int) -> None:
        """The key's timer: a sweep, then the next waiters sent ahead (``Throttle._sweep_key``)."""
        self.sweep()
        handoffs, standbys = self.call(lambda b: b.send_standbys(KEY, limit=DEFAULT, count=count))
        self.absorb(handoffs, standbys)

    def deliver(self, copy: Copy) -> None:
        """A courier pushes ``copy`` and confirms it (whatever the answer, the copy is on the broker)."""
        self.broker.append(copy)
        self.confirm(copy)

    def confirm(self, copy: Copy) -> None:
        if copy.standby:
            self.call(
                lambda b: b.confirm_standby(
                    KEY, copy.holder, copy.payload, ttl_ms=PICKUP_MS, generation=copy.generation
                )
            )
        else:
            self.call(
                lambda b: b.confirm_handoff(KEY, copy.holder, ttl_ms=PICKUP_MS, generation=copy.generation)
            )

    def take_wake(self, thread: Thread) -> bool:
        """The standby takes its wake, if it has one: it starts (renewed to a period from now)."""
        holder = thread.copy.holder
        woken = self.call(lambda b: b.wait_for_handoff(KEY, holder, timeout_ms=0))
        if woken is None:
            return False
        del self.threads[holder]
        placed = self.placed[holder]
        assert self.call(lambda b: b.renew(KEY, holder, ttl_ms=PERIOD_MS)), f"{holder} lost its woken place"
        self.start(holder, placed)
        return True

    # --- rules ---------------------------------------------------------------------------------

    def backlog(self) -> int:
        return sum(1 for holder in self.sent if not self.started[holder])

    @precondition(lambda self: self.backlog() < BACKLOG)
    @rule(courier=COURIER)
    def a_message_is_sent(self, courier: str) -> None:
        with self.marking_failure():
            self.courier = courier
            self.send(f"{next(self.messages)}:0")

    @precondition(lambda self: self.backlog() < BACKLOG and any(self.retriable()))
    @rule(data=st.data(), courier=COURIER)
    def a_start_fails_and_is_retried(self, data: st.DataObject, courier: str) -> None:
        """A started attempt fails; Retries sends it again, a new start (decided when it is due)."""
        with self.marking_failure():
            self.courier = courier
            holder = data.draw(st.sampled_from(sorted(self.retriable())))
            self.retried.add(holder)
            mid, _, retries = holder.rpartition(":")
            self.send(f"{mid}:{int(retries) + 1}")

    def retriable(self) -> Iterator[str]:
        for holder in self.started:
            if holder not in self.retried and int(holder.rpartition(":")[2]) < MAX_RETRIES:
                yield holder

    @precondition(lambda self: self.broker)
    @rule(data=st.data(), block=st.sampled_from([True, True, False]), courier=COURIER)
    def a_worker_picks_up_a_copy(self, data: st.DataObject, block: bool, courier: str) -> None:
        """``block``: the worker has a standby seat free (a standby picked up blocks for its place)."""
        with self.marking_failure():
            self.courier = courier
            copy = data.draw(st.sampled_from(self.broker))
            self.broker.remove(copy)
            self.pick_up(copy, block=block)

    @precondition(lambda self: self.threads)
    @rule(
        data=st.data(), action=st.sampled_from(["wake", "wake", "check", "give up", "die"]), courier=COURIER
    )
    def a_standby_thread_acts(self, data: st.DataObject, action: str, courier: str) -> None:
        """A blocked standby takes its wake, checks the key again (``Claim.block``'s backstop),
        gives up at the end of its wait (parking again), or dies (the broker delivers its copy again)."""
        with self.marking_failure():
            self.courier = courier
            thread = self.threads[data.draw(st.sampled_from(sorted(self.threads)))]
            if action == "wake":
                self.take_wake(thread)
            elif action == "die":
                del self.threads[thread.copy.holder]
                self.broker.append(thread.copy)
            else:
                del self.threads[thread.copy.holder]
                self.pick_up(thread.copy, block=action == "check", runner=thread.runner)

    @precondition(lambda self: self.pending)
    @rule(
        data=st.data(), how=st.sampled_from(["now", "now", "now", "dies", "dies after push"]), courier=COURIER
    )
    def a_courier_delivers(self, data: st.DataObject, how: str, courier: str) -> None:
        """A courier that got a copy earlier pushes and confirms it now; or dies before the push, or
        after it (the reservation lapses: the waiter waits again; the pushed copy may be stale when
        picked up). ``courier``: what the courier of the hand-offs the confirmation makes does."""
        with self.marking_failure():
            self.courier = courier
            copy = data.draw(st.sampled_from(self.pending))
            self.pending.remove(copy)
            self.courier_acts(copy, how)

    @rule(ms=st.sampled_from(LEAPS))
    def time_passes(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(courier=COURIER)
    def the_sweep_runs(self, courier: str) -> None:
        with self.marking_failure():
            self.courier = courier
            self.sweep()

    @rule(count=st.sampled_from([1, 2, 4]), courier=COURIER)
    def the_key_timer_fires(self, count: int, courier: str) -> None:
        """``count``: the standbys it sends ahead (``min(limit, standby seats)``)."""
        with self.marking_failure():
            self.courier = courier
            self.timer_fires(count)

    @rule(limit=st.sampled_from(LIMITS), courier=COURIER)
    def the_limit_changes(self, limit: int | None, courier: str) -> None:
        with self.marking_failure():
            self.courier = courier
            self.set_limit(limit)

    def set_limit(self, limit: int | None) -> None:
        self.limits.append((self.now + TICK_MS, DEFAULT if limit is None else limit))  # the call's time
        result = self.call(lambda b: b.set_limit(KEY, limit, default=DEFAULT))
        self.absorb(result.handoffs)
        assert self.backend.get_limit(KEY) == limit

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def no_window_holds_more_starts_than_its_limit(self) -> None:
        with self.marking_failure():
            bad = window_overflows(self.starts, self.limit_at, PERIOD_MS)
            assert not bad, f"over the limit (limits {self.limits}): {bad[0]}"

    @invariant()
    def a_start_holds_its_place_for_a_period_exactly(self) -> None:
        """Nothing renews or releases a start: while it is listed, its deadline is its start + period."""
        with self.marking_failure():
            started_at = {start.holder: start.at for start in self.starts}
            for holder, deadline in self.backend.inspect(KEY).holders:
                if holder in started_at:
                    assert deadline == started_at[holder] + PERIOD_MS, (holder, started_at[holder], deadline)

    @invariant()
    def every_attempt_is_somewhere_and_started_at_most_once(self) -> None:
        with self.marking_failure():
            twice = {holder: n for holder, n in self.started.items() if n > 1}
            assert not twice, f"started more than once: {twice}"
            state = self.backend.inspect(KEY)
            somewhere = {waiter for waiter, _, _ in state.waiters} | set(state.reserved)
            somewhere |= {c.holder for c in itertools.chain(self.pending, self.broker)}
            somewhere |= set(self.threads)
            lost = sorted(h for h in self.sent if not self.started[h] and h not in somewhere)
            assert not lost, f"lost: {lost} ({state})"

    # --- the end -------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if not self.failed:
                self.drain()
        finally:
            self.backend.close()

    def drain(self) -> None:
        """Clear the limit, then period by period deliver, pick up and sweep until all started."""
        self.courier = "now"
        self.set_limit(None)
        for _ in range(20 + 3 * len(self.sent)):
            for thread in list(self.threads.values()):
                if not self.take_wake(thread):
                    del self.threads[thread.copy.holder]
                    self.pick_up(thread.copy, block=False, runner=thread.runner)
            while self.pending:
                self.deliver(self.pending.pop(0))
            picked, self.broker = self.broker, []
            for copy in picked:
                self.pick_up(copy, block=False)
            if all(self.started[h] for h in self.sent) and not self.broker:
                break
            self.clock.advance(PERIOD_MS)
            self.timer_fires(4)
            self.no_window_holds_more_starts_than_its_limit()
            self.every_attempt_is_somewhere_and_started_at_most_once()
        never = sorted(h for h in self.sent if not self.started[h])
        assert not never, f"never started: {never} ({self.backend.inspect(KEY)})"
        assert all(n == 1 for n in self.started.values()), self.started
        self.no_window_holds_more_starts_than_its_limit()


@pytest.fixture(scope="module")
def clock() -> Iterator[FakeClock]:
    if libfaketime() is None:
        unavailable("libfaketime is not installed (apt-get install libfaketime): the model needs it")
    clock = FakeClock(START_MS)
    yield clock
    clock.close()


@pytest.fixture(params=["redis", "cluster", "memory"])
def make_backend(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Callable[[], GuardBackend]]:
    """A maker of a fresh backend on ``clock``: a RedisBackend on a private server (standalone, or a
    one-node Cluster owning every slot), or a MemoryBackend."""
    if request.param == "memory":
        with fakeredis_clock(lambda: clock.now_ms):
            yield lambda: MemoryBackend(namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS)
        return
    if redis_server_executable() is None and shutil.which("redis-server") is None:
        unavailable("redis-server is not installed: the throttle model runs on a private one")
    with model_client(clock, cluster=request.param == "cluster") as client:

        def fresh() -> GuardBackend:
            client.flushall()
            return RedisBackend(client, namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS)

        yield fresh


@pytest.mark.timeout(900)  # a failure is shrunk, which takes minutes: let it finish and print
def test_the_throttle_keeps_its_window(clock: FakeClock, make_backend: Callable[[], GuardBackend]) -> None:
    """Random sends, pickups, standbys, hand-offs, sweeps, limits and time (module docstring)."""

    BUDGET.run(ThrottleModel, clock, make_backend)
