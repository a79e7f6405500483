"""What one redis-py client of a worker process sends: its round trips by thread, its commands by name.

A bench actor module gives the guard a client of its own made by :func:`counted_client`, so that
its requests are told apart from the broker's. :class:`PublishTraffic`, added to the broker,
writes this process's counts to ``bench:traffic:<pid>`` once the worker has booted (a producer's
sends are not published), when they changed, every :data:`PUBLISH_EVERY_S`; the bench sums them
with :func:`read_traffic`. A request is one write to the socket: a command, or a pipeline of them
(one round trip). A command is named by itself, a function or script call (FCALL, EVALSHA) by
what it calls.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, cast

import dramatiq
import redis

#: The prefix of each worker process's hash of counts.
TRAFFIC_PREFIX = "bench:traffic:"
#: How often a worker process writes its counts.
PUBLISH_EVERY_S = 0.02
#: The thread a request counts under when it is not one of the guard's own (named) threads.
WORKER_THREADS = "worker threads"
_CALLS = {"fcall", "fcall_ro", "evalsha", "evalsha_ro"}


def command_names(packed: bytes) -> Iterator[str]:
    """The name of each command of a request in the Redis protocol (a function call's: ``fcall <name>``)."""
    at = 0
    while at < len(packed):
        end = packed.index(b"\r\n", at)
        count, at = int(packed[at + 1 : end]), end + 2
        args = []
        for k in range(count):
            end = packed.index(b"\r\n", at)
            length, at = int(packed[at + 1 : end]), end + 2
            if k < 2:
                args.append(packed[at : at + length].decode("utf-8", "replace"))
            at += length + 2
        name = args[0].lower()
        yield f"{name} {args[1]}" if name in _CALLS and len(args) > 1 else name


class Traffic:
    """This process's counts: ``requests <thread>`` per request, ``commands <name>`` per command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def record(self, chunks: Iterable[Any]) -> None:
        thread = threading.current_thread().name
        kind = thread if thread.startswith("dramatiq-guard") else WORKER_THREADS
        names = list(command_names(b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)))
        with self._lock:
            self.counts[f"requests {kind}"] += 1
            self.counts.update(f"commands {name}" for name in names)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


traffic = Traffic()


class CountingConnection(redis.Connection):
    """A connection that counts what it writes in :data:`traffic`."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        traffic.record([command] if isinstance(command, (str, bytes)) else command)
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def counted_client(url: str) -> redis.Redis:
    """A client on ``url`` whose every request is counted (timeouts below a lease, as the guard asks)."""
    pool = redis.ConnectionPool.from_url(
        url, connection_class=CountingConnection, socket_timeout=5, socket_connect_timeout=5
    )
    return redis.Redis(connection_pool=pool)


class PublishTraffic(dramatiq.Middleware):
    """Writes this worker process's counts to ``bench:traffic:<pid>`` when they changed, every
    :data:`PUBLISH_EVERY_S`."""

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        client, key = broker.client, f"{TRAFFIC_PREFIX}{os.getpid()}"

        def publish() -> None:
            published: dict[str, int] = {}
            while True:
                counts = traffic.snapshot()
                if counts != published:
                    client.hset(key, mapping=counts)
                    published = counts
                time.sleep(PUBLISH_EVERY_S)

        threading.Thread(target=publish, name="bench-traffic", daemon=True).start()


def read_traffic(client: redis.Redis) -> Counter[str]:
    """The counts of every worker process that published them, summed."""
    total: Counter[str] = Counter()
    for key in client.scan_iter(match=f"{TRAFFIC_PREFIX}*"):
        fields = cast(dict[bytes, bytes], client.hgetall(key))
        total.update({k.decode(): int(v) for k, v in fields.items()})
    return total
