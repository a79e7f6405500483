"""Mutexes and concurrency slots: at most N messages per key execute at a time.

A mutex (the ``mutex`` actor option) is a one-slot limit; concurrency slots
(the ``concurrency`` option) are an N-slot limit. Both are built once, here,
on the guard backend's leases and lockwait area
(:mod:`dramatiq_guard.backends.base`).

Keys
  A message's guard key is ``"mutex:<key>"`` or ``"concurrency:<key>"``,
  where ``<key>`` is what the option's ``key`` gives (see
  :mod:`dramatiq_guard.keys`). A mutex and a concurrency limit never share
  a guard key.

Execution (``before_process_message``)
  The message acquires a lease with its ``message_id`` as the holder. A slot
  reserved for it (at enqueue, or handed to it when it was parked) becomes
  its lease. The lease is registered with the process's renewer
  (:mod:`dramatiq_guard.renewer`), exposed as
  ``dramatiq_guard.current_lease()`` while the actor runs, and released
  (checked: compare-and-delete on the holder) in ``after_process_message`` or
  ``after_skip_message``. A freed slot goes atomically to the oldest waiter;
  a parked waiter's message is re-enqueued on the broker, then the hand-off
  is confirmed. A lease found lost (it lapsed under a paused or partitioned
  worker and was reclaimed) is reported: the lease says so while the actor
  runs (:attr:`~dramatiq_guard.lease.Lease.lost`), and the release logs an
  error with the lease and the release result.

Parking
  A message over the limit (``concurrency``, and ``mutex`` with
  ``on_busy="park"``) leaves the broker and waits in the key's FIFO
  lockwait area, invisible to workers:

  * at enqueue, in the enqueue gate (:mod:`dramatiq_guard.gate`, priority
    20, after deduplication). A message that finds a free slot *reserves*
    it for ``pickup_ttl`` (so a burst of sends fills the limit exactly and
    the rest park without costing a broker pickup); one that finds the key
    full is parked and ``send()`` returns normally. Delayed messages are
    decided when they come due, not when sent;
  * after pickup, if the slot was taken meanwhile: the message is parked
    and skipped (``SkipMessage``).

  A parked message keeps its ``message_id`` and its options (so it consumes
  no retry), and fires no pipeline or group step (those fire only in
  ``after_process_message``, which a skip does not emit). A message parked
  after pickup gets ``store_results=False`` on the copy that is being acked
  (the parked copy was encoded before), so the Results middleware does not
  store ``None`` for it: ``get_result(block=True)`` waits for the real
  result. Prometheus still counts such a skip as processed; parking at
  enqueue avoids most of them. The execution state is marked ``parked``, so
  the deduplication middleware does not treat the skip as terminal.

  A handed-off message re-enqueued through the gate is not parked again (it
  holds a reservation): the re-enqueue bypasses this middleware's gate.

Standbys (``lookahead``, ``standby_wait``, ``standby_threads``)
  A parked message re-enqueued only when a slot frees would then wait for a
  worker to fetch it (the RedisBroker's consumer polls with a back-off while
  its queue is empty, and with everything parked it nearly always is), the
  slot idle meanwhile. So a worker that releases a slot of a key that has
  waiters also sends the next waiters to the broker *ahead*, as standbys
  (chosen by the release itself, in the same backend operation;
  :meth:`SlotsMiddleware.send_standbys` does it alone): the backend keeps the first
  ``lookahead`` waiters of the FIFO (default: the limit, i.e. at most one per
  slot; ``0``: none) on the broker, each enqueued (bypassing the gate) and
  then confirmed, keeping its place. A standby that is picked up blocks its
  worker thread as a waiter in that place (the TimeLimit timer paused), is
  woken by a push when a slot is handed to it, and runs at once; one handed a
  slot before it was picked up starts as soon as it is. Each message is still
  fetched once. Dramatiq does not fetch the standbys in order across processes
  (one can sit in the prefetch of a worker whose threads are all busy), so a
  free slot goes to a waiter that a thread is already blocked on before an
  older one that no thread holds yet, within the first ``limit`` waiters of
  the FIFO (the backend decides it; see
  :meth:`~dramatiq_guard.backends.GuardBackend.release`): FIFO is relaxed
  within that window only, and not at all for a mutex.

  A process lets at most ``standby_threads`` threads (default: half its
  worker threads) block as standbys, so that standbys never take all the
  threads from running work; a process that allows none sends none. A
  standby picked up beyond that, or not woken within ``standby_wait``
  (default 5 s), parks again in its place: skipped with ``parked`` set and
  ``store_results=False``, so no retry is consumed and no result stored, as
  for a message parked after pickup. A standby whose entry lapsed meanwhile
  (its worker died and the broker redelivered it late) is an ordinary message
  when picked up. Before its sender confirms it, a standby keeps its stored
  payload: if the sender dies, it becomes a parked waiter again after the
  backend's hand-off reservation time.

``on_busy`` (mutex only; concurrency always parks)
  ``"drop"``
    The message does not run; it is acked and logged at INFO, and counts as
    deduplicated (:attr:`Mutex.dropped`). Its result, if stored, is ``None``.
  ``"wait"``
    The worker thread blocks up to ``wait`` as a blocking waiter, woken by a
    push from the release that hands it the lock (no polling; a backstop
    re-check every few seconds reclaims a dead holder's lapsed lease). The
    push carries its fencing token, so it starts without another round trip
    (the renewer takes the hand-off reservation up to a lease at once). If
    the lock does not come within ``wait``, it gives up with
    :class:`MutexWaitTimeout`, a
    :class:`~dramatiq.middleware.MiddlewareError` that the Retries middleware
    retries. Waiting does **not** eat the actor's ``time_limit``: the
    TimeLimit middleware's timer is paused while the thread waits and
    re-armed with the full limit when the lock is acquired.
  ``"park"``
    As concurrency slots with a limit of one.

Limits at run time
  The default limit of a key is the option's (``1`` for a mutex), unless a
  per-actor default was set at run time (:meth:`Concurrency.set_actor_limit`:
  stored in the backend as the run-time limit of the pseudo-key
  ``"concurrency-default:<actor_name>"``, read by every process with a short
  cache, ``limit_cache``). A per-key run-time limit
  (:meth:`Concurrency.set_limit`) overrides both. ``0`` halts the key:
  everything parks. Raising a per-key limit hands the new slots to waiters
  at once; raising a per-actor default takes effect within ``limit_cache``
  plus ``sweep_interval``.

Waiters are never stranded
  Each worker process runs one sweep thread (started in
  ``after_worker_boot``) that every ``sweep_interval`` reclaims lapsed
  leases and reservations of the keys that have waiters, and hands their
  slots on. The sweep must know a key's default limit: it uses the actor of
  keys this process has seen, the actor named in a digested key, and else
  the smallest default of the actors with callable keys (a lower bound, so
  the limit is never exceeded; the first waiter that runs hands the
  remaining slots on with the right limit).

Crashes
  A SIGKILLed holder's lease lapses within ``lease_ttl``. A process killed
  between parking a message after pickup and acking it, or between
  re-enqueueing a handed-off message and confirming it, may leave two
  copies of the message (the broker redelivers the unacked one): the only
  places a message can run twice, and only where Dramatiq itself would
  redeliver. (A standby sent ahead whose sender stalls past the hand-off
  reservation time between enqueueing and confirming it is parked again while
  its copy is on the broker: picked up, that copy parks into the same entry.)
  No step loses a message: a payload stays stored in the backend until its
  re-enqueue is confirmed, and a lapsed reservation puts it back at its
  place in the queue.

Backend unavailable
  Fail closed: the backend's :class:`~dramatiq_guard.errors.BackendUnavailable`
  (a MiddlewareError) propagates from ``before_process_message`` and the
  Retries middleware retries the message; ``send()`` raises it at enqueue.
  With ``fail_open=True`` the message runs (or is pushed) unguarded, with a
  warning.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import Token
from typing import Any, ClassVar, Generic, Literal, TypeVar

import dramatiq
from dramatiq import Broker, Message, Worker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage, TimeLimit

from dramatiq_guard import events
from dramatiq_guard.backends.base import AcquireResult, GuardBackend, Handoff, ReleaseResult, Waiter
from dramatiq_guard.context import current_lease_var
from dramatiq_guard.errors import BackendUnavailable, GuardError
from dramatiq_guard.gate import Diverted, PushTicket
from dramatiq_guard.lease import Lease
from dramatiq_guard.middleware.base import ActorGuard, GuardMiddleware, execution_state
from dramatiq_guard.policies import ConcurrencyPolicy, MutexPolicy, duration_ms

__all__ = [
    "Concurrency",
    "Mutex",
    "MutexWaitTimeout",
    "SlotsMiddleware",
    "activity",
]

logger = logging.getLogger(__name__)

P = TypeVar("P", ConcurrencyPolicy, MutexPolicy)
Mode = Literal["drop", "wait", "park"]

#: The longest a blocking waiter sleeps before re-checking the key (reclaiming
#: a dead holder's lapsed lease). Hand-offs wake it by a push before that.
WAIT_BACKSTOP_MS = 2_000

#: Notified whenever this process released, parked, handed off or swept a
#: slot key (used by :func:`dramatiq_guard.testing.join`).
activity = threading.Condition()


def _notify() -> None:
    with activity:
        activity.notify_all()


class MutexWaitTimeout(GuardError):
    """A ``mutex`` with ``on_busy="wait"`` was still held when ``wait`` ran out.

    The Retries middleware retries the message (it is a MiddlewareError, so
    Dramatiq does not swallow it in ``before_process_message``).

    Parameters:
      key(str): The guard key.
      message_id(str): The message that waited.
      wait_ms(int): How long it waited.
      holders(tuple[str, ...]): Who held the key when it gave up.
    """

    def __init__(self, key: str, message_id: str, wait_ms: int, holders: tuple[str, ...] = ()) -> None:
        held_by = f" (held by {', '.join(holders)})" if holders else ""
        super().__init__(
            f"message {message_id} waited {wait_ms} ms for the mutex {key!r}{held_by}; giving up"
        )
        self.key = key
        self.message_id = message_id
        self.wait_ms = wait_ms
        self.holders = holders


# -- per-thread markers -------------------------------------------------------

_local = threading.local()


@contextmanager
def _bypassing(prefix: str, message_id: str) -> Iterator[None]:
    """While re-enqueueing a handed-off message: this guard's gate lets it through."""
    bypass: set[tuple[str, str]] = _local.__dict__.setdefault("bypass", set())
    item = (prefix, message_id)
    bypass.add(item)
    try:
        yield
    finally:
        bypass.discard(item)


