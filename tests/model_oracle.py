"""The model test's oracle: the guard backend contract written a second time, in plain Python.

The guard's semantics are written once, in the Lua scripts of ``dramatiq_guard/backends/lua``:
the Redis backend runs them on Redis, and the in-memory backend (a StubBroker's) runs the very
same scripts on fakeredis. This module is not part of the package; only ``tests/test_model.py``
uses it, as an *independent* oracle: the model drives it in lockstep with the scripts (on a real
Redis, a Redis Cluster and fakeredis) and requires every result and state to agree. Why keep a
second implementation at all: the scripts checked only against themselves would agree with any
bug in them; a model written apart from them, in another language and shape (one object per key,
one lock, no expiry: what a key holds is plain data), disagrees where the Lua is wrong, and the
model test's random runs find where. It is kept in step with the contract
(``dramatiq_guard/backends/base.py``) by hand, like a specification, and used nowhere else.

Each guard key is a :class:`_Guard` object with its holders, its queue of waiters (by priority,
lower first, then FIFO) and its *reserved* waiters. Every operation runs under one lock; blocking
waiters sleep on a :class:`threading.Condition` of that lock and are woken by a notification when
a slot is handed to them.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence

from dramatiq_guard.backends.base import (
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    KeySummary,
    ReleaseResult,
    Stake,
    Waiter,
    WaiterPeek,
    Woken,
)
from dramatiq_guard.backends.checks import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    check_acquire,
    check_count,
    check_key,
    check_ms,
)
from dramatiq_guard.backends.values import DEBOUNCE_TIMER, HOLDERS_SHOWN, MIN_STANDBY_WINDOW, AcquireOutcome

__all__ = ["OracleBackend"]

#: The live generation of a waiter whose copy from the broker parked in its place: no copy
#: carries it (generations are tokens, above ORIGINAL_GENERATION), so every copy of the waiter
#: on the broker is stale; the next hand-off's generation replaces it.
_REPARKED = -1


@dataclasses.dataclass
class _Entry:
    """A waiter: its place in the queue (its priority, then when it came: lower first), when it
    came, and what it waits with."""

    place: tuple[int, int]
    since_ms: int
    payload: bytes | None = None
    drop_at_ms: int | None = None  # ready waiters and standbys only
    on_broker: bool = False  # a standby sent ahead, not picked up (with a payload: not confirmed)
    info: str | None = None  # a ready waiter's, recorded as the holder's info by a hand-off
    runner: str | None = None  # a ready waiter's, recorded as the holder's runner by a hand-off
    route: str | None = None  # a parked waiter's: only a caller of this route delivers it
    generation: int | None = None  # of its hand-off or standby send not confirmed yet

    @property
    def ready(self) -> bool:
        """A thread is blocked on this waiter: a slot handed to it starts at once."""
        return self.payload is None and self.drop_at_ms is not None and not self.on_broker


@dataclasses.dataclass
class _Guard:
    """The state of one guard key."""

    holders: dict[str, int] = dataclasses.field(default_factory=dict)
    queue: dict[str, _Entry] = dataclasses.field(default_factory=dict)
    reserved: dict[str, _Entry] = dataclasses.field(default_factory=dict)
    woken: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # token, wake deadline
    # holder -> (since_ms, info, runner): when it first held, what it said of itself, who runs it
    info: dict[str, tuple[int, str | None, str | None]] = dataclasses.field(default_factory=dict)
    token: int = 0
    token_ms: int = 0  # when the last token was issued: it outlives the key's state by stale_ttl_ms
    default_limit: int | None = None  # recorded when a waiter queues, for callers that do not know it
    # waiter -> (the one generation of its message that may start, until when it is remembered,
    # whether it is kept only for the copy that parked: that copy's ack forgets it, forget_parked_copy)
    live: dict[str, tuple[int, int, bool]] = dataclasses.field(default_factory=dict)
    first_send_ms: int = 0  # a debounce key's: when its burst's first send came
    clock: Callable[[], int] = time.time_ns  # the backend's clock, in ns since the epoch

    def next_token(self) -> int:
        """The next fencing token: above every one issued before, and at least the time in us."""
        now_us = self.clock() // 1000
        self.token = max(self.token + 1, now_us)
        self.token_ms = now_us // 1000
        return self.token

    def first_holders(self) -> tuple[str, ...]:
        """Who a refused acquire names: the first :data:`HOLDERS_SHOWN`, earliest deadline first."""
        order = sorted(self.holders, key=lambda h: (self.holders[h], h))
        return tuple(order[:HOLDERS_SHOWN])

    def record_holder(self, holder: str, now: int, info: str | None, runner: str | None) -> None:
        """An acquiring holder's info: a re-entrant one (or a reservation or hand-off taken up)
        keeps its first since and info, and a runner given is recorded."""
        first = self.info.get(holder)
        if first is None:
            self.info[holder] = (now, info or None, runner)
        elif runner is not None:
            self.info[holder] = (first[0], first[1], runner)

    def is_idle(self) -> bool:
        return not (self.holders or self.queue or self.reserved)

    def deliverable(self, entry: _Entry, route: str) -> bool:
        """Whether a caller of ``route`` delivers this parked waiter (see the contract's *routes*)."""
        return not entry.route or entry.route == route

    def reclaim(self, now: int, stale_ttl_ms: int) -> int:
        """Drop lapsed holders (returning unconfirmed hand-offs to the queue) and expired waiters."""
        lapsed = [holder for holder, deadline in self.holders.items() if deadline <= now]
        for holder in lapsed:
            del self.holders[holder]
            self.info.pop(holder, None)
            entry = self.reserved.pop(holder, None)
            if entry is not None:
                self.queue[holder] = entry
                self.mark_lapsed(holder, entry, now + stale_ttl_ms)
        for waiter in [w for w, e in self.queue.items() if e.drop_at_ms is not None and e.drop_at_ms <= now]:
            entry = self.queue[waiter]
            if entry.payload is not None:
                entry.drop_at_ms = None  # a standby sent but never confirmed parks again
                entry.on_broker = False
                self.mark_lapsed(waiter, entry, now + stale_ttl_ms)
            else:
                del self.queue[waiter]
        self.woken = {w: wake for w, wake in self.woken.items() if wake[1] > now}
        self.live = {w: live for w, live in self.live.items() if live[1] > now}
        return len(lapsed)

    def mark_lapsed(self, waiter: str, entry: _Entry, until: int) -> None:
        """Its hand-off or send lapsed unconfirmed: only that generation's copy may start now."""
        if entry.generation is not None:
            self.live[waiter] = (entry.generation, until, False)
            entry.generation = None

    def new_generation(self, waiter: str, entry: _Entry, until: int) -> int:
        """A new generation for the waiter's hand-off or standby send (see the contract)."""
        entry.generation = self.next_token()
        if waiter in self.live:
            self.live[waiter] = (entry.generation, until, self.live[waiter][2])
        return entry.generation

    def is_stale(self, waiter: str, generation: int | None) -> bool:
        live = self.live.get(waiter)
        return generation is not None and live is not None and live[0] != generation

    def choose(self, free: int, limit: int) -> list[str]:
        """Who ``free`` slots go to, in queue order: among the first ``limit``, the ready ones first."""
        if free <= 0:
            return []
        window = sorted(self.queue, key=lambda w: self.queue[w].place)[: max(free, limit)]
        ready = [w for w in window if self.queue[w].ready][:free]
        others = [w for w in window if w not in ready][: free - len(ready)]
        return sorted(ready + others, key=lambda w: self.queue[w].place)


def _in_flight(guard: _Guard, waiter: str, generation: int) -> bool:
    """Whether ``waiter``'s hand-off or standby send of ``generation`` is unconfirmed and current."""
    reserved = guard.reserved.get(waiter)
    if reserved is not None:
        return reserved.generation == generation
    entry = guard.queue.get(waiter)
    if entry is None or not entry.on_broker or entry.payload is None:
        return False  # not being sent (confirmed, parked again, or gone)
    return entry.generation == generation


class OracleBackend(GuardBackend):
    """The guard backend contract in this process's memory, written apart from the scripts.

    Thread-safe; not shared across processes. Deadlines and fencing tokens
    use ``clock`` (``time.time_ns``, the wall clock, unless given).

    Parameters:
      handoff_ttl_ms(int): How long a slot handed to a waiter stays reserved.
      max_payload_bytes(int): The largest parked message stored (see
        :class:`~dramatiq_guard.backends.GuardBackend`).
      stale_ttl_ms(int): How long a waiter's live generation (after its
        hand-off lapsed, or a copy of it picked up parked) is remembered
        (see :class:`~dramatiq_guard.backends.GuardBackend`).
      clock(Callable[[], int]): The backend's clock: the time in nanoseconds
        since the epoch, as :func:`time.time_ns` returns it. A test passes
        one it controls, so leases and reservations lapse without sleeping
        (e.g. to drive this backend in lockstep with a Redis whose clock it
        also controls). Blocking waits (:meth:`wait_for_handoff`) still time
        out on :func:`time.monotonic`.
    """

    def __init__(
        self,
        *,
        handoff_ttl_ms: int = 10_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        stale_ttl_ms: int = 86_400_000,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        super().__init__(
            handoff_ttl_ms=handoff_ttl_ms, max_payload_bytes=max_payload_bytes, stale_ttl_ms=stale_ttl_ms
        )
        self._clock = clock
        self._changed = threading.Condition(threading.Lock())
        self._guards: dict[str, _Guard] = {}
        self._limits: dict[str, int] = {}
        self._places = itertools.count()

    def _now_ms(self) -> int:
        return self._clock() // 1_000_000

    def _guard(self, key: str) -> _Guard:
        """The key's state, made empty (on this backend's clock) if it has none."""
        guard = self._guards.get(key)
        if guard is None:
            guard = self._guards[key] = _Guard(clock=self._clock)
        return guard

    # Helpers run with the lock held.

    def _begin(self, key: str) -> tuple[_Guard, int]:
        check_key(key)
        guard = self._guard(key)
        now = self._now_ms()
        guard.reclaim(now, self.stale_ttl_ms)
        return guard, now

    def _in_force(self, key: str, guard: _Guard, limit: int | None) -> int:
        """The limit in force: the run-time one, else the caller's default, else the recorded one, else 0."""
        default = limit if limit is not None else (guard.default_limit or 0)
        return self._limits.get(key, default)

    def _hand_off(self, key: str, guard: _Guard, limit: int, now: int) -> list[Handoff]:
        handed: list[Handoff] = []
        stopped = False
        for waiter in guard.choose(limit - len(guard.holders), limit):
            entry = guard.queue[waiter]
            if entry.payload is not None and not entry.on_broker:
                # A parked waiter of another route stops the parked ones (its owner's sweep hands it on).
                stopped = stopped or not guard.deliverable(entry, self.route)
                if stopped:
                    continue
            del guard.queue[waiter]
            guard.holders[waiter] = now + self.handoff_ttl_ms
            payload, generation = entry.payload, None
            if payload is not None:
                guard.reserved[waiter] = entry
                if entry.on_broker:
                    # A standby being sent: its sender enqueues and confirms it.
                    entry.drop_at_ms = payload = None
                    entry.on_broker = False
                else:
                    generation = guard.new_generation(waiter, entry, now + self.stale_ttl_ms)
            else:
                guard.woken[waiter] = (guard.next_token(), now + self.wake_ttl_ms)
                if entry.info is not None or entry.runner is not None:
                    guard.info[waiter] = (now, entry.info, entry.runner)
                self._changed.notify_all()
            handed.append(Handoff(key, waiter, payload, generation))
        return handed

    def _send_ahead(self, key: str, guard: _Guard, count: int, limit: int, now: int) -> tuple[Handoff, ...]:
        """Mark the parked waiters of this route among the first ``count`` as standbys being sent.

        At most the standby window of ``limit``, the limit in force (at least MIN_STANDBY_WINDOW).
        """
        sent = []
        window = 0 if limit <= 0 else min(count, max(limit, MIN_STANDBY_WINDOW))
        for waiter, entry in sorted(guard.queue.items(), key=lambda item: item[1].place)[: max(0, window)]:
            if entry.payload is not None and not entry.on_broker and guard.deliverable(entry, self.route):
                entry.drop_at_ms = now + self.handoff_ttl_ms
                entry.on_broker = True
                generation = guard.new_generation(waiter, entry, now + self.stale_ttl_ms)
                sent.append(Handoff(key, waiter, entry.payload, generation))
        return tuple(sent)

    def _end(self, key: str, guard: _Guard) -> None:
        if not (guard.queue or guard.reserved):
            guard.default_limit = None  # recorded for the waiters, it goes with them (as on Redis)
        if guard.is_idle():
            # The live generations and the last token outlive the rest of the key's state, as on
            # Redis (the token for stale_ttl_ms after it was issued).
            kept = guard.token if guard.token_ms + self.stale_ttl_ms > self._now_ms() else 0
            if guard.live or kept:
                self._guards[key] = _Guard(
                    live=guard.live, token=kept, token_ms=guard.token_ms, clock=self._clock
                )
            else:
                self._guards.pop(key, None)

    # The operations.

    def acquire(self, stake: Stake, wait: Waiter | None = None) -> AcquireResult:
        """Try to become a holder of ``stake.key``; see :meth:`GuardBackend.acquire`."""
        check_acquire(stake, wait)
        key, holder, limit, ttl_ms = stake.key, stake.holder, stake.limit, stake.ttl_ms
        info, generation, runner = stake.info, stake.generation, stake.runner
        self.check_payload(key, holder, wait)
        sent = time.monotonic()  # the result's valid_from: the deadline counts from later
        with self._changed:
            guard, now = self._begin(key)
            in_force = self._in_force(key, guard, limit)
            refused = self._refusal(guard, holder, generation, runner, in_force, now)
            if refused is not None:
                self._end(key, guard)
                return refused
            handoffs = [h for h in self._hand_off(key, guard, in_force, now) if h.waiter_id != holder]
            token = None
            acquired = parked = standby = False
            if holder in guard.holders or (len(guard.holders) < in_force and not guard.queue):
                acquired = True
                guard.holders[holder] = now + ttl_ms
                guard.record_holder(holder, now, info, runner)
                guard.queue.pop(holder, None)
                guard.reserved.pop(holder, None)
                guard.woken.pop(holder, None)
                if generation is not None and holder in guard.live:
                    # This copy started: it is the one that may start again (a redelivery).
                    guard.live[holder] = (generation, now + self.stale_ttl_ms, guard.live[holder][2])
                token = guard.next_token() if stake.fenced else None
            elif wait is not None:
                entry = guard.queue.get(holder)
                standby = (
                    wait.payload is not None
                    and wait.wait_ms > 0
                    and entry is not None
                    and (entry.on_broker or entry.ready)
                )
                if entry is None:
                    entry = guard.queue[holder] = _Entry((stake.priority, next(self._places)), now)
                if limit is not None:
                    guard.default_limit = limit
                entry.on_broker = False
                if standby:  # a standby sent ahead was picked up (or asks again): it blocks in its place
                    entry.payload = None
                    entry.drop_at_ms = now + wait.wait_ms
                else:
                    entry.payload = wait.payload
                    entry.drop_at_ms = None if wait.payload is not None else now + wait.wait_ms
                    if wait.payload is not None:
                        entry.route = self.route
                        if generation is not None:
                            # A copy from the broker parked in its place: it is the entry now (no
                            # copy on the broker may start, this one included if delivered again,
                            # and a late confirmation does not take the entry out). With no record
                            # before, it is kept for this copy only, until the broker acks it.
                            # Not at the gate (no runner): no broker acks that copy, it may come back.
                            only_parked = holder not in guard.live and bool(runner)
                            guard.live[holder] = (_REPARKED, now + self.stale_ttl_ms, only_parked)
                entry.info = (info or None) if entry.ready else None
                entry.runner = runner if entry.ready else None
                parked = True
            holders = () if acquired else guard.first_holders()
            self._end(key, guard)
            return AcquireResult(
                _outcome(acquired, parked, standby),
                token,
                holders,
                in_force,
                tuple(handoffs),
                valid_from=sent,
            )

    @staticmethod
    def _refusal(
        guard: _Guard, holder: str, generation: int | None, runner: str | None, in_force: int, now: int
    ) -> AcquireResult | None:
        """The acquire's refusal with nothing done, if any: a stale copy, or a second copy of a holder.

        A second copy: ``holder`` holds the key, or blocks on it as a ready
        waiter, for a runner other than ``runner`` (which may be None).
        """
        if guard.is_stale(holder, generation):
            return AcquireResult(AcquireOutcome.STALE, None, (), in_force)
        other: str | None = None
        until: int | None = None  # when the entry of the other runner lapses
        if holder in guard.holders:
            first = guard.info.get(holder)
            other, until = (None if first is None else first[2]), guard.holders[holder]
        else:
            entry = guard.queue.get(holder)
            if entry is not None and entry.ready:
                other, until = entry.runner, entry.drop_at_ms
        if other is not None and other != runner and until is not None:
            lapses_in_ms = max(0, until - now)
            return AcquireResult(AcquireOutcome.RUNNING, None, (), in_force, lapses_in_ms=lapses_in_ms)
        return None

    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        """Extend ``holder``'s lease; see :meth:`GuardBackend.renew`."""
        check_key(key)
        check_ms(ttl_ms, "ttl_ms", minimum=0)
        with self._changed:
            guard = self._guards.get(key)
            now = self._now_ms()
            if guard is None or guard.holders.get(holder, now) <= now:
                return False
            guard.holders[holder] = now + ttl_ms
            return True

    def give_back(self, key: str, holder: str, *, limit: int | None) -> ReleaseResult:
        """:meth:`release`, unless a runner took ``holder``'s slot; see :meth:`GuardBackend.give_back`."""
        with self._changed:
            first = self._guards.get(key)
            entry = first.info.get(holder) if first is not None else None
            if entry is not None and entry[2]:
                return ReleaseResult(False, (), ())
        return self.release(key, holder, limit=limit)

    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        """Give up ``holder``'s slot; see :meth:`GuardBackend.release`."""
        check_count(limit, "limit")
        check_count(send_ahead, "send_ahead")
        with self._changed:
            guard, now = self._begin(key)
            released = guard.holders.pop(holder, None) is not None
            guard.info.pop(holder, None)
            if released:
                guard.reserved.pop(holder, None)
            in_force = self._in_force(key, guard, limit)
            handoffs = self._hand_off(key, guard, in_force, now)
            standbys = self._send_ahead(key, guard, send_ahead, in_force, now)
            self._end(key, guard)
            return ReleaseResult(released, tuple(handoffs), standbys)

    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a handed-off parked message was re-enqueued; see :meth:`GuardBackend.confirm_handoff`."""
        check_ms(ttl_ms, "ttl_ms")
        with self._changed:
            guard, now = self._begin(key)
            reserved = guard.reserved.get(waiter_id)
            if reserved is not None and generation in (None, reserved.generation):
                del guard.reserved[waiter_id]
                guard.holders[waiter_id] = now + ttl_ms
                held = True
            else:
                held = waiter_id in guard.holders and waiter_id not in guard.reserved
                live = guard.live.get(waiter_id)
                reparked = live is not None and live[0] == _REPARKED
                if (
                    not held
                    and not reparked
                    and (generation is None or (live is not None and live[0] == generation))
                ):
                    # Lapsed and back in the queue before any newer hand-off: the re-enqueued copy wins.
                    guard.queue.pop(waiter_id, None)
            self._end(key, guard)
            return held

    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        """Send the oldest parked waiters ahead as standbys; see :meth:`GuardBackend.send_standbys`."""
        check_count(limit, "limit")
        check_count(count, "count")
        with self._changed:
            guard, now = self._begin(key)
            in_force = self._in_force(key, guard, limit)
            handoffs = self._hand_off(key, guard, in_force, now)
            sent = self._send_ahead(key, guard, count, in_force, now)
            self._end(key, guard)
            return tuple(handoffs), sent

    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a standby was enqueued; see :meth:`GuardBackend.confirm_standby`."""
        check_ms(ttl_ms, "ttl_ms")
        with self._changed:
            guard, now = self._begin(key)
            reserved = guard.reserved.get(waiter_id)
            entry = guard.queue.get(waiter_id)
            held = True
            current = reserved if reserved is not None else entry
            in_flight = current.generation if current is not None else None
            if generation is not None and in_flight is not None and in_flight != generation:
                self._end(key, guard)
                return False  # a confirmation of an older send: that copy will not start
            if reserved is not None and reserved.payload == payload:
                del guard.reserved[waiter_id]
                guard.holders[waiter_id] = now + ttl_ms
            elif entry is not None and entry.payload == payload and entry.on_broker:
                entry.payload = None
                entry.generation = None
                entry.drop_at_ms = now + ttl_ms
            else:
                # Picked up already (ready, or holding its slot), or sent again; else parked.
                held = waiter_id in guard.holders or (entry is not None and entry.drop_at_ms is not None)
            self._end(key, guard)
            return held

    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """Sleep until a slot is handed to ``waiter_id``; see :meth:`GuardBackend.wait_for_handoff`."""
        check_key(key)
        check_ms(timeout_ms, "timeout_ms", minimum=0)
        give_up = time.monotonic() + timeout_ms / 1000
        with self._changed:
            while True:
                guard = self._guards.get(key)
                wake = None if guard is None else guard.woken.pop(waiter_id, None)
                if wake is not None and wake[1] > self._now_ms():
                    return self.woken(wake[0])
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def forget_parked_copy(self, key: str, waiter_id: str) -> bool:
        """The broker acked the parked copy of ``waiter_id``; see :meth:`GuardBackend.forget_parked_copy`."""
        check_key(key)
        with self._changed:
            guard = self._guards.get(key)
            live = guard.live.get(waiter_id) if guard is not None else None
            if guard is None or live is None or not live[2]:
                return False
            del guard.live[waiter_id]
            return True

    def cancel_wait(
        self, key: str, waiter_id: str, *, limit: int | None, generation: int | None = None
    ) -> ReleaseResult:
        """Leave the waiters of ``key``; see :meth:`GuardBackend.cancel_wait`."""
        check_count(limit, "limit")
        with self._changed:
            guard, now = self._begin(key)
            if generation is not None and not _in_flight(guard, waiter_id, generation):
                # The message came back to the key after that hand-off or send: its entry stays.
                handoffs = self._hand_off(key, guard, self._in_force(key, guard, limit), now)
                self._end(key, guard)
                return ReleaseResult(False, tuple(handoffs))
            guard.queue.pop(waiter_id, None)
            guard.woken.pop(waiter_id, None)
            guard.reserved.pop(waiter_id, None)
            released = guard.holders.pop(waiter_id, None) is not None
            guard.info.pop(waiter_id, None)
            handoffs = self._hand_off(key, guard, self._in_force(key, guard, limit), now)
            self._end(key, guard)
            return ReleaseResult(released, tuple(handoffs))

    def debounce(
        self, key: str, waiter_id: str, payload: bytes, *, wait_ms: int, max_wait_ms: int
    ) -> tuple[tuple[str, ...], int]:
        """Make ``waiter_id`` the key's pending run; see :meth:`GuardBackend.debounce`."""
        check_ms(wait_ms, "wait_ms")
        check_ms(max_wait_ms, "max_wait_ms")
        with self._changed:
            guard, now = self._begin(key)
            first = guard.first_send_ms if guard.queue else now
            superseded = tuple(
                w for w, _ in sorted(guard.queue.items(), key=lambda i: i[1].place) if w != waiter_id
            )
            for waiter in superseded:
                del guard.queue[waiter]
            entry = guard.queue.setdefault(waiter_id, _Entry((0, next(self._places)), now))
            entry.payload, entry.route = payload, self.route
            guard.default_limit, guard.first_send_ms = 1, first
            due = max(now, min(now + wait_ms, first + max_wait_ms))
            guard.holders[DEBOUNCE_TIMER] = due  # the timer holder: it keeps the key's one slot until then
            self._end(key, guard)
            return superseded, due - now

    def copy_is_live(self, key: str, waiter_id: str, generation: int) -> bool:
        """Whether the copy carrying ``generation`` may start; see :meth:`GuardBackend.copy_is_live`."""
        with self._changed:
            guard, _ = self._begin(key)
            stale = guard.is_stale(waiter_id, generation)
            self._end(key, guard)
        if not stale:  # it starts: its hand-off is confirmed, if it was not yet
            self.confirm_handoff(key, waiter_id, ttl_ms=1, generation=generation)
        return not stale

    def sweep(self, key: str, *, limit: int | None) -> ReleaseResult:
        """Reclaim lapsed holders and hand free slots on; see :meth:`GuardBackend.sweep`.

        Returns:
          ReleaseResult: ``released`` tells whether any lapsed holder was reclaimed.
        """
        check_key(key)
        check_count(limit, "limit")
        with self._changed:
            guard = self._guard(key)
            now = self._now_ms()
            reclaimed = guard.reclaim(now, self.stale_ttl_ms)
            handoffs = self._hand_off(key, guard, self._in_force(key, guard, limit), now)
            self._end(key, guard)
            return ReleaseResult(reclaimed > 0, tuple(handoffs))

    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        """Set or clear the run-time limit; see :meth:`GuardBackend.set_limit`.

        Returns:
          ReleaseResult: ``released`` is always False (nobody is evicted).

        Raises:
          ValueError: If ``limit`` or ``default`` is out of range (:func:`check_count`).
        """
        if limit is not None:
            check_count(limit, "limit")
        check_count(default, "default")
        check_key(key)
        with self._changed:
            if limit is None:
                self._limits.pop(key, None)
            else:
                self._limits[key] = limit
            guard, now = self._begin(key)
            handoffs = self._hand_off(key, guard, self._in_force(key, guard, default), now)
            self._end(key, guard)
            return ReleaseResult(False, tuple(handoffs))

    def get_limit(self, key: str) -> int | None:
        """The run-time limit of ``key``, or None."""
        check_key(key)
        with self._changed:
            return self._limits.get(key)

    def inspect(self, key: str, *, waiters: int | None = None) -> KeyState:
        """A snapshot of ``key`` (it reclaims nothing); see :meth:`GuardBackend.inspect`."""
        check_key(key)
        if waiters is not None:
            check_count(waiters, "waiters")
        with self._changed:
            guard = self._guards.get(key)
            if guard is None:
                return KeyState((), (), (), self._limits.get(key), None)
            queue = sorted(guard.queue.items(), key=lambda item: item[1].place)[:waiters]
            holders = tuple(sorted(guard.holders.items(), key=lambda item: item[1]))
            return KeyState(
                holders=holders,
                waiters=tuple((w, e.since_ms, e.payload is not None) for w, e in queue),
                reserved=tuple(guard.reserved),
                limit=self._limits.get(key),
                token=guard.token or None,
                holder_info=tuple((h, *guard.info[h][:2]) for h, _ in holders if h in guard.info),
            )

    def queue(self, key: str) -> list[tuple[str, bool, bool, str | None]]:
        """The waiters of ``key`` in queue order: (waiter, ready, parked and not being sent, route)."""
        with self._changed:
            guard = self._guards.get(key)
            entries = sorted(guard.queue.items(), key=lambda item: item[1].place) if guard else []
            return [(w, e.ready, e.payload is not None and not e.on_broker, e.route) for w, e in entries]

    def waiting_keys(self) -> list[str]:
        """Keys with waiters or unconfirmed hand-offs (the backend's own table of keys)."""
        with self._changed:
            return [key for key, guard in self._guards.items() if guard.queue or guard.reserved]

    def limit_keys(self) -> list[str]:
        """Keys that have a run-time limit (the backend's own table of limits), sorted."""
        with self._changed:
            return sorted(self._limits)

    def summaries(self, keys: Sequence[str], *, waiters: int = 0) -> list[KeySummary]:
        """A few numbers about each key; see :meth:`GuardBackend.summaries` (all under one lock)."""
        check_count(waiters, "waiters")
        for key in keys:
            check_key(key)
        with self._changed:
            return [self._summary(key, self._guards.get(key), waiters) for key in keys]

    def _summary(self, key: str, guard: _Guard | None, waiters: int) -> KeySummary:
        limit = self._limits.get(key)
        if guard is None:
            return KeySummary(key, 0, 0, 0, None, limit, None)
        # Sorting is O(n log n) here; this backend is for tests, where queues are short.
        queue = sorted(guard.queue.items(), key=lambda item: item[1].place)
        return KeySummary(
            key,
            holders=len(guard.holders),
            waiters=len(queue),
            reserved=len(guard.reserved),
            oldest_since_ms=queue[0][1].since_ms if queue else None,
            limit=limit,
            recorded_limit=guard.default_limit,
            first=tuple(WaiterPeek(w, e.since_ms, e.payload, e.info) for w, e in queue[:waiters]),
        )

    def close(self) -> None:
        """Nothing to release; the state is kept (it is the process's memory)."""


def _outcome(acquired: bool, parked: bool, standby: bool) -> AcquireOutcome:
    if acquired:
        return AcquireOutcome.ACQUIRED
    if standby:
        return AcquireOutcome.STANDBY
    return AcquireOutcome.QUEUED if parked else AcquireOutcome.BUSY
