"""A pytest plugin to test guarded actors with the guard on.

Installed with dramatiq-guard (a ``pytest11`` entry point named
``dramatiq_guard``), it changes nothing in a test session until a test asks
for one of its fixtures by name: loading it imports only pytest (not
``dramatiq_guard``, Dramatiq, redis-py or pytest-redis: they are imported by
the fixtures that need them), and sets no global broker. That is why it is a
module of its own beside the ``dramatiq_guard`` package, whose import alone
would load Dramatiq's brokers, redis-py and SQLAlchemy into every test
session. ``-p no:dramatiq_guard`` turns it off.

Deduplication, mutexes, concurrency limits and the idempotency ledger stay
*on* in tests: a duplicate send is dropped, a limit parks the messages over
it, and the tests can assert it::

    def test_webhooks_respect_the_limit(guarded_stub_broker, guard_worker, guard_join, guard_limits):
        @dramatiq.actor(concurrency={"limit": 2, "key": lambda customer_id, n: f"webhooks:{customer_id}"})
        def deliver_webhook(customer_id, n): ...

        guard_worker()
        for n in range(10):
            deliver_webhook.send(42, n)
        guard_join(deliver_webhook)
        guard_limits.assert_held("webhooks:42", limit=2)

Declare actors after the broker fixture is set up (inside the test, or in a
fixture that takes the broker fixture): ``@dramatiq.actor`` binds an actor
to the global broker of that moment, and guard options are only accepted by
a broker with the guard installed.

Fixtures
  ``guarded_stub_broker``
      A StubBroker with the guard installed (the in-memory backend), set as
      the global broker; the previous global broker is put back afterwards.
  ``guarded_redis_broker``
      A RedisBroker with the guard installed, on a real Redis
      (``guard_redis_url``), every key of both under a namespace of the
      test's own (``guard-test-<random>:``), deleted afterwards; set as the
      global broker, the previous one put back afterwards.
  ``guard_worker(broker=None, *, threads=4, **options) -> dramatiq.Worker``
      Starts a :class:`dramatiq.Worker` in this process on ``broker``
      (default: the global broker a broker fixture set); stopped at
      teardown, before the broker is closed.
  ``guard_join(queue=None, *, broker=None, timeout=None, **join_options)``
      :func:`dramatiq_guard.testing.join`: waits until a queue (a name, or
      an actor's queue) is drained *and* nothing waits parked in the
      lockwait area. A worker must be running.
  ``guard_limits``
      A :class:`dramatiq_guard.testing.GuardLimits` recording for the test:
      ``guard_limits.assert_held(key, limit=n)``, ``guard_limits.peak(key)``.
  ``guard_assert_idempotent``
      :func:`dramatiq_guard.testing_ledger.assert_idempotent`: runs an actor
      twice and asserts its effects happened once.

Settings (fixtures to override in your ``conftest.py``)
  ``guard_redis_url`` (session)
      The Redis of ``guarded_redis_broker``: the ``--guard-redis-url``
      option, else the ``DRAMATIQ_GUARD_REDIS_URL`` environment variable,
      else the ``guard_redis_url`` ini setting, else a private
      ``redis-server`` started by pytest-redis (``pip install
      'dramatiq-guard[pytest]'``), else the test fails saying so.
  ``guard_ledger``
      The idempotency ledger's database (``install(ledger=)``): a SQLite
      file of the test's own. Return your own Engine or URL to have
      ``ledger_session()`` write to your tables.
  ``guard_settings``
      More keyword arguments for :func:`dramatiq_guard.install` (default: none).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pathlib import Path

    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.brokers.stub import StubBroker

    from dramatiq_guard.testing import GuardLimits

__all__ = [
    "guard_assert_idempotent",
    "guard_join",
    "guard_ledger",
    "guard_limits",
    "guard_redis_url",
    "guard_settings",
    "guard_worker",
    "guarded_redis_broker",
    "guarded_stub_broker",
]

#: The environment variable ``guard_redis_url`` reads: ``dramatiq_guard.resolve.REDIS_URL_ENV``,
#: written out because importing ``dramatiq_guard`` here would load it into every session.
REDIS_URL_ENV = "DRAMATIQ_GUARD_REDIS_URL"

_WORKERS = pytest.StashKey[list["dramatiq.Worker"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = (
        "Redis URL for dramatiq-guard's guarded_redis_broker fixture (default: DRAMATIQ_GUARD_REDIS_URL, "
        "else the guard_redis_url ini setting, else a private redis-server started by pytest-redis)"
    )
    parser.getgroup("dramatiq-guard").addoption(
        "--guard-redis-url", dest="guard_redis_url", default=None, metavar="URL", help=help_text
    )
    parser.addini("guard_redis_url", help_text, default="")


# --- settings ---------------------------------------------------------------------------------


@pytest.fixture
def guard_settings() -> dict[str, Any]:
    """More keyword arguments for ``dramatiq_guard.install()`` in the guarded broker fixtures.

    Override it to change a setting, e.g. ``return {"lease_ttl": 5_000}``.
    """
    return {}


@pytest.fixture
def guard_ledger(tmp_path: Path) -> Any:
    """The idempotency ledger's database in the guarded broker fixtures: a SQLite file of the test's own.

    Override it to return your own SQLAlchemy Engine or URL: ``ledger_session()``
    then writes to your tables, in one transaction with the ledger's row.
    """
    return f"sqlite:///{tmp_path / 'guard-ledger.sqlite3'}"


@pytest.fixture(scope="session")
def guard_redis_url(request: pytest.FixtureRequest) -> str:
    """The Redis of ``guarded_redis_broker`` (see the module docstring for where it comes from)."""
    config = request.config
    url = (
        config.getoption("guard_redis_url")
        or os.environ.get(REDIS_URL_ENV)
        or config.getini("guard_redis_url")
    )
    if url:
        return str(url)
    try:
        proc = request.getfixturevalue("redis_proc")  # pytest-redis's private redis-server
    except pytest.FixtureLookupError:
        proc = None
    if proc is None:
        pytest.fail(
            "guarded_redis_broker needs a Redis: pass --guard-redis-url URL, set "
            f"{REDIS_URL_ENV} or the guard_redis_url ini setting, or install pytest-redis "
            "(pip install 'dramatiq-guard[pytest]') to start a private redis-server",
            pytrace=False,
        )
    return f"redis://{proc.host}:{proc.port}/0"


# --- brokers --------------------------------------------------------------------------------


@contextlib.contextmanager
def _global_broker(broker: dramatiq.Broker, request: pytest.FixtureRequest) -> Iterator[None]:
    """``broker`` as the global broker; then its workers stopped, it closed, the previous one back."""
    import dramatiq.broker

    saved = dramatiq.broker.global_broker
    dramatiq.set_broker(broker)
    try:
        yield
    finally:
        _stop_workers(request, broker)
        broker.close()
        dramatiq.broker.global_broker = saved


@pytest.fixture
def guarded_stub_broker(
    request: pytest.FixtureRequest, guard_ledger: Any, guard_settings: dict[str, Any]
) -> Iterator[StubBroker]:
    """A StubBroker with the guard installed (in-memory backend), the global broker during the test."""
    from dramatiq.brokers.stub import StubBroker

    import dramatiq_guard

    broker = StubBroker()
    with _global_broker(broker, request):
        dramatiq_guard.install(broker, ledger=guard_ledger, **guard_settings)
        broker.emit_after("process_boot")
        yield broker


@pytest.fixture
def guarded_redis_broker(
    request: pytest.FixtureRequest, guard_redis_url: str, guard_ledger: Any, guard_settings: dict[str, Any]
) -> Iterator[RedisBroker]:
    """A RedisBroker with the guard installed, under a Redis namespace of the test's own (deleted after).

    The broker's keys are under ``<namespace>:broker:``, the guard's under
    ``<namespace>:``; the global broker during the test.
    """
    from dramatiq.brokers.redis import RedisBroker

    import dramatiq_guard
    from dramatiq_guard.backends.redis import RedisBackend

    namespace = f"guard-test-{uuid.uuid4().hex[:12]}"
    broker = RedisBroker(url=guard_redis_url, namespace=f"{namespace}:broker")
    try:
        with _global_broker(broker, request):
            backend = RedisBackend(broker.client, namespace=namespace)
            dramatiq_guard.install(broker, redis=backend, ledger=guard_ledger, **guard_settings)
            broker.emit_after("process_boot")
            yield broker
    finally:
        _delete_namespace(guard_redis_url, namespace)


def _delete_namespace(url: str, namespace: str) -> None:
    """Delete every key under ``namespace:`` (the test's own, so a SCAN of that prefix is safe)."""
    import redis

    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])


