"""A rolling deploy from the released version to the working tree, and a refused downgrade.

The release is the wheel of the commit that released :data:`RELEASED` (the newest commit in the
history whose ``dramatiq_guard/__init__.py`` declares that version; tags do not travel with every
clone), built from ``git archive`` and installed (not
editable, with its dependencies) into a virtualenv of its own, cached per commit (see the
``release`` fixture). Its ``dramatiq`` workers and producers run with that virtualenv's Python
and see nothing of the working tree but the actor module and ``tests/harness``; the working
tree's run as every other test's do. Both share one Redis: the broker's queues and the guard's
namespace.

The rolling deploy: a worker of the release and one of the working tree consume the same queues;
producers of both versions send concurrency-limited, mutex and deduplicated messages, many of
which park behind runs the old worker holds; the old worker is stopped (SIGTERM) while it holds
slots, mutexes and dedup locks, and a second worker of the working tree takes its queues. Every
message runs once, no limit is exceeded, no dedup key is admitted twice while its lock is held,
nothing of the guard is left and the layout record is the release's. The downgrade: the release
refuses to start on a namespace a newer layout was recorded in.

Without that commit in the clone (a shallow clone) the tests are skipped, and fail with
``CI=true``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from harness import (
    BROKER_URL_ENV,
    GUARD_REDIS_URL_ENV,
    REDIS_URL_ENV,
    DramatiqWorker,
    Recorder,
    WaitTimeout,
    guard_leftovers,
    unavailable,
    wait_for_redis_broker_drain,
    wait_until,
)

from dramatiq_guard.backends.redis_health import LAYOUT

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

#: The release the working tree must be able to replace, worker by worker.
RELEASED = "0.1.0"
#: Where a version declared its ``__version__`` (``__init__.py`` up to 0.1.0).
VERSION_FILES = ("dramatiq_guard/_version.py", "dramatiq_guard/__init__.py")
#: Where built releases are kept between runs (default: a directory in the system's temp dir).
RELEASE_CACHE_ENV = "DRAMATIQ_GUARD_TEST_RELEASE_CACHE"
#: Tells an actor module which worker runs it (``old``, ``new``, ``new2``; producers: ``producer``).
SIDE_ENV = "DRAMATIQ_GUARD_TEST_SIDE"
LAYOUT_KEY = "dramatiq-guard:layout"

#: The first test to run builds the release (about half a minute when nothing is cached).
pytestmark = [pytest.mark.worker, pytest.mark.timeout(240)]

ACTORS = """
import os
import time

import dramatiq
from harness import Gate, Recorder, broker_from_env

import dramatiq_guard
from dramatiq_guard.backends.redis_health import LAYOUT
from dramatiq_guard.middleware.dedup import deduplicated_by

# A RedisBroker's consumer stopping gracefully leaves what it fetched but had not handed to a worker
# thread in its acks, until a live worker's maintenance finds it dead (heartbeat_timeout, 60 s by
# default, looked at on 1 in 1,000 commands): a hand-off the old worker fetched in its last moments
# waited minutes, and its reservation kept its key for pickup_ttl (docs/failure-model.md). Looked
# at on every command here, after 15 s (the jobs are short: docs/failure-model.md says when that is safe).
broker = broker_from_env(heartbeat_timeout=15_000, maintenance_chance=1_000_000)
dramatiq_guard.install(broker)  # the guard's defaults, as a deploy has them
dramatiq.set_broker(broker)
rec = Recorder.from_env()
SIDE = os.environ.get("DRAMATIQ_GUARD_TEST_SIDE", "producer")
PACKAGE = os.path.dirname(dramatiq_guard.__file__)


def run(kind, key, n, hold):
    with rec.track(key):
        rec.record(phase="start", kind=kind, key=key, n=n, side=SIDE, package=PACKAGE)
        if hold:
            Gate.from_env("deploy").wait(timeout=60)  # until the old worker was told to stop
        else:
            time.sleep(0.005)  # the job's own work
    rec.record(phase="end", kind=kind, key=key, n=n, side=SIDE)