def _bypassed(prefix: str, message_id: str) -> bool:
    bypass: set[tuple[str, str]] = _local.__dict__.get("bypass", set())
    return (prefix, message_id) in bypass


def _parked_now(message_id: str | None) -> None:
    """Record on this thread that a slot guard just parked ``message_id`` in the gate."""
    _local.last_parked = message_id


def _was_parked_now(message_id: str) -> bool:
    return getattr(_local, "last_parked", None) == message_id


@contextmanager
def _time_limit_paused(broker: Broker, message: MessageProxy) -> Iterator[Callable[[], None]]:
    """Pause this thread's TimeLimit timer while it waits for a slot: waiting does not eat the limit.

    Yields the call that re-arms it with the message's full time limit, once the slot is held.
    """
    time_limit = next((m for m in broker.middleware if isinstance(m, TimeLimit)), None)
    manager: Any = time_limit.manager if time_limit is not None else None
    thread_id = threading.get_ident()
    if manager is not None:
        manager.remove_timeout(thread_id)

    def rearm() -> None:
        if time_limit is not None:
            actor = broker.get_actor(message.actor_name)
            limit_ms = message.options.get("time_limit") or actor.options.get(
                "time_limit", time_limit.time_limit
            )
            manager.add_timeout(thread_id, limit_ms)

    yield rearm


