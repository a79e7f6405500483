"""install(): every guard on the broker, in the right place, with the backend DESIGN.md prescribes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import dramatiq
import pytest
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Retries

import dramatiq_guard
from dramatiq_guard.backends import MemoryBackend, RedisBackend, Stake
from dramatiq_guard.backends.memory import STUB_EXTRA_MISSING
from dramatiq_guard.middleware.base import GuardMiddleware

GUARDS = [
    dramatiq_guard.Mutex,
    dramatiq_guard.Concurrency,
    dramatiq_guard.Throttle,
    dramatiq_guard.Debounce,
    dramatiq_guard.Deduplication,
    dramatiq_guard.Idempotency,
]


def backends(broker: dramatiq.Broker, installed: list[Any]) -> set[int]:
    """The identities of the backends the installed guards resolve."""
    return {id(m.backend(broker)) for m in installed if isinstance(m, GuardMiddleware)}


def test_a_redis_broker_lends_its_own_client(redis_url: str, tmp_path: Path) -> None:
    broker = RedisBroker(url=redis_url)
    try:
        installed = dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
        assert [type(m) for m in installed] == GUARDS
        backend = cast(GuardMiddleware[Any], installed[0]).backend(broker)
        assert isinstance(backend, RedisBackend)
        assert backend.client is broker.client
        assert backends(broker, installed) == {id(backend)}
    finally:
        broker.close()


def test_guards_sit_just_before_retries_in_broker_order(redis_url: str, tmp_path: Path) -> None:
    broker = RedisBroker(url=redis_url)
    try:
        dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
        names = [type(m).__name__ for m in broker.middleware]
        retries = names.index(Retries.__name__)
        assert names[retries - len(GUARDS) : retries] == [cls.__name__ for cls in GUARDS]
    finally:
        broker.close()


def test_installing_twice_adds_nothing(tmp_path: Path) -> None:
    broker = StubBroker()
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    first = dramatiq_guard.install(broker, ledger=ledger)
    count = len(broker.middleware)
    assert dramatiq_guard.install(broker, ledger=ledger) == first
    assert len(broker.middleware) == count


def test_a_stub_broker_gets_one_shared_in_memory_backend(tmp_path: Path) -> None:
    broker = StubBroker()
    installed = dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
    (backend_id,) = backends(broker, installed)
    assert isinstance(cast(GuardMiddleware[Any], installed[0]).backend(broker), MemoryBackend)
    assert id(cast(GuardMiddleware[Any], installed[0]).backend(broker)) == backend_id


#: A StubBroker installed in a fresh interpreter in which ``{blocked}`` cannot be imported (None in
#: ``sys.modules``: Python's own way to make an import fail, as if it were not installed).
WITHOUT_STUB_EXTRA = """
import sys
sys.modules[{blocked!r}] = None
import dramatiq_guard
from dramatiq.brokers.stub import StubBroker
dramatiq_guard.install(StubBroker(), ledger={ledger!r})
"""


@pytest.mark.parametrize("blocked", ["fakeredis", "lupa"])
def test_a_stub_broker_without_the_stub_extra_is_one_clear_line(blocked: str, tmp_path: Path) -> None:
    """Without fakeredis (or lupa, which runs its scripts), a StubBroker's install says what to install."""
    script = WITHOUT_STUB_EXTRA.format(blocked=blocked, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert last == f"dramatiq_guard.errors.ConfigurationError: {STUB_EXTRA_MISSING}", ran.stderr
    assert "pip install 'dramatiq-guard[stub]'" in last


def test_a_rabbitmq_broker_without_a_redis_url_is_a_clear_error(
    rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DRAMATIQ_GUARD_REDIS_URL", raising=False)
    broker = RabbitmqBroker(url=rabbitmq_url)
    try:
        with pytest.raises(dramatiq_guard.ConfigurationError, match="DRAMATIQ_GUARD_REDIS_URL") as raised:
            dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
        assert "RabbitmqBroker" in str(raised.value)
        assert not any(isinstance(m, GuardMiddleware) for m in broker.middleware)
    finally:
        broker.close()


def test_a_rabbitmq_broker_uses_the_environment_url(
    rabbitmq_url: str, redis_url: str, redisdb: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DRAMATIQ_GUARD_REDIS_URL", redis_url)
    broker = RabbitmqBroker(url=rabbitmq_url)
    try:
        installed = dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
        backend = cast(GuardMiddleware[Any], installed[0]).backend(broker)
        assert isinstance(backend, RedisBackend)
        assert backend.acquire(Stake("install-probe", "h1", limit=1, ttl_ms=60_000)).acquired
        assert redisdb.keys("dramatiq-guard:{install-probe}:*"), "state went to the configured Redis"
        backend.release("install-probe", "h1", limit=1)
    finally:
        broker.close()


@pytest.mark.parametrize("form", ["url", "client"])
def test_an_explicit_redis_wins_over_the_broker(
    form: str, redis_url: str, redisdb: redis.Redis, tmp_path: Path
) -> None:
    broker = StubBroker()
    given: Any = redis_url if form == "url" else redis.Redis.from_url(redis_url)
    installed = dramatiq_guard.install(broker, redis=given, ledger=f"sqlite:///{tmp_path / 'ledger.db'}")
    backend = cast(GuardMiddleware[Any], installed[0]).backend(broker)
    assert isinstance(backend, RedisBackend)
    if form == "client":
        assert backend.client is given
    assert backends(broker, installed) == {id(backend)}


def test_an_unknown_setting_is_refused_naming_the_settings_that_exist() -> None:
    broker = StubBroker()
    with pytest.raises(dramatiq_guard.ConfigurationError, match="lease_tll") as raised:
        dramatiq_guard.install(broker, lease_tll=5000)
    assert "lease_ttl" in str(raised.value)
    assert not any(isinstance(m, GuardMiddleware) for m in broker.middleware)


def test_a_setting_reaches_the_middlewares_that_take_it(tmp_path: Path) -> None:
    broker = StubBroker()
    installed = dramatiq_guard.install(broker, lease_ttl=12_345, ledger=f"sqlite:///{tmp_path / 'l.db'}")
    slots = [m for m in installed if isinstance(m, (dramatiq_guard.Mutex, dramatiq_guard.Concurrency))]
    assert [m.lease_ttl_ms for m in slots] == [12_345, 12_345]


def test_install_can_name_the_route(tmp_path: Path) -> None:
    broker = StubBroker()
    installed = dramatiq_guard.install(broker, ledger=f"sqlite:///{tmp_path / 'l.db'}", route="billing")
    backend = cast(GuardMiddleware[Any], installed[0]).backend(broker)
    assert backend.route == "billing"
    with pytest.raises(dramatiq_guard.ConfigurationError, match="route must be a non-empty str"):
        dramatiq_guard.install(StubBroker(), route="")
