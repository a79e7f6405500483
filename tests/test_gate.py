"""The enqueue gate: guards decide in priority order; diverted sends return normally; failed pushes undo;
the caller of ``admit`` learns the outcome."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq import Broker, Message
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard.errors import GuardError
from dramatiq_guard.gate import Diverted, Outcome, PushTicket, gate_for


class Ticket:
    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    def pushed(self) -> None:
        self.log.append(f"{self.name}:pushed")

    def parked(self) -> None:
        self.log.append(f"{self.name}:parked")

    def failed(self) -> None:
        self.log.append(f"{self.name}:failed")


class RecordingGuard:
    """A guard that records its calls and does what it is told."""

    def __init__(
        self,
        log: list[str],
        name: str,
        priority: int,
        action: str = "ticket",
        *,
        actors: set[str] | None = None,
    ) -> None:
        self.log = log
        self.name = name
        self.gate_priority = priority
        self.action = action
        self.actors = actors  # None: every actor

    def guards_actor(self, actor_name: str) -> bool:
        return self.actors is None or actor_name in self.actors

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> PushTicket | None:
        self.log.append(f"{self.name}:before")
        if holds is not None and holds.startswith(self.name + ":"):
            return None  # the message holds this guard's key already
        if self.action == "drop":
            raise Diverted(message.copy(options={"dropped_by": self.name}), Outcome.DROPPED)
        if self.action == "park":
            raise Diverted(message, Outcome.PARKED)
        if self.action == "refuse":
            raise GuardError("refused")
        return Ticket(self.log, self.name)


@pytest.fixture
def broker() -> StubBroker:
    broker = StubBroker()
    broker.emit_after("process_boot")
    return broker


def make_actor(broker: StubBroker) -> dramatiq.Actor[Any, Any]:
    @dramatiq.actor(broker=broker)
    def job(x: int) -> None:
        pass

    return job


def test_guards_run_in_priority_order_and_tickets_settle_after_the_push(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "late", 20))
    gate.add(RecordingGuard(log, "early", 10))
    job.send(1)
    assert log == ["early:before", "late:before", "late:pushed", "early:pushed"]
    assert broker.queues["default"].qsize() == 1


def test_the_gate_is_installed_once_per_broker(broker: StubBroker) -> None:
    assert gate_for(broker) is gate_for(broker)


def test_a_dropped_message_is_not_pushed_and_send_returns_what_the_guard_said(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "first", 10))
    gate.add(RecordingGuard(log, "dedup", 20, action="drop"))
    message = job.send(1)
    assert message.options["dropped_by"] == "dedup"
    assert broker.queues["default"].qsize() == 0
    assert log == ["first:before", "dedup:before", "first:failed"]


def test_a_parked_message_is_not_pushed_and_earlier_guards_are_told_it_parked(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "dedup", 10))
    gate.add(RecordingGuard(log, "slots", 20, action="park"))
    job.send(1)
    assert broker.queues["default"].qsize() == 0
    assert log == ["dedup:before", "slots:before", "dedup:parked"]


def test_a_refusal_reaches_the_caller_and_undoes_earlier_guards(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "dedup", 10))
    gate.add(RecordingGuard(log, "slots", 20, action="refuse"))
    with pytest.raises(GuardError, match="refused"):
        job.send(1)
    assert log == ["dedup:before", "slots:before", "dedup:failed"]


def test_a_failed_push_undoes_every_guard(broker: StubBroker) -> None:
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "dedup", 10))
    undeclared: Message[Any] = Message(queue_name="nowhere", actor_name="job", args=(), kwargs={}, options={})
    with pytest.raises(dramatiq.errors.QueueNotFound):
        broker.enqueue(undeclared)
    assert log == ["dedup:before", "dedup:failed"]


def test_admit_says_what_became_of_the_message_and_the_guard_of_a_held_key_lets_it_through(
    broker: StubBroker,
) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "dedup", 10))
    gate.add(RecordingGuard(log, "slots", 20, action="park"))
    message = job.message(1)
    parked = gate.admit(message)
    assert parked.outcome is Outcome.PARKED
    assert broker.queues["default"].qsize() == 0
    # A hand-off of a "slots:" key going back to the broker: that guard lets it through.
    pushed = gate.admit(message, holds="slots:k")
    assert pushed.outcome is Outcome.PUSHED
    assert pushed.message.message_id == message.message_id
    assert broker.queues["default"].qsize() == 1
    assert log == [
        "dedup:before",
        "slots:before",
        "dedup:parked",
        "dedup:before",
        "slots:before",
        "dedup:pushed",
    ]


def test_an_object_that_is_not_a_message_gets_the_brokers_own_error(broker: StubBroker) -> None:
    """An enqueue that no guard can take part in behaves exactly as without the gate."""
    make_actor(broker)
    plain = StubBroker()
    with pytest.raises(Exception) as without_gate:
        plain.enqueue("not a message")  # type: ignore[arg-type]
    log: list[str] = []
    gate_for(broker).add(RecordingGuard(log, "dedup", 10))
    with pytest.raises(type(without_gate.value)) as with_gate:
        broker.enqueue("not a message")  # type: ignore[arg-type]
    assert str(with_gate.value) == str(without_gate.value)
    assert log == []


def test_a_guard_is_not_asked_about_an_actor_it_does_not_guard(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "other", 10, action="drop", actors={"someone_else"}))
    gate.add(RecordingGuard(log, "mine", 20, actors={job.actor_name}))
    job.send(1)
    assert log == ["mine:before", "mine:pushed"]
    assert broker.queues[job.queue_name].qsize() == 1
