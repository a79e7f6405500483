"""The enqueue gate: guards decide in priority order; diverted sends return normally; failed pushes undo."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq import Broker, Message
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard.errors import GuardError
from dramatiq_guard.gate import Diverted, PushTicket, gate_for


class Ticket:
    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    def pushed(self) -> None:
        self.log.append(f"{self.name}:pushed")

    def failed(self) -> None:
        self.log.append(f"{self.name}:failed")


class RecordingGuard:
    """A guard that records its calls and does what it is told."""

    def __init__(self, log: list[str], name: str, priority: int, action: str = "ticket") -> None:
        self.log = log
        self.name = name
        self.gate_priority = priority
        self.action = action

    def before_push(self, broker: Broker, message: Message[Any], delay: int | None) -> PushTicket | None:
        self.log.append(f"{self.name}:before")
        if self.action == "drop":
            raise Diverted(message.copy(options={"dropped_by": self.name}), accepted=False)
        if self.action == "park":
            raise Diverted(message, accepted=True)
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


def test_a_parked_message_is_not_pushed_and_earlier_guards_count_it_as_enqueued(broker: StubBroker) -> None:
    job = make_actor(broker)
    log: list[str] = []
    gate = gate_for(broker)
    gate.add(RecordingGuard(log, "dedup", 10))
    gate.add(RecordingGuard(log, "slots", 20, action="park"))
    job.send(1)
    assert broker.queues["default"].qsize() == 0
    assert log == ["dedup:before", "slots:before", "dedup:pushed"]


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