def by_key(key, n, hold):
    return key


@dramatiq.actor(concurrency={"limit": 2, "key": by_key}, max_retries=0, queue_name=QUEUE)
def limited(key, n, hold):
    run("limited", key, n, hold)


@dramatiq.actor(concurrency={"limit": 2, "key": by_key}, max_retries=0, queue_name=OLD_QUEUE)
def limited_on_old(key, n, hold):
    run("limited", key, n, hold)


@dramatiq.actor(mutex={"on_busy": "park", "key": by_key}, max_retries=0, queue_name=QUEUE)
def serial(key, n, hold):
    run("serial", key, n, hold)


@dramatiq.actor(mutex={"on_busy": "park", "key": by_key}, max_retries=0, queue_name=OLD_QUEUE)
def serial_on_old(key, n, hold):
    run("serial", key, n, hold)


@dramatiq.actor(dedup={"strategy": "until_executed", "key": ["key"]}, max_retries=0, queue_name=OLD_QUEUE)
def deduped(key, n, hold):
    run("deduped", key, n, hold)


@dramatiq.actor(dedup={"strategy": "until_executed", "key": ["key"]}, max_retries=0, queue_name=NEXT_QUEUE)
def deduped_later(key, n, hold):
    run("deduped", key, n, hold)


def produce(plan):
    sent = []
    for name, args in plan:
        message = globals()[name].send(*args)
        dup_of = deduplicated_by(message)
        sent.append({"actor": name, "args": args, "id": message.message_id, "dup_of": dup_of})
    return {"version": dramatiq_guard.__version__, "layout": LAYOUT, "package": PACKAGE, "sent": sent}
"""

PRODUCE = "import json, sys, actors; print(json.dumps(actors.produce(json.loads(sys.argv[1]))))"

Plan = list[tuple[str, list[Any]]]
Sent = dict[str, Any]
Record = dict[str, Any]


# --- the release ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Release:
    """The released version, installed from its wheel into a virtualenv of its own.

    Parameters:
      commit(str): The commit the tag names.
      python(Path): The virtualenv's interpreter.
      version(str): Its ``dramatiq_guard.__version__``.
      layout(int): The newest layout of the guard's state it reads (its ``LAYOUT``).
      package(str): The directory it imports ``dramatiq_guard`` from.
    """

    commit: str
    python: Path
    version: str
    layout: int
    package: str


def release_commit(version: str) -> str | None:
    """The newest commit in ``HEAD``'s history that declares ``version``, or None (no git, shallow).

    The commits that add or remove the line ``__version__ = "<version>"`` in one of
    :data:`VERSION_FILES` are candidates; the newest whose file holds it is the release (the next
    one moved on).
    """
    line = f'__version__ = "{version}"'

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        command = ["git", "-C", str(REPO_ROOT), *args]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    try:
        found = git("log", "--format=%H", "-G", re.escape(line), "HEAD", "--", *VERSION_FILES)
        if found.returncode != 0:
            return None
        for commit in found.stdout.split():
            for path in VERSION_FILES:
                shown = git("show", f"{commit}:{path}")
                if shown.returncode == 0 and line in shown.stdout.splitlines():
                    return commit
    except OSError:
        return None
    return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (pytest-xdist workers build a release one at a time)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_checked(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run ``cmd``; on failure raise an error with its output."""
    done = subprocess.run(list(cmd), capture_output=True, check=False, **kwargs)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace")
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{output}")
    return done


def release_dependencies(pyproject: Path) -> list[str]:
    """The ``[project] dependencies`` of ``pyproject`` (none known before Python 3.11: no tomllib)."""
    if sys.version_info >= (3, 11):
        import tomllib

        dependencies: list[str] = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
        return dependencies
    return []


