"""A pytest helper: assert that an actor's effects happen once when it runs twice (docs/testing.md)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import dramatiq
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy

__all__ = ["assert_idempotent"]


class _Outcomes(dramatiq.Middleware):
    """Tells the helper how a message it enqueued ended: ``(kind, result or exception)``."""

    def __init__(self) -> None:
        self.waiting: dict[str, Future[tuple[str, Any]]] = {}

    def _done(self, message: MessageProxy, kind: str, value: Any) -> None:
        future = self.waiting.pop(message.message_id, None)
        if future is not None:
            future.set_result((kind, value))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._done(message, *(("raised", exception) if exception is not None else ("returned", result)))

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._done(message, "skipped", None)


_outcomes_lock = threading.Lock()


def _outcomes_of(broker: Broker) -> _Outcomes:
    with _outcomes_lock:
        found = next((m for m in broker.middleware if isinstance(m, _Outcomes)), None)
        if found is None:
            found = _Outcomes()
            broker.add_middleware(found)
        return found


def _run(broker: Broker, message: Message[Any], timeout: float, which: str) -> Any:
    future = _outcomes_of(broker).waiting[message.message_id] = Future()
    broker.enqueue(message)
    try:
        kind, value = future.result(timeout)
    except FutureTimeout:
        raise AssertionError(f"the {which} run of {message} did not finish within {timeout:g}s") from None
    if kind == "raised":
        raise AssertionError(f"the {which} run of {message} raised {value!r}") from value
    return value


@contextlib.contextmanager
def _running(broker: dramatiq.Broker, worker: dramatiq.Worker | None) -> Iterator[None]:
    """``worker`` as it is, or a worker of one thread started for the block and stopped after."""
    if worker is not None:
        yield
        return
    own = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    own.start()
    try:
        yield
    finally:
        own.stop()


def assert_idempotent(
    actor: dramatiq.Actor[Any, Any],
    *args: Any,
    effects: Callable[[], Any],
    options: Mapping[str, Any] | None = None,
    same_message: bool | None = None,
    expect_change: bool = True,
    worker: dramatiq.Worker | None = None,
    timeout: float = 30.0,
    **kwargs: Any,
) -> Any:
    """Run ``actor`` twice with the same arguments and assert its effects happened once.

    Parameters:
      actor: The actor (declared on the broker it will run on).
      *args: Its positional arguments.
      effects: Returns a comparable snapshot of the actor's effects (rows,
        balances, sent emails...). Called before, after the first and after
        the second run.
      options: Message options (e.g. ``{"idempotency_key": "order-1"}``).
      same_message: Enqueue the same message twice (a redelivery) rather than
        two messages with the same arguments (a duplicate send). Default: a
        redelivery for ``idempotency_key=True`` or no key, unless ``options``
        carry an ``idempotency_key``; else a duplicate send.
      expect_change: Require the first run to change the effects.
      worker: A running worker on the actor's broker (no other may consume
        its queue meanwhile); default: one of one thread, for the call.
      timeout: Seconds to wait for each run.
      **kwargs: Its keyword arguments.

    Returns:
      The effects after the first run.

    Raises:
      AssertionError: A run raised or did not finish, the first run changed
        nothing, or the second run changed the effects again.
    """
    broker = actor.broker
    options = dict(options or {})
    if same_message is None:
        same_message = (
            actor.options.get("idempotency_key") in (None, True) and "idempotency_key" not in options
        )
    first = actor.message_with_options(args=args, kwargs=kwargs, **options)
    second = first if same_message else actor.message_with_options(args=args, kwargs=kwargs, **options)
    _outcomes_of(broker)
    with _running(broker, worker):
        before = effects()
        _run(broker, first, timeout, "first")
        once = effects()
        if expect_change:
            assert once != before, f"the first run of {actor.actor_name} changed nothing: {once!r}"
        _run(broker, second, timeout, "second")
        twice = effects()
    assert twice == once, (
        f"{actor.actor_name} is not idempotent: its effects changed again on the second run "
        f"({'the same message' if same_message else 'a new message with the same arguments'}):\n"
        f"  after one run:  {once!r}\n  after two runs: {twice!r}"
    )
    return once