# -- execution state ----------------------------------------------------------


@dataclasses.dataclass
class _Held:
    """A lease held by one execution of a message."""

    lease: Lease
    context: Token[Any] | None


@dataclasses.dataclass
class _NotRun:
    """This execution did not run: why."""

    reason: Literal["parked", "dropped"]
    key: str


class _ReservationTicket:
    """A slot reserved at enqueue: released if the push fails, or if a later guard parked the message."""

    def __init__(
        self, middleware: SlotsMiddleware[Any], broker: Broker, key: str, message_id: str, limit: int
    ):
        self.middleware = middleware
        self.broker = broker
        self.key = key
        self.message_id = message_id
        self.limit = limit

    def pushed(self) -> None:
        if _was_parked_now(self.message_id):
            # Accepted by parking in another slot guard: it must not keep our slot meanwhile.
            self.failed()

    def failed(self) -> None:
        result = self.middleware.backend(self.broker).release(self.key, self.message_id, limit=self.limit)
        self.middleware.requeue(self.broker, result.handoffs)


# -- the sweep ----------------------------------------------------------------


class _Sweeper:
    """One thread per process and backend: sweeps the slot keys that have waiters."""

    def __init__(self, backend: GuardBackend, interval_s: float) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self.members: dict[int, tuple[SlotsMiddleware[Any], Broker]] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dramatiq-guard-sweep", daemon=True)

    def _run(self) -> None:
        from dramatiq_guard.backends import redis_health

        while not self.stop_event.wait(self.interval_s):
            _sweep_all(self.backend, list(self.members.values()))
            redis_health.watch(self.backend)  # state the guard's Redis lost since the last pass


def _sweep_all(backend: GuardBackend, members: list[tuple[SlotsMiddleware[Any], Broker]]) -> None:
    """Sweep every key with waiters that belongs to one of ``members``."""
    try:
        keys = backend.waiting_keys()
    except Exception:
        logger.warning("The slot sweep could not list the waiting keys; retrying.", exc_info=True)
        return
    for middleware, broker in members:
        for key in keys:
            if key.startswith(middleware.prefix + ":"):
                try:
                    middleware.sweep(broker, key)
                except Exception:
                    logger.warning("The slot sweep of %r failed; retrying.", key, exc_info=True)


_sweepers: dict[int, _Sweeper] = {}
_sweepers_lock = threading.Lock()


# -- the shared middleware ----------------------------------------------------


