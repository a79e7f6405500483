"""``concurrency=`` and ``throttle=`` given a list, or guards of several options on one actor: a
message starts only when every guard admits it.

A RedisBroker on a private Redis with in-process worker threads (the guard state in the same
Redis), and a StubBroker on the in-memory backend (as users' tests run it). The invariants
(docs/flow-control-design.md, "Composed guards"): no guard's limit is exceeded; a message waits
parked on exactly one guard, the first in the list that refused it, and holds nothing of the
others meanwhile (a slot they reserved, a place a throttle counted, a hand-off's reservation);
every message runs once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker
from harness import wait_until

import dramatiq_guard
from bench.actors.traffic import WORKER_THREADS, counted_client, traffic
from dramatiq_guard import Concurrency, GuardKeyError, GuardOptionError, Mutex, Throttle
from dramatiq_guard.backends import GuardBackend, Stake
from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.middleware.base import execution_state
from dramatiq_guard.middleware.dedup import deduplicated_by
from dramatiq_guard.middleware.slots.base import composed
from dramatiq_guard.testing import join

WAIT = 30.0


class Running:
    """How many runs of each key are executing now, and the most there ever were."""

    def __init__(self) -> None:
        self.now: collections.Counter[str] = collections.Counter()
        self.most: collections.Counter[str] = collections.Counter()
        self.ran: list[Any] = []
        self.lock = threading.Lock()

    def run(self, keys: list[str], what: Any) -> None:
        with self.lock:
            for key in keys:
                self.now[key] += 1
                self.most[key] = max(self.most[key], self.now[key])
        time.sleep(0.01)  # the job's work: long enough for runs to overlap
        with self.lock:
            for key in keys:
                self.now[key] -= 1
            self.ran.append(what)


@pytest.fixture
def guarded(redis_broker: RedisBroker) -> RedisBroker:
    dramatiq_guard.install(redis_broker, sweep_interval=100)
    return redis_broker


@pytest.fixture
def worker(guarded: RedisBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(guarded, worker_threads=8, worker_timeout=50)
    yield worker
    worker.stop()


def per_tenant(running: Running, *, in_all: int) -> dramatiq.Actor[[str, int], None]:
    """An actor of the global broker with ``in_all`` runs at once in all and one per tenant."""

    @dramatiq.actor(
        concurrency=[{"limit": in_all, "key": lambda tenant, n: "all"}, {"limit": 1, "key": ["tenant"]}],
        max_retries=0,
    )
    def call(tenant: str, n: int) -> None:
        running.run(["all", tenant], (tenant, n))

    return call


def backend_of(broker: dramatiq.Broker) -> GuardBackend:
    return next(m for m in broker.middleware if isinstance(m, Concurrency)).backend(broker)


def holders(backend: GuardBackend, key: str) -> list[str]:
    return [holder for holder, _ in backend.inspect(key).holders]


def parked(backend: GuardBackend, key: str) -> list[str]:
    return [waiter for waiter, _, is_parked in backend.inspect(key).waiters if is_parked]


def test_a_tenant_limit_inside_a_global_one_holds_both_and_parks_on_the_refusing_guard(
    guarded: RedisBroker, worker: dramatiq.Worker, redisdb: redis.Redis
) -> None:
    """Three in all, one per tenant: a send parks on its tenant's key and gives its global slot back."""
    running = Running()
    call = per_tenant(running, in_all=3)

    tenant_key = f"concurrency:{call.actor_name}#1:"  # a later guard's digested keys carry its index
    sent = [(tenant, n, call.send(tenant, n)) for tenant in ("t0", "t1", "t2", "t3") for n in range(3)]
    backend = backend_of(guarded)
    ids = {(tenant, n): m.message_id for tenant, n, m in sent}
    # t0 and t1 took a global slot each and their next sends parked on their tenant's key (giving
    # the global slot they reserved back); t2's first send took the last one: the sends after it
    # parked on "all", the first guard that refused them.
    assert redisdb.llen(f"dramatiq:{call.queue_name}") == 3
    assert sorted(holders(backend, "concurrency:all")) == sorted(ids[t, 0] for t in ("t0", "t1", "t2"))
    on_all = [("t2", 1), ("t2", 2), ("t3", 0), ("t3", 1), ("t3", 2)]
    assert parked(backend, "concurrency:all") == [ids[sent] for sent in on_all]
    tenant_keys = [key for key in backend.waiting_keys() if key.startswith(tenant_key)]
    assert sorted(parked(backend, key) for key in tenant_keys) == sorted(
        [ids[tenant, 1], ids[tenant, 2]] for tenant in ("t0", "t1")
    )

    worker.start()
    wait_until(lambda: len(running.ran) == 12, timeout=WAIT)
    assert sorted(running.ran) == sorted((tenant, n) for tenant, n, _ in sent)
    assert running.most["all"] <= 3
    assert all(running.most[tenant] == 1 for tenant in ("t0", "t1", "t2", "t3"))
    join(guarded, call.queue_name)
    wait_until(lambda: not holders(backend, "concurrency:all"), timeout=WAIT)


