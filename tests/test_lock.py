"""The standalone lock across processes, on a real Redis: blocking, non-blocking and timeout modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from harness import wait_until

from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.errors import LeaseLost
from dramatiq_guard.lock import Lock

REPO_ROOT = Path(__file__).resolve().parent.parent

CONTENDER = """
import json, sys
from dramatiq_guard.lock import Lock, LockNotAcquired

url, mode = sys.argv[1], sys.argv[2]
lock = Lock("report", redis=url, lease_ttl=2_000)
if mode == "blocking":
    with lock as lease:
        print(json.dumps({"ran": True, "token": lease.token}))
elif mode == "nonblocking":
    run = Lock("report", redis=url, blocking=False).run(lambda: 42)
    print(json.dumps({"ran": run.ran, "value": run.value, "token": run.token}))
elif mode == "timeout":
    try:
        with Lock("report", redis=url, blocking_timeout=0.2):
            print(json.dumps({"ran": True}))
    except LockNotAcquired as e:
        print(json.dumps({"ran": False, "error": str(e)}))
"""


def contender(redis_url: str, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CONTENDER), redis_url, mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def outcome(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result: dict[str, Any] = json.loads(out)
    return result


def test_blocking_waits_for_the_holder_in_another_process(redis_url: str, redisdb: Any) -> None:
    backend = RedisBackend(redisdb)
    lock = Lock("report", redis=backend, lease_ttl=2_000)
    assert lock.acquire()
    assert lock.lease is not None
    proc = contender(redis_url, "blocking")
    wait_until(lambda: backend.inspect("mutex:report").waiters, what="the contender to wait", redis=redisdb)
    held_token = lock.lease.token
    lock.release()
    got = outcome(proc)
    assert got["ran"] and got["token"] > held_token
    assert not lock.locked()


def test_non_blocking_tells_whether_it_ran_and_its_value(redis_url: str, redisdb: Any) -> None:
    lock = Lock("report", redis=RedisBackend(redisdb))
    with lock:
        assert outcome(contender(redis_url, "nonblocking")) == {"ran": False, "value": None, "token": None}
    got = outcome(contender(redis_url, "nonblocking"))
    assert got["ran"] and got["value"] == 42


def test_a_blocking_timeout_gives_up(redis_url: str, redisdb: Any) -> None:
    backend = RedisBackend(redisdb)
    with Lock("report", redis=backend):
        got = outcome(contender(redis_url, "timeout"))
    assert got["ran"] is False and "mutex:report" in got["error"]
    assert backend.inspect("mutex:report").waiters == ()  # the waiter left


def test_a_lost_lease_is_raised_at_release_and_the_next_token_is_higher(redis_url: str) -> None:
    # A client without a socket timeout: a blocking wait's BLPOP must outlast it.
    backend = RedisBackend.from_url(redis_url)
    first = Lock("report", redis=backend, lease_ttl=200)
    assert first.acquire(blocking=False)
    assert first.lease is not None
    first.lease.unregister()  # the holder stalls: no more renewals
    second = Lock("report", redis=backend)
    assert second.acquire(blocking_timeout=30)  # handed over once the stalled lease lapses
    assert second.lease is not None and second.lease.token > first.lease.token
    with pytest.raises(LeaseLost):
        first.release()
    assert first.lease.lost
    second.release()
    backend.close()
