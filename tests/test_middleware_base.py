"""The middleware base: options are parsed when the actor is declared, and bad ones fail the declaration."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_guard.middleware.base import GuardMiddleware
from dramatiq_guard.policies import ConcurrencyPolicy


class LimitOnly(GuardMiddleware[ConcurrencyPolicy]):
    """The base with nothing added: it owns the ``concurrency`` option."""

    policy_class = ConcurrencyPolicy


@pytest.fixture
def setup() -> tuple[StubBroker, LimitOnly]:
    broker = StubBroker()
    middleware = LimitOnly()
    broker.add_middleware(middleware)
    return broker, middleware


def test_an_option_is_parsed_at_declaration(setup: tuple[StubBroker, LimitOnly]) -> None:
    broker, middleware = setup

    @dramatiq.actor(broker=broker, concurrency={"limit": 3, "key": ["customer_id"]})
    def deliver(customer_id: int, payload: str) -> None:
        pass

    guard = middleware.guard_lists["deliver"][0]
    assert guard.policy == ConcurrencyPolicy(limit=3, key=("customer_id",))
    assert guard.key_of(deliver.message(7, "a")) == guard.key_of(deliver.message_with_options(args=(7, "b")))


def test_an_async_actor_resolves_names_through_its_own_signature(setup: tuple[StubBroker, LimitOnly]) -> None:
    broker, middleware = setup

    @dramatiq.actor(broker=broker, concurrency={"limit": 1, "key": ["customer_id"]})
    async def deliver_async(customer_id: int, payload: str) -> None:
        pass

    guard = middleware.guard_lists["deliver_async"][0]
    assert guard.key_of(deliver_async.message(7, "a")) == guard.key_of(
        deliver_async.message_with_options(kwargs={"customer_id": 7, "payload": "b"})
    )


def test_an_actor_without_the_option_is_not_guarded(setup: tuple[StubBroker, LimitOnly]) -> None:
    broker, middleware = setup

    @dramatiq.actor(broker=broker)
    def plain() -> None:
        pass

    assert "plain" not in middleware.guard_lists


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("ten", "not one of the allowed forms"),
        ({"limit": 2, "key": ["nobody"]}, "'nobody' that deliver() does not take"),
    ],
)
def test_a_bad_value_fails_the_declaration_with_a_value_error(
    setup: tuple[StubBroker, LimitOnly], value: Any, fragment: str
) -> None:
    broker, middleware = setup
    with pytest.raises(ValueError, match="actor 'deliver'") as raised:

        @dramatiq.actor(broker=broker, concurrency=value)
        def deliver(customer_id: int) -> None:
            pass

    assert fragment in str(raised.value)
    assert "concurrency takes an int limit" in str(raised.value)
    assert "deliver" not in broker.actors
    assert "deliver" not in middleware.guard_lists
