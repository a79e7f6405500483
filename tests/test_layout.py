"""The layout of the guard's state in Redis: recorded per namespace, a newer one refused (a downgrade)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import redis

import dramatiq_guard
from dramatiq_guard.backends.redis_health import LAYOUT
from dramatiq_guard.cli import main
from dramatiq_guard.errors import LayoutTooNew

LAYOUT_KEY = "dramatiq-guard:layout"


def test_install_records_the_layout_of_a_new_namespace(redis_broker: Any, redisdb: redis.Redis) -> None:
    dramatiq_guard.install(redis_broker)

    assert redisdb.get(LAYOUT_KEY) == str(LAYOUT).encode()
    assert redisdb.pttl(LAYOUT_KEY) == -1  # kept, as a run-time limit is


def test_install_refuses_state_of_a_newer_layout_and_writes_nothing(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    redisdb.set(LAYOUT_KEY, LAYOUT + 1)
    before = sorted(redisdb.keys("dramatiq-guard:*"))

    with pytest.raises(LayoutTooNew) as raised:
        dramatiq_guard.install(redis_broker)

    message = str(raised.value)
    assert f"layout {LAYOUT + 1}" in message
    assert f"({dramatiq_guard.__version__}) reads layouts up to {LAYOUT} only" in message
    assert repr(LAYOUT_KEY) in message  # what to delete, once drained, to go back
    assert raised.value.stored == LAYOUT + 1
    assert sorted(redisdb.keys("dramatiq-guard:*")) == before
    assert redisdb.get(LAYOUT_KEY) == str(LAYOUT + 1).encode()


def test_a_namespace_of_this_layout_is_joined_and_a_lost_record_written_again(
    redis_broker: Any, redisdb: redis.Redis
) -> None:
    redisdb.set(LAYOUT_KEY, LAYOUT)
    dramatiq_guard.install(redis_broker)  # a second process of the same version
    assert redisdb.get(LAYOUT_KEY) == str(LAYOUT).encode()


def test_each_namespace_has_its_own_record(redis_url: str, redisdb: redis.Redis) -> None:
    from dramatiq_guard.backends import RedisBackend
    from dramatiq_guard.backends.redis_health import check_layout

    redisdb.set(LAYOUT_KEY, LAYOUT + 1)
    other = RedisBackend.from_url(redis_url, namespace="other-app")
    try:
        assert check_layout(other) == LAYOUT
    finally:
        other.close()
    assert redisdb.get("other-app:layout") == str(LAYOUT).encode()


def test_the_command_refuses_a_newer_layout_and_records_none(
    redis_url: str, redisdb: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["--redis", redis_url, "inspect"], stdout=io.StringIO())
    assert status == 0
    assert redisdb.get(LAYOUT_KEY) is None  # a read leaves nothing behind

    redisdb.set(LAYOUT_KEY, LAYOUT + 1)
    status = main(["--redis", redis_url, "limit", "set", "k", "3"], stdout=io.StringIO())
    err = capsys.readouterr().err
    assert status == 1
    assert f"layout {LAYOUT + 1}" in err
    assert redisdb.get("dramatiq-guard:{k}:limit") is None
