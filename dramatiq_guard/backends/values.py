"""The values the backend operations take and return (:mod:`dramatiq_guard.backends.base`)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, NamedTuple

#: How many holders a refused acquire names (:attr:`AcquireResult.holders`).
HOLDERS_SHOWN = 10

#: The generation of a message's copy as sent (no hand-off or standby send made it); a worker
#: acquires with it, never None, so a redelivery of a copy that parked is stale (*generations*).
ORIGINAL_GENERATION = 0

#: The holder that keeps a debounce key's one slot until its pending run is due: its deadline is the
#: run's due time (*debounce*).
DEBOUNCE_TIMER = "~due"

#: The standby window when the limit in force is smaller (not 0): one per slot is too few for short jobs.
MIN_STANDBY_WINDOW = 4


@dataclasses.dataclass(frozen=True)
class Stake:
    """What one holder claims of one guard key: what :meth:`GuardBackend.acquire` takes.

    Parameters:
      key(str): The guard key.
      holder(str): The would-be holder's id (a message id, or a lock's random id).
      limit(int|None): The key's default limit, unless a run-time limit is set; None if the
        caller does not know it (the recorded one is used: *limits known from the backend*).
      ttl_ms(int): The lease an acquire takes.
      info(str|None): What :meth:`GuardBackend.inspect` shows of the holder (its actor's name).
      generation(int|None): The generation of the copy acquiring (*Generations*):
        :data:`ORIGINAL_GENERATION` as sent, None for a message not on a broker.
      runner(str|None): Who runs the job once it holds (:func:`~dramatiq_guard.lease.runner_id`),
        or None (a reservation, a lock); a holder of a runner is re-entered by that runner only
        (else ``running``). At most 200 characters, without ``|`` or ``@``.
      fenced(bool): False for a lock that fences no writes (a dedup lock): no token is issued
        nor kept for the key.
      priority(int): Its place among the key's waiters if it waits: lower is handed a slot
        first, FIFO within one priority (an actor's Dramatiq ``priority``). From -2048 to
        2048 (:data:`~dramatiq_guard.bounds.MAX_PRIORITY`).
    """

    key: str
    holder: str
    limit: int | None
    ttl_ms: int
    info: str | None = None
    generation: int | None = None
    runner: str | None = None
    fenced: bool = True
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A waiter (``waiter_id``, a message id) just given a slot of ``key``: now a holder with a
    reservation. ``payload``: the parked message to re-enqueue, or None for a blocking waiter (woken
    by the backend). ``generation``: this hand-off's or standby send's (*Generations*), which the
    re-enqueued copy carries; not compared."""

    key: str
    waiter_id: str
    payload: bytes | None
    generation: int | None = dataclasses.field(default=None, compare=False)


class AcquireOutcome(enum.Enum):
    """What an acquire did: one state (:attr:`AcquireResult.outcome`)."""

    #: ``holder`` holds a slot of the key now.
    ACQUIRED = "acquired"
    #: Refused and queued as a waiter (asked to wait, or already waiting): parked, or blocking.
    QUEUED = "queued"
    #: A standby that acquired in park mode with ``Waiter.wait_ms > 0``: queued as a blocking
    #: waiter, for :meth:`GuardBackend.wait_for_handoff`.
    STANDBY = "standby"
    #: A stale copy of a handed-off message (*generations*): nothing was done; it must not run.
    STALE = "stale"
    #: ``holder`` holds the key (or blocks for it) for another runner (:attr:`Stake.runner`):
    #: nothing was done, nothing queued; this copy must not run now.
    RUNNING = "running"
    #: Refused, and not queued (no ``wait`` was given).
    BUSY = "busy"

    @classmethod
    def refusal(cls, word: str) -> AcquireOutcome:
        """The refusal the scripts name ``word`` (queued, standby, stale, running), else busy."""
        try:
            return cls(word)
        except ValueError:
            return cls.BUSY


@dataclasses.dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`GuardBackend.acquire`.

    Parameters:
      outcome(AcquireOutcome): What it did (:attr:`acquired`, :attr:`parked`, :attr:`standby`,
        :attr:`stale` and :attr:`running` read it).
      token(int|None): The new fencing token when acquired, else None.
      holders(tuple[str, ...]): When refused, the first :data:`HOLDERS_SHOWN` live holders in
        the way (earliest deadline first); empty when acquired.
      limit(int): The limit in force.
      handoffs(tuple[Handoff, ...]): Waiters given a slot by this operation; the caller must
        re-enqueue the ones with a payload.
      reserved_ms(int|None): From a wake (:meth:`Woken.result`): the reservation lasts at least
        this long; the lease must be renewed within it.
      valid_from(float|None): When the lease's ttl surely started counting (``time.monotonic()``),
        or None (:mod:`dramatiq_guard.renewer`, known-valid time).
      lapses_in_ms(int|None): With :attr:`running`: in how many ms the entry in the way lapses.
    """

    outcome: AcquireOutcome
    token: int | None
    holders: tuple[str, ...]
    limit: int
    handoffs: tuple[Handoff, ...] = ()
    reserved_ms: int | None = None
    valid_from: float | None = None
    lapses_in_ms: int | None = None

    @property
    def acquired(self) -> bool:
        """Whether ``holder`` now holds a slot of the key."""
        return self.outcome is AcquireOutcome.ACQUIRED

    @property
    def parked(self) -> bool:
        """Whether the caller's waiter entry is queued (parked, blocking, or a standby)."""
        return self.outcome in (AcquireOutcome.QUEUED, AcquireOutcome.STANDBY)

    @property
    def standby(self) -> bool:
        """Whether the caller is a standby that blocks for its slot (:attr:`AcquireOutcome.STANDBY`)."""
        return self.outcome is AcquireOutcome.STANDBY

    @property
    def stale(self) -> bool:
        """Whether the caller is a stale copy (:attr:`AcquireOutcome.STALE`): it must not run."""
        return self.outcome is AcquireOutcome.STALE

    @property
    def running(self) -> bool:
        """Whether the holder runs elsewhere (:attr:`AcquireOutcome.RUNNING`): this copy must not run now."""
        return self.outcome is AcquireOutcome.RUNNING


@dataclasses.dataclass(frozen=True)
class Woken:
    """A blocking waiter woken by a hand-off: it holds the slot now (:meth:`GuardBackend.wait_for_handoff`),
    with the fencing ``token`` the hand-off issued, and ``reserved_ms`` from ``taken_at`` (the wake,
    on ``time.monotonic()``) to renew it."""

    token: int
    reserved_ms: int
    taken_at: float = dataclasses.field(default_factory=time.monotonic, compare=False)

    def result(self, limit: int) -> AcquireResult:
        """This wake as an acquired :class:`AcquireResult` (``reserved_ms`` counted from ``taken_at``)."""
        return AcquireResult(
            AcquireOutcome.ACQUIRED,
            self.token,
            (),
            limit,
            reserved_ms=self.reserved_ms,
            valid_from=self.taken_at,
        )


@dataclasses.dataclass(frozen=True)
class ReleaseResult:
    """The outcome of a release, a sweep, a limit change or a cancelled wait.

    Parameters:
      released(bool): Whether the holder held the key (False: e.g. its lease had lapsed; the
        caller must report it).
      handoffs(tuple[Handoff, ...]): Waiters given a slot by this operation.
      standbys(tuple[Handoff, ...]): Waiters sent ahead by a release with ``send_ahead``; the
        caller enqueues each and confirms it (:meth:`GuardBackend.confirm_standby`).
    """

    released: bool
    handoffs: tuple[Handoff, ...] = ()
    standbys: tuple[Handoff, ...] = ()


@dataclasses.dataclass(frozen=True)
class KeyState:
    """A read-only snapshot of a key, for inspection and tests.

    Parameters:
      holders(tuple[tuple[str, int], ...]): ``(holder, deadline_ms)`` pairs.
      waiters(tuple[tuple[str, int, bool], ...]): ``(waiter_id, since_ms, parked)`` in FIFO
        order; ``parked`` is False for blocking waiters.
      reserved(tuple[str, ...]): Holders that are hand-offs whose re-enqueue is unconfirmed.
      limit(int|None): The run-time limit, or None if none is set.
      token(int|None): The last fencing token issued, if the key has state.
      holder_info(tuple[tuple[str, int, str|None], ...]): ``(holder, since_ms, info)`` of the
        holders that acquired, in the order of ``holders``.
    """

    holders: tuple[tuple[str, int], ...]
    waiters: tuple[tuple[str, int, bool], ...]
    reserved: tuple[str, ...]
    limit: int | None
    token: int | None
    holder_info: tuple[tuple[str, int, str | None], ...] = ()

    def window(self) -> tuple[int, int | None]:
        """A throttle key's window: its starts (holders but unconfirmed hand-offs), and when its next
        place opens (its oldest holder's deadline, ms; None without holders)."""
        reserved = set(self.reserved)
        starts = sum(1 for holder, _ in self.holders if holder not in reserved)
        return starts, min((deadline for _, deadline in self.holders), default=None)


@dataclasses.dataclass(frozen=True)
class Waiter:
    """How a refused acquirer asks to wait: ``payload``, the encoded message to park, or None for a
    blocking waiter (a thread that will call ``wait_for_handoff``, its entry living ``wait_ms``); a
    parked waiter whose entry is a standby blocks instead, for ``wait_ms`` (0: it always parks)."""

    payload: bytes | None = None
    wait_ms: int = 0


@dataclasses.dataclass(frozen=True)
class WaiterPeek:
    """One of the first waiters of a key (:meth:`GuardBackend.summaries`): its id, when it queued
    (the backend's clock), its parked message (None: a blocking waiter, a confirmed standby, or one
    handed a slot between two reads), and what a ready waiter's thread said of it (its actor)."""

    waiter_id: str
    since_ms: int
    payload: bytes | None
    info: str | None = None


@dataclasses.dataclass(frozen=True)
class KeySummary:
    """A few numbers about a key, cheap to read for many keys (:meth:`GuardBackend.summaries`).

    Parameters:
      key(str): The guard key.
      holders(int): How many holders it has (lapsed ones not yet reclaimed included).
      waiters(int): How many waiters are queued.
      reserved(int): How many holders are unconfirmed hand-offs.
      oldest_since_ms(int|None): When the first waiter (the next handed a slot) queued, or None.
      limit(int|None): The run-time limit, or None.
      recorded_limit(int|None): The default limit recorded with the key's waiters
        (*limits known from the backend*), or None.
      first(tuple[WaiterPeek, ...]): The first waiters in FIFO order, as many as asked for.
      due_ms(int|None): A debounce key's: when its pending run is due (the deadline of its
        :data:`DEBOUNCE_TIMER` holder), or None.
      superseded(int|None): A debounce key's: how many sends its pending run superseded in this
        burst (a waiter that came back from a lapsed hand-off included), or None.
    """

    key: str
    holders: int
    waiters: int
    reserved: int
    oldest_since_ms: int | None
    limit: int | None
    recorded_limit: int | None
    first: tuple[WaiterPeek, ...] = ()
    due_ms: int | None = None
    superseded: int | None = None

    @property
    def limit_in_force(self) -> int | None:
        """The run-time limit, else the recorded one, else None (unknown here)."""
        return self.limit if self.limit is not None else self.recorded_limit


class Enqueue(NamedTuple):
    """A message (``data``, encoded) to push to a broker's queue (a delay queue's for a delayed one)
    as its own enqueue would (``lock_and_enqueue``); ``message_id``: the broker's id of this push (a
    RedisBroker's ``redis_message_id``)."""

    broker: Any
    queue_name: str
    message_id: str
    data: bytes


class Due(NamedTuple):
    """What :meth:`~dramatiq_guard.backends.GuardBackend.due_keys` answers.

    Parameters:
      keys(list[str]): The waiting keys a sweep should look at now.
      prompt_in_ms(int|None): In how many ms the first key ahead with a prompt prefix is due, if
        within the time asked; None if none is, or the backend cannot tell.
    """

    keys: list[str]
    prompt_in_ms: int | None = None
