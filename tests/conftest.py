"""Fixtures for dramatiq-guard's tests: real services, real workers, waits by events.

Helpers that are not fixtures live in ``tests/harness`` (imported as ``harness``).

Redis (a private ``redis-server`` per test session, on a random free port; pytest-redis)
  ``redis_server_url``  session  the private server's URL (``redis://127.0.0.1:<port>/0``).
  ``redisdb``           function a ``redis.Redis`` (bytes) on it; the server is FLUSHALLed
                                 before and after the test.
  ``redis_url``         function the URL, clean for this test (uses ``redisdb``).
  ``recorder``          function ``harness.Recorder(redisdb)``: records from actors, and
                                 concurrency per key; actors use ``Recorder.from_env()``.
  ``redis_broker``      function a RedisBroker on ``redis_url``, set as the global broker.
  ``private_redis``     function a started ``harness.RedisServer`` of the test's own, which the
                                 test may ``stop()`` / ``start()`` (e.g. to make Redis unreachable).

Workers and actor modules
  ``actor_module(source, name="actors", *, broker_url=None) -> ModuleType``
      Writes ``source`` to ``tmp_path/<name>.py`` and imports it in the test process, with the
      harness environment set (so ``harness.broker_from_env()`` / ``Recorder.from_env()`` work).
      The global broker is restored and the module's broker closed afterwards.
  ``dramatiq_worker(module, *, processes=1, threads=1, broker_url=None, env=None, queues=None,
                    extra_args=(), ready_timeout=60.0, wait_ready=True,
                    shutdown_timeout_ms=5000) -> harness.DramatiqWorker``
      Starts ``python -m dramatiq <module> --processes N --threads M`` with ``tmp_path``,
      ``tests/`` and the repository root on ``PYTHONPATH`` and the harness environment set,
      waits until every worker process logged "Worker process is ready for action."; the
      worker's ``worker_pids`` are its worker processes. Stopped at teardown (SIGTERM, then
      SIGKILL of its process group); its log is attached to the report of a failed test.
  ``stub_broker``       function a StubBroker, set as the global broker.
  ``unique_name``       function a fresh ``t<hex>`` string (queue names, keys).

SQL (each test gets its own schema / database, dropped afterwards)
  ``postgres_url`` / ``postgres_engine``   a unique schema (``search_path``) in the configured
                                            PostgreSQL (``DRAMATIQ_GUARD_TEST_POSTGRES_URL``).
  ``mariadb_url`` / ``mariadb_engine``     a unique database in the configured MariaDB
                                            (``DRAMATIQ_GUARD_TEST_MARIADB_URL``).
  ``sqlite_url``                            a SQLite file in ``tmp_path``.
  ``sql_url`` / ``sql_engine``              parametrized over sqlite, postgres, mariadb.

RabbitMQ
  ``rabbitmq_url``      session  the configured RabbitMQ (``DRAMATIQ_GUARD_TEST_RABBITMQ_URL``).
  ``rabbitmq_broker``   function a RabbitmqBroker (confirm_delivery), set as the global broker.
                                 Queues whose names start with ``unique_name``, declared by it or
                                 by the global broker at teardown (an ``actor_module``'s), are
                                 deleted afterwards: name your queues ``f"{unique_name}_..."``
                                 (the server is shared with other test runs).

An unreachable PostgreSQL / MariaDB / RabbitMQ skips the test, or fails it when ``CI=true``.

The suite runs in parallel (pytest-xdist, ``-n auto`` in pyproject.toml: two test processes per
core, see ``pytest_xdist_auto_num_workers``): each test process has
its own session fixtures (its own private Redis, Redis Cluster node, browser), and everything on
the shared services is named per test (schemas, databases, queues from ``unique_name``), so tests
never depend on which process runs them. ``-n 0`` runs them in this process (e.g. for ``--pdb``).
Markers (``redis``, ``postgres``, ``mariadb``, ``rabbitmq``, ``worker``) are added to each
test from the fixtures it uses, so ``-m "not worker"`` etc. work without marking by hand.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import textwrap
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import coverage
import dramatiq
import dramatiq.broker
import pytest
import redis
import sqlalchemy as sa
from pytest_redis import factories

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from harness import (  # noqa: E402
    BROKER_URL_ENV,
    GUARD_REDIS_URL_ENV,
    REDIS_URL_ENV,
    DramatiqWorker,
    Recorder,
    RedisServer,
    redis_server_executable,
    services,
    unavailable,
)

# --- markers --------------------------------------------------------------------------------

MARKERS = {
    "redis": "needs a Redis server (pytest-redis spawns a private one)",
    "postgres": "needs PostgreSQL",
    "mariadb": "needs MariaDB/MySQL",
    "rabbitmq": "needs RabbitMQ",
    "worker": "runs real dramatiq worker processes",
}

#: A test that uses (directly or not) the fixture on the left gets the marker on the right.
FIXTURE_MARKERS = {
    "redis_proc": "redis",
    "private_redis": "redis",
    "postgres_server_url": "postgres",
    "mariadb_server_url": "mariadb",
    "rabbitmq_url": "rabbitmq",
    "dramatiq_worker": "worker",
}


def pytest_configure(config: pytest.Config) -> None:
    # Already declared in pyproject.toml; repeated so the plugin also works on its own.
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in names and item.get_closest_marker(marker) is None:
                item.add_marker(getattr(pytest.mark, marker))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes per core, as most tests wait on worker processes and services.

    (Measured on two cores: the CPUs are busy less than half of a run with one process per core.)
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still overrides this.
    """
    override = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if override:
        return int(override)
    return 2 * (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


#: The model tests (hypothesis state machines over the backends) run with coverage paused: its
#: tracing doubles their time (test_model.py at 20 examples, alone: 22.9 s without, 38.1 s with),
#: they are most of the suite's CPU, and what they drive is covered by the contract and unit tests
#: (the coverage floor in pyproject.toml holds without them). Not pytest-cov's ``no_cover`` marker:
#: with ``--no-cov`` under xdist it raises (pytest-cov 7.1), and it pauses one measurement where an
#: xdist worker has two (pytest-cov's, and the one every subprocess starts: ``patch = subprocess``).
UNTRACED_MODULES = frozenset(
    {"test_model.py", "test_composed_model.py", "test_throttle_model.py", "test_debounce_model.py"}
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    paused: list[coverage.Coverage] = []
    while item.path.name in UNTRACED_MODULES and (cov := coverage.Coverage.current()) is not None:
        cov.stop()  # the one started last; the one under it, if any, is current now
        paused.append(cov)
    try:
        return (yield)
    finally:
        for cov in reversed(paused):
            cov.start()


_WORKERS = pytest.StashKey[list[DramatiqWorker]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        workers: list[DramatiqWorker] = item.stash.get(_WORKERS, [])
        for index, worker in enumerate(workers):
            title = f"dramatiq worker {index} ({' '.join(worker.modules)}) log"
            report.sections.append((title, worker.log or "(no output)"))
    return report


# --- shared helpers -------------------------------------------------------------------------


def _require(service: services.Service) -> str:
    """The service's URL, or skip (fail with CI=true) when it does not answer."""
    reason = services.unreachable(service)
    if reason is not None:
        unavailable(services.unreachable_message(service, reason))
    return service.url


def _unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


@pytest.fixture
def unique_name() -> str:
    """A fresh ``t<12 hex>`` name for queues and keys."""
    return _unique()


@pytest.fixture
def restore_global_broker() -> Iterator[None]:
    """Put back dramatiq's global broker after the test, closing any broker the test made global."""
    saved = dramatiq.broker.global_broker
    yield
    current = dramatiq.broker.global_broker
    if current is not None and current is not saved:
        with contextlib.suppress(Exception):  # a broker the test broke: nothing left to do
            current.close()
    dramatiq.broker.global_broker = saved


# --- Redis ----------------------------------------------------------------------------------

#: pytest-redis's process fixture, on a random free port (overrides the plugin's default); the
#: server is ``$DRAMATIQ_GUARD_TEST_REDIS_SERVER`` if set, else pytest-redis's ``redis_exec``.
redis_proc = factories.redis_proc(port=None, executable=redis_server_executable())  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def redis_server_url(redis_proc: Any) -> str:
    url = f"redis://{redis_proc.host}:{redis_proc.port}/0"
    with redis.Redis.from_url(url) as client:
        # Lets harness.wait_until(redis=...) wake on key changes.
        client.config_set("notify-keyspace-events", "KA")
    return url


@pytest.fixture
def redisdb(redis_server_url: str) -> Iterator[redis.Redis]:
    """A client of the session's private Redis, empty at the start and flushed at the end."""
    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def redis_url(redisdb: redis.Redis, redis_server_url: str) -> str:
    """The private Redis's URL; the database is empty when the test starts."""
    return redis_server_url


@pytest.fixture
def recorder(redisdb: redis.Redis) -> Recorder:
    """The default :class:`harness.Recorder` (same channel as ``Recorder.from_env()`` in actors)."""
    return Recorder(redisdb)


@pytest.fixture
def redis_broker(redis_url: str, restore_global_broker: None) -> Any:
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=redis_url)
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def hooks(redis_broker: Any) -> Any:
    """A :class:`harness.one_step.EnqueueHooks` on ``redis_broker`` (added before the guard is
    installed on it): what the broker's enqueue hooks saw, for the one-step push tests."""
    from harness.one_step import EnqueueHooks

    hooks = EnqueueHooks()
    redis_broker.add_middleware(hooks)
    import dramatiq_guard

    dramatiq_guard.install(redis_broker)
    return hooks


@pytest.fixture
def stub_broker(restore_global_broker: None) -> Any:
    from dramatiq.brokers.stub import StubBroker

    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def redis_server_on_path() -> str:
    """The ``redis-server`` executable, for a test that starts one itself (skip, or fail with CI=true)."""
    path = shutil.which("redis-server")
    if path is None:
        unavailable("redis-server is not on PATH")
    return path


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis server of this test's own (free port), that the test may stop and restart."""
    server = RedisServer().start()
    yield server
    server.close()


# --- actor modules and workers --------------------------------------------------------------


def _harness_env(redis_url: str, broker_url: str | None) -> dict[str, str]:
    return {
        REDIS_URL_ENV: redis_url,
        BROKER_URL_ENV: broker_url or redis_url,
        GUARD_REDIS_URL_ENV: redis_url,
    }


@pytest.fixture
def actor_module(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, restore_global_broker: None
) -> Iterator[Callable[..., ModuleType]]:
    loaded: list[str] = []

    def load(source: str, name: str = "actors", *, broker_url: str | None = None) -> ModuleType:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        for key, value in _harness_env(redis_url, broker_url).items():
            monkeypatch.setenv(key, value)
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        loaded.append(name)
        return importlib.import_module(name)

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.fixture
def dramatiq_worker(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
) -> Iterator[Callable[..., DramatiqWorker]]:
    workers = request.node.stash.setdefault(_WORKERS, [])

    def start(
        module: str | Sequence[str],
        *,
        processes: int = 1,
        threads: int = 1,
        broker_url: str | None = None,
        env: Mapping[str, str] | None = None,
        queues: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 60.0,
        wait_ready: bool = True,
        shutdown_timeout_ms: int = 5000,
    ) -> DramatiqWorker:
        full_env = dict(os.environ)
        full_env.update(_harness_env(redis_url, broker_url))
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env["PYTHONDONTWRITEBYTECODE"] = "1"
        paths = [str(tmp_path), str(TESTS_DIR), str(REPO_ROOT)]
        if full_env.get("PYTHONPATH"):
            paths.append(full_env["PYTHONPATH"])
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
        full_env.update(env or {})
        worker = DramatiqWorker(
            module,
            processes=processes,
            threads=threads,
            env=full_env,
            queues=queues,
            extra_args=extra_args,
            shutdown_timeout_ms=shutdown_timeout_ms,
            cwd=tmp_path,
        )
        workers.append(worker)
        worker.start()
        if wait_ready:
            worker.wait_ready(ready_timeout)
        return worker

    yield start
    for worker in workers:  # all at once: each takes a second or more to drain and exit
        worker.terminate()
    for worker in workers:
        worker.stop()


# --- SQL ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    return _require(services.POSTGRES)


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A URL whose connections see only a fresh schema (``search_path``), dropped after the test.

    The URL also sets ``application_name`` to the schema's name, so connections the test leaked
    are terminated before the schema is dropped.
    """
    schema = _unique("dgt_")
    base = sa.make_url(postgres_server_url)
    admin = sa.create_engine(base, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = base.update_query_dict({"options": f"-csearch_path={schema}", "application_name": schema})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": schema},
            )
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def postgres_engine(postgres_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(postgres_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def mariadb_server_url() -> str:
    return _require(services.MARIADB)


@pytest.fixture
def mariadb_url(mariadb_server_url: str) -> Iterator[str]:
    """A URL on a fresh database, dropped after the test (leaked connections to it are killed)."""
    database = _unique("dgt_")
    base = sa.make_url(mariadb_server_url)
    admin = sa.create_engine(base, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4"))
    try:
        yield base.set(database=database).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = :db AND ID <> CONNECTION_ID()"
                ),
                {"db": database},
            ).all()
            for (connection_id,) in rows:
                with contextlib.suppress(sa.exc.DBAPIError):  # it ended meanwhile
                    conn.execute(sa.text(f"KILL {int(connection_id)}"))
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{database}`"))
        admin.dispose()


@pytest.fixture
def mariadb_engine(mariadb_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(mariadb_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'test.sqlite3'}"


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    ]
)
def sql_url(request: pytest.FixtureRequest) -> str:
    """A fresh database URL on each SQL backend in turn (see ``sqlite_url``, ``postgres_url``, ...)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
def sql_engine(sql_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sql_url)
    yield engine
    engine.dispose()


# --- RabbitMQ -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    return _require(services.RABBITMQ)


@pytest.fixture
def rabbitmq_broker(rabbitmq_url: str, unique_name: str, restore_global_broker: None) -> Iterator[Any]:
    import pika
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.common import dq_name, xq_name

    broker = RabbitmqBroker(url=rabbitmq_url, confirm_delivery=True)
    dramatiq.set_broker(broker)
    yield broker
    # The queues this broker declared, and those of a broker an actor module made global.
    queues: set[str] = set()
    for candidate in (broker, dramatiq.broker.global_broker):
        if isinstance(candidate, RabbitmqBroker):
            queues.update(q for q in candidate.get_declared_queues() if q.startswith(unique_name))
    broker.close()
    if queues:
        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        try:
            channel = connection.channel()
            for queue in queues:
                for name in (queue, dq_name(queue), xq_name(queue)):
                    channel.queue_delete(name)
        finally:
            connection.close()
