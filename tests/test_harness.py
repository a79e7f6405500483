"""The test harness itself, against the real services (see tests/conftest.py)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from harness import (
    POSTGRES_URL_ENV,
    Recorder,
    WaitTimeout,
    WorkerFailed,
    pid_alive,
    redis_broker_pending,
    wait_for_redis_broker_drain,
    wait_until,
)
from redis.backoff import NoBackoff
from redis.retry import Retry

TESTS_DIR = Path(__file__).resolve().parent

ACTORS = """
import dramatiq
from harness import Gate, Recorder, broker_from_env

broker = broker_from_env()
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(max_retries=0, queue_name=QUEUE)
def hello(n):
    with rec.track("hello"):
        rec.record(actor="hello", n=n)


@dramatiq.actor(max_retries=0, queue_name=QUEUE)
def hold():
    rec.record(actor="hold")
    Gate.from_env("hold").wait(timeout=60)
"""


def actors_source(queue: str = "default") -> str:
    return f"QUEUE = {queue!r}\n" + ACTORS


# --- Redis ----------------------------------------------------------------------------------


@pytest.mark.parametrize("run", [1, 2])
def test_redisdb_is_clean_for_every_test(redisdb: redis.Redis, redis_url: str, run: int) -> None:
    assert redisdb.dbsize() == 0
    redisdb.set("left-behind", run)
    with redis.Redis.from_url(redis_url) as other:
        assert other.get("left-behind") == str(run).encode()


def test_redis_server_is_private(redis_url: str) -> None:
    assert not redis_url.endswith(":6379/0"), "the session Redis must be a private server on a free port"


def test_private_redis_can_stop_and_restart(private_redis: object) -> None:
    from harness import RedisServer

    assert isinstance(private_redis, RedisServer)
    client = private_redis.client(socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    client.set("k", "v")
    private_redis.stop()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    private_redis.start()
    assert client.ping()
    assert client.get("k") is None  # no persistence: a restart is a clean server
    client.close()


def test_recorder_tracks_max_concurrency(recorder: Recorder) -> None:
    barrier = threading.Barrier(3, timeout=30)

    def run(i: int) -> None:
        with recorder.track("k"):
            barrier.wait()  # all three are inside at once
            recorder.record(i=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    records = recorder.take(3, timeout=30)
    for t in threads:
        t.join()
    assert sorted(r["i"] for r in records) == [0, 1, 2]
    assert recorder.max_concurrency("k") == 3
    assert recorder.concurrency("k") == 0
    assert recorder.max_concurrency("other") == 0


def test_recorder_take_times_out_with_what_it_got(recorder: Recorder) -> None:
    recorder.record(n=1)
    with pytest.raises(WaitTimeout, match="got 1 of 2"):
        recorder.take(2, timeout=0.2)
    recorder.expect_no_more(within=0.05)


def test_wait_until_wakes_on_a_keyspace_event(redisdb: redis.Redis) -> None:
    go = threading.Event()

    def writer() -> None:
        go.wait(30)
        redisdb.set("flag", "up")

    thread = threading.Thread(target=writer)
    thread.start()
    go.set()
    value = wait_until(lambda: redisdb.get("flag"), timeout=30, what="flag", redis=redisdb, keys=["flag"])
    thread.join()
    assert value == b"up"
    with pytest.raises(WaitTimeout, match="the missing key"):
        wait_until(lambda: redisdb.get("missing"), timeout=0.1, what="the missing key", redis=redisdb)


# --- SQL ------------------------------------------------------------------------------------


def test_postgres_gets_its_own_schema(postgres_engine: sa.Engine) -> None:
    with postgres_engine.begin() as conn:
        assert conn.execute(sa.text("SELECT current_schema()")).scalar_one().startswith("dgt_")
        conn.execute(sa.text("CREATE TABLE t (id int primary key)"))
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    with postgres_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1


def test_mariadb_gets_its_own_database(mariadb_engine: sa.Engine) -> None:
    with mariadb_engine.begin() as conn:
        assert conn.execute(sa.text("SELECT DATABASE()")).scalar_one().startswith("dgt_")
        conn.execute(sa.text("CREATE TABLE t (id int primary key)"))
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    with mariadb_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1


def test_sql_url_covers_every_backend(sql_engine: sa.Engine) -> None:
    table = sa.Table("t", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    table.metadata.create_all(sql_engine)
    with sql_engine.begin() as conn:
        conn.execute(table.insert().values(id=7))
    with sql_engine.connect() as conn:
        assert conn.execute(sa.select(table.c.id)).scalar_one() == 7


def test_unreachable_service_fails_in_ci_and_skips_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "test_needs_postgres.py").write_text("def test_it(postgres_url):\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ)
    env[POSTGRES_URL_ENV] = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rs", "-q"]
    cmd += ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)]

    def run(ci: str | None) -> subprocess.CompletedProcess[str]:
        run_env = {k: v for k, v in env.items() if k != "CI"}
        if ci is not None:
            run_env["CI"] = ci
        return subprocess.run(cmd, env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two pytest sessions, side by side
        in_ci_run, locally_run = pool.submit(run, "true"), pool.submit(run, None)
        in_ci, locally = in_ci_run.result(), locally_run.result()
    assert in_ci.returncode == 1, in_ci.stdout + in_ci.stderr
    assert "PostgreSQL is unreachable at postgresql+psycopg://postgres@127.0.0.1:1/nowhere" in in_ci.stdout
    assert "1 error" in in_ci.stdout and "skipped" not in in_ci.stdout

    assert locally.returncode == 0, locally.stdout + locally.stderr
    assert "1 skipped" in locally.stdout and "PostgreSQL is unreachable" in locally.stdout


# --- workers --------------------------------------------------------------------------------


def test_worker_runs_real_actors(actor_module, dramatiq_worker, recorder: Recorder, redisdb) -> None:  # type: ignore[no-untyped-def]
    actors = actor_module(actors_source())
    for n in range(6):
        actors.hello.send(n)
    assert redis_broker_pending(redisdb) == 6  # nothing consumes them yet

    worker = dramatiq_worker("actors", processes=2, threads=2)
    assert len(worker.worker_pids) == 2 and all(pid_alive(pid) for pid in worker.worker_pids)

    records = recorder.take(6, timeout=60)
    assert sorted(r["n"] for r in records) == list(range(6))
    assert {r["pid"] for r in records} <= set(worker.worker_pids)
    assert 1 <= recorder.max_concurrency("hello") <= 4
    wait_for_redis_broker_drain(redisdb, timeout=60)

    assert worker.stop() == 0
    assert "Worker process is ready for action." in worker.log


@pytest.mark.parametrize("processes", [1, 2])
def test_worker_process_can_be_killed_mid_actor(  # type: ignore[no-untyped-def]
    actor_module, dramatiq_worker, recorder: Recorder, processes: int
) -> None:
    actors = actor_module(actors_source())
    worker = dramatiq_worker("actors", processes=processes, threads=1)
    actors.hold.send()
    victim = recorder.take_one(timeout=60)["pid"]  # it is inside the actor, held by the gate
    assert victim in worker.worker_pids

    worker.kill_worker(victim)

    assert not pid_alive(victim)
    # Dramatiq's CLI stops every worker process when one dies, and exits with status 1 (its
    # status for a worker killed by a signal). Its "exited unexpectedly" line can be lost (see
    # harness.worker), so unexpected_exits may miss it, but never names another process.
    assert worker.wait_exit(timeout=60) == 1
    assert set(worker.unexpected_exits) <= {(victim, -9)}


def test_worker_that_cannot_boot_reports_its_log(tmp_path: Path, dramatiq_worker) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "broken.py").write_text("import dramatiq\nraise ImportError('no such thing, on purpose')\n")
    with pytest.raises(WorkerFailed, match="no such thing, on purpose"):
        dramatiq_worker("broken")


def test_worker_on_rabbitmq(  # type: ignore[no-untyped-def]
    actor_module, dramatiq_worker, recorder: Recorder, rabbitmq_url: str, rabbitmq_broker, unique_name: str
) -> None:
    actors = actor_module(actors_source(f"{unique_name}_q"), broker_url=rabbitmq_url)
    dramatiq_worker("actors", broker_url=rabbitmq_url, threads=2)
    for n in range(3):
        actors.hello.send(n)
    assert sorted(r["n"] for r in recorder.take(3, timeout=60)) == [0, 1, 2]
