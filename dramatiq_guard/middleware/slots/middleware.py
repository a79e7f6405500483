"""The Dramatiq hooks of mutexes and concurrency slots (docs/slots.md).

Before a guarded message runs it acquires a lease with its ``message_id`` as
the holder (a slot reserved for it becomes its lease); if the key is full it
parks, is dropped, or waits, by ``on_busy``. After it runs the lease is
released (checked), and a freed slot goes to the oldest waiter, delivered by
:class:`dramatiq_guard.delivery.Courier`.
"""

from __future__ import annotations

import abc
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import dramatiq
from dramatiq import Broker, Message, Worker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, Handoff, ReleaseResult, Waiter
from dramatiq_guard.claim import Claim, entry_ms
from dramatiq_guard.delivery import Courier, acks_are_final, copy_generation, generation_of, keep_polling
from dramatiq_guard.errors import BackendUnavailable, MutexWaitTimeout
from dramatiq_guard.lease import Lease, runner_id
from dramatiq_guard.middleware.base import (
    ActorGuard,
    ExecutionState,
    GuardMiddleware,
    execution_state,
    fail_open,
)
from dramatiq_guard.middleware.slots.execution import (
    NotRun,
    defer_second_copy,
    hold,
    skip_dropped,
    skip_parked,
    skip_stale,
    take_held,
)
from dramatiq_guard.middleware.slots.limits import KeyDirectory
from dramatiq_guard.middleware.slots.releases import ContendedKeys, Releaser, starts_follow_ups
from dramatiq_guard.middleware.slots.reservation import ReservationTicket, reserve_or_park
from dramatiq_guard.middleware.slots.standbys import Standbys, wait_as_standby
from dramatiq_guard.middleware.slots.waits import wait_for_mutex
from dramatiq_guard.middleware.sweep import Sweeper, join_sweep, leave_sweep
from dramatiq_guard.policies import ConcurrencyPolicy, MutexPolicy, OnBusy, duration_ms

logger = logging.getLogger("dramatiq_guard.middleware.slots")

P = TypeVar("P", ConcurrencyPolicy, MutexPolicy)


#: Added to the time a copy refused as running waits (see ``_deferral_ms``): the entry in its way
#: has lapsed by the time it asks again, on a server clock a little ahead.
DEFERRAL_MARGIN_MS = 100