def test_a_hand_off_parked_by_an_earlier_guard_gives_its_reservation_back_at_once(
    guarded: RedisBroker, worker: dramatiq.Worker
) -> None:
    """Invariant: a parked message holds nothing of another guard. The worst moment: the second
    guard hands the message a slot (reserved for its pickup), and at pickup the first guard is full."""
    ran: list[str] = []

    @dramatiq.actor(concurrency=[{"limit": 1, "key": lambda: "a"}, {"limit": 1, "key": lambda: "b"}])
    def pair() -> None:
        ran.append("pair")

    backend = backend_of(guarded)
    [concurrency] = [m for m in guarded.middleware if isinstance(m, Concurrency)]
    assert backend.acquire(Stake("concurrency:b", "other-b", limit=1, ttl_ms=60_000)).acquired
    message = pair.send()
    assert parked(backend, "concurrency:b") == [message.message_id]
    assert holders(backend, "concurrency:a") == []  # its reservation of "a" went back at once
    assert backend.acquire(Stake("concurrency:a", "other-a", limit=1, ttl_ms=60_000)).acquired
    # "b" frees: its hand-off reserves "b" for the message and pushes it to the broker.
    concurrency.deliver(guarded, backend.release("concurrency:b", "other-b", limit=1).handoffs)
    assert holders(backend, "concurrency:b") == [message.message_id]

    worker.start()
    wait_until(lambda: parked(backend, "concurrency:a") == [message.message_id], timeout=WAIT)
    # Parked on "a" after pickup: the slot of "b" is free now, not after pickup_ttl (a minute).
    wait_until(lambda: holders(backend, "concurrency:b") == [], timeout=WAIT)
    assert ran == []
    concurrency.deliver(guarded, backend.release("concurrency:a", "other-a", limit=1).handoffs)
    wait_until(lambda: ran == ["pair"], timeout=WAIT)


def test_a_throttle_hand_off_parked_by_the_concurrency_guard_gives_its_place_back_at_once(
    guarded: RedisBroker, worker: dramatiq.Worker
) -> None:
    """The same across options: a throttle hands a message a place, and at pickup the concurrency
    guard (which decides first) parks it: the place goes back to the window's next waiter."""
    ran: list[str] = []

    @dramatiq.actor(
        concurrency={"limit": 1, "key": lambda: "pool"},
        throttle={"limit": 1, "period": 60_000, "key": lambda: "partner"},
    )
    def paced() -> None:
        ran.append("paced")

    backend = backend_of(guarded)
    [throttle] = [m for m in guarded.middleware if isinstance(m, Throttle)]
    assert backend.acquire(Stake("throttle:partner", "earlier", limit=1, ttl_ms=60_000)).acquired
    message = paced.send()  # parks on the throttle at send
    holder = f"{message.message_id}:0"
    assert parked(backend, "throttle:partner") == [holder]
    throttle.deliver(guarded, backend.release("throttle:partner", "earlier", limit=1).handoffs)
    # Its way back to the broker reserved a place of each guard for its pickup; another message
    # takes the pool's before the pickup (its reservation lapsed, say).
    assert holders(backend, "throttle:partner") == [holder]
    assert backend.release("concurrency:pool", message.message_id, limit=1).released
    assert backend.acquire(Stake("concurrency:pool", "other", limit=1, ttl_ms=60_000)).acquired

    worker.start()
    wait_until(lambda: parked(backend, "concurrency:pool") == [message.message_id], timeout=WAIT)
    wait_until(lambda: holders(backend, "throttle:partner") == [], timeout=WAIT)
    assert ran == []


