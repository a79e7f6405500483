"""Records from actors to the test, by Redis lists: the test waits on BLPOP, never on sleeps.

In an actor module (running in a worker subprocess or in the test process)::

    rec = Recorder.from_env()                     # the harness Redis, from the environment

    @dramatiq.actor(max_retries=0)
    def job(key, n):
        with rec.track(f"job:{key}"):             # concurrency per key: INCR on start, DECR on end
            rec.record(actor="job", key=key, n=n) # RPUSH one JSON record (pid and ts added)

In the test (the ``recorder`` fixture is ``Recorder(redisdb)`` with the same default name)::

    records = recorder.take(10, timeout=30)       # BLPOP 10 records, or WaitTimeout
    assert recorder.max_concurrency("job:a") <= 2 # the highest count ever seen inside track()

A :class:`Gate` holds an actor until the test opens it (e.g. to SIGKILL its worker
while it is inside the actor): ``Gate.from_env("hold").wait()`` in the actor,
``recorder.gate("hold").open()`` in the test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from .env import redis_client_from_env
from .waiting import WaitTimeout

_ENTER = """
local cur = redis.call('INCR', KEYS[1])
local max = tonumber(redis.call('GET', KEYS[2]) or '0')
if cur > max then redis.call('SET', KEYS[2], cur) end
return cur
"""

_EXIT = """
local cur = redis.call('DECR', KEYS[1])
if cur <= 0 then redis.call('DEL', KEYS[1]) end
return cur
"""

Record = dict[str, Any]


def _client(client: redis.Redis | str | None) -> redis.Redis:
    if client is None:
        return redis_client_from_env()
    if isinstance(client, str):
        return redis.Redis.from_url(client)
    return client


class Recorder:
    """A named channel of records from actors to the test, plus per-key concurrency counters.

    Parameters:
      client: A redis client, a Redis URL, or None for the harness Redis from the environment.
      name: The channel name; the test and the actors must use the same one.

    Attributes:
      seen: Every record :meth:`take` returned so far, in arrival order.
    """

    def __init__(self, client: redis.Redis | str | None = None, name: str = "default") -> None:
        self.client = _client(client)
        self.name = name
        self.key = f"harness:{{{name}}}:records"
        self.seen: list[Record] = []
        self._enter = self.client.register_script(_ENTER)
        self._exit = self.client.register_script(_EXIT)

    @classmethod
    def from_env(cls, name: str = "default") -> Recorder:
        """A recorder on the harness Redis named by ``DRAMATIQ_GUARD_TEST_REDIS_URL``."""
        return cls(None, name)

    # --- the actor side -------------------------------------------------------------------

    def record(self, **fields: Any) -> Record:
        """Push one record (JSON; ``pid``, ``thread`` and ``ts`` = time.time() are added)."""
        record: Record = {"pid": os.getpid(), "thread": threading.get_ident(), "ts": time.time()}
        record.update(fields)
        self.client.rpush(self.key, json.dumps(record, default=repr))
        return record

    @contextmanager
    def track(self, key: str) -> Iterator[int]:
        """Count the holder in ``key``'s concurrency while the block runs; yields the count on entry.

        The highest count ever reached is kept (atomically, by a Lua script) for
        :meth:`max_concurrency`.
        """
        cur_key, max_key = self._conc_keys(key)
        current = int(self._enter(keys=[cur_key, max_key]))
        try:
            yield current
        finally:
            self._exit(keys=[cur_key, max_key])

    # --- the test side --------------------------------------------------------------------

    def take(self, n: int = 1, timeout: float = 30.0) -> list[Record]:
        """Pop the next ``n`` records, waiting (BLPOP) up to ``timeout`` seconds in all.

        Raises:
          WaitTimeout: Fewer than ``n`` arrived in time; the message lists those that did.
        """
        deadline = time.monotonic() + timeout
        got: list[Record] = []
        while len(got) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            item = blpop(self.client, self.key, remaining)
            if item is None:
                break
            got.append(json.loads(item[1]))
        self.seen.extend(got)
        if len(got) < n:
            raise WaitTimeout(
                f"recorder {self.name!r}: got {len(got)} of {n} records within {timeout:g}s: {got!r}"
            )
        return got

    def take_one(self, timeout: float = 30.0) -> Record:
        """Pop the next record (see :meth:`take`)."""
        return self.take(1, timeout)[0]

    def expect_no_more(self, within: float = 1.0) -> None:
        """Assert that no record arrives within ``within`` seconds (a bounded BLPOP).

        For negative checks only ("the duplicate never ran"). Prefer a positive
        event when there is one, e.g. wait for the broker to drain first.
        """
        item = blpop(self.client, self.key, within)
        if item is not None:
            record = json.loads(item[1])
            self.seen.append(record)
            raise AssertionError(f"recorder {self.name!r}: unexpected record {record!r}")

    def pending(self) -> int:
        """How many records were pushed and not taken yet."""
        return int(self.client.llen(self.key))

    def max_concurrency(self, key: str) -> int:
        """The highest number of holders ever inside :meth:`track` for ``key`` at once."""
        return int(self.client.get(self._conc_keys(key)[1]) or 0)

    def concurrency(self, key: str) -> int:
        """How many holders are inside :meth:`track` for ``key`` now."""
        return int(self.client.get(self._conc_keys(key)[0]) or 0)

    def gate(self, name: str) -> Gate:
        """A :class:`Gate` on the same Redis."""
        return Gate(self.client, name)

    def _conc_keys(self, key: str) -> tuple[str, str]:
        base = f"harness:{{{self.name}}}:conc:{key}"
        return f"{base}:cur", f"{base}:max"


#: The longest single BLPOP: redis-py 8 clients time a read out after 5 s by default (a
#: client made from a URL lists no socket_timeout, yet has one), so a longer wait is chunked.
BLPOP_CHUNK_S = 1.0


def blpop(client: redis.Redis, key: str, timeout: float) -> Any:
    """BLPOP ``key`` for up to ``timeout`` seconds, in chunks the client's read timeout allows.

    Returns the popped ``(key, value)`` pair, or None when nothing came in time.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        item = client.blpop([key], timeout=min(max(remaining, 0.01), BLPOP_CHUNK_S))
        if item is not None or remaining <= BLPOP_CHUNK_S:
            return item


class Gate:
    """A counting gate: :meth:`wait` blocks (BLPOP) until :meth:`open` pushes a token.

    Each :meth:`open` lets ``n`` waiters (present or future) through.
    """

    def __init__(self, client: redis.Redis | str | None, name: str) -> None:
        self.client = _client(client)
        self.name = name
        self.key = f"harness:gate:{{{name}}}"

    @classmethod
    def from_env(cls, name: str) -> Gate:
        return cls(None, name)

    def wait(self, timeout: float = 60.0) -> None:
        """Block until a token is available and take it.

        Raises:
          WaitTimeout: No token within ``timeout`` seconds.
        """
        if blpop(self.client, self.key, timeout) is None:
            raise WaitTimeout(f"gate {self.name!r} was not opened within {timeout:g}s")

    def open(self, n: int = 1) -> None:
        """Let ``n`` waiters through."""
        self.client.rpush(self.key, *(["1"] * n))
