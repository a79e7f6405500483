"""A model-checked debounce: the backend operations of the ``debounce`` option, on the test's clock.

A Hypothesis state machine sends to one debounce key, moves the clock, sweeps it, pushes and
confirms what the sweep hands off (or dies before the push, or after it and before the
confirmation), and has workers start the copies on the broker, which check their generation.
Every operation runs in lockstep on the oracle (``tests/model_oracle.py``), the in-memory backend
(fakeredis) and, where libfaketime is installed, RedisBackends on a private ``redis-server`` and on
a one-node Redis Cluster owning every slot, on the same frozen clock; every result and the key's
state must agree. After every step:

* **invariant D**: at most one pending run of the key was never handed off (the others in its
  queue are hand-offs that lapsed unconfirmed and came back);
* a run is handed off only once its due time passed, ``min(last send + wait, first send +
  max_wait)`` of the last send, and every send's due time is that;
* every send is pending, handed off, or superseded; no copy starts twice.

At the end the key is drained (time moves on, sweeps hand off, every copy is pushed, confirmed
and started): every send started or was superseded, and started and superseded both only where
a hand-off lapsed unconfirmed with its copy on the broker (at least once).

Budget: ``DRAMATIQ_GUARD_DEBOUNCE_MODEL_EXAMPLES`` runs (default 40) of up to
``DRAMATIQ_GUARD_DEBOUNCE_MODEL_STEPS`` steps (default 40), derandomized unless
``DRAMATIQ_GUARD_DEBOUNCE_MODEL_RANDOM=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from harness import FakeClock, MarksFailure, ModelBudget, SettableClock, fakeredis_clock, model_clock
from harness.topology import model_client
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from model_oracle import OracleBackend

from dramatiq_guard.backends import GuardBackend, MemoryBackend, RedisBackend

BUDGET = ModelBudget.from_env("DEBOUNCE", examples=40, steps=40)
KEY = "debounce:doc"
WAIT_MS, MAX_WAIT_MS, HANDOFF_MS = 300, 1_000, 2_000
LEAPS = (1, 50, WAIT_MS - 1, WAIT_MS, MAX_WAIT_MS, HANDOFF_MS + 1)
COURIER = st.sampled_from(["now"] * 4 + ["later", "dies", "dies after push"])
NAMESPACE = "debounce-model"
START_MS = 1_893_456_000_000

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Copy:
    """A hand-off of the key's run: with a courier, or on the broker."""

    waiter: str
    generation: int


Clock = FakeClock | SettableClock