def test_a_throttle_place_taken_before_a_later_throttle_parks_the_message_leaves_the_window(
    guarded: RedisBroker, worker: dramatiq.Worker
) -> None:
    """A start counts only if the message starts: a place the first throttle gave a message that the
    second parks (after pickup: a delayed message is decided then) goes back to the window."""
    ran: list[int] = []

    @dramatiq.actor(
        throttle=[
            {"limit": 5, "period": 60_000, "key": lambda n: "all"},
            {"limit": 1, "period": 60_000, "key": lambda n: f"one-{n}"},
        ],
        max_retries=0,
    )
    def paced(n: int) -> None:
        ran.append(n)

    backend = backend_of(guarded)
    assert backend.acquire(Stake("throttle:one-0", "earlier", limit=1, ttl_ms=60_000)).acquired
    at_send = paced.send(0)  # parks on "one-0" at send: the place it reserved on "all" goes back
    assert holders(backend, "throttle:all") == []
    after_pickup = paced.send(1)  # reserves a place on both keys
    holder = f"{after_pickup.message_id}:0"  # a throttle's holder is an attempt: id and retries
    assert backend.release("throttle:one-1", holder, limit=1).released  # another takes its place
    assert backend.acquire(Stake("throttle:one-1", "earlier", limit=1, ttl_ms=60_000)).acquired
    worker.start()
    # At pickup, "all" counts its start, then "one-1" is full: it parks there, and "all" lets it go.
    wait_until(lambda: parked(backend, "throttle:one-1") == [holder], timeout=WAIT)
    wait_until(lambda: holders(backend, "throttle:all") == [], timeout=WAIT)
    assert parked(backend, "throttle:one-0") == [f"{at_send.message_id}:0"]
    assert ran == []


def test_guards_of_a_list_on_a_stub_broker_with_the_memory_backend(stub_broker: Any) -> None:
    """The same composition as users' StubBroker tests run it: every message runs once, both held."""
    dramatiq_guard.install(stub_broker, redis=MemoryBackend())
    running = Running()
    call = per_tenant(running, in_all=2)

    for n in range(4):
        for tenant in ("t0", "t1", "t2"):
            call.send(tenant, n)
    worker = dramatiq.Worker(stub_broker, worker_threads=4, worker_timeout=50)
    worker.start()
    try:
        wait_until(lambda: len(running.ran) == 12, timeout=WAIT)
    finally:
        worker.stop()
    assert running.most["all"] <= 2
    assert all(running.most[tenant] == 1 for tenant in ("t0", "t1", "t2"))


def test_an_actors_slots_middlewares_are_found_anew_when_it_is_declared_again_or_the_middleware_changes(
    stub_broker: Any,
) -> None:
    """What :func:`composed` keeps per actor follows a declaration of the actor by any slots middleware,
    and a change of the broker's middleware (one added, removed or moved)."""
    dramatiq_guard.install(stub_broker, redis=MemoryBackend())
    mutex = next(m for m in stub_broker.middleware if isinstance(m, Mutex))
    concurrency = next(m for m in stub_broker.middleware if isinstance(m, Concurrency))

    def declare(**options: Any) -> None:
        stub_broker.actors.pop("job", None)  # Dramatiq 2 refuses a name declared already
        dramatiq.actor(actor_name="job", **options)(lambda: None)

    declare(mutex=True)
    assert composed(stub_broker, "job", mutex) == [mutex]
    assert composed(stub_broker, "job", concurrency) == [concurrency]  # not one of them: alone
    declare(mutex=True, concurrency=2)
    assert composed(stub_broker, "job", mutex) == [mutex, concurrency]
    assert composed(stub_broker, "job", concurrency) == [mutex, concurrency]
    declare(concurrency=2)
    assert composed(stub_broker, "job", concurrency) == [concurrency]
    assert composed(stub_broker, "job", mutex) == [mutex]
    declare(mutex=True, concurrency=2)
    assert composed(stub_broker, "job", concurrency) == [mutex, concurrency]
    stub_broker.middleware.remove(mutex)
    assert composed(stub_broker, "job", concurrency) == [concurrency]
    stub_broker.middleware.append(mutex)  # after it now
    assert composed(stub_broker, "job", concurrency) == [concurrency, mutex]


def test_an_actor_declared_again_with_a_second_guard_sends_in_two_steps(
    guarded: RedisBroker,
) -> None:
    """Whether a guard is an actor's only enqueue-time guard (its decision and the push in one script)
    is asked anew when the actor is declared again."""
    dedup = next(m for m in guarded.middleware if isinstance(m, dramatiq_guard.Deduplication))
    backend = dedup.backend(guarded)

    def declare(**options: Any) -> None:
        guarded.actors.pop("job", None)  # Dramatiq 2 refuses a name declared already
        dramatiq.actor(actor_name="job", **options)(lambda: None)

    declare(dedup="until_executed")
    assert dedup.enqueues_alone(guarded, "job", backend)
    declare(dedup="until_executed", concurrency=2)
    assert not dedup.enqueues_alone(guarded, "job", backend)


