"""The README's "run it" command, ``python -m examples.tour``, in each of its modes.

The tour checks every promise it shows and exits 1 if one does not hold, so exit status 0 is
the main assertion; the output's key lines are checked too. Each run is a subprocess started
from the repository root, as a user would start it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from harness import free_port, pid_alive

REPO_ROOT = Path(__file__).resolve().parent.parent

#: What every mode prints, whatever the ids and tokens.
KEY_LINES = [
    "100 sends for user 42 in a burst: 1 enqueued, 99 deduplicated",
    "the worker ran it once",
    "3 sends: one runs, two worker threads wait for the lock",
    "they ran one after another",
    "fencing tokens rising:",
    "4 more sends while it ran: all 4 dropped by the workers",
    "10 deliveries to customer 7: 2 run, 8 parked outside the queue",
    'Concurrency.set_limit("webhooks:7", 4): 2 waiters handed a slot at once, 4 running',
    "all 10 delivered, each once: never more than 2 at once, then never more than 4",
    'transfer("t-1", 1 -> 2, 10) sent twice: it ran once; the other message found t-1',
    "balances moved once: account 1 100 -> 90, account 2 0 -> 10",
    "ledger row t-1: completed, attempts 1",
    "the last save ran, with version 19, once the draft was quiet for 300 ms",
    "holders 0  limit 4  waiters 0",
]


def run_tour(*args: str, env: dict[str, str]) -> str:
    """Run the tour; return its output, after checking that it exited 0."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.tour", *args],
        cwd=REPO_ROOT,
        env=full_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for line in KEY_LINES:
        assert line in proc.stdout, f"{line!r} is missing from the tour's output:\n{output}"
    assert re.search(r"^Done in \d+\.\d s\.$", proc.stdout, re.M), output
    # The inspect view while 2 deliveries hold the key's slots and the rest wait.
    # The limit in force is the actor's default (2), as the sender recorded it with the waiters.
    shown = r"^ +holders 2  limit 2 \(actor default, as recorded with its waiters\)  waiters [1-8] "
    assert re.search(shown, proc.stdout, re.M), output
    return proc.stdout


def closed_url() -> str:
    """A Redis URL on which nothing listens."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.mark.worker
def test_the_tour_on_a_reachable_redis_leaves_nothing_there(redis_url: str, redisdb: redis.Redis) -> None:
    redisdb.set("users-own-key", "untouched")
    out = run_tour(env={"DRAMATIQ_GUARD_REDIS_URL": redis_url})
    assert f"Where: the Redis at {redis_url} (DRAMATIQ_GUARD_REDIS_URL)" in out
    assert "Worker: dramatiq examples.tour:worker_broker --processes 2 --threads 4 (pid " in out
    namespace = re.search(r'under "(guard-tour-[0-9a-f]+):"', out)
    assert namespace is not None, out
    assert f"$ dramatiq-guard --redis {redis_url} --namespace {namespace[1]} inspect" in out
    assert re.search(r"^Cleanup: \d+ Redis keys deleted$", out, re.M), out
    # Everything it wrote was under its own namespace, and is gone; the user's key is untouched.
    assert [key.decode() for key in redisdb.scan_iter()] == ["users-own-key"]


@pytest.mark.worker
def test_without_redis_the_tour_starts_a_private_redis_server_and_stops_it(redis_server_on_path: str) -> None:
    url = closed_url()
    out = run_tour(env={"DRAMATIQ_GUARD_REDIS_URL": url})
    assert f"Where: no Redis answers at {url}; started a private redis-server at redis://127.0.0.1:" in out
    pid = re.search(r"\(pid (\d+); stopped at the end\)", out)
    assert pid is not None, out
    assert not pid_alive(int(pid[1]))
    assert "Worker: dramatiq examples.tour:worker_broker" in out


@pytest.mark.parametrize("how", ["no redis-server on PATH", "--no-spawn"])
def test_without_redis_or_redis_server_the_tour_runs_in_process(how: str, tmp_path: Path) -> None:
    url = closed_url()
    env = {"DRAMATIQ_GUARD_REDIS_URL": url}
    args: list[str] = []
    if how == "--no-spawn":
        args.append("--no-spawn")
    else:
        env["PATH"] = str(tmp_path)  # an empty directory: no redis-server (nor anything else)
    out = run_tour(*args, env=env)
    assert f"Where: no Redis answers at {url} and {how}: in-process, on a StubBroker with" in out
    assert "Worker: dramatiq.Worker(broker, worker_threads=8): started" in out
    assert "dramatiq-guard inspect concurrency:webhooks:7 (the in-memory backend, in this process):" in out
    assert "Redis keys deleted" not in out


def test_the_tour_runs_in_process_when_asked() -> None:
    out = run_tour("--in-process", env={})
    assert "Where: in-process, as asked (--in-process)" in out
