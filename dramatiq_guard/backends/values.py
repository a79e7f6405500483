"""The values the backend operations take and return (see :mod:`dramatiq_guard.backends.base`)."""

from __future__ import annotations

import dataclasses
import enum
import time

#: How many holders a refused acquire names (:attr:`AcquireResult.holders`); the
#: Redis scripts get it from here (``backends/redis_layout.py``).
HOLDERS_SHOWN = 10

#: The generation of a message's copy that no hand-off or standby send of the key made: the
#: message as sent. A worker acquires with it (not None) so that, once the copy has parked after
#: pickup, a delivery of it again (its worker died before the broker's ack) is stale (contract,
#: *generations*). Hand-off generations are fencing tokens, above it.
ORIGINAL_GENERATION = 0

#: How many of a key's first waiters may be standbys when its limit in force is smaller (and not
#: 0: a halted key sends none); the Redis scripts get it from here
#: (``backends/redis_layout.py``). One standby per slot is too few for a mutex (or a limit of 2 or
#: 3) whose jobs are short: a standby sent when one job ends must be picked up before the next one
#: ends, and Dramatiq's consumer, idle while everything is parked, polls with a back-off of 5 ms and
#: more, so the slot would stand idle. The first waiter of four was sent three hand-offs earlier.
MIN_STANDBY_WINDOW = 4


def standby_window(count: int, limit: int) -> int:
    """How many of a key's first waiters a send ahead of ``count`` covers, with ``limit`` in force.

    ``count`` but at most the limit, or :data:`MIN_STANDBY_WINDOW` if the limit is smaller (none
    for a halted key, limit 0).
    """
    return 0 if limit <= 0 else min(count, max(limit, MIN_STANDBY_WINDOW))


@dataclasses.dataclass(frozen=True)
class Stake:
    """What one holder claims of one guard key: what :meth:`GuardBackend.acquire` takes.

    Parameters:
      key(str): The guard key.
      holder(str): The would-be holder's id (a message id, or a lock's random id).
      limit(int|None): The key's default limit, used unless a run-time limit is set; None if
        the caller does not know it (the recorded one, see *limits known from the backend*).
      ttl_ms(int): The lease an acquire takes.
      info(str|None): A short description of the holder (its actor's name), kept while it
        holds the key, for :meth:`GuardBackend.inspect` (``KeyState.holder_info``).
      generation(int|None): The generation of the copy acquiring (see *generations*): a
        hand-off's, :data:`ORIGINAL_GENERATION` for a message picked up as sent, None for one
        not on a broker (enqueue time). A stale one is refused (``stale``) with nothing done.
      runner(str|None): Who runs the holder's job once it holds (a worker thread,
        :func:`~dramatiq_guard.lease.runner_id`), or None (an enqueue-time reservation, a
        lock). A holder held, or blocked for, by a runner is re-entered by that runner only:
        any other acquire of it is refused (``running``), with nothing done, so two copies of
        one message never hold a slot at once. At most 200 characters, without ``|`` or ``@``.
      fenced(bool): False for a lock that fences no writes (a dedup lock): no fencing token
        is issued (``token`` is None) nor kept for the key.
    """

    key: str
    holder: str
    limit: int | None
    ttl_ms: int
    info: str | None = None
    generation: int | None = None
    runner: str | None = None
    fenced: bool = True


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A waiter that was just given a slot.

    Parameters:
      waiter_id(str): The waiter's id (a message id); now a holder of the key
        with a reservation deadline.
      payload(bytes|None): The parked message to re-enqueue, or None for a
        blocking waiter (already woken by the backend).
      generation(int|None): The generation of this hand-off or standby send
        (see *generations*): the re-enqueued copy carries it, and its
        confirmation names it. None for a blocking waiter. Not compared.
    """

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
    #: A standby (sent ahead by :meth:`GuardBackend.send_standbys`) that acquired in park mode
    #: with ``Waiter.wait_ms > 0``: not parked, it waits as a blocking waiter, for
    #: :meth:`GuardBackend.wait_for_handoff`. Queued too.
    STANDBY = "standby"
    #: A stale copy of a handed-off message (see *generations*): nothing was done; it must not run.
    STALE = "stale"
    #: ``holder`` holds the key (or blocks for it) for another runner (see ``runner`` of
    #: :meth:`GuardBackend.acquire`): its message runs there, or ran there until its worker died
    #: and the lease has not lapsed yet. Nothing was done; this copy must not run now, nor is it
    #: queued.
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
      outcome(AcquireOutcome): What it did (one state; :attr:`acquired`,
        :attr:`parked`, :attr:`standby`, :attr:`stale` and :attr:`running` read it).
      token(int|None): The new fencing token when acquired, else None.
      holders(tuple[str, ...]): When refused, who is in the way, for the
        caller to name: the first :data:`HOLDERS_SHOWN` live holders (earliest
        deadline first). Empty when acquired: the reply never carries the whole
        set (a limit may be thousands; :meth:`GuardBackend.inspect` lists it).
      limit(int): The limit in force.
      handoffs(tuple[Handoff, ...]): Waiters given a slot by this operation;
        the caller must re-enqueue the ones with a payload.
      reserved_ms(int|None): Set only on a result made from a wake
        (:meth:`Woken.result`): the slot was taken by the push that handed it
        over, not by an acquire, so the holder's deadline is still the
        hand-off reservation, which lasts at least this long from the wake.
        The lease must be renewed within that (:class:`~dramatiq_guard.lease.Lease`
        renews it a third of the way into it when given ``reserved_ms``).
      valid_from(float|None): When the lease's ttl (or ``reserved_ms``)
        surely started counting, on this process's ``time.monotonic()``:
        just before the acquire request was sent (the backend counts from
        later), or when the wake was taken. Backends set it; None (unknown)
        makes a :class:`~dramatiq_guard.lease.Lease` count from when it is
        made. See :mod:`dramatiq_guard.renewer` (known-valid time).
      lapses_in_ms(int|None): With :attr:`running`: in how many ms the entry in
        the way (the other runner's lease, or its wait) lapses unless it is
        renewed (a live runner renews its lease); the copy may ask again then.
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
    """A blocking waiter woken by a hand-off: it holds the slot now (:meth:`GuardBackend.wait_for_handoff`).

    Parameters:
      token(int): The fencing token the hand-off issued to it.
      reserved_ms(int): How long its hand-off reservation lasts at least, from
        when the wake was taken: the time it has to take the lease up (renew it).
      taken_at(float): When the wake was taken (``time.monotonic()``; default:
        when this object is made, right after the wake came back).
    """

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
      released(bool): Whether the holder held the key (False: it was not a
        holder, e.g. its lease had lapsed and was reclaimed; the caller must
        report this, never swallow it).
      handoffs(tuple[Handoff, ...]): Waiters given a slot by this operation.
      standbys(tuple[Handoff, ...]): Parked waiters sent ahead as standbys by
        a release with ``send_ahead`` (see :meth:`GuardBackend.release`); the
        caller enqueues each and confirms it with
        :meth:`GuardBackend.confirm_standby`.
    """

    released: bool
    handoffs: tuple[Handoff, ...] = ()
    standbys: tuple[Handoff, ...] = ()


