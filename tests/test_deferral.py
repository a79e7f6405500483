"""A hand-off's copy refused by a copy of its own message that a later guard parked at pickup, in
another process (issue #33): it is deferred briefly, not for a lease ttl (docs/slots.md, "Execution").

Two StubBrokers stand for two worker processes on one Redis; their hooks are driven by hand, each
process's pickups on a thread of its own (a runner of its own), so every step happens in a set order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dramatiq
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import dq_name
from dramatiq.middleware import SkipMessage

import dramatiq_guard
from dramatiq_guard import Concurrency
from dramatiq_guard.backends import RedisBackend, Stake
from dramatiq_guard.middleware.slots.execution import DEFERRAL_MARGIN_MS, DEFERRALS_OPTION

A, B = "mutex:a", "concurrency:b"


class Process(StubBroker):
    """A worker process's broker: records the delay of each message it enqueues."""

    def __init__(self, backend: RedisBackend) -> None:
        super().__init__()
        self.delays: list[int | None] = []
        self.thread = ThreadPoolExecutor(1)  # alive to the end: its runner id is its own
        dramatiq_guard.install(self, redis=backend)

        def job() -> None: ...

        self.job = dramatiq.actor(
            broker=self, mutex={"key": lambda: "a"}, concurrency={"limit": 1, "key": lambda: "b"}
        )(job)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        self.delays.append(delay)
        return super().enqueue(message, delay=delay)

    def take(self) -> MessageProxy:
        """The next message on the actor's queue."""
        return MessageProxy(Message.decode(self.queues[self.job.queue_name].get_nowait()))

    def come_due(self) -> None:
        """Enqueue the next delayed message, as a worker's consumer does when it is due."""
        delayed = Message.decode(self.queues[dq_name(self.job.queue_name)].get_nowait())
        due = delayed.copy(queue_name=self.job.queue_name)
        del due.options["eta"]
        self.enqueue(due)

    def pick_up(self, message: MessageProxy) -> BaseException | None:
        """Run ``before_process_message`` on this process's worker thread: what it raised, if anything."""
        return self.thread.submit(self.emit_before, "process_message", message).exception()


def holders(backend: RedisBackend, key: str) -> list[str]:
    return [holder for holder, _ in backend.inspect(key).holders]


def test_a_hand_off_refused_by_its_copy_parked_elsewhere_asks_again_soon_and_starts_once_it_let_go(
    redisdb: redis.Redis, restore_global_broker: None
) -> None:
    """P1's copy holds the mutex and parks on the full concurrency key; before P1 gives the mutex
    back, the key's holder leaves and hands its slot to the message, whose copy P2 picks up: the mutex
    refuses it as running. It is deferred 100 ms, then 200 ms (not a lease ttl, as a first delivery
    refused as running still is: checked last), and starts when it comes back after P1's copy let go."""
    backend = RedisBackend(redisdb)
    p1, p2 = Process(backend), Process(backend)
    try:
        run(backend, p1, p2)
    finally:
        p1.thread.shutdown()
        p2.thread.shutdown()


def run(backend: RedisBackend, p1: Process, p2: Process) -> None:
    assert backend.acquire(Stake(B, "x", 1, 60_000, runner="elsewhere")).acquired
    message = p1.job.message()
    first = MessageProxy(message)
    assert isinstance(p1.pick_up(first), SkipMessage)  # parked on B, still holding A
    assert holders(backend, A) == [message.message_id]

    concurrency = next(m for m in p2.middleware if isinstance(m, Concurrency))
    concurrency.deliver(p2, backend.release(B, "x", limit=1).handoffs)  # B goes to the message
    copy = p2.take()
    for delay in (100, 200):
        assert isinstance(p2.pick_up(copy), SkipMessage)  # A refuses it: P1's copy has not let go
        p2.emit_after("skip_message", copy)
        assert p2.delays[-1] == delay
        p2.come_due()
        copy = p2.take()

    p1.emit_after("skip_message", first)  # P1's parked copy gives A back
    assert copy.options[DEFERRALS_OPTION] == 2 and p2.pick_up(copy) is None  # it starts
    assert holders(backend, A) == holders(backend, B) == [message.message_id]
    assert DEFERRALS_OPTION not in copy.options
    p2.emit_after("process_message", copy, result=None, exception=None)
    assert holders(backend, A) == holders(backend, B) == []

    running = MessageProxy(p1.job.message())  # a first delivery refused as running: a lease ttl
    assert p1.pick_up(running) is None
    assert isinstance(p2.pick_up(MessageProxy(running._message.copy())), SkipMessage)
    assert p2.delays[-1] is not None and p2.delays[-1] > 10 * DEFERRAL_MARGIN_MS
