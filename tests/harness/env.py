"""Environment variables shared by the test process and the worker subprocesses.

The ``dramatiq_worker`` fixture sets these in the worker's environment, and the
``actor_module`` fixture sets them in the test process while a module is
imported, so one actor module works on both sides::

    import dramatiq
    from harness import Recorder, broker_from_env

    broker = broker_from_env()          # RedisBroker / RabbitmqBroker / StubBroker by URL
    dramatiq.set_broker(broker)
    rec = Recorder.from_env()           # the test's private Redis

    @dramatiq.actor(max_retries=0)
    def hello(n):
        rec.record(actor="hello", n=n)
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import dramatiq
import redis

#: The URL of the test's private Redis (the harness's own keys: recorder, gates).
REDIS_URL_ENV = "DRAMATIQ_GUARD_TEST_REDIS_URL"
#: The broker URL an actor module should connect to (``redis://``, ``amqp://`` or ``stub://``).
BROKER_URL_ENV = "DRAMATIQ_GUARD_TEST_BROKER_URL"
#: The product's own variable: where a guard backend finds Redis when the broker is not a RedisBroker.
GUARD_REDIS_URL_ENV = "DRAMATIQ_GUARD_REDIS_URL"

#: Overrides for the external services (defaults in :mod:`harness.services`).
POSTGRES_URL_ENV = "DRAMATIQ_GUARD_TEST_POSTGRES_URL"
MARIADB_URL_ENV = "DRAMATIQ_GUARD_TEST_MARIADB_URL"
RABBITMQ_URL_ENV = "DRAMATIQ_GUARD_TEST_RABBITMQ_URL"


def in_ci() -> bool:
    """True when ``CI`` is set to a true value: unreachable services fail tests instead of skipping."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def unavailable(message: str) -> NoReturn:
    """Skip the test for want of what ``message`` names; with CI=true, fail it instead."""
    import pytest

    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: this module is meant to be imported through the harness "
            "(the dramatiq_worker / actor_module fixtures set it)."
        )
    return value


def redis_url_from_env() -> str:
    """The harness Redis URL (``DRAMATIQ_GUARD_TEST_REDIS_URL``)."""
    return _required(REDIS_URL_ENV)


def broker_url_from_env() -> str:
    """The broker URL (``DRAMATIQ_GUARD_TEST_BROKER_URL``, else the harness Redis)."""
    return os.environ.get(BROKER_URL_ENV) or redis_url_from_env()


def redis_client_from_env(*, decode_responses: bool = False) -> redis.Redis:
    """A client for the harness Redis."""
    return redis.Redis.from_url(redis_url_from_env(), decode_responses=decode_responses)


def broker_from_env(url: str | None = None, **kwargs: Any) -> dramatiq.Broker:
    """Build the broker an actor module should use, chosen by the URL's scheme.

    ``redis://`` / ``rediss://`` / ``unix://`` give a RedisBroker, ``amqp://`` /
    ``amqps://`` a RabbitmqBroker, ``stub://`` a StubBroker. ``kwargs`` go to the
    broker's constructor (e.g. ``middleware=[...]``, ``heartbeat_timeout=...``).
    The broker is not made global: call ``dramatiq.set_broker`` yourself.
    """
    url = url or broker_url_from_env()
    scheme = url.split("://", 1)[0].lower()
    if scheme in {"redis", "rediss", "unix"}:
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=url, **kwargs)
    if scheme in {"amqp", "amqps"}:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url, **kwargs)
    if scheme == "stub":
        from dramatiq.brokers.stub import StubBroker

        return StubBroker(**kwargs)
    raise ValueError(f"broker_from_env: unsupported broker URL scheme {scheme!r} in {url!r}")