class SlotsMiddleware(GuardMiddleware[P], Generic[P]):
    """What :class:`Mutex` and :class:`Concurrency` share: see the module docstring.

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
        broker ahead of a free slot, as standbys (see the module docstring):
        at most the key's limit. None (the default): the limit; 0: none.
      standby_wait: How long a picked-up standby blocks its worker thread
        waiting for a slot before it parks again. Default 5 s.
      standby_threads(int|None): How many worker threads of a process may
        block as standbys at once (a standby picked up beyond that parks
        again). None (the default): half the worker's threads. A process
        that allows none sends no standbys.
    """

    #: The guard key prefix (``"mutex"`` or ``"concurrency"``).
    prefix: ClassVar[str]

    def __init__(
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
        self.standby_threads = _count(standby_threads, "standby_threads")
        self._standby_cap = 0 if standby_threads is None else standby_threads
        self._standing = 0
        self._standing_lock = threading.Lock()
        self.broker: Broker | None = None
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._known: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._sweeper: _Sweeper | None = None

    # -- what the two capabilities differ in ----------------------------------

    @abc.abstractmethod
    def mode(self, policy: P) -> Mode:
        """What a message that finds the key full does."""

    @abc.abstractmethod
    def default_limit(self, guard: ActorGuard[P]) -> int:
        """The default limit of the actor's keys (a per-key run-time limit overrides it)."""

    def wait_ms(self, policy: P) -> int:
        """How long ``on_busy="wait"`` blocks."""
        return 0

    # -- keys -----------------------------------------------------------------

    def guard_key_of(self, guard: ActorGuard[P], message: Message[Any] | MessageProxy) -> str:
        """The guard key of ``message`` (with this capability's prefix).

        Raises:
          GuardError: If the key cannot be computed (a key callable failed,
            or the arguments do not fit the actor).
        """
        try:
            key = f"{self.prefix}:{guard.key_of(message)}"
        except Exception as e:
            raise GuardError(
                f"the {self.option} key of message {message.message_id} ({message.actor_name}) "
                f"could not be computed: {e}"
            ) from e
        with self._known_lock:
            self._known[key] = guard.actor_name
            self._known.move_to_end(key)
            if len(self._known) > 10_000:
                self._known.popitem(last=False)
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

    def _guard_of_key(self, key: str) -> ActorGuard[P] | None:
        """The guard of the actor a guard key belongs to, if this process can tell.

        It can for a key it has seen, and for a digested key (``<actor>:<sha256>``);
        not for a key given by a callable that it never computed.
        """
        with self._known_lock:
            actor_name = self._known.get(key)
        guard = self.guarded.get(actor_name) if actor_name is not None else None
        if guard is None:
            actor_name, _, digest = key[len(self.prefix) + 1 :].rpartition(":")
            candidate = self.guarded.get(actor_name)
            if candidate is not None and not callable(candidate.resolve_key.spec) and len(digest) == 64:
                guard = candidate
        return guard

    def _limit_for_key(self, key: str) -> int:
        """The default limit of a guard key this process may never have seen (for sweeps)."""
        guard = self._guard_of_key(key)
        if guard is not None:
            return self.default_limit(guard)
        callables = [g for g in list(self.guarded.values()) if callable(g.resolve_key.spec)]
        return min((self.default_limit(g) for g in callables), default=0)

    # -- wiring ---------------------------------------------------------------

    def attach(self, broker: Broker) -> None:
        """Remember ``broker`` and join its enqueue gate."""
        self.broker = broker
        super().attach(broker)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Start this process's sweep of keys with waiters."""
        self.broker = broker
        if self.standby_threads is None:
            self._standby_cap = int(getattr(worker, "worker_threads", 0)) // 2
        backend = self.backend(broker)
        with _sweepers_lock:
            sweeper = _sweepers.get(id(backend))
            if sweeper is None or not sweeper.thread.is_alive():
                sweeper = _sweepers[id(backend)] = _Sweeper(backend, self.sweep_interval_ms / 1000)
                sweeper.thread.start()
            sweeper.members[id(self)] = (self, broker)
            self._sweeper = sweeper

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the sweep when the last middleware using it shuts down."""
        with _sweepers_lock:
            sweeper, self._sweeper = self._sweeper, None
            if sweeper is None:
                return
            sweeper.members.pop(id(self), None)
            if not sweeper.members:
                sweeper.stop_event.set()
                if _sweepers.get(id(sweeper.backend)) is sweeper:
                    del _sweepers[id(sweeper.backend)]

    # -- enqueue --------------------------------------------------------------

    gate_priority = 20

    def before_push(self, broker: Broker, message: Message[Any], delay: int | None) -> PushTicket | None:
        """Reserve a slot for ``message``, or park it if its key is full (see the module docstring).

        Raises:
          Diverted: The message was parked (``accepted=True``): ``send()`` returns it.
          GuardError: The key could not be computed, or the backend is
            unavailable (unless ``fail_open``).
        """
        guard = self.guard_of(message)
        if guard is None or delay is not None or self.mode(guard.policy) != "park":
            return None
        if _bypassed(self.prefix, message.message_id):
            return None
        with self._inflight_lock:
            if message.message_id in self._inflight:
                return None  # its own re-enqueue (Retries) while it holds the slot
        backend = self.backend(broker)
        key = self.guard_key_of(guard, message)
        limit = self.default_limit(guard)
        try:
            result = backend.acquire(
                key,
                message.message_id,
                limit=limit,
                ttl_ms=self.pickup_ttl_ms,
                wait=Waiter(payload=message.encode()),
                info=message.actor_name,
            )
        except BackendUnavailable:
            if guard.policy.fail_open:
                logger.warning("Guard backend unavailable: enqueueing %s unguarded (fail_open).", message)
                return None
            raise
        self.requeue(broker, result.handoffs)
        if result.acquired:
            return _ReservationTicket(self, broker, key, message.message_id, limit)
        if result.parked:
            logger.debug("Parked %s at enqueue: %r is full (limit %d).", message, key, result.limit)
            events.parked(message.actor_name)
            _parked_now(message.message_id)
            _notify()
            raise Diverted(message, accepted=True)
        return None

    # -- execution ------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Acquire the message's slot; park, drop or wait when the key is full.

        Raises:
          SkipMessage: The message was parked or dropped.
          MutexWaitTimeout: ``on_busy="wait"`` gave up (Retries retries it).
          BackendUnavailable: The backend could not be reached (unless ``fail_open``).
          GuardError: The key could not be computed.
        """
        guard = self.guard_of(message)
        if guard is None or message.failed:
            return
        state = execution_state(message)
        backend = self.backend(broker)
        key = self.guard_key_of(guard, message)
        limit = self.default_limit(guard)
        mode = self.mode(guard.policy)
        holder = message.message_id
        wait = None
        if mode == "park":
            # A standby (sent ahead) may block for a slot instead of parking, if this process lets it.
            block_ms = _block_ms(self.standby_wait_ms) if self._standby_cap > 0 else 0
            wait = Waiter(payload=message.encode(), wait_ms=block_ms)
        elif mode == "wait":
            wait = Waiter(wait_ms=min(self.wait_ms(guard.policy), WAIT_BACKSTOP_MS) + WAIT_BACKSTOP_MS)
        try:
            result = backend.acquire(
                key, holder, limit=limit, ttl_ms=self._lease_ttl(guard), wait=wait, info=message.actor_name
            )
        except BackendUnavailable:
            if guard.policy.fail_open:
                logger.warning("Guard backend unavailable: running %s unguarded (fail_open).", message)
                return
            raise
        self.requeue(broker, result.handoffs)
        if result.standby:
            assert wait is not None and wait.payload is not None
            result = self._stand_by(broker, message, guard, key, limit, wait.payload)
        if not result.acquired and mode == "wait" and result.parked:
            with events.lock_wait(message.actor_name):
                result = self._wait(broker, message, guard, key, limit)
        if result.acquired:
            self._hold(message, state, guard, key, limit, result)
            return
        if mode == "drop":
            self._drop(message, state, key, result)
        elif mode == "park":
            state.parked = True
            state.data[self.option] = _NotRun("parked", key)
            # The parked copy was encoded above; this copy is only acked.
            message.options["store_results"] = False
            logger.info("Parked %s after pickup: %r is full (limit %d).", message, key, result.limit)
            events.parked(message.actor_name)
            _notify()
            raise SkipMessage(f"parked: {key!r} is full")
        raise MutexWaitTimeout(key, holder, self.wait_ms(guard.policy), result.holders)

    def _drop(self, message: MessageProxy, state: Any, key: str, result: AcquireResult) -> None:
        state.data[self.option] = _NotRun("dropped", key)
        self._count_drop()
        events.deduplicated(message.actor_name)
        logger.info(
            "Dropped %s (deduplicated): %r is held by %s.",
            message,
            key,
            ", ".join(result.holders) or "nobody",
        )
        raise SkipMessage(f"dropped: {key!r} is held")

    def _count_drop(self) -> None:
        """Overridden by :class:`Mutex` to count drops."""

    def _lease_ttl(self, guard: ActorGuard[P]) -> int:
        cap = guard.policy.ttl_ms
        return self.lease_ttl_ms if cap is None else max(1, min(self.lease_ttl_ms, cap))

    def _hold(
        self,
        message: MessageProxy,
        state: Any,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        result: AcquireResult,
    ) -> None:
        assert result.token is not None
        lease = Lease(
            self.backend_or_raise(),
            key,
            message.message_id,
            result.token,
            limit=limit,
            ttl_ms=self.lease_ttl_ms,
            cap_ms=guard.policy.ttl_ms,
            reserved_ms=result.reserved_ms,
        )
        state.data[self.option] = _Held(lease, current_lease_var.set(lease))
        events.acquired(message.actor_name)
        with self._inflight_lock:
            self._inflight.add(message.message_id)

    def backend_or_raise(self) -> GuardBackend:
        """The backend already resolved (it is, once a hook ran)."""
        assert self._backend is not None
        return self._backend

    def _stand_by(
        self,
        broker: Broker,
        message: MessageProxy,
        guard: ActorGuard[P],
        key: str,
        limit: int,
        payload: bytes,
    ) -> AcquireResult:
        """Block as a standby until a slot is handed to the message, up to ``standby_wait``.

        Woken by a push. The TimeLimit timer is paused meanwhile. Returns the
        acquired result, or a parked one: the standby parks again in its
        place when ``standby_wait`` passes, when its entry lapsed meanwhile
        (it parks at the back), or at once when this process already has
        ``standby_threads`` threads blocked as standbys.
        """
        backend = self.backend(broker)
        holder = message.message_id
        if not self._stand():
            result = backend.acquire(
                key, holder, limit=limit, ttl_ms=self._lease_ttl(guard), wait=Waiter(payload=payload)
            )
            self.requeue(broker, result.handoffs)
            return result
        deadline = time.monotonic() + self.standby_wait_ms / 1000
        try:
            with _time_limit_paused(broker, message) as rearm:
                while True:
                    woken, remaining_ms = _await_wake(backend, key, holder, deadline, limit)
                    if woken is not None:
                        result = woken  # the hand-off issued its token: it starts now
                    else:
                        # The backstop, or out of time (then wait_ms=0 parks it again).
                        block_ms = _block_ms(remaining_ms) if remaining_ms > 0 else 0
                        result = backend.acquire(
                            key,
                            holder,
                            limit=limit,
                            ttl_ms=self._lease_ttl(guard),
                            wait=Waiter(payload=payload, wait_ms=block_ms),
                            info=message.actor_name,
                        )
                        self.requeue(broker, result.handoffs)
                        if result.standby:
                            continue
                    if result.acquired:
                        rearm()
                    return result
        finally:
            self._sit()

    def _stand(self) -> bool:
        """Count this thread as a blocked standby, unless ``standby_threads`` already are."""
        with self._standing_lock:
            if self._standing >= self._standby_cap:
                return False
            self._standing += 1
            return True

    def _sit(self) -> None:
        with self._standing_lock:
            self._standing -= 1

    def _wait(
        self, broker: Broker, message: MessageProxy, guard: ActorGuard[P], key: str, limit: int
    ) -> AcquireResult:
        """Block as a waiter of ``key`` up to ``wait``; the TimeLimit timer is paused meanwhile."""
        backend = self.backend(broker)
        holder = message.message_id
        wait_ms = self.wait_ms(guard.policy)
        deadline = time.monotonic() + wait_ms / 1000
        done = False
        try:
            with _time_limit_paused(broker, message) as rearm:
                while True:
                    woken, remaining_ms = _await_wake(backend, key, holder, deadline, limit)
                    if woken is not None:
                        result = woken  # the hand-off issued its token: it starts now
                    else:
                        # The backstop: take the slot if it is ours (a wake that lapsed), else keep
                        # our place while there is time left.
                        waiter = (
                            Waiter(wait_ms=min(remaining_ms, WAIT_BACKSTOP_MS) + WAIT_BACKSTOP_MS)
                            if remaining_ms > 0
                            else None
                        )
                        result = backend.acquire(
                            key,
                            holder,
                            limit=limit,
                            ttl_ms=self._lease_ttl(guard),
                            wait=waiter,
                            info=message.actor_name,
                        )
                        self.requeue(broker, result.handoffs)
                    if result.acquired:
                        done = True
                        rearm()
                        return result
                    if remaining_ms <= 0:
                        return result
        finally:
            if not done:
                try:
                    cancelled = backend.cancel_wait(key, holder, limit=limit)
                    self.requeue(broker, cancelled.handoffs)
                except Exception:
                    logger.warning("Could not leave the waiters of %r; the entry lapses.", key, exc_info=True)

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

    def _finish(self, broker: Broker, message: MessageProxy) -> None:
        guard = self.guard_of(message)
        if guard is None:
            return
        held = execution_state(message).data.pop(self.option, None)
        if not isinstance(held, _Held):
            return
        with self._inflight_lock:
            self._inflight.discard(message.message_id)
        if held.context is not None:
            try:
                current_lease_var.reset(held.context)
            except ValueError:
                current_lease_var.set(None)
        # If the key has waiters, the release keeps the next ones on the broker ahead of the next
        # free slot, as standbys.
        send_ahead = self._lookahead() if self.mode(guard.policy) == "park" else 0
        result = self.release(broker, held.lease, send_ahead=send_ahead)
        events.released(message.actor_name)
        if result is not None and not result.released:
            events.lease_lost(message.actor_name)

    def release(self, broker: Broker, lease: Lease, *, send_ahead: int = 0) -> ReleaseResult | None:
        """Release ``lease``, re-enqueue the waiters it hands the slot to, and send its standbys.

        ``send_ahead``: how many waiters the same backend operation sends ahead
        as standbys (see :meth:`send_standbys`). A lease that was lost is
        reported (an error is logged with the lease and the release result),
        never silently dropped.

        Returns:
          ReleaseResult|None: The result, or None if the backend was
          unreachable (the lease then lapses within ``lease_ttl``).
        """
        try:
            result = lease.release(send_ahead=send_ahead)
        except BackendUnavailable:
            logger.error("Could not release %r: the backend is unavailable; it lapses on its own.", lease)
            return None
        if not result.released:
            logger.error(
                "%r was lost before it was released (it lapsed and was reclaimed while the actor ran): %r",
                lease,
                result,
            )
        self.requeue(broker, result.handoffs)
        self._send_standbys(broker, lease.key, lease.limit, result.standbys)
        _notify()
        return result

    # -- hand-offs ------------------------------------------------------------

    def requeue(self, broker: Broker, handoffs: Iterable[Handoff]) -> None:
        """Re-enqueue the parked messages handed a slot, then confirm each hand-off.

        Blocking waiters (no payload) were already woken by the backend. If a
        re-enqueue fails, the payload stays stored: the reservation lapses and
        the waiter goes back to its place in the queue. Every hand-off counts in
        :func:`~dramatiq_guard.events.handed_off` (a woken waiter's actor is the
        key's, when this process can tell it).
        """
        for handoff in handoffs:
            if handoff.payload is None:
                guard = self._guard_of_key(handoff.key)
                if guard is not None:
                    events.handed_off(guard.actor_name)
                continue
            try:
                self._requeue_one(broker, handoff)
            except Exception:
                logger.exception(
                    "Could not re-enqueue %s handed a slot of %r; its reservation lapses and it waits again.",
                    handoff.waiter_id,
                    handoff.key,
                )

    def _requeue_one(self, broker: Broker, handoff: Handoff) -> None:
        assert handoff.payload is not None
        backend = self.backend(broker)
        message = Message.decode(handoff.payload)
        events.handed_off(message.actor_name)
        _parked_now(None)
        with _bypassing(self.prefix, message.message_id):
            broker.enqueue(message)
        if _was_parked_now(message.message_id):
            # Another slot guard parked it on the way: give this slot back.
            guard = self.guard_of(message)
            limit = self.default_limit(guard) if guard is not None else self._limit_for_key(handoff.key)
            result = backend.release(handoff.key, handoff.waiter_id, limit=limit)
            self.requeue(broker, result.handoffs)
        elif not backend.confirm_handoff(handoff.key, handoff.waiter_id, ttl_ms=self.pickup_ttl_ms):
            logger.warning(
                "The hand-off of %r to %s lapsed before it was confirmed; the re-enqueued copy runs.",
                handoff.key,
                handoff.waiter_id,
            )
        _notify()

    def send_standbys(self, broker: Broker, key: str, limit: int) -> None:
        """Send the oldest parked waiters of ``key`` to the broker ahead, as standbys (up to ``lookahead``).

        Each is enqueued, then confirmed. Nothing is sent if this process
        lets no standby block (``standby_threads``). Failures are logged: an
        unsent standby parks again on its own.
        """
        count = self._lookahead()
        if count <= 0:
            return
        backend = self.backend(broker)
        try:
            handoffs, sent = backend.send_standbys(key, limit=limit, count=count)
        except Exception:
            logger.warning("Could not send the standbys of %r; they stay parked.", key, exc_info=True)
            return
        self.requeue(broker, handoffs)
        self._send_standbys(broker, key, limit, sent)

    def _lookahead(self) -> int:
        """How many waiters per key to keep on the broker as standbys (0 if this process lets none block)."""
        if self._standby_cap <= 0:
            return 0
        return self.lookahead if self.lookahead is not None else 1 << 30

    def _send_standbys(self, broker: Broker, key: str, limit: int, sent: Iterable[Handoff]) -> None:
        """Enqueue and confirm each standby selected by the backend; failures are logged."""
        for standby in sent:
            try:
                self._send_standby(broker, standby, limit)
            except Exception:
                logger.warning(
                    "Could not send %s ahead as a standby of %r; it parks again on its own.",
                    standby.waiter_id,
                    key,
                    exc_info=True,
                )

    def _send_standby(self, broker: Broker, standby: Handoff, limit: int) -> None:
        assert standby.payload is not None
        backend = self.backend(broker)
        message = Message.decode(standby.payload)
        _parked_now(None)
        with _bypassing(self.prefix, message.message_id):
            broker.enqueue(message)
        if _was_parked_now(message.message_id):
            # Another slot guard parked it on the way: it waits there, not here.
            result = backend.cancel_wait(standby.key, standby.waiter_id, limit=limit)
            self.requeue(broker, result.handoffs)
        elif not backend.confirm_standby(
            standby.key, standby.waiter_id, standby.payload, ttl_ms=self.pickup_ttl_ms
        ):
            logger.debug("Standby %s of %r parked again before it was confirmed.", message, standby.key)

    def sweep(self, broker: Broker, key: str) -> ReleaseResult:
        """Reclaim lapsed leases of ``key`` and hand free slots to its waiters."""
        result = self.backend(broker).sweep(key, limit=self._limit_for_key(key))
        self.requeue(broker, result.handoffs)
        if result.released or result.handoffs:
            _notify()
        return result

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
        result = self.backend(broker).set_limit(guard_key, limit, default=self._limit_for_key(guard_key))
        self.requeue(broker, result.handoffs)
        _notify()
        return result

    def get_limit(self, key: str, *, broker: Broker | None = None) -> int | None:
        """The run-time limit of a key (without the capability prefix), or None."""
        return self.backend(self._broker_or(broker)).get_limit(f"{self.prefix}:{key}")

    def _broker_or(self, broker: Broker | None) -> Broker:
        broker = broker or self.broker
        if broker is None:
            broker = dramatiq.get_broker()
        return broker


class Mutex(SlotsMiddleware[MutexPolicy]):
    """At most one message per key executes at a time (the ``mutex`` actor option).

    ``mutex=True``, or a dict / :class:`~dramatiq_guard.MutexPolicy` with
    ``key``, ``ttl``, ``on_busy`` (``"drop"``, ``"wait"`` or ``"park"``) and
    ``wait``. See :mod:`dramatiq_guard.middleware.slots` for the semantics
    and the parameters.

    Attributes:
      dropped(int): How many messages this process dropped because their
        mutex was held (``on_busy="drop"``): they count as deduplicated.
    """

    policy_class = MutexPolicy
    prefix = "mutex"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._dropped = itertools.count()
        self.dropped = 0

    def mode(self, policy: MutexPolicy) -> Mode:
        return policy.on_busy

    def default_limit(self, guard: ActorGuard[MutexPolicy]) -> int:
        return 1

    def wait_ms(self, policy: MutexPolicy) -> int:
        return policy.wait_ms

    def _count_drop(self) -> None:
        self.dropped = next(self._dropped) + 1

    def _limit_for_key(self, key: str) -> int:
        return 1


class Concurrency(SlotsMiddleware[ConcurrencyPolicy]):
    """At most N messages per key execute at a time; the rest park (the ``concurrency`` actor option).

    ``concurrency=10``, or a dict / :class:`~dramatiq_guard.ConcurrencyPolicy`
    with ``limit``, ``key`` and ``ttl``. See
    :mod:`dramatiq_guard.middleware.slots` for the semantics and the parameters.
    """

    policy_class = ConcurrencyPolicy
    prefix = "concurrency"
    #: The pseudo-key whose run-time limit is an actor's default limit.
    actor_limit_prefix = "concurrency-default"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._actor_limits: dict[str, tuple[float, int | None]] = {}

    def mode(self, policy: ConcurrencyPolicy) -> Mode:
        return "park"

    def default_limit(self, guard: ActorGuard[ConcurrencyPolicy]) -> int:
        """The actor's run-time default (cached ``limit_cache``), else its option's ``limit``."""
        now = time.monotonic()
        cached = self._actor_limits.get(guard.actor_name)
        if cached is None or cached[0] <= now:
            backend = self._backend or self.backend(self._broker_or(None))
            value = backend.get_limit(f"{self.actor_limit_prefix}:{guard.actor_name}")
            cached = (now + self.limit_cache_ms / 1000, value)
            self._actor_limits[guard.actor_name] = cached
        return guard.policy.limit if cached[1] is None else cached[1]

    def set_actor_limit(
        self, actor: dramatiq.Actor[Any, Any] | str, limit: int | None, *, broker: Broker | None = None
    ) -> None:
        """Set (or with None, clear) an actor's default limit at run time, for every process.

        Processes see it within ``limit_cache``; waiters of the actor's keys
        are released by the next sweeps. A per-key limit still overrides it.

        Raises:
          ValueError: If ``limit`` is negative.
        """
        name = actor if isinstance(actor, str) else actor.actor_name
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"a limit must be a non-negative int or None, got {limit!r}")
        broker = self._broker_or(broker)
        backend = self.backend(broker)
        backend.set_limit(f"{self.actor_limit_prefix}:{name}", limit, default=0)
        self._actor_limits.pop(name, None)
        _sweep_all(backend, [(self, broker)])

    def get_actor_limit(
        self, actor: dramatiq.Actor[Any, Any] | str, *, broker: Broker | None = None
    ) -> int | None:
        """An actor's run-time default limit, or None."""
        name = actor if isinstance(actor, str) else actor.actor_name
        return self.backend(self._broker_or(broker)).get_limit(f"{self.actor_limit_prefix}:{name}")


def _await_wake(
    backend: GuardBackend, key: str, holder: str, deadline: float, limit: int
) -> tuple[AcquireResult | None, int]:
    """Wait for a hand-off's push until the backstop or ``deadline`` (``time.monotonic()``).

    Returns:
      tuple: The acquired result if woken (the slot and its token came with
      the push), else None; and the milliseconds left until ``deadline``.
    """
    remaining_ms = int((deadline - time.monotonic()) * 1000)
    if remaining_ms <= 0:
        return None, remaining_ms
    woken = backend.wait_for_handoff(key, holder, timeout_ms=min(remaining_ms, WAIT_BACKSTOP_MS))
    remaining_ms = int((deadline - time.monotonic()) * 1000)
    return (None if woken is None else woken.result(limit)), remaining_ms


def _block_ms(wait_ms: int) -> int:
    """How long a blocking entry that re-checks every backstop lives: past the next re-check."""
    return min(wait_ms, WAIT_BACKSTOP_MS) + WAIT_BACKSTOP_MS


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
