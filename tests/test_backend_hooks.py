"""The backend contract's hooks, and the rule they keep: no guard layer above the backends reaches Redis.

What a process needs from the store its guards keep their state in (the health check when it
resolves it, the watch its sweep runs, replica waits) goes through
:class:`~dramatiq_guard.backends.GuardBackend`: the middlewares and ``install()`` import no Redis
module, and a backend with no replicas refuses replica waits itself. The Redis side of these
hooks (an evicting Redis refused, lost state found) is tested in ``test_redis_forgets.py``.
"""

from __future__ import annotations

import ast
import os
import socket
import time
from pathlib import Path

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from harness import wait_until
from harness.fake_clock import fakeredis_clock

import dramatiq_guard
from dramatiq_guard.backends import MemoryBackend, RedisBackend
from dramatiq_guard.backends.redis_scripts import ScriptLibrary, processes_key
from dramatiq_guard.errors import ConfigurationError

PACKAGE = Path(dramatiq_guard.__file__).parent


def redis_imports(source: str, module: str) -> list[str]:
    """The names that ``source``, the text of ``module``, imports from Redis code.

    Redis code: ``dramatiq_guard.backends.redis*`` (``RedisBackend`` imported through
    ``dramatiq_guard.backends`` too) and redis-py. Every import statement counts, at module level
    or inside a function, relative ones resolved.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from the module's package (level 1) or above
                package = module.split(".")[: -node.level]
                base = ".".join([*package, base] if base else package)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            name
            for name in names
            if name.lower().startswith("dramatiq_guard.backends.redis") or name.partition(".")[0] == "redis"
        ]
    return found


def module_name(path: Path) -> str:
    """The dotted name of a module of the package (a package's ``__init__`` counts as ``pkg.__init__``)."""
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_no_middleware_and_not_install_imports_a_redis_module() -> None:
    """Generic layers reach the store through the backend contract only (issue #32).

    The command's and the dashboard's views (``admin.py``, the dashboard's application) too: they
    read the store's clock through :meth:`~dramatiq_guard.backends.GuardBackend.now_ms`.
    """
    checked = [
        *sorted((PACKAGE / "middleware").rglob("*.py")),
        PACKAGE / "install.py",
        PACKAGE / "admin.py",
        PACKAGE / "web" / "app.py",
    ]
    assert PACKAGE / "middleware" / "slots" / "middleware.py" in checked
    found = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in checked
        if (names := redis_imports(path.read_text(), module_name(path)))
    }
    assert found == {}


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import dramatiq_guard.backends.redis_watch", ["dramatiq_guard.backends.redis_watch"]),
        ("from dramatiq_guard.backends import redis_health", ["dramatiq_guard.backends.redis_health"]),
        ("from dramatiq_guard.backends import RedisBackend", ["dramatiq_guard.backends.RedisBackend"]),
        ("from ...backends.redis import RedisBackend", ["dramatiq_guard.backends.redis.RedisBackend"]),
        ("from redis.exceptions import RedisError", ["redis.exceptions.RedisError"]),
        ("from dramatiq.brokers import redis", []),  # a broker module, not the guard's store
        (
            "def f():\n    from ..sweep import Sweeper\n    from ...backends import redis_client",
            ["dramatiq_guard.backends.redis_client"],
        ),
    ],
)
def test_the_import_rule_sees_every_form_of_import(source: str, found: list[str]) -> None:
    """Absolute, relative, lazy and package-level imports of Redis code are all caught."""
    assert redis_imports(source, "dramatiq_guard.middleware.slots.middleware") == found


def test_replica_waits_are_refused_by_a_backend_without_replicas() -> None:
    backend = MemoryBackend()
    backend.wait_for_replicas(0, 1_000)  # none asked for: nothing to refuse
    with pytest.raises(
        ConfigurationError, match="replica_waits=2 needs the guard's state on Redis, not on a MemoryBackend"
    ):
        backend.wait_for_replicas(2, 1_000)
    with pytest.raises(ValueError, match="replica_wait_timeout_ms"):
        backend.wait_for_replicas(0, 0)  # checked as Redis checks it, whatever the backend

    broker = StubBroker()
    with pytest.raises(ConfigurationError, match="replica_waits=1"):
        dramatiq_guard.install(broker, redis=backend, replica_waits=1)
    assert not [m for m in broker.middleware if type(m).__module__.startswith("dramatiq_guard")]  # none


def test_now_ms_reads_the_backends_clock(redis_url: str, unique_name: str) -> None:
    """Redis ``TIME``, for Redis and in memory (its emulated server's clock)."""
    memory = MemoryBackend()
    with fakeredis_clock(lambda: 1_234_567_891):
        assert memory.now_ms() == 1_234_567_891
    before = time.time_ns() // 1_000_000
    assert before <= MemoryBackend().now_ms() <= time.time_ns() // 1_000_000

    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    first = seconds * 1000 + micros // 1000
    now = RedisBackend(client, namespace=unique_name).now_ms()
    seconds, micros = client.time()
    assert first <= now <= seconds * 1000 + micros // 1000


def test_a_worker_sweep_records_its_process_on_redis_and_withdraws_it_at_shutdown(
    redis_url: str, unique_name: str
) -> None:
    """The sweep's watch hook keeps the record ``functions prune`` reads, and its end withdraws it."""
    client = redis.Redis.from_url(redis_url)
    backend = RedisBackend(client, namespace=unique_name)
    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq_guard.install(broker, redis=backend, sweep_interval=50)
    this_process = {backend.scripts.library: [f"{socket.gethostname()}:{os.getpid()}"]}
    records = [processes_key(unique_name)]
    worker = dramatiq.Worker(broker, worker_threads=1)
    worker.start()
    try:
        wait_until(
            lambda: ScriptLibrary.running(client, unique_name) == this_process,
            what="the sweep to record this process",
            redis=client,
            keys=records,
        )
    finally:
        worker.stop()
    wait_until(  # the sweep thread may be ending a pass: its own end withdraws it too
        lambda: ScriptLibrary.running(client, unique_name) == {},
        what="the record to be withdrawn",
        redis=client,
        keys=records,
    )
    client.close()