class SlotsMiddleware(GuardMiddleware[P], Generic[P]):
    """What :class:`~dramatiq_guard.Mutex` and :class:`~dramatiq_guard.Concurrency` share (docs/slots.md).

    Every duration is integer milliseconds or a :class:`datetime.timedelta`.

    Parameters:
      redis: The backend (see :class:`~dramatiq_guard.middleware.base.GuardMiddleware`).
      lease_ttl: How long a lease lives without renewal: a SIGKILLed holder's
        slot is free within this. Renewed every third of it. Default 30 s.
      pickup_ttl: How long a slot reserved for a queued message (at enqueue,
        or handed to a parked one) waits for it to start before it lapses
        and goes to the next waiter. Default 60 s.
      sweep_interval: How often each worker sweeps keys with waiters. Default 1 s.
      limit_cache: How long a process caches a per-actor default limit. Default 1 s.
      lookahead(int|None): How many parked waiters per key are sent to the
        broker ahead of a free slot, as standbys: at most the key's limit, or
        :data:`~dramatiq_guard.backends.base.MIN_STANDBY_WINDOW` (4) for a
        smaller limit (a mutex's), so that a short job's next waiter has been
        picked up by the time the slot frees. None (the default): 16
        (:data:`~dramatiq_guard.middleware.slots.standbys.DEFAULT_LOOKAHEAD`;
        every release of a key with waiters reads that many); 0: none.
      standby_wait: How long a picked-up standby blocks its worker thread
        waiting for a slot before it parks again. Default 5 s. After a job
        that held its slot long, a release sends only the standbys expected
        to get a slot within it (none after a mutex's job that held longer).
      standby_threads(int|None): How many worker threads of a process may
        block as standbys at once (a standby picked up beyond that parks
        again). None (the default): half the worker's threads. A process that
        allows none sends no standbys.
    """

    #: The guard key prefix (``"mutex"`` or ``"concurrency"``).
    prefix: ClassVar[str]
    #: Slots decide after deduplication (10) in the enqueue gate.
    gate_priority = 20

    def __init__(  # noqa: PLR0913
        self,
        *,
        redis: Any = None,
        lease_ttl: Any = 30_000,
        pickup_ttl: Any = 60_000,
        sweep_interval: Any = 1_000,
        limit_cache: Any = 1_000,
        lookahead: int | None = None,
        standby_wait: Any = 5_000,
        standby_threads: int | None = None,
    ) -> None:
        super().__init__(redis=redis)
        self.lease_ttl_ms = _positive(lease_ttl, "lease_ttl")
        self.pickup_ttl_ms = _positive(pickup_ttl, "pickup_ttl")
        self.sweep_interval_ms = _positive(sweep_interval, "sweep_interval")
        self.limit_cache_ms = _positive(limit_cache, "limit_cache", allow_zero=True)
        self.lookahead = _count(lookahead, "lookahead")
        self.standby_wait_ms = _positive(standby_wait, "standby_wait")
        self.standbys = Standbys(
            self.lookahead, 0 if standby_threads is None else standby_threads, self.standby_wait_ms
        )
        self.standby_threads = _count(standby_threads, "standby_threads")
        self.broker: Broker | None = None
        self.keys: KeyDirectory[P] = KeyDirectory(self.prefix, self.guarded)
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._couriers: dict[int, Courier] = {}
        self._sweeper: Sweeper | None = None
        self._releaser: Releaser | None = None
        self._worker: Worker | None = None  # this process's, once it boots (see keep_polling)
        self._contended = ContendedKeys()

    # -- what the two capabilities differ in ----------------------------------

    @abc.abstractmethod
    def on_busy(self, policy: P) -> OnBusy:
        """What a message that finds the key full does."""

    @abc.abstractmethod
    def default_limit(self, guard: ActorGuard[P]) -> int:
        """The default limit of the actor's keys (a per-key run-time limit overrides it)."""

    def wait_ms(self, policy: P) -> int:
        """How long ``on_busy="wait"`` blocks."""
        return 0

    def count_drop(self) -> None:
        """Count a message dropped because its key was held (:class:`~dramatiq_guard.Mutex`)."""

    # -- keys -----------------------------------------------------------------

    def claims(self, key: str) -> bool:
        """Whether ``key`` is a guard key of this capability."""
        return key.startswith(self.prefix + ":")

    def guard_key_of(self, guard: ActorGuard[P], message: Message[Any] | MessageProxy) -> str:
        """The guard key of ``message`` (with this capability's prefix).

        Raises:
          GuardKeyError: If the key cannot be computed (a key callable failed,
            an argument cannot be digested, or the arguments do not fit the actor).
        """
        key = f"{self.prefix}:{guard.key_of(message)}"
        if callable(guard.resolve_key.spec):  # a digested key names its actor (KeyDirectory.guard_of)
            self.keys.remember(key, guard.actor_name)
        return key

    def key_for(self, actor: dramatiq.Actor[Any, Any] | str, *args: Any, **kwargs: Any) -> str:
        """The key (without prefix) a message of ``actor`` with these arguments would use.

        Raises:
          ValueError: If ``actor`` is not guarded by this middleware.
        """
        name = actor if isinstance(actor, str) else actor.actor_name
        guard = self.guarded.get(name)
        if guard is None:
            raise ValueError(f"actor {name!r} has no {self.option}= option")
        return guard.resolve_key(args, kwargs)

    def limit_for_key(self, key: str) -> int | None:
        """The default limit of a guard key this process may never have seen (for sweeps).

        The limit of the key's actor if this process can tell it
        (:class:`~dramatiq_guard.middleware.slots.limits.KeyDirectory`), else
        None: the backend then uses the limit recorded by the process that
        parked the key's waiters (it never guesses one from this process's
        actors: the key may be another application's).
        """
        guard = self.keys.guard_of(key)
        return self.default_limit(guard) if guard is not None else None

    # -- wiring ---------------------------------------------------------------

    def attach(self, broker: Broker) -> None:
        """Remember ``broker`` and join its enqueue gate."""
        self.broker = broker
        super().attach(broker)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Start this process's sweep of keys with waiters, and (but on a StubBroker) its release thread."""
        self.broker = broker
        self._worker = worker
        if self.standby_threads is None:
            self.standbys.seats.seats = int(getattr(worker, "worker_threads", 0)) // 2
        if not isinstance(broker, StubBroker) and self._releaser is None:
            self._releaser = Releaser()
        self._sweeper = join_sweep(self, broker, self.sweep_interval_ms)

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the sweep when the last middleware using it shuts down."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            leave_sweep(self, sweeper)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Release what the release thread still holds (the worker threads have stopped)."""
        self.flush_releases()
        self._worker = None

    def flush_releases(self) -> None:
        """Release now every lease of a finished message still waiting for the release thread."""
        if self._releaser is not None:
            self._releaser.flush()

    # -- enqueue --------------------------------------------------------------

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> ReservationTicket | None:
        """Reserve a slot for ``message``, or park it if its key is full (see :mod:`.reservation`).

        A delayed message is decided when it comes due; one that holds a key
        of this capability (a hand-off going back), or that holds a slot here
        (its own re-enqueue by Retries), passes.
        """
        guard = self.guard_of(message)
        if guard is None or delay is not None or self.on_busy(guard.policy) != "park":
            return None
        if holds is not None and self.claims(holds):
            return None
        with self._inflight_lock:
            if message.message_id in self._inflight:
                return None
        key = self.guard_key_of(guard, message)
        claim = Claim(
            key, message.message_id, self.default_limit(guard), self.pickup_ttl_ms,
            info=message.actor_name, generation=generation_of(message, key), backend=self.backend(broker),
        )  # fmt: skip
        deliver = functools.partial(self.deliver, broker)
        return reserve_or_park(claim, message, deliver, fail_open_allowed=guard.policy.fail_open)

    # -- execution ------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Acquire the message's slot; park, drop or wait when the key is full.

        Raises:
          SkipMessage: The message was parked or dropped; or another copy of it
            holds its slot, and this copy is sent again after a lease's ttl
            (:func:`.execution.defer_second_copy`).
          MutexWaitTimeout: ``on_busy="wait"`` gave up (Retries retries it).
          BackendUnavailable: The backend could not be reached (unless ``fail_open``).
          GuardKeyError: The key could not be computed.
        """
        guard = self.guard_of(message)
        if guard is None or message.failed:
            return
        key = self.guard_key_of(guard, message)
        limit = self.default_limit(guard)
        on_busy = self.on_busy(guard.policy)
        result = self._acquire(broker, message, guard, key, limit, on_busy)
        if result is None:
            return  # the backend is unavailable and the policy fails open
        state = execution_state(message)
        if result.running:
            defer_second_copy(broker, message, state, self.option, key, self._deferral_ms(guard, result))
        if not result.acquired or result.reserved_ms is not None or result.handoffs:
            self._contended.mark(key)  # the key has waiters: its release stays on the worker thread
        if result.stale:
            skip_stale(message, state, self.option, key)
        if result.acquired:
            self._hold(message, state, guard, key, limit, result)
        elif on_busy == "drop":
            self.count_drop()
            skip_dropped(message, state, self.option, key, result.holders)
        elif on_busy == "park":
            skip_parked(message, state, self.option, key, result.limit)
        else:
            raise MutexWaitTimeout(key, message.message_id, self.wait_ms(guard.policy), result.holders)

    def _acquire(
        self,
        broker: Broker,
        message: MessageProxy,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        on_busy: OnBusy,
    ) -> AcquireResult | None:
        """Acquire the slot, blocking for it where the message may: a standby, or a mutex ``wait``.

        Returns None if the backend is unavailable and the policy says ``fail_open``.
        """
        claim = Claim(
            key, message.message_id, limit, self._lease_ttl(guard), backend=self.backend(broker),
            info=message.actor_name, generation=copy_generation(message, key),
            runner=runner_id(),  # a second copy of the message, delivered while this one holds, is refused
        )  # fmt: skip
        wait = None
        if on_busy == "park":
            # A standby (sent ahead) may block for a slot instead of parking, if this process lets it.
            block_ms = entry_ms(self.standby_wait_ms) if self.standbys.seats.seats else 0
            wait = Waiter(payload=message.encode(), wait_ms=block_ms)
        elif on_busy == "wait":
            wait = Waiter(wait_ms=entry_ms(self.wait_ms(guard.policy)))
        try:
            result = claim.acquire(wait)
        except BackendUnavailable as e:
            fail_open(guard.policy.fail_open, e, f"{message} runs unguarded")
            return None
        deliver = functools.partial(self.deliver, broker)
        deliver(result.handoffs)
        if result.standby:
            assert wait is not None and wait.payload is not None
            return wait_as_standby(
                broker, message, claim, wait.payload, self.standbys.seats, wait_ms=self.standby_wait_ms,
                deliver=deliver,
            )  # fmt: skip
        if not result.acquired and on_busy == "wait" and result.parked:
            with events.lock_wait(message.actor_name):
                return wait_for_mutex(
                    broker, message, claim, wait_ms=self.wait_ms(guard.policy), deliver=deliver
                )
        return result

    def _hold(
        self,
        message: MessageProxy,
        state: ExecutionState,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        result: AcquireResult,
    ) -> None:
        assert result.token is not None and self._backend is not None
        lease = Lease(
            self._backend,
            key,
            message.message_id,
            result.token,
            limit=limit,
            ttl_ms=self.lease_ttl_ms,
            cap_ms=guard.policy.ttl_ms,
            reserved_ms=result.reserved_ms,
            valid_from=result.valid_from,
        )
        hold(message, state, self.option, lease)
        with self._inflight_lock:
            self._inflight.add(message.message_id)

    def _deferral_ms(self, guard: ActorGuard[P], result: AcquireResult) -> int:
        """How long a copy refused as running waits before it asks again: until the entry in its
        way would lapse (a dead runner's), and at most a lease's ttl (a live runner renews it)."""
        ttl = self._lease_ttl(guard)
        if result.lapses_in_ms is None:
            return ttl
        return max(DEFERRAL_MARGIN_MS, min(ttl, result.lapses_in_ms + DEFERRAL_MARGIN_MS))

    def _lease_ttl(self, guard: ActorGuard[P]) -> int:
        cap = guard.policy.ttl_ms
        return self.lease_ttl_ms if cap is None else max(1, min(self.lease_ttl_ms, cap))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        """Release the message's lease (Retries has already decided about a failure)."""
        self._finish(broker, message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """Release the lease if a later middleware skipped the message after it acquired."""
        self._finish(broker, message)

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        """A copy that parked after pickup was acked: its generation record goes (contract, *generations*).

        Only on a broker whose ack cannot be undone (:func:`~dramatiq_guard.delivery.acks_are_final`):
        elsewhere, and if the backend cannot be reached, the record lapses after ``stale_ttl_ms``.
        """
        not_run = execution_state(message).data.get(self.option)
        if not (isinstance(not_run, NotRun) and not_run.reason == "parked" and acks_are_final(broker)):
            return
        try:
            self.backend(broker).forget_parked_copy(not_run.key, message.message_id)
        except BackendUnavailable:
            logger.debug("Could not forget the parked copy of %s; its record lapses on its own.", message)

    def _finish(self, broker: Broker, message: MessageProxy) -> None:
        guard = self.guard_of(message)
        if guard is None:
            return
        held = take_held(execution_state(message), self.option)
        if held is None:
            return
        with self._inflight_lock:
            self._inflight.discard(message.message_id)
        # If the key has waiters, the release keeps the next ones on the broker ahead of the next
        # free slot, as standbys: only those expected to get a slot within standby_wait after a
        # long job (see standbys.py).
        lease, actor = held.lease, message.actor_name
        send_ahead = 0
        if self.on_busy(guard.policy) == "park":
            held_ms = (time.time() - lease.acquired_at) * 1000
            send_ahead = self.standbys.count_after(held_ms, lease.limit)
        events.released(actor, lease.key)
        releaser = self._releaser
        if releaser is not None and lease.key not in self._contended and not starts_follow_ups(message):

            def then(result: ReleaseResult | None) -> None:
                self._report_release(broker, lease, result, actor)

            releaser.add((lease, send_ahead, then))
            return
        self.release(broker, lease, send_ahead=send_ahead, actor=actor)

    def release(
        self, broker: Broker, lease: Lease, *, send_ahead: int = 0, actor: str | None = None
    ) -> ReleaseResult | None:
        """Release ``lease``, deliver the waiters it hands the slot to, and send its standbys.

        ``send_ahead``: how many waiters the same backend operation sends ahead
        as standbys (see :meth:`GuardBackend.release
        <dramatiq_guard.backends.GuardBackend.release>`). A lease that was lost
        (:attr:`Lease.lost <dramatiq_guard.lease.Lease.lost>`: it lapsed and
        was reclaimed, or its known-valid time passed while the backend did
        not answer) is reported (an error is logged with the lease and the
        release result), never silently dropped, even when the release itself
        fails. On a backend that does not answer, the release lasts as long as
        the client's socket timeout lets it. ``actor``: the message's actor,
        whose lost leases are counted (:func:`~dramatiq_guard.events.lease_lost`).

        Returns:
          ReleaseResult|None: The result, or None if the backend was
          unreachable (the lease then lapses within ``lease_ttl``).
        """
        try:
            result: ReleaseResult | None = lease.release(send_ahead=send_ahead)
        except BackendUnavailable:
            result = None
        self._report_release(broker, lease, result, actor)
        return result

    def _report_release(
        self, broker: Broker, lease: Lease, result: ReleaseResult | None, actor: str | None = None
    ) -> None:
        """Report the release of ``lease`` and deliver what it handed on (see :meth:`release`).

        ``result`` is None if the backend was unreachable.
        """
        if actor is not None and lease.lost:
            events.lease_lost(actor)
        if result is None:
            logger.error("Could not release %r: the backend is unavailable; it lapses on its own.", lease)
            if lease.lost:
                logger.error(
                    "%r was lost while the actor ran (the backend did not answer before its lease's "
                    "known-valid time passed: another holder may have had the key).",
                    lease,
                )
            return
        if lease.lost:
            logger.error(
                "%r was lost before it was released (it lapsed, or the backend did not answer before "
                "its known-valid time passed, while the actor ran): %r",
                lease,
                result,
            )
        if not (result.handoffs or result.standbys):  # nothing parked moved: no one to tell
            self._contended.unmark(lease.key)
            return
        self._contended.mark(lease.key)
        self.deliver(broker, result.handoffs)
        self.courier(broker).send_ahead(result.standbys)
        events.lockwait_changed()

    # -- hand-offs ------------------------------------------------------------

    def courier(self, broker: Broker) -> Courier:
        """How this capability's hand-offs go back to ``broker``.

        Confirmed for ``pickup_ttl``; a slot handed to a message that another
        guard parks on its way is given back.
        """
        courier = self._couriers.get(id(broker))
        if courier is None:
            courier = self._couriers[id(broker)] = Courier(
                broker,
                self.backend(broker),
                ttl_ms=lambda _message: self.pickup_ttl_ms,
                default_limit=self.limit_for_key,
                keep_when_parked=False,
                counts_handoffs=True,
                after_push=lambda message: keep_polling(self._worker, message.queue_name),
            )
        return courier

    def deliver(self, broker: Broker, handoffs: Sequence[Handoff]) -> None:
        """Deliver the parked messages handed a slot (see :mod:`dramatiq_guard.delivery`).

        Every hand-off counts in :func:`~dramatiq_guard.events.handed_off` (a
        woken blocking waiter's actor is the key's, when this process can tell it).
        """
        if not handoffs:
            return
        for handoff in handoffs:
            if handoff.payload is None:
                guard = self.keys.guard_of(handoff.key)
                if guard is not None:
                    events.handed_off(guard.actor_name)
        self.courier(broker).deliver(handoffs)

    def sweep_limit(self, key: str) -> int | None:
        """The default limit the sweep hands ``key`` on with (None if no actor here declares it)."""
        return self.limit_for_key(key)

    def swept(self, broker: Broker, key: str, result: ReleaseResult) -> None:
        """Re-enqueue what the sweep of ``key`` handed on (see :mod:`dramatiq_guard.middleware.sweep`)."""
        self.deliver(broker, result.handoffs)
        if result.released or result.handoffs:
            events.lockwait_changed()

    # -- run-time limits ------------------------------------------------------

    def set_limit(self, key: str, limit: int | None, *, broker: Broker | None = None) -> ReleaseResult:
        """Set (or with None, clear) the run-time limit of a key; 0 halts it.

        Raising it hands the new slots to the key's waiters at once (their
        messages are re-enqueued). The limit stays in the backend until cleared.

        Parameters:
          key(str): The key as the option's ``key`` gives it, without the
            capability prefix (see :meth:`key_for`).
          limit(int|None): The new limit, or None to go back to the default.
          broker(Broker|None): The broker to re-enqueue on (default: the one
            this middleware is attached to).
        """
        broker = self._broker_or(broker)
        guard_key = f"{self.prefix}:{key}"
        result = self.backend(broker).set_limit(guard_key, limit, default=self.limit_for_key(guard_key))
        self.deliver(broker, result.handoffs)
        events.lockwait_changed()
        return result

    def get_limit(self, key: str, *, broker: Broker | None = None) -> int | None:
        """The run-time limit of a key (without the capability prefix), or None."""
        return self.backend(self._broker_or(broker)).get_limit(f"{self.prefix}:{key}")

    def _broker_or(self, broker: Broker | None) -> Broker:
        broker = broker or self.broker
        if broker is None:
            broker = dramatiq.get_broker()
        return broker


def _count(value: int | None, what: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{what} must be a non-negative int or None, not {value!r}")
    return value


def _positive(value: Any, what: str, *, allow_zero: bool = False) -> int:
    ms = duration_ms(value, what=what)
    assert ms is not None
    if ms == 0 and not allow_zero:
        raise ValueError(f"{what} must be positive, not {value!r}")
    return ms