class DebounceModel(MarksFailure, RuleBasedStateMachine):
    def __init__(self, clock: Clock, make_backends: Callable[[], list[GuardBackend]]) -> None:
        super().__init__()
        self.clock, self.backends = clock, make_backends()
        self.messages = (f"m{n}" for n in itertools.count())
        self.sent: list[str] = []
        self.superseded: set[str] = set()
        self.handed: set[str] = set()
        self.started: Counter[str] = Counter()
        self.couriers: list[Copy] = []
        self.broker: list[Copy] = []
        self.first = self.due = 0

    def all(self, operation: Callable[[GuardBackend], T]) -> T:
        """One tick, then ``operation`` on every backend: they must agree."""
        self.clock.advance(1)
        results = [operation(backend) for backend in self.backends]
        assert all(r == results[0] for r in results), results
        return results[0]

    def pending(self) -> list[str]:
        return [w for w, _, _ in self.backends[0].inspect(KEY).waiters]

    @rule()
    def send(self) -> None:
        with self.marking_failure():
            waiter = next(self.messages)
            state, now = self.backends[0].inspect(KEY), self.clock.now_ms + 1  # after all()'s tick
            lapsed = {h for h, deadline in state.holders if deadline <= now and h in state.reserved}
            queued = [w for w, _, _ in state.waiters] + sorted(lapsed)  # a lapsed hand-off is back
            superseded, due_in = self.all(
                lambda b: b.debounce(KEY, waiter, waiter.encode(), wait_ms=WAIT_MS, max_wait_ms=MAX_WAIT_MS)
            )
            self.first = self.first if queued else now
            assert set(superseded) == set(queued) - {waiter}
            assert due_in == max(0, min(WAIT_MS, self.first + MAX_WAIT_MS - now))
            self.sent.append(waiter)
            self.superseded.update(superseded)
            self.due = now + due_in

    @rule(leap=st.sampled_from(LEAPS))
    def time_passes(self, leap: int) -> None:
        self.clock.advance(leap)

    @rule(fate=COURIER)
    def sweep(self, fate: str) -> None:
        with self.marking_failure():
            # (Its ``released`` may differ: on Redis, holders that lapsed a while ago expired with H.)
            for handoff in self.all(lambda b: b.sweep(KEY, limit=1).handoffs):
                assert self.clock.now_ms >= self.due, f"handed off before its due time {self.due}"
                assert handoff.payload == handoff.waiter_id.encode() and handoff.generation is not None
                copy = Copy(handoff.waiter_id, handoff.generation)
                self.handed.add(copy.waiter)
                if fate == "later":
                    self.couriers.append(copy)
                elif fate != "dies":
                    self.deliver(copy, confirm=fate == "now")

    def deliver(self, copy: Copy, *, confirm: bool = True) -> None:
        self.broker.append(copy)
        if confirm:
            self.all(lambda b: b.confirm_handoff(KEY, copy.waiter, ttl_ms=1, generation=copy.generation))

    @precondition(lambda self: self.couriers)
    @rule()
    def courier_delivers_late(self) -> None:
        with self.marking_failure():
            self.deliver(self.couriers.pop(0))

    @precondition(lambda self: self.broker)
    @rule()
    def worker_starts_a_copy(self) -> None:
        with self.marking_failure():
            copy = self.broker.pop(0)
            if self.all(lambda b: b.copy_is_live(KEY, copy.waiter, copy.generation)):
                self.started[copy.waiter] += 1
                assert self.started[copy.waiter] == 1, f"{copy.waiter} started twice"

    @invariant()
    def the_backends_agree_and_one_pending_run_was_never_handed_off(self) -> None:
        states = [b.inspect(KEY) for b in self.backends]
        now = self.clock.now_ms  # live holders only: on Redis, lapsed ones expire with H
        shown = [(tuple(h for h in s.holders if h[1] > now), s.waiters, s.reserved) for s in states]
        assert all(s == shown[0] for s in shown), shown
        fresh = [w for w in self.pending() if w not in self.handed]
        assert len(fresh) <= 1, fresh
        assert set(self.sent) <= set(self.pending()) | self.handed | self.superseded

    def teardown(self) -> None:
        if self.failed:
            return
        for _ in range(len(self.sent) + 3):
            self.clock.advance(HANDOFF_MS + MAX_WAIT_MS)
            self.sweep("now")
            while self.couriers:
                self.deliver(self.couriers.pop(0))
            while self.broker:
                self.worker_starts_a_copy()
        assert not self.pending(), self.backends[0].inspect(KEY)
        assert set(self.sent) == set(self.started) | self.superseded, "a send neither ran nor was superseded"
        assert set(self.started) & self.superseded <= self.handed


@pytest.fixture(scope="module")
def clock() -> Iterator[Clock]:
    with model_clock(START_MS) as clock:
        yield clock


@pytest.fixture
def make_backends(clock: Clock) -> Iterator[Callable[[], list[GuardBackend]]]:
    """A maker of fresh backends on ``clock``: the oracle, a MemoryBackend and, with libfaketime,
    RedisBackends on a private standalone server and on a one-node Cluster owning every slot."""
    with fakeredis_clock(lambda: clock.now_ms), contextlib.ExitStack() as stack:
        clients: list[Any] = []
        if isinstance(clock, FakeClock) and shutil.which("redis-server"):
            clients = [stack.enter_context(model_client(clock, cluster=cluster)) for cluster in (False, True)]

        def fresh() -> list[GuardBackend]:
            made: list[GuardBackend] = [
                OracleBackend(handoff_ttl_ms=HANDOFF_MS, clock=clock.ns),
                MemoryBackend(namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS),
            ]
            for client in clients:
                client.flushall()
                made.append(RedisBackend(client, namespace=NAMESPACE, handoff_ttl_ms=HANDOFF_MS))
            return made

        yield fresh


@pytest.mark.timeout(900)
def test_debounce_keeps_invariant_d(clock: Clock, make_backends: Callable[[], list[GuardBackend]]) -> None:
    """Random sends, sweeps, couriers, pickups and time (module docstring)."""

    BUDGET.run(DebounceModel, clock, make_backends)
