"""The dedup confirmation thread's batches (``_Confirmer``) against real backends.

One Redis of the test's own is stopped to stand for an unreachable backend; no
thread is started: ``send`` (one flush) is called directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from harness import RedisServer
from redis.backoff import NoBackoff
from redis.retry import Retry

from dramatiq_guard.backends import Stake
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.middleware.confirmer import Confirmer as _Confirmer

TTL_MS = 60_000


@pytest.fixture
def unreachable(private_redis: RedisServer) -> Iterator[RedisBackend]:
    """A RedisBackend whose server is stopped (connections refused at once, no retries)."""
    client = private_redis.client(socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    private_redis.stop()
    yield RedisBackend(client, namespace="unreachable")
    client.close()


@pytest.fixture
def reachable(redisdb: redis.Redis) -> RedisBackend:
    return RedisBackend(redisdb)


def pending(backend: RedisBackend, key: str, holder: str) -> tuple[RedisBackend, str, str, int, float]:
    """A confirmer item for a pending lock taken on ``backend`` (or not, if it is unreachable)."""
    return (backend, key, holder, TTL_MS, time.monotonic() + 3600)


def test_a_failed_group_followed_by_a_confirmed_group_is_reported_failed(
    unreachable: RedisBackend, reachable: RedisBackend
) -> None:
    assert reachable.acquire(Stake("b", "m2", limit=1, ttl_ms=10_000)).acquired
    confirmer = _Confirmer(linger=0.01)
    lost = pending(unreachable, "a", "m1")

    assert confirmer.send([lost, pending(reachable, "b", "m2")]) is False
    assert confirmer._items == [lost]  # kept for the next flush, before it lapses
    deadline_ms = dict(reachable.inspect("b").holders)["m2"]
    assert deadline_ms > time.time() * 1000 + TTL_MS / 2  # the reachable one was confirmed


def test_a_lock_gone_before_its_confirmation_is_not_a_failure(reachable: RedisBackend) -> None:
    assert reachable.acquire(Stake("b", "m2", limit=1, ttl_ms=10_000)).acquired
    confirmer = _Confirmer(linger=0.01)
    # "c" was released (or lapsed) before the flush: nothing to confirm, nothing to retry.
    assert confirmer.send([pending(reachable, "b", "m2"), pending(reachable, "c", "m3")]) is True
    assert confirmer._items == []
