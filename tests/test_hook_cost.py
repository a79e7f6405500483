"""What the guard's worker hooks cost a message (issue #32): counted calls, not timings.

Every hook of every guard middleware hears every message a worker processes. A message of an
actor that opts into nothing must cost each of them nothing beyond being called (DESIGN.md §4:
"nothing at all for actors that opt into nothing").
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

import dramatiq_guard

PACKAGE = str(Path(dramatiq_guard.__file__).resolve().parent)

#: The worker hooks Dramatiq calls for a message that runs, and is acked.
HOOKS = {"before_process_message", "after_process_message", "before_ack", "after_ack"}


class Calls:
    """The guard's functions entered, and the builtins they called, while :meth:`watching`."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.builtins: list[Any] = []

    def _event(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if event == "call":
            self.entered.append(frame.f_code.co_name)
        elif event == "c_call":
            self.builtins.append(arg)

    def watching(self, run: Callable[[], None]) -> None:
        sys.setprofile(self._event)
        try:
            run()
        finally:
            sys.setprofile(None)


@pytest.fixture
def broker(stub_broker: StubBroker) -> Iterator[StubBroker]:
    dramatiq_guard.install(stub_broker)
    yield stub_broker


def process(broker: StubBroker, message: MessageProxy) -> None:
    """The hooks a worker runs for a message that runs and is acked (as dramatiq.worker does)."""
    broker.emit_before("process_message", message)
    broker.emit_after("process_message", message, result=None)
    broker.emit_before("ack", message)
    broker.emit_after("ack", message)


def test_a_message_that_opts_into_nothing_costs_the_guard_hooks_no_call(broker: StubBroker) -> None:
    @dramatiq.actor(broker=broker)
    def plain(n: int) -> None: ...

    @dramatiq.actor(broker=broker, mutex=True, dedup="until_executed", concurrency=2)
    def guarded(n: int) -> None: ...  # the guard's middlewares have an actor each: they are in use

    message = MessageProxy(plain.message(1))
    process(broker, MessageProxy(plain.message(0)))  # anything made on first use is made
    calls = Calls()
    calls.watching(lambda: process(broker, message))

    assert calls.entered, "no guard hook ran"
    assert set(calls.entered) <= HOOKS, f"the guard's hooks called {sorted(set(calls.entered) - HOOKS)}"
    # But for the ledger's context variable (a message of its own running, read as it ends), no builtin.
    others = [c for c in calls.builtins if not isinstance(getattr(c, "__self__", None), ContextVar)]
    assert others == [], f"the guard's hooks called builtins {[c.__qualname__ for c in others]}"