# --- workers and helpers --------------------------------------------------------------------


def _current_broker(what: str) -> dramatiq.Broker:
    import dramatiq.broker

    broker = dramatiq.broker.global_broker
    if broker is None:
        raise pytest.UsageError(
            f"{what} found no global broker: ask for guarded_stub_broker or guarded_redis_broker "
            f"before it, or pass broker="
        )
    return broker


def _stop_workers(request: pytest.FixtureRequest, broker: dramatiq.Broker | None = None) -> None:
    workers = request.node.stash.get(_WORKERS, [])
    for worker in [w for w in workers if broker is None or w.broker is broker]:
        workers.remove(worker)
        worker.stop()


@pytest.fixture
def guard_worker(request: pytest.FixtureRequest) -> Iterator[Callable[..., dramatiq.Worker]]:
    """Start a ``dramatiq.Worker`` in this process: ``guard_worker(broker=None, *, threads=4, **options)``.

    ``broker`` defaults to the global broker (set by a guarded broker
    fixture); ``options`` go to ``dramatiq.Worker``. Each worker is stopped
    at teardown, before its broker fixture closes the broker.
    """

    def start(broker: dramatiq.Broker | None = None, *, threads: int = 4, **options: Any) -> dramatiq.Worker:
        import dramatiq

        options.setdefault("worker_timeout", 100)
        worker = dramatiq.Worker(broker or _current_broker("guard_worker"), worker_threads=threads, **options)
        worker.start()
        request.node.stash.setdefault(_WORKERS, []).append(worker)
        return worker

    yield start
    _stop_workers(request)