def test_what_a_send_needs_is_made_anew_when_its_actor_is_declared_again(guarded: RedisBroker) -> None:
    """What the sends of an actor need is kept from its first send until the actor is declared again:
    a dedup actor that comes to have a concurrency guard takes its lock before the message parks (a
    duplicate of the parked message is dropped), and a concurrency actor that comes to have a list
    reserves a slot of each of its guards (it parks on the second)."""
    concurrency = next(m for m in guarded.middleware if isinstance(m, Concurrency))
    concurrency.set_limit("halted", 0)

    def declare(name: str, **options: Any) -> dramatiq.Actor[[int], None]:
        guarded.actors.pop(name, None)  # Dramatiq 2 refuses a name declared already

        def job(n: int) -> None: ...

        return dramatiq.actor(actor_name=name, **options)(job)

    job = declare("job", dedup="until_executed")
    assert deduplicated_by(job.send(1)) is None  # the first send: lock and push in one step
    job = declare("job", dedup="until_executed", concurrency={"limit": 1, "key": lambda n: "halted"})
    parked = job.send(2)
    assert deduplicated_by(job.send(2)) == parked.message_id

    limited = declare("limited", concurrency={"limit": 5, "key": lambda n: "open"})
    limited.send(3)  # the first send: a slot reserved with the push in one step
    limits = [{"limit": 5, "key": lambda n: "open"}, {"limit": 1, "key": lambda n: "halted"}]
    waiting = declare("limited", concurrency=limits).send(4)
    assert waiting.message_id in [w for w, *_ in backend_of(guarded).inspect("concurrency:halted").waiters]


def test_a_list_is_checked_at_declaration(guarded: RedisBroker) -> None:
    with pytest.raises(GuardOptionError, match=r"concurrency=\[\] is not valid: an empty list"):
        dramatiq.actor(concurrency=[])(lambda: None)
    with pytest.raises(GuardOptionError, match=r"throttle=\{'limit': 1\} is not valid.*or a non-empty list"):
        dramatiq.actor(throttle=[{"limit": 1, "period": 10}, {"limit": 1}])(lambda: None)
    with pytest.raises(GuardOptionError, match="mutex takes True"):
        dramatiq.actor(mutex=[True])(lambda: None)


def test_two_guards_of_a_list_with_one_key_are_refused_at_send(guarded: RedisBroker) -> None:
    @dramatiq.actor(concurrency=[{"limit": 1, "key": lambda: "same"}, {"limit": 2, "key": lambda: "same"}])
    def twice() -> None: ...

    with pytest.raises(GuardKeyError, match="two guards of its list give one key"):
        twice.send()


def test_the_slots_of_every_option_of_an_actor_are_taken_in_one_round_trip(
    redis_broker: RedisBroker, redis_url: str
) -> None:
    """A mutex, a concurrency limit and a throttle on one actor (issue #33): its send reserves the
    three slots in one request to the guard's Redis (the broker's push is the broker's own), and
    its pickup takes them in one."""
    dramatiq_guard.install(redis_broker, redis=counted_client(redis_url), limit_cache=600_000)

    @dramatiq.actor(
        mutex={"key": ["n"], "on_busy": "park"},
        concurrency=10,
        throttle={"limit": 10, "period": 60_000},
        max_retries=0,
    )
    def call(n: int) -> None:
        """Not run: the test takes its slots as a worker's pickup does."""

    def requests() -> int:
        return traffic.snapshot().get(f"requests {WORKER_THREADS}", 0)

    call.send(0)  # the backend's first use: its health check and functions
    before = requests()
    message = call.send(1)
    assert requests() - before == 1
    proxy = MessageProxy(message)
    before = requests()
    redis_broker.emit_before("process_message", proxy)
    assert requests() - before == 1
    assert sorted(execution_state(proxy).data) == ["concurrency", "mutex", "throttle"]
    data, backend = execution_state(proxy).data, backend_of(redis_broker)
    assert holders(backend, data["mutex"].lease.key) == [message.message_id]
    assert holders(backend, data["concurrency"].lease.key) == [message.message_id]
    assert holders(backend, data["throttle"].key) == [f"{message.message_id}:0"]  # a start counts its retry
    redis_broker.emit_after("process_message", proxy, result=None)