@dataclasses.dataclass(frozen=True)
class KeyState:
    """A read-only snapshot of a key, for inspection and tests.

    Parameters:
      holders(tuple[tuple[str, int], ...]): ``(holder, deadline_ms)`` pairs.
      waiters(tuple[tuple[str, int, bool], ...]): ``(waiter_id, since_ms,
        parked)`` in FIFO order; ``parked`` is False for blocking waiters.
      reserved(tuple[str, ...]): Holders that are reservations handed to a
        parked waiter whose re-enqueue is not yet confirmed.
      limit(int|None): The run-time limit, or None if none is set.
      token(int|None): The last fencing token issued, if the key has state.
      holder_info(tuple[tuple[str, int, str|None], ...]): ``(holder, since_ms,
        info)`` of the holders that acquired (in the order of ``holders``):
        when the holder first acquired (a re-entrant acquire keeps it) and
        the ``info`` it passed. Reservations not yet acquired have none.
    """

    holders: tuple[tuple[str, int], ...]
    waiters: tuple[tuple[str, int, bool], ...]
    reserved: tuple[str, ...]
    limit: int | None
    token: int | None
    holder_info: tuple[tuple[str, int, str | None], ...] = ()


@dataclasses.dataclass(frozen=True)
class Waiter:
    """How a refused acquirer asks to wait.

    Parameters:
      payload(bytes|None): The encoded message to park; None for a blocking
        waiter (a thread that will call ``wait_for_handoff``).
      wait_ms(int): For a blocking waiter: how long its entry lives before
        it is dropped by reclaim. For a parked waiter: if its entry is a
        standby (see :meth:`GuardBackend.send_standbys`), it blocks instead of
        parking, for this long; 0 always parks.
    """

    payload: bytes | None = None
    wait_ms: int = 0


@dataclasses.dataclass(frozen=True)
class WaiterPeek:
    """One of the first waiters of a key, as :meth:`GuardBackend.summaries` shows it.

    Parameters:
      waiter_id(str): The waiter's id (a message id).
      since_ms(int): When it queued (its place in the FIFO), on the backend's clock.
      payload(bytes|None): The parked message, or None for a blocking
        waiter, a confirmed standby, or a waiter handed a slot between the
        two reads of a Redis summary.
      info(str|None): What a ready waiter's thread said of it (its actor's
        name), if anything.
    """

    waiter_id: str
    since_ms: int
    payload: bytes | None
    info: str | None = None


@dataclasses.dataclass(frozen=True)
class KeySummary:
    """A few numbers about a key, cheap to read for many keys (:meth:`GuardBackend.summaries`).

    Parameters:
      key(str): The guard key.
      holders(int): How many holders it has (lapsed ones not yet reclaimed
        included, as :meth:`GuardBackend.inspect` shows them).
      waiters(int): How many waiters are queued.
      reserved(int): How many holders are unconfirmed hand-offs.
      oldest_since_ms(int|None): When the oldest waiter queued, or None.
      limit(int|None): The run-time limit, or None.
      recorded_limit(int|None): The default limit recorded with the key's
        waiters by a process that knows it (see *limits known from the
        backend*), or None.
      first(tuple[WaiterPeek, ...]): The first waiters in FIFO order, as
        many as asked for.
    """

    key: str
    holders: int
    waiters: int
    reserved: int
    oldest_since_ms: int | None
    limit: int | None
    recorded_limit: int | None
    first: tuple[WaiterPeek, ...] = ()

    @property
    def limit_in_force(self) -> int | None:
        """The run-time limit, else the recorded one, else None (unknown here)."""
        return self.limit if self.limit is not None else self.recorded_limit