@pytest.fixture
def guard_join() -> Callable[..., None]:
    """:func:`dramatiq_guard.testing.join`: ``guard_join(queue=None, *, broker=None, timeout=None)``.

    ``queue``: an actor (its queue and broker) or a queue name (default:
    ``"default"``); ``broker`` defaults to the actor's, else the global
    broker; ``timeout`` in milliseconds (None: wait as long as it takes);
    other keyword arguments go to ``join`` (e.g. ``fail_fast=True``).
    """
    from dramatiq_guard.testing import join

    def guard_join(
        queue: dramatiq.Actor[Any, Any] | str | None = None,
        *,
        broker: dramatiq.Broker | None = None,
        timeout: int | None = None,
        **join_options: Any,
    ) -> None:
        if queue is None or isinstance(queue, str):
            join(broker or _current_broker("guard_join"), queue or "default", timeout=timeout, **join_options)
        else:
            join(broker or queue.broker, queue.queue_name, timeout=timeout, **join_options)

    return guard_join


@pytest.fixture
def guard_limits() -> Iterator[GuardLimits]:
    """A :class:`dramatiq_guard.testing.GuardLimits` recording while the test runs.

    ``guard_limits.assert_held("webhooks:42", limit=2)`` fails, naming the
    key, its peak and the limit, if more messages held the key at once.
    """
    from dramatiq_guard.testing import GuardLimits

    with GuardLimits() as limits:
        yield limits


@pytest.fixture
def guard_assert_idempotent() -> Callable[..., Any]:
    """:func:`dramatiq_guard.testing_ledger.assert_idempotent`: ``(actor, *args, effects=..., **kwargs)``."""
    from dramatiq_guard.testing_ledger import assert_idempotent

    return assert_idempotent