def build_release(commit: str, venv: Path) -> None:
    """Build the wheel of ``commit`` and install it, with its dependencies, into a new ``venv``.

    The dependencies are installed while the wheel builds. The virtualenv has no pip of its
    own: this interpreter's pip installs into it (``pip --python``, pip >= 22.3), which saves
    the seconds of ``ensurepip``.
    """
    work = Path(tempfile.mkdtemp(prefix="dramatiq-guard-release-"))
    try:
        archive = run_checked(["git", "-C", str(REPO_ROOT), "archive", "--format=zip", commit]).stdout
        with zipfile.ZipFile(io.BytesIO(archive)) as source:
            source.extractall(work / "src")
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist")]
        building = subprocess.Popen(
            [*pip_wheel, str(work / "src")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            import pip

            if tuple(int(part) for part in pip.__version__.split(".")[:2]) >= (22, 3):
                run_checked([sys.executable, "-m", "venv", "--without-pip", str(venv)])
                install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
            else:
                run_checked([sys.executable, "-m", "venv", str(venv)])
                install = [str(venv / "bin" / "python"), "-m", "pip", "install"]
            dependencies = release_dependencies(work / "src" / "pyproject.toml")
            if dependencies:
                run_checked([*install, "-q", *dependencies], cwd=work)
        finally:
            output, _ = building.communicate()
        if building.returncode != 0:
            raise RuntimeError(
                f"pip wheel exited with {building.returncode}:\n{output.decode(errors='replace')}"
            )
        (wheel,) = (work / "dist").glob("dramatiq_guard-*.whl")
        run_checked([*install, "-q", str(wheel)], cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def release() -> Release:
    """The release :data:`RELEASED`, built once per commit and Python, then reused from the cache.

    The cache is ``$DRAMATIQ_GUARD_TEST_RELEASE_CACHE``, else ``dramatiq-guard-releases`` in the
    system's temp directory; a file lock lets parallel test processes share it.
    """
    commit = release_commit(RELEASED)
    if commit is None:
        unavailable(
            f"no commit declaring version {RELEASED} is in the history of this clone ({REPO_ROOT}); the "
            f"upgrade tests run that release's wheel beside the working tree: clone the full history"
        )
    base = hashlib.sha256(os.path.realpath(sys.base_prefix).encode()).hexdigest()[:8]
    key = f"v{RELEASED}-{commit[:12]}-py{sys.version_info.major}{sys.version_info.minor}-{base}"
    cache = Path(os.environ.get(RELEASE_CACHE_ENV) or Path(tempfile.gettempdir()) / "dramatiq-guard-releases")
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / key
    ready = venv / "release.json"
    with file_lock(cache / f"{key}.lock"):
        if not (ready.exists() and (venv / "bin" / "python").exists()):
            shutil.rmtree(venv, ignore_errors=True)  # a build that was interrupted
            build_release(commit, venv)
            describe = (
                "import json, os, dramatiq_guard; from dramatiq_guard.backends.redis_health import LAYOUT; "
                "print(json.dumps({'version': dramatiq_guard.__version__, 'layout': LAYOUT, "
                "'package': os.path.dirname(dramatiq_guard.__file__)}))"
            )
            facts = run_checked([str(venv / "bin" / "python"), "-I", "-c", describe], cwd=venv).stdout
            ready.write_bytes(facts)
    facts = json.loads(ready.read_text())
    return Release(commit=commit, python=venv / "bin" / "python", **facts)


def released_env(release: Release, redis_url: str, tmp_path: Path, side: str) -> dict[str, str]:
    """The environment of a process of the release: the harness's, and nothing of the working tree."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env.update(
        {
            REDIS_URL_ENV: redis_url,
            BROKER_URL_ENV: redis_url,
            GUARD_REDIS_URL_ENV: redis_url,
            SIDE_ENV: side,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS_DIR)]),
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env


class ReleasedWorker(DramatiqWorker):
    """A ``dramatiq`` worker run by the release's interpreter.

    Parameters:
      python(Path): The release's interpreter.
      *args, **kwargs: As for :class:`harness.DramatiqWorker`.
    """

    def __init__(self, python: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.python = python

    @property
    def command(self) -> list[str]:
        return [str(self.python), *super().command[1:]]


@pytest.fixture
def released_worker(
    release: Release, tmp_path: Path, redis_url: str
) -> Iterator[Callable[..., ReleasedWorker]]:
    """Starts ``dramatiq`` workers of the release (as ``dramatiq_worker`` does the working tree's).

    Each is stopped at teardown and its log printed (pytest shows it when the test failed).
    """
    workers: list[ReleasedWorker] = []

    def start(
        module: str,
        *,
        threads: int = 1,
        queues: Sequence[str] | None = None,
        wait_ready: bool = True,
        shutdown_timeout_ms: int = 5000,
    ) -> ReleasedWorker:
        worker = ReleasedWorker(
            release.python,
            module,
            threads=threads,
            env=released_env(release, redis_url, tmp_path, "old"),
            queues=queues,
            shutdown_timeout_ms=shutdown_timeout_ms,
            cwd=tmp_path,
        )
        workers.append(worker)
        worker.start()
        if wait_ready:
            worker.wait_ready()
        return worker

    yield start
    for worker in workers:
        worker.stop()
        print(f"--- dramatiq worker of the release {release.version} log:\n{worker.log}")


class ReleasedProducer:
    """Sends a plan of messages from a process of the release (``actors.produce``).

    Parameters:
      release(Release): The release.
      env(dict): Its environment (:func:`released_env`).
      cwd(Path): Where the actor module is.
      plan(list): ``(actor name, args)`` pairs, sent in order.
    """

    def __init__(self, release: Release, env: dict[str, str], cwd: Path, plan: Plan) -> None:
        self.proc = subprocess.Popen(
            [str(release.python), "-c", PRODUCE, json.dumps(plan)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for the producer; return what ``actors.produce`` returned."""
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"the release's producer failed:\n{err.decode(errors='replace')}"
        result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return result


# --- the journal ----------------------------------------------------------------------------


def collect_until(
    recorder: Recorder, done: Callable[[list[Record]], bool], what: str, timeout: float
) -> None:
    """Take the actors' records (``recorder.seen``) until ``done(recorder.seen)``.

    Raises:
      WaitTimeout: Not done within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not done(recorder.seen):
        try:
            recorder.take(1, timeout=max(deadline - time.monotonic(), 0.001))
        except WaitTimeout:
            raise WaitTimeout(f"{what}: not within {timeout:g}s; records: {recorder.seen!r}") from None


def runs(records: list[Record], phase: str) -> Counter[tuple[str, str, str]]:
    """How many times each ``(kind, key, n)`` logged ``phase`` (``start`` or ``end``)."""
    return Counter((r["kind"], r["key"], r["n"]) for r in records if r["phase"] == phase)


def expected_runs(sent: list[Sent]) -> Counter[tuple[str, str, str]]:
    """Each message that was enqueued (not deduplicated) once, as :func:`runs` names it."""
    return Counter(
        (s["actor"].split("_")[0], s["args"][0], s["args"][1]) for s in sent if s["dup_of"] is None
    )


# --- the tests ------------------------------------------------------------------------------


def actors_source(queue: str) -> str:
    names = f"QUEUE = {queue!r}\nOLD_QUEUE = {queue + '_old'!r}\nNEXT_QUEUE = {queue + '_next'!r}\n"
    return names + ACTORS


def held_on_old(side: str) -> Plan:
    """What ``side`` (``old`` or ``new``) sends first: the runs the old worker holds into the deploy.

    Messages only the old worker consumes, whose runs hold two slots of k0, one of k1, the
    mutexes m0 and m1 and the dedup locks d0 and d1 until the deploy starts; and the dedup
    holders e0 and e1, queued where only the second new worker consumes.
    """
    if side == "old":
        return [
            ("limited_on_old", ["k0", "old:h0", True]),
            ("limited_on_old", ["k0", "old:h1", True]),
            ("limited_on_old", ["k1", "old:h2", True]),
            ("serial_on_old", ["m0", "old:h3", True]),
            *[("deduped", ["d0", f"old:d{i}", True]) for i in range(3)],
            *[("deduped_later", ["e0", f"old:e{i}", False]) for i in range(3)],
        ]
    return [
        ("serial_on_old", ["m1", "new:h0", True]),
        *[("deduped", [key, f"new:d{i}", True]) for i in range(3) for key in ("d1", "d0")],
        *[("deduped_later", [key, f"new:e{i}", False]) for i in range(3) for key in ("e1", "e0")],
    ]


def busy(side: str, rounds: int = 12) -> Plan:
    """What ``side`` sends while the old worker holds: limited and serial messages, duplicates.

    k0's messages and the serial ones park behind the runs the old worker holds; k1's run one
    and k2's two at a time on either version's worker; every dedup send is a duplicate.
    """
    plan: Plan = []
    for i in range(rounds):
        plan += [("limited", [key, f"{side}:{key}:{i}", False]) for key in ("k0", "k1", "k2")]
        if i % 3 == 0:
            plan += [("serial", [key, f"{side}:{key}:{i}", False]) for key in ("m0", "m1")]
            plan += [("deduped", [key, f"{side}:x{i}", False]) for key in ("d0", "d1")]
            plan += [("deduped_later", [key, f"{side}:x{i}", False]) for key in ("e0", "e1")]
    return plan


def assert_one_admitted_per_key(sent: list[Sent]) -> None:
    """Every dedup key was admitted once, by either version; every other send names its holder."""
    by_key: dict[str, list[Sent]] = {}
    for s in sent:
        if s["actor"].startswith("deduped"):
            by_key.setdefault(s["args"][0], []).append(s)
    assert sorted(by_key) == ["d0", "d1", "e0", "e1"]
    for key, sends in by_key.items():
        admitted = [s for s in sends if s["dup_of"] is None]
        assert len(admitted) == 1, f"{key} admitted {len(admitted)} times while its lock was held: {admitted}"
        assert {s["dup_of"] for s in sends if s is not admitted[0]} == {admitted[0]["id"]}, key


def test_a_rolling_deploy_from_the_release_loses_nothing_and_exceeds_no_limit(
    release: Release,
    released_worker: Callable[..., ReleasedWorker],
    actor_module: Callable[..., ModuleType],
    dramatiq_worker: Callable[..., DramatiqWorker],
    recorder: Recorder,
    redisdb: redis.Redis,
    redis_url: str,
    unique_name: str,
    tmp_path: Path,
) -> None:
    queue = f"{unique_name}_q"
    queues = [queue, f"{queue}_old", f"{queue}_next"]
    actors = actor_module(actors_source(queue))
    producer_env = released_env(release, redis_url, tmp_path, "producer")
    # The old worker consumes the shared queue and its own; the new one only the shared queue.
    old = released_worker("actors", threads=10, queues=queues[:2], shutdown_timeout_ms=30_000)
    new = dramatiq_worker("actors", threads=4, queues=queues[:1], env={SIDE_ENV: "new"})

    # 1. Runs held on the old worker: both slots of k0, one of k1, the mutexes m0 and m1, the dedup
    # holders d0 and d1; the dedup holders e0 and e1 wait in a queue nobody consumes yet.
    old_sent = ReleasedProducer(release, producer_env, tmp_path, held_on_old("old")).result()
    sent: list[Sent] = old_sent["sent"] + actors.produce(held_on_old("new"))["sent"]
    collect_until(
        recorder,
        lambda records: sum(r["phase"] == "start" and r["side"] == "old" for r in records) == 7,
        "the 7 held runs started on the old worker",
        timeout=30,
    )

    # 2. Both versions send at once: k0 and the mutexes park (their holders run on the old
    # worker), k1 and k2 run one and two at a time on either worker, duplicates are dropped.
    producer = ReleasedProducer(release, producer_env, tmp_path, busy("old"))
    sent += actors.produce(busy("new"))["sent"]
    sent += producer.result()["sent"]
    collect_until(
        recorder,
        lambda records: sum(r["phase"] == "end" and r["key"] in {"k1", "k2"} for r in records) >= 6,
        "k1 and k2 runs",
        timeout=30,
    )

    # 3. The deploy: the old worker is stopped (SIGTERM) while it holds slots, mutexes and dedup
    # locks with messages parked behind them; a second new worker takes its queues.
    os.kill(old.pid, signal.SIGTERM)
    old.wait_for_log(r"Shutting down")
    sent += actors.produce(busy("late", rounds=3))["sent"]  # e0 and e1 are still queued: dropped
    recorder.gate("deploy").open(7)  # the held runs end during the old worker's shutdown
    new2 = dramatiq_worker("actors", threads=4, queues=queues, env={SIDE_ENV: "new2"})
    assert old.wait_exit(60) == 0, old.log

    expected = expected_runs(sent)
    collect_until(recorder, lambda records: runs(records, "end") == expected, "every message to run", 60)
    wait_for_redis_broker_drain(redisdb, queues)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)
    assert recorder.pending() == 0, "a message ran twice"
    assert runs(recorder.seen, "start") == expected

    assert_one_admitted_per_key(sent)
    for key in ("k0", "k1", "k2"):
        assert recorder.max_concurrency(key) <= 2, key
    for key in ("m0", "m1", "d0", "d1", "e0", "e1"):
        assert recorder.max_concurrency(key) == 1, key
    # Each side ran the code it was meant to: the release's from its virtualenv, ours from the tree.
    packages = {r["side"]: r["package"] for r in recorder.seen if r["phase"] == "start"}
    assert packages["old"] == release.package != packages["new2"] == str(REPO_ROOT / "dramatiq_guard")
    assert old_sent["package"] == release.package
    # Both read and keep the release's layout record.
    assert redisdb.get(LAYOUT_KEY) == str(release.layout).encode()
    assert release.layout <= LAYOUT

    # The locks the release took and the tree released (and the reverse) admit a new send at once.
    again = actors.produce([("deduped", ["d0", "new:again", False])])["sent"]
    again += ReleasedProducer(
        release, producer_env, tmp_path, [("deduped_later", ["e1", "old:again", False])]
    ).result()["sent"]
    assert [s["dup_of"] for s in again] == [None, None]
    collect_until(
        recorder, lambda records: runs(records, "end") == expected + expected_runs(again), "the new runs", 30
    )
    wait_for_redis_broker_drain(redisdb, queues)
    wait_until(lambda: not guard_leftovers(redisdb), what="no guard state left", redis=redisdb)
    # Nothing either version read of the other's failed: no hook raised, nothing was logged as an error.
    for worker in (old, new, new2):
        assert not re.search(r"Traceback|\[(ERROR|CRITICAL)\]", worker.log), worker.log


def test_the_release_refuses_a_namespace_a_newer_layout_was_recorded_in(
    release: Release,
    released_worker: Callable[..., ReleasedWorker],
    actor_module: Callable[..., ModuleType],
    redisdb: redis.Redis,
    redis_url: str,
    unique_name: str,
    tmp_path: Path,
) -> None:
    actor_module(actors_source(f"{unique_name}_q"))  # the working tree records its layout
    assert redisdb.get(LAYOUT_KEY) == str(LAYOUT).encode()
    newer = release.layout + 1
    redisdb.set(LAYOUT_KEY, newer)  # as a version whose state the release would misread does
    before = sorted(redisdb.keys("dramatiq-guard:*"))

    worker = released_worker("actors", wait_ready=False)
    assert worker.wait_exit(60) != 0
    assert "LayoutTooNew" in worker.log
    assert f"layout {newer}, written by a newer dramatiq-guard" in worker.log
    assert f"({release.version}) reads layouts up to {release.layout} only" in worker.log
    assert f"{release.package}/backends/redis_health.py" in worker.log  # raised by the release
    assert "ready for action" not in worker.log

    cli = [str(release.python), "-I", "-m", "dramatiq_guard.cli", "--redis", redis_url]
    command = subprocess.run(
        [*cli, "limit", "set", "k", "3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert command.returncode == 1, command
    assert f"layout {newer}" in command.stderr
    assert sorted(redisdb.keys("dramatiq-guard:*")) == before  # it wrote nothing
