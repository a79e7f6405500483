"""The guard backend contract (``dramatiq_guard/backends/base.py``), held against both backends.

Every test named ``test_*`` that takes ``env`` runs on the in-memory backend and on Redis (a
private server from pytest-redis, through the ``redisdb`` fixture of ``conftest.py``). A few
need several OS processes sharing one backend, so they run on Redis only.

Waits that wait on *time itself* (a lease or reservation lapsing) poll the backend's own clock
with a bounded deadline; everything else waits on an event.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from dramatiq_guard.backends import (
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    MemoryBackend,
    RedisBackend,
    ReleaseResult,
    Stake,
    Waiter,
    Woken,
)
from dramatiq_guard.backends.redis_client import RedisClient
from dramatiq_guard.backends.values import (
    DEBOUNCE_TIMER,
    HOLDERS_SHOWN,
    MIN_STANDBY_WINDOW,
    ORIGINAL_GENERATION,
)
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.lease import Lease
from dramatiq_guard.renewer import LeaseRenewer, get_renewer

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))

from backend_procs import contend  # noqa: E402
from harness import fakeredis_clock, free_port, redis_server_executable, wait_until  # noqa: E402

KEY = "slots:webhooks:42"
#: How long a bounded wait on time may take beyond what it waits for.
MARGIN_S = 10.0


class Env:
    """The backend under test, how to make more clients of it, and its clock.

    ``kind``: "memory", "redis" (the session's server) or "cluster" (a one-node Redis Cluster,
    which refuses any command or script whose keys are not all in one slot).
    """

    def __init__(self, kind: str, client: RedisClient | None, url: str | None, namespace: str) -> None:
        self.kind = kind
        self.client = client
        self.url = url
        self.namespace = namespace
        self._made: list[GuardBackend] = []
        self._clients: list[RedisClient] = []

    def backend(
        self,
        *,
        handoff_ttl_ms: int = 10_000,
        decode: bool = False,
        index_grace_ms: int = 0,
        socket_timeout: float | None = 5.0,
    ) -> GuardBackend:
        """A new backend (a new client, for Redis) with these settings."""
        made: GuardBackend
        if self.kind == "memory":
            made = MemoryBackend(handoff_ttl_ms=handoff_ttl_ms)
        else:
            assert self.url is not None
            client: RedisClient
            if self.kind == "cluster":
                client = RedisCluster.from_url(
                    self.url, decode_responses=decode, socket_timeout=socket_timeout
                )
            else:
                client = redis.Redis.from_url(
                    self.url, decode_responses=decode, socket_timeout=socket_timeout
                )
            made = RedisBackend(
                client,
                namespace=self.namespace,
                handoff_ttl_ms=handoff_ttl_ms,
                index_grace_ms=index_grace_ms,
            )
            self._clients.append(client)
        self._made.append(made)
        return made

    def another_client(self, backend: GuardBackend) -> GuardBackend:
        """A second client of the same store (the same object for the in-memory backend)."""
        if self.kind == "memory":
            return backend
        return self.backend(handoff_ttl_ms=backend.handoff_ttl_ms)

    def stored(self, pattern: str = "*") -> set[str]:
        """The names of the Redis keys under the namespace (in tests only: KEYS scans)."""
        assert self.client is not None
        return {k.decode() if isinstance(k, bytes) else k for k in self.client.keys(self.namespace + pattern)}

    def now_ms(self) -> int:
        """The backend's clock."""
        if self.client is None:
            return time.time_ns() // 1_000_000
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def wait_past(self, deadline_ms: int) -> None:
        """Wait until the backend's clock is past ``deadline_ms`` (a wait on time itself)."""
        give_up = time.monotonic() + (deadline_ms - self.now_ms()) / 1000 + MARGIN_S
        while self.now_ms() <= deadline_ms:
            assert time.monotonic() < give_up, "the backend's clock did not reach the deadline"
            time.sleep(0.01)

    def close(self) -> None:
        for backend in self._made:
            backend.close()
        for client in self._clients:
            client.close()


def _start_cluster_node(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start a one-node Redis Cluster owning every slot; returns the server and its port."""
    log = directory / "redis.log"
    # Both ports explicit: the default bus port (port + 10000) may be taken or out of range.
    port, bus_port = free_port(), free_port()
    server = subprocess.Popen(
        [redis_server_executable() or "redis-server",
         "--port", str(port), "--cluster-port", str(bus_port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
         "--cluster-config-file", str(directory / f"nodes-{port}.conf"), "--dir", str(directory),
         "--loglevel", "warning", "--logfile", str(log)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port, socket_connect_timeout=1)
    give_up = time.monotonic() + MARGIN_S
    try:
        while True:  # neither start-up nor the cluster state has an event to wait on
            try:
                if int(client.cluster("info").get("cluster_slots_assigned", 0)) == 0:
                    client.cluster("addslotsrange", 0, 16383)
                if client.cluster("info").get("cluster_state") == "ok":
                    return server, port
            except redis.ConnectionError:
                pass
            if server.poll() is not None or time.monotonic() > give_up:
                server.kill()
                server.wait()
                raise RuntimeError(f"the Redis Cluster node did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Redis Cluster for the whole session (a taken port is retried on others)."""
    directory = tmp_path_factory.mktemp("redis-cluster")
    for attempt in range(3):
        try:
            server, port = _start_cluster_node(directory)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.kill()
        server.wait()


def _env(request: pytest.FixtureRequest, kind: str, namespace: str) -> Env:
    if kind == "memory":
        return Env("memory", None, None, namespace)
    if kind == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        client = RedisCluster.from_url(url)
        client.flushall()
        made = Env("cluster", client, url, namespace)
        made._clients.append(client)
        return made
    client = request.getfixturevalue("redisdb")
    return Env("redis", client, request.getfixturevalue("redis_server_url"), namespace)


@pytest.fixture(params=["memory", "redis", "cluster"])
def env(request: pytest.FixtureRequest, unique_name: str) -> Iterator[Env]:
    made = _env(request, request.param, unique_name)
    yield made
    made.close()


@pytest.fixture(
    params=[("memory", False), ("redis", False), ("redis", True)],
    ids=["memory-in_this_process", "redis-in_this_process", "redis-killed_process"],
)
def crash_env(request: pytest.FixtureRequest, unique_name: str) -> Iterator[tuple[Env, bool]]:
    """An env, and whether the step that dies runs in a helper process that is SIGKILLed.

    The in-memory backend lives in one process: there, the caller "dies" by not taking the
    next step, which is all the backend can see of a death anyway.
    """
    kind, in_a_process = request.param
    made = _env(request, kind, unique_name)
    yield made, in_a_process
    made.close()


@pytest.fixture
def redis_env(redisdb: redis.Redis, redis_server_url: str, unique_name: str) -> Iterator[Env]:
    made = Env("redis", redisdb, redis_server_url, unique_name)
    yield made
    made.close()


def deadline_of(backend: GuardBackend, key: str, holder: str) -> int:
    return dict(backend.inspect(key).holders)[holder]


def wait_lapsed(env: Env, backend: GuardBackend, key: str, holder: str) -> None:
    """Wait until ``holder``'s lease of ``key`` lapsed; it has if an operation already reclaimed it
    (a slow machine can take longer than a short lease between two calls of a test)."""
    deadline = dict(backend.inspect(key).holders).get(holder)
    if deadline is not None:
        env.wait_past(deadline)


def waiter_ids(state: KeyState) -> list[str]:
    return [waiter for waiter, _, _ in state.waiters]


def park(backend: GuardBackend, waiter: str, *, limit: int = 1, key: str = KEY) -> None:
    result = backend.acquire(
        Stake(key, waiter, limit=limit, ttl_ms=60_000), wait=Waiter(payload=f"msg:{waiter}".encode())
    )
    assert not result.acquired and result.parked


def assert_drained(
    env: Env, backend: GuardBackend, *, key: str = KEY, limit: int | None = None, lapsed: Sequence[str] = ()
) -> None:
    """Nothing of ``key`` is left but its run-time limit (and its entry in the limits index), and
    its last fencing token if it issued one, expiring within ``stale_ttl_ms`` (so a token issued
    later, by a promoted replica whose clock is behind, is still above it).

    ``lapsed``: waiters of which a stale copy may still be on the broker (a hand-off lapsed
    unconfirmed, or a copy parked after pickup), so the generation that may start is remembered
    too, one record per waiter, each expiring within ``stale_ttl_ms``.
    """
    state = backend.inspect(key)
    assert dataclasses.replace(state, token=None) == KeyState((), (), (), limit, None)
    assert key not in backend.waiting_keys()
    assert (key in backend.limit_keys()) is (limit is not None)
    if env.client is not None:
        expected = (
            {f"{env.namespace}:{{{key}}}:limit", f"{env.namespace}:limits"} if limit is not None else set()
        )
        for waiter in lapsed:
            gens = f"{env.namespace}:{{{key}}}:gens:{waiter}"
            expected.add(gens)
            assert 0 < env.client.pttl(gens) <= backend.stale_ttl_ms
        token = f"{env.namespace}:{{{key}}}:token"
        if state.token is not None:
            expected.add(token)
            assert 0 < env.client.pttl(token) <= backend.stale_ttl_ms
        assert env.stored() == expected


# --- Processes (Redis) ------------------------------------------------------------------------


class Proc:
    """A helper process of ``backend_procs.py``, read line by line, killed at the end."""

    def __init__(self, env: Env, mode: str, *args: object, handoff_ttl_ms: int = 10_000) -> None:
        assert env.url is not None
        pythonpath = os.pathsep.join(
            [str(TESTS_DIR), str(TESTS_DIR.parent), os.environ.get("PYTHONPATH", "")]
        )
        self.popen = subprocess.Popen(
            [
                sys.executable,
                str(TESTS_DIR / "backend_procs.py"),
                mode,
                env.url,
                env.namespace,
                str(handoff_ttl_ms),
                *map(str, args),
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": pythonpath},
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        assert line, f"the helper process ended (exit code {self.popen.wait()})"
        result: dict[str, Any] = json.loads(line)
        return result

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def finish(self) -> int:
        return self.popen.wait(timeout=60)


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(env: Env, mode: str, *args: object, handoff_ttl_ms: int = 10_000) -> Proc:
        proc = Proc(env, mode, *args, handoff_ttl_ms=handoff_ttl_ms)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.kill()
        if proc.popen.stdout is not None:
            proc.popen.stdout.close()


# --- At most `limit` holders ------------------------------------------------------------------


def test_at_most_limit_holders_while_16_threads_contend(env: Env, procs: Callable[..., Proc]) -> None:
    backend = env.backend()
    limit, rounds = 3, 12
    if env.kind == "memory":
        inside = 0
        lock = threading.Lock()

        def enter(token: int) -> int:
            nonlocal inside
            with lock:
                inside += 1
                return inside

        def leave() -> None:
            nonlocal inside
            with lock:
                inside -= 1

        results = [contend(backend, KEY, limit=limit, threads=16, rounds=rounds, enter=enter, leave=leave)]
    else:
        # 2 processes x 8 threads; holders INCR/DECR a counter in Redis when they enter/leave.
        started = [procs(env, "contend", KEY, limit, 8, rounds) for _ in range(2)]
        results = [proc.read() for proc in started]
        assert [proc.finish() for proc in started] == [0, 0]
    assert sum(r["count"] for r in results) == 16 * rounds
    assert max(r["max"] for r in results) == limit  # never more, and contention did happen
    tokens = [token for r in results for token in r["tokens"]]
    assert len(set(tokens)) == len(tokens)
    assert_drained(env, backend)


def test_fencing_tokens_grow_across_processes(redis_env: Env, procs: Callable[..., Proc]) -> None:
    # A mutex taken in turn by 2 processes x 4 threads; each holder logs its token while it
    # holds the mutex, so the log is in acquisition order. The key falls idle and is recreated
    # many times on the way.
    started = [procs(redis_env, "contend", KEY, 1, 4, 10) for _ in range(2)]
    results = [proc.read() for proc in started]
    assert [proc.finish() for proc in started] == [0, 0]
    assert [r["max"] for r in results] == [1, 1]
    assert redis_env.client is not None
    tokens = [int(t) for t in redis_env.client.lrange(f"test:{{{KEY}}}:tokens", 0, -1)]
    assert len(tokens) == 80
    assert all(earlier < later for earlier, later in itertools.pairwise(tokens))
    backend = redis_env.backend()
    later = backend.acquire(Stake(KEY, "later", limit=1, ttl_ms=1000))
    assert later.token is not None and later.token > max(tokens)


def test_fencing_tokens_strictly_increase(env: Env) -> None:
    first = env.backend()
    second = env.another_client(first)
    tokens: list[int | None] = []
    for backend, holder in [(first, "a"), (second, "b"), (first, "c")]:
        result = backend.acquire(Stake(KEY, holder, limit=3, ttl_ms=60_000))
        assert result.acquired
        tokens.append(result.token)
    again = second.acquire(Stake(KEY, "a", limit=3, ttl_ms=120_000))  # re-entrant: a new token too
    assert again.acquired and again.holders == ()  # an acquired reply names nobody
    assert backend_holders(second) == ["b", "c", "a"]
    tokens.append(again.token)
    for holder in "abc":
        assert first.release(KEY, holder, limit=3).released
    assert_drained(env, first)  # the key's state, token included, is gone...
    recreated = second.acquire(Stake(KEY, "d", limit=3, ttl_ms=60_000))
    tokens.append(recreated.token)  # ...and the next token is still greater
    assert None not in tokens
    assert tokens == sorted(t for t in tokens if t is not None) and len(set(tokens)) == len(tokens)


# --- Release, lapse, renewal ------------------------------------------------------------------


def test_release_by_a_non_holder_is_refused(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    refused = backend.release(KEY, "intruder", limit=1)
    assert refused.released is False
    assert backend.inspect(KEY).holders[0][0] == "a"
    assert backend.release(KEY, "a", limit=1).released
    assert backend.release(KEY, "a", limit=1).released is False  # twice: not a holder any more
    assert_drained(env, backend)


def test_release_many_is_each_release_in_order(env: Env) -> None:
    backend = env.backend()
    other = f"{KEY}:other"
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p")
    assert backend.acquire(Stake(other, "b", limit=2, ttl_ms=60_000)).acquired
    handed, freed, refused, empty = backend.release_many(
        [(KEY, "a", 1, 0), (other, "b", 2, 0), (other, "intruder", 2, 0), (f"{KEY}:none", "c", 1, 0)]
    )
    assert handed.released and [h.waiter_id for h in handed.handoffs] == ["p"]  # the waiter gets the slot
    assert handed.handoffs[0].payload == b"msg:p"
    assert freed == ReleaseResult(True, (), ())
    assert refused.released is False and empty.released is False  # a non-holder changes nothing
    assert backend.inspect(other).holders == ()
    assert backend.release_many([]) == []


def test_leases_released_together_report_as_each_would_alone(env: Env) -> None:
    from dramatiq_guard.lease import release_leases

    backend = env.backend()
    held = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000))
    early = backend.acquire(Stake(f"{KEY}:2", "b", limit=1, ttl_ms=60_000))
    short = backend.acquire(Stake(f"{KEY}:3", "c", limit=1, ttl_ms=200))
    assert held.token is not None and early.token is not None and short.token is not None
    leases = [
        Lease(backend, KEY, "a", held, limit=1, ttl_ms=60_000),
        Lease(backend, f"{KEY}:2", "b", early, limit=1, ttl_ms=60_000),
        Lease(backend, f"{KEY}:3", "c", short, limit=1, ttl_ms=200, cap_ms=200),
    ]
    first = leases[1].release()  # released before: keeps its first result
    wait_lapsed(env, backend, f"{KEY}:3", "c")
    assert backend.acquire(Stake(f"{KEY}:3", "d", limit=1, ttl_ms=60_000)).acquired  # c lapsed and was taken
    results = release_leases(backend, [(lease, 0) for lease in leases])
    assert [r.released for r in results] == [True, True, False]
    assert results[1] is first
    assert [lease.lost for lease in leases] == [False, False, True]
    assert all(lease.released for lease in leases)
    assert backend.inspect(KEY).holders == () and [h for h, _ in backend.inspect(f"{KEY}:3").holders] == ["d"]


def test_holders_carry_since_and_info_until_they_go(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=60_000)
    before = env.now_ms()
    assert backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=60_000, info="report")).acquired
    assert backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=200)).acquired  # no info: only since
    park(backend, "p1", limit=2)
    [(holder, since, info), (other, _, no_info)] = sorted(backend.inspect(KEY).holder_info)
    assert (holder, info, other, no_info) == ("a", "report", "b", None)
    assert before <= since <= env.now_ms()
    assert backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=60_000, info="again")).acquired  # re-entrant
    assert ("a", since, "report") in backend.inspect(KEY).holder_info  # keeps its since and info
    wait_lapsed(env, backend, KEY, "b")
    [handoff] = backend.sweep(KEY, limit=2).handoffs  # b lapsed: p1 is handed the slot...
    assert handoff.waiter_id == "p1"
    assert [h for h, _, _ in backend.inspect(KEY).holder_info] == ["a"]  # ...a reservation has none
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.acquire(Stake(KEY, "p1", limit=2, ttl_ms=60_000, info="park")).acquired
    assert {(h, i) for h, _, i in backend.inspect(KEY).holder_info} == {("a", "report"), ("p1", "park")}
    assert backend.release(KEY, "a", limit=2).released
    assert [h for h, _, _ in backend.inspect(KEY).holder_info] == ["p1"]
    assert backend.release(KEY, "p1", limit=2).released
    assert_drained(env, backend)


# --- Runners: two copies of one message never hold a slot at once ---------------------------


def test_a_second_copy_of_a_running_holder_is_refused_with_nothing_done(env: Env) -> None:
    """The broker delivers a running message again (RabbitMQ, a lost connection): refused as running."""
    backend = env.backend()
    first = backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, info="report", runner="p1:1"))
    assert first.acquired
    park(backend, "p")  # a waiter too: the full path, not only the fast one
    before = backend.inspect(KEY)
    for wait in (None, Waiter(payload=b"msg:m"), Waiter(wait_ms=60_000)):
        for runner in ("p2:7", None):  # another thread; or none: the message sent again meanwhile
            again = backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner=runner), wait=wait)
            assert again.running and not again.acquired and not again.parked and again.token is None
            assert again.lapses_in_ms is not None and 0 < again.lapses_in_ms <= 60_000  # its lease's end
            assert backend.inspect(KEY) == before  # not queued, not renewed, nothing handed on
    same = backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p1:1"))  # its own thread
    assert same.acquired and not same.running
    assert ("m", "report") in {(h, i) for h, _, i in backend.inspect(KEY).holder_info}
    assert backend.release(KEY, "m", limit=1).handoffs[0].waiter_id == "p"
    later = backend.acquire(
        Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p2:7")
    )  # released: no longer running
    assert not later.running and not later.acquired and later.holders == ("p",)


def test_a_reservation_is_taken_up_by_whichever_thread_picks_it_up(env: Env) -> None:
    """A slot reserved at enqueue (no runner) or handed on is anyone's; then it is that runner's."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=5_000), wait=Waiter(payload=b"msg:m")).acquired
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p2:7")).acquired
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p1:1")).running
    assert backend.release(KEY, "m", limit=1).released
    assert_drained(env, backend)


def test_a_second_copy_of_a_blocked_waiter_is_refused_and_the_slot_goes_to_the_first(env: Env) -> None:
    """A thread blocks for a slot; a second copy of its message, on another thread, is refused, and
    the slot handed to the waiter is held for the first thread's runner."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    blocked = backend.acquire(
        Stake(KEY, "w", limit=1, ttl_ms=60_000, runner="p1:1"), wait=Waiter(wait_ms=60_000)
    )
    assert blocked.parked and not blocked.running
    before = backend.inspect(KEY)
    second = backend.acquire(
        Stake(KEY, "w", limit=1, ttl_ms=60_000, runner="p2:7"), wait=Waiter(wait_ms=60_000)
    )
    assert second.running and not second.parked and backend.inspect(KEY) == before
    assert second.lapses_in_ms is not None and 0 < second.lapses_in_ms <= 60_000  # the first's wait
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w", None),)
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000, runner="p2:7")).running  # w's is p1:1's
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000, runner="p1:1")).acquired  # a missed wake
    assert backend.release(KEY, "w", limit=1).released
    assert_drained(env, backend)


def test_a_dead_runners_holder_is_free_for_another_once_its_lease_lapsed(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=200, runner="p1:1")).acquired
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p2:7")).running
    wait_lapsed(env, backend, KEY, "m")
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p2:7")).acquired
    assert backend.release(KEY, "m", limit=1).released
    assert_drained(env, backend)


def test_a_waiter_refused_as_running_leaves_the_other_copys_slot_alone(env: Env) -> None:
    """Claim.block gives up on a refusal as running without cancelling: the entry is the other copy's."""
    from dramatiq_guard.claim import Claim

    backend = env.backend()
    assert backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="p2:7")).acquired
    claim = Claim(KEY, "m", limit=1, ttl_ms=60_000, runner="p1:1", backend=backend)
    result = claim.block(time.monotonic(), lambda _: None)
    assert result.running and not result.acquired
    assert backend_holders(backend) == ["m"]  # still the other copy's
    assert backend.release(KEY, "m", limit=1).released
    assert_drained(env, backend)


@pytest.mark.parametrize("runner", ["", "a|b", "a@b", "x" * 201])
def test_a_runner_the_backends_cannot_keep_is_refused(env: Env, runner: str) -> None:
    backend = env.backend()
    with pytest.raises(ValueError, match="a runner must be a non-empty str of at most 200 characters"):
        backend.acquire(Stake(KEY, "m", limit=1, ttl_ms=60_000, runner=runner))
    assert backend.inspect(KEY).holders == ()


def test_a_lapsed_holder_is_reclaimed(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=200)).acquired
    refused = backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=60_000))
    assert not refused.acquired and refused.holders == ("a",) and refused.token is None
    wait_lapsed(env, backend, KEY, "a")
    assert backend.renew(KEY, "a", ttl_ms=60_000) is False  # a lapsed lease is never revived
    taken = backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=60_000))
    assert taken.acquired and backend_holders(backend) == ["b"]
    assert backend.release(KEY, "a", limit=1).released is False  # the lapsed holder is told
    assert backend.release(KEY, "b", limit=1).released
    assert_drained(env, backend)


def test_the_memory_backend_runs_on_its_servers_clock_which_a_test_can_drive() -> None:
    """The in-memory backend's clock is its fakeredis server's ``TIME``: a test moves it
    (:func:`harness.fakeredis_clock`), and leases lapse without sleeping."""
    now_ms = [1_900_000_000_000]
    with fakeredis_clock(lambda: now_ms[0]):
        backend = MemoryBackend()
        first = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=1_000))
        # A token is at least the time in us (TIME reads <ms>.000500 s on this clock).
        assert first.acquired and first.token == now_ms[0] * 1000 + 500
        assert deadline_of(backend, KEY, "a") == now_ms[0] + 1_000
        now_ms[0] += 999
        assert not backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=1_000)).acquired
        now_ms[0] += 1  # the deadline itself: lapsed, without sleeping
        taken = backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=1_000))
        assert taken.acquired and backend_holders(backend) == ["b"] and taken.token == now_ms[0] * 1000 + 500
        assert backend.release(KEY, "b", limit=1).released


# Leases of a second: long enough that a loaded machine's stall (GC, a busy CI box) does not
# pass for a lapse; the tests still wait on the backend's clock, never on a guess.
TTL = 1_000


def test_renewal_keeps_a_lease_alive_past_its_ttl(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=TTL)).acquired
    first_deadline = deadline_of(backend, KEY, "a")
    while env.now_ms() <= first_deadline + TTL:  # renew by hand across two ttls
        assert backend.renew(KEY, "a", ttl_ms=TTL)
        time.sleep(0.05)
    assert not backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=TTL)).acquired
    assert backend.renew_many([(KEY, "a", TTL), (KEY, "b", TTL), ("other", "a", TTL)]) == [True, False, False]
    assert backend.release(KEY, "a", limit=1).released


def test_a_large_renewal_batch_reports_each_lease_in_order(env: Env) -> None:
    """More leases than one script call renews (RENEWALS_PER_CALL), of many keys and, interleaved
    with them, many of one key (a Redis Cluster batches those): every answer in its place."""
    backend = env.backend()
    leases = [(f"batch-{i}", "a") if i % 2 else ("wide", f"w{i}") for i in range(900)]
    held = [i % 3 != 0 for i in range(len(leases))]
    for (key, holder), holds in zip(leases, held, strict=True):
        if holds:
            assert backend.acquire(Stake(key, holder, limit=1_000, ttl_ms=60_000)).acquired
    before = {lease: deadline_of(backend, *lease) for lease, holds in zip(leases, held, strict=True) if holds}
    renewed = backend.renew_many([(key, holder, 120_000) for key, holder in leases])
    assert renewed == held
    assert all(deadline_of(backend, *lease) > deadline for lease, deadline in before.items())


def test_the_renewer_keeps_leases_alive_and_reports_lost_ones(env: Env) -> None:
    backend = env.backend()
    renewer = LeaseRenewer()
    try:
        assert backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=TTL)).acquired
        assert backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=TTL)).acquired
        handle_a = renewer.register(backend, KEY, "a", TTL)
        handle_b = renewer.register(backend, KEY, "b", TTL)
        first_deadline = deadline_of(backend, KEY, "a")
        env.wait_past(first_deadline + TTL)
        assert {h for h, _ in backend.inspect(KEY).holders} == {"a", "b"}
        assert not handle_a.lost and not handle_b.lost
        # Released by force: the next renewal finds it gone and reports it.
        assert backend.release(KEY, "b", limit=2).released
        assert handle_b.wait_lost(MARGIN_S)
        assert renewer.leases == 1
        # Unregistered: renewal stops at once and the lease lapses within a ttl.
        handle_a.unregister()
        last_deadline = deadline_of(backend, KEY, "a")
        env.wait_past(last_deadline)
        assert backend.acquire(Stake(KEY, "c", limit=1, ttl_ms=1000)).acquired and backend_holders(
            backend
        ) == ["c"]
        assert not handle_a.lost
    finally:
        renewer.stop(MARGIN_S)


class RecordingBackend(MemoryBackend):
    """A memory backend that records each ``renew_many`` batch, and can play unreachable."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.unreachable = False
        self.renewed_twice = threading.Event()

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches.append(len(leases))
        if len(self.batches) >= 2:
            self.renewed_twice.set()
        if self.unreachable:
            raise BackendUnavailable("the test made the backend unreachable")
        return super().renew_many(leases)


def test_the_renewer_batches_the_leases_of_a_backend() -> None:
    backend = RecordingBackend()
    renewer = LeaseRenewer()
    try:
        # All three held first, then registered at once, so the first round finds them all.
        for holder in "abc":
            assert backend.acquire(Stake(KEY, holder, limit=3, ttl_ms=1_000)).acquired
        for holder in "abc":
            renewer.register(backend, KEY, holder, 1_000)
        assert backend.renewed_twice.wait(MARGIN_S)
        assert set(backend.batches) == {3}  # one call per round for the three leases
    finally:
        renewer.stop(MARGIN_S)


def test_a_lease_that_cannot_be_renewed_for_a_whole_ttl_is_lost() -> None:
    backend = RecordingBackend()
    renewer = LeaseRenewer()
    try:
        # 1 s, not shorter: on a loaded machine the renewer's thread must get its turns to retry.
        assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=1_000)).acquired
        handle = renewer.register(backend, KEY, "a", 1_000)
        backend.unreachable = True
        assert handle.wait_lost(MARGIN_S)
        assert len(backend.batches) >= 2  # it was retried before being given up
        assert renewer.leases == 0
    finally:
        renewer.stop(MARGIN_S)


def test_a_killed_holders_lease_lapses_within_a_ttl(redis_env: Env, procs: Callable[..., Proc]) -> None:
    backend = redis_env.backend()
    ttl = 500
    holder = procs(redis_env, "hold", KEY, "doomed", ttl)
    first = holder.read()
    # The process's renewer keeps the lease past its ttl...
    redis_env.wait_past(first["deadline"] + ttl)
    assert not backend.acquire(Stake(KEY, "next", limit=1, ttl_ms=1000)).acquired
    holder.kill()
    killed_at = redis_env.now_ms()
    # ...and once it is killed, the lease lapses within one ttl.
    assert deadline_of(backend, KEY, "doomed") <= killed_at + ttl
    give_up = time.monotonic() + ttl / 1000 + MARGIN_S
    while not (taken := backend.acquire(Stake(KEY, "next", limit=1, ttl_ms=1000))).acquired:
        assert time.monotonic() < give_up
        time.sleep(0.02)
    assert taken.token is not None and taken.token > first["token"]


def test_a_waiter_killed_between_its_wake_and_its_renewal_strands_nothing(
    redis_env: Env, procs: Callable[..., Proc]
) -> None:
    # The worst moment of a hand-off by push: the waiter took its token (it holds the slot) and
    # died before its lease was renewed. The slot lapses within the hand-off reservation and goes
    # on, with a higher token.
    backend = redis_env.backend(handoff_ttl_ms=1_000)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    doomed = procs(redis_env, "woken", KEY, "doomed", handoff_ttl_ms=1_000)
    assert doomed.read() == {"queued": True}
    assert backend.acquire(Stake(KEY, "next", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "doomed", None),)
    token = doomed.read()["token"]
    reserved_until = deadline_of(backend, KEY, "doomed")
    doomed.kill()
    assert reserved_until <= redis_env.now_ms() + 1_000
    redis_env.wait_past(reserved_until)
    swept = backend.sweep(KEY, limit=1)  # what every worker's sweep does each second
    # (Not swept.released: the holders zset expired with doomed's reservation, its last
    # deadline, so there was nothing left to reclaim; see RedisBackend.sweep.)
    assert swept.handoffs == (Handoff(KEY, "next", None),)
    woken = backend.wait_for_handoff(KEY, "next", timeout_ms=10_000)
    assert woken is not None and woken.token > token
    assert backend.release(KEY, "next", limit=1).released
    assert_drained(redis_env, backend)


def test_the_renewer_is_per_process_and_fresh_after_fork() -> None:
    parent = get_renewer()
    assert get_renewer() is parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh renewer of its own, then exit without pytest's cleanup
        os.close(read)
        os.write(write, b"fresh" if get_renewer() is not parent and get_renewer().leases == 0 else b"same")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"fresh"
    os.waitpid(pid, 0)


# --- Parked payloads and hand-off -------------------------------------------------------------


def test_parked_payloads_come_out_fifo_and_reparking_keeps_the_place(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2", "p3", "p4"]:
        park(backend, waiter)
    park(backend, "p2")  # again: keeps its place
    state = backend.inspect(KEY)
    assert waiter_ids(state) == ["p1", "p2", "p3", "p4"]
    assert all(parked for _, _, parked in state.waiters)
    assert KEY in backend.waiting_keys()
    # A newcomer does not jump the queue.
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    out = ["p1"]
    holder = "p1"
    while True:
        assert backend.confirm_handoff(KEY, holder, ttl_ms=60_000)  # re-enqueued on the broker
        started = backend.acquire(Stake(KEY, holder, limit=1, ttl_ms=60_000))  # the message starts
        assert started.acquired and started.handoffs == ()
        released = backend.release(KEY, holder, limit=1)
        assert released.released
        if not released.handoffs:
            break
        [handoff] = released.handoffs
        assert handoff.payload == f"msg:{handoff.waiter_id}".encode()
        holder = handoff.waiter_id
        out.append(holder)
    assert out == ["p1", "p2", "p3", "p4"]
    assert_drained(env, backend)


def hand_off_all(backend: GuardBackend, holder: str, *, key: str = KEY) -> list[str]:
    """Release ``holder``, then run each parked waiter handed the slot in turn: who ran, in order."""
    out: list[str] = []
    while True:
        released = backend.release(key, holder, limit=1)
        assert released.released
        if not released.handoffs:
            return out
        [handoff] = released.handoffs
        holder = handoff.waiter_id
        out.append(holder)
        assert backend.confirm_handoff(key, holder, ttl_ms=60_000)
        assert backend.acquire(Stake(key, holder, limit=1, ttl_ms=60_000)).acquired


def test_waiters_are_handed_off_by_priority_then_in_order(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    parks = [("p1", 5), ("p2", 0), ("p3", -3), ("p4", 0), ("p5", 5), ("p6", -3), ("p7", 2048), ("p8", -2048)]
    before_ms = int(time.time() * 1000)
    for waiter, priority in [*parks, ("p2", 0)]:  # p2 again: keeps its place
        stake = Stake(KEY, waiter, limit=1, ttl_ms=60_000, priority=priority)
        assert backend.acquire(stake, Waiter(payload=f"msg:{waiter}".encode())).parked
    blocked = backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=60_000, priority=-3), Waiter(wait_ms=60_000))
    assert blocked.parked
    after_ms = int(time.time() * 1000)  # after b queued too (on a loaded machine it can be ms later)
    order = ["p8", "p3", "p6", "b", "p2", "p4", "p1", "p5", "p7"]
    state = backend.inspect(KEY)
    assert waiter_ids(state) == order
    # A place runs ahead of the clock by at most one per park before it in its priority.
    assert all(before_ms <= since <= after_ms + len(parks) + 1 for _, since, _ in state.waiters)
    [summary] = backend.summaries([KEY], waiters=2)
    assert [peek.waiter_id for peek in summary.first] == ["p8", "p3"]
    assert summary.oldest_since_ms == state.waiters[0][1]
    assert backend.cancel_wait(KEY, "b", limit=1).handoffs == ()
    assert hand_off_all(backend, "a") == [w for w in order if w != "b"]
    assert_drained(env, backend)


def test_acquire_many_acquires_each_key_on_its_own_and_queues_nothing(env: Env) -> None:
    """One round trip for several keys (a list's guards): each acquire as alone, a refusal parks nothing."""
    backend = env.backend()
    other = KEY + "-other"
    assert backend.acquire(Stake(other, "holder", limit=1, ttl_ms=60_000, fenced=False)).acquired
    results = backend.acquire_many(
        [Stake(KEY, "m", limit=1, ttl_ms=60_000, runner="w1"), Stake(other, "m", limit=1, ttl_ms=60_000)]
    )
    assert [r.acquired for r in results] == [True, False]
    assert results[0].token is not None and results[1].holders == ("holder",)
    assert backend.inspect(other).waiters == ()  # refused without a wait: not queued
    assert backend.acquire_many([]) == []
    for key, holder in ((KEY, "m"), (other, "holder")):
        assert backend.release(key, holder, limit=1).released
    assert_drained(env, backend)


def test_give_back_releases_a_reservation_and_never_a_slot_a_runner_took(env: Env) -> None:
    """A copy parked on another key gives back what it holds reserved here, never a runner's lease."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "reserved", limit=2, ttl_ms=60_000)).acquired  # at send: no runner
    assert backend.acquire(Stake(KEY, "running", limit=2, ttl_ms=60_000, runner="w1")).acquired
    assert not backend.give_back(KEY, "running", limit=2).released
    assert not backend.give_back(KEY, "nobody", limit=2).released
    assert backend.give_back(KEY, "reserved", limit=2).released
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["running"]
    assert backend.release(KEY, "running", limit=2).released
    assert_drained(env, backend)


def test_a_priority_out_of_range_is_refused(env: Env) -> None:
    backend = env.backend()
    for priority in (2049, -2049, 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer from -2048 to 2048"):
            backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=1_000, priority=priority))  # type: ignore[arg-type]
    assert backend.inspect(KEY) == KeyState((), (), (), None, None)


def test_a_waiter_parked_before_priorities_is_handed_off_among_the_defaults(env: Env) -> None:
    """A place written by a version without priorities (the server's time in us) is priority 0's."""
    backend = env.backend()
    assert isinstance(backend, RedisBackend)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    seconds, micros = backend.client.time()
    names = f"{backend.namespace}:{{{KEY}}}:"
    backend.client.zadd(names + "waiters", {"old": seconds * 1_000_000 + micros})
    backend.client.hset(names + "payloads", "old", b"msg:old")
    for waiter, priority in [("late", 1), ("new", 0), ("urgent", -1)]:
        stake = Stake(KEY, waiter, limit=1, ttl_ms=60_000, priority=priority)
        assert backend.acquire(stake, Waiter(payload=f"msg:{waiter}".encode())).parked
    state = backend.inspect(KEY)
    assert waiter_ids(state) == ["urgent", "old", "new", "late"]
    assert state.waiters[1][1] == seconds * 1000 + micros // 1000
    assert hand_off_all(backend, "a") == ["urgent", "old", "new", "late"]
    assert_drained(env, backend)


def test_an_acquirer_with_free_slots_lets_waiters_go_first(env: Env) -> None:
    backend = env.backend()
    backend.set_limit(KEY, 0)
    park(backend, "p1", limit=2)
    park(backend, "p2", limit=2)
    backend.set_limit(KEY, None)  # the default (2) is back, but nobody acted on it yet
    result = backend.acquire(Stake(KEY, "p1", limit=2, ttl_ms=60_000))  # p1 itself starts: no hand-off of p1
    assert result.acquired and result.handoffs == (Handoff(KEY, "p2", b"msg:p2"),)
    newcomer = backend.acquire(Stake(KEY, "n", limit=2, ttl_ms=60_000))
    assert not newcomer.acquired and newcomer.holders == ("p2", "p1")


def test_a_handoff_whose_caller_dies_before_confirming_goes_back_to_the_head(
    crash_env: tuple[Env, bool], procs: Callable[..., Proc]
) -> None:
    env, in_a_process = crash_env
    backend = env.backend(handoff_ttl_ms=300)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    if in_a_process:
        proc = procs(env, "handoff", KEY, "a", 1, "released", handoff_ttl_ms=300)
        assert proc.read() == {"released": True, "handoffs": [["p1", "msg:p1"]]}
        proc.kill()
    else:
        assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    # The caller died before re-enqueuing and confirming: the slot stays reserved for p1...
    state = backend.inspect(KEY)
    assert state.reserved == ("p1",) and waiter_ids(state) == ["p2"]
    assert not backend.acquire(Stake(KEY, "n", limit=1, ttl_ms=60_000)).acquired
    # ...until the reservation lapses; then p1 is back at the head with its payload.
    wait_lapsed(env, backend, KEY, "p1")
    assert backend.sweep(KEY, limit=1) == ReleaseResult(True, (Handoff(KEY, "p1", b"msg:p1"),))
    assert waiter_ids(backend.inspect(KEY)) == ["p2"]


def test_a_confirmed_handoff_is_not_duplicated_when_its_caller_dies(
    crash_env: tuple[Env, bool], procs: Callable[..., Proc]
) -> None:
    env, in_a_process = crash_env
    backend = env.backend(handoff_ttl_ms=300)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    if in_a_process:
        proc = procs(env, "handoff", KEY, "a", 1, "confirmed", handoff_ttl_ms=300)
        assert proc.read()["handoffs"] == [["p1", "msg:p1"]]
        assert proc.read() == {"confirmed": [True]}
        proc.kill()
    else:
        assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
        assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    # p1 is on the broker now: its payload is gone from the lockwait area, its slot is held
    # for it beyond the short hand-off reservation, and no operation hands it out again.
    env.wait_past(env.now_ms() + 300)
    assert backend.sweep(KEY, limit=1).handoffs == ()
    state = backend.inspect(KEY)
    assert state.holders[0][0] == "p1" and state.reserved == () and waiter_ids(state) == ["p2"]
    started = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000))  # the re-enqueued copy starts
    assert started.acquired and started.handoffs == ()
    assert backend.release(KEY, "p1", limit=1).handoffs == (Handoff(KEY, "p2", b"msg:p2"),)


def test_confirm_after_the_reservation_lapsed_removes_the_reparked_copy(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=200)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    wait_lapsed(env, backend, KEY, "p1")
    # The slow caller re-enqueued p1 after all: that copy wins, the parked one is dropped.
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000) is False
    state = backend.inspect(KEY)
    assert waiter_ids(state) == ["p2"] and state.holders == () and state.reserved == ()
    # confirm_handoff hands nothing off; the next operation does.
    assert backend.sweep(KEY, limit=1).handoffs == (Handoff(KEY, "p2", b"msg:p2"),)
    # The re-enqueued p1 starts later and finds the slot taken: it parks again, at the back.
    park(backend, "p1")
    assert backend.confirm_handoff(KEY, "p2", ttl_ms=60_000)
    assert backend.release(KEY, "p2", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.cancel_wait(KEY, "p1", limit=1).released
    assert_drained(env, backend, lapsed=("p1",))


def test_a_late_confirm_leaves_the_entry_its_own_copy_parked_again(env: Env) -> None:
    """Regression (found while writing tests/test_model.py, and shown by its model): a
    confirmation that came after the reservation lapsed took the waiter out of the queue ("the
    re-enqueued copy wins") even when that copy had been picked up meanwhile and had parked
    again in its place: the message was lost."""
    backend = env.backend(handoff_ttl_ms=200)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    [handoff] = backend.release(KEY, "a", limit=1).handoffs  # pushed; its confirmation is slow
    wait_lapsed(env, backend, KEY, "p1")
    assert backend.set_limit(KEY, 0).handoffs == ()  # reclaims: p1 is back in the queue
    picked = backend.acquire(
        Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=handoff.generation),
        wait=Waiter(payload=b"msg:p1"),
    )
    assert picked.parked and not picked.acquired  # the pushed copy finds no slot: it parks in its place
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=handoff.generation) is False
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000) is False
    assert waiter_ids(backend.inspect(KEY)) == ["p1"]  # still parked: not lost
    stale = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=handoff.generation))
    assert stale.stale  # a duplicate of the copy that parked may not start either
    [again] = backend.set_limit(KEY, None, default=1).handoffs
    assert (again.waiter_id, again.payload) == ("p1", b"msg:p1")
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=again.generation)
    assert backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=again.generation)).acquired
    assert backend.release(KEY, "p1", limit=1).released
    assert_drained(env, backend, lapsed=("p1",))


# --- Blocking waiters ---------------------------------------------------------------------------


def test_a_blocking_waiter_is_woken_by_a_push_that_hands_it_the_slot_and_its_token(env: Env) -> None:
    backend = env.backend()
    waiter_side = env.another_client(backend)
    first = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000))
    assert first.acquired and first.token is not None
    result = waiter_side.acquire(
        Stake(KEY, "w", limit=1, ttl_ms=60_000, info="report"), wait=Waiter(wait_ms=60_000)
    )
    assert not result.acquired and result.parked
    assert backend.inspect(KEY).waiters[0][::2] == ("w", False)
    woken: list[Woken | None] = []
    thread = threading.Thread(
        target=lambda: woken.append(waiter_side.wait_for_handoff(KEY, "w", timeout_ms=60_000))
    )
    thread.start()
    released = backend.release(KEY, "a", limit=1)
    assert released.handoffs == (Handoff(KEY, "w", None),)
    thread.join(MARGIN_S)  # far less than the waiter's own timeout: it was woken, not timed out
    # The push carried the token the hand-off issued: w holds the slot without an acquire, with
    # at least half the reservation left to take it up, and its info recorded.
    assert woken == [Woken(woken[0].token if woken[0] else 0, 5_000)]
    assert woken[0] is not None and woken[0].token > first.token
    state = backend.inspect(KEY)
    assert [h for h, _ in state.holders] == ["w"] and state.token == woken[0].token
    assert [(h, info) for h, _, info in state.holder_info] == [("w", "report")]
    assert waiter_side.wait_for_handoff(KEY, "w", timeout_ms=0) is None  # the push was consumed
    assert waiter_side.renew(KEY, "w", ttl_ms=60_000)  # taken up
    assert backend.release(KEY, "w", limit=1).released
    assert_drained(env, backend)


def test_tokens_a_handoff_pushes_stay_below_the_acquirers_in_the_same_step(env: Env) -> None:
    backend = env.backend()
    lapsing = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=200))
    assert lapsing.acquired and lapsing.token is not None
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    wait_lapsed(env, backend, KEY, "a")
    # One operation reclaims a, hands its slot to w (pushing w's token), and lets b acquire.
    taken = backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=60_000))
    assert taken.acquired and taken.token is not None and taken.handoffs == (Handoff(KEY, "w", None),)
    woken = backend.wait_for_handoff(KEY, "w", timeout_ms=10_000)
    assert woken is not None and lapsing.token < woken.token < taken.token
    for holder in ["w", "b"]:
        assert backend.release(KEY, holder, limit=2).released
    assert_drained(env, backend)


def test_a_waiter_that_misses_its_wake_still_finds_its_slot(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=2_000)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w", None),)
    # The wake is dropped after half the reservation (a popped token always has the other half).
    env.wait_past(deadline_of(backend, KEY, "w") - 1_000)
    assert backend.wait_for_handoff(KEY, "w", timeout_ms=0) is None
    late = backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000))
    assert late.acquired and late.token is not None
    assert backend.release(KEY, "w", limit=1).released
    assert_drained(env, backend)


def test_a_lease_taken_by_a_wake_is_renewed_from_its_reservation_before_it_ends(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=3_000)  # a wake has 1.5 s of reservation left, at least
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    backend.release(KEY, "a", limit=1)
    reserved_until = deadline_of(backend, KEY, "w")
    woken = backend.wait_for_handoff(KEY, "w", timeout_ms=10_000)
    assert woken is not None
    lease = Lease(backend, KEY, "w", woken.result(1), limit=1, ttl_ms=60_000)
    try:
        # A third of the way into the reservation (not of the 60 s ttl), the renewer takes it up to
        # a full lease, and the lease was held all along.
        wait_until(
            lambda: deadline_of(backend, KEY, "w") > reserved_until + 30_000,
            timeout=MARGIN_S,
            what="the renewal of a lease taken by a wake",
        )
        assert lease.held
    finally:
        assert lease.release().released
    assert_drained(env, backend)


def test_blocking_and_parked_waiters_share_one_fifo(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    assert backend.acquire(Stake(KEY, "w2", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    park(backend, "p3")
    assert [(w, parked) for w, _, parked in backend.inspect(KEY).waiters] == [
        ("p1", True),
        ("w2", False),
        ("p3", True),
    ]
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.release(KEY, "p1", limit=1).handoffs == (Handoff(KEY, "w2", None),)
    assert backend.wait_for_handoff(KEY, "w2", timeout_ms=10_000)
    assert backend.acquire(Stake(KEY, "w2", limit=1, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "w2", limit=1).handoffs == (Handoff(KEY, "p3", b"msg:p3"),)


def test_a_dead_blocking_waiters_entry_is_dropped_after_wait_ms(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=200)).parked
    since = backend.inspect(KEY).waiters[0][1]
    env.wait_past(since + 200)  # its thread died: nobody waits on it
    assert backend.release(KEY, "a", limit=1) == ReleaseResult(True, ())
    assert_drained(env, backend)


def test_cancel_wait_hands_a_reservation_on(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w1", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.acquire(Stake(KEY, "w2", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    park(backend, "p3")
    # w2 gives up while still queued: it just leaves.
    assert backend.cancel_wait(KEY, "w2", limit=1).released is False
    assert waiter_ids(backend.inspect(KEY)) == ["w1", "p3"]
    # w1 is handed the slot but gives up (timed out) before taking it: the slot goes on.
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w1", None),)
    cancelled = backend.cancel_wait(KEY, "w1", limit=1)
    assert cancelled.released and cancelled.handoffs == (Handoff(KEY, "p3", b"msg:p3"),)
    assert backend.wait_for_handoff(KEY, "w1", timeout_ms=0) is None


# --- Standbys -----------------------------------------------------------------------------------


def pick_up(backend: GuardBackend, waiter: str, *, limit: int = 1, wait_ms: int = 60_000) -> Any:
    """The standby's message is picked up and acquires in park mode, allowed to block."""
    return backend.acquire(
        Stake(KEY, waiter, limit=limit, ttl_ms=60_000),
        wait=Waiter(payload=f"msg:{waiter}".encode(), wait_ms=wait_ms),
    )


def test_standbys_are_sent_ahead_in_fifo_order_and_block_when_picked_up(env: Env) -> None:
    backend = env.backend()
    for holder in ["a", "b"]:
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2", "p3", "p4"]:
        park(backend, waiter, limit=2)
    handoffs, sent = backend.send_standbys(KEY, limit=2, count=2)  # the first two (see the window's test)
    assert handoffs == () and sent == (Handoff(KEY, "p1", b"msg:p1"), Handoff(KEY, "p2", b"msg:p2"))
    assert backend.send_standbys(KEY, limit=2, count=2) == ((), ())  # already sent
    for waiter in ["p1", "p2"]:
        assert backend.confirm_standby(KEY, waiter, f"msg:{waiter}".encode(), ttl_ms=60_000)
    state = backend.inspect(KEY)  # they keep their places; their payloads are on the broker now
    assert state.waiters[0][::2] == ("p1", False) and state.waiters[1][::2] == ("p2", False)
    assert waiter_ids(state) == ["p1", "p2", "p3", "p4"]
    # p1 is picked up while the key is full: it blocks instead of parking.
    waiting = pick_up(backend, "p1", limit=2)
    assert not waiting.acquired and waiting.parked and waiting.standby
    assert waiter_ids(backend.inspect(KEY)) == ["p1", "p2", "p3", "p4"]
    # A freed slot goes to it by a push; nothing to re-enqueue.
    assert backend.release(KEY, "a", limit=2).handoffs == (Handoff(KEY, "p1", None),)
    assert backend.wait_for_handoff(KEY, "p1", timeout_ms=10_000)
    assert backend.acquire(Stake(KEY, "p1", limit=2, ttl_ms=60_000)).acquired
    # p2 gets a slot before it is picked up: it starts as soon as it is.
    assert backend.release(KEY, "b", limit=2).handoffs == (Handoff(KEY, "p2", None),)
    started = pick_up(backend, "p2", limit=2)
    assert started.acquired and not started.standby
    handoffs, sent = backend.send_standbys(KEY, limit=2, count=1)
    assert sent == (Handoff(KEY, "p3", b"msg:p3"),)
    assert backend.confirm_standby(KEY, "p3", b"msg:p3", ttl_ms=60_000)
    for holder, waiter in [("p1", "p3"), ("p2", "p4")]:
        [handoff] = backend.release(KEY, holder, limit=2).handoffs
        assert handoff.waiter_id == waiter
    assert backend.confirm_handoff(KEY, "p4", ttl_ms=60_000)
    for holder in ["p3", "p4"]:
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
        assert backend.release(KEY, holder, limit=2).released
    assert_drained(env, backend)


def test_a_freed_slot_goes_to_a_ready_standby_before_an_older_one_still_on_the_broker(env: Env) -> None:
    backend = env.backend()
    for holder in ["a", "b"]:
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2", "p3"]:
        park(backend, waiter, limit=2)
    # w4 blocks too, but behind the first `limit` waiters: it does not jump them.
    assert backend.acquire(Stake(KEY, "w4", limit=2, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    _, sent = backend.send_standbys(KEY, limit=2, count=2)
    assert [s.waiter_id for s in sent] == ["p1", "p2"]
    for waiter in ["p1", "p2"]:
        assert backend.confirm_standby(KEY, waiter, f"msg:{waiter}".encode(), ttl_ms=60_000)
    # p2 is picked up first (p1 sits on the broker, or in a busy worker's queue) and blocks.
    assert pick_up(backend, "p2", limit=2).standby
    # Its backstop re-check keeps it a standby, in its place.
    assert pick_up(backend, "p2", limit=2).standby
    assert waiter_ids(backend.inspect(KEY)) == ["p1", "p2", "p3", "w4"]
    # The freed slot goes to p2, which starts on the push, not to p1 that no thread holds yet.
    assert backend.release(KEY, "a", limit=2).handoffs == (Handoff(KEY, "p2", None),)
    assert backend.wait_for_handoff(KEY, "p2", timeout_ms=10_000)
    assert backend.acquire(Stake(KEY, "p2", limit=2, ttl_ms=60_000)).acquired
    # With no ready waiter in the window, the oldest goes first: p1, not w4 (beyond the window).
    assert backend.release(KEY, "b", limit=2).handoffs == (Handoff(KEY, "p1", None),)
    assert pick_up(backend, "p1", limit=2).acquired
    # w4 is in the window now, and ready: it goes before the older p3, which is parked.
    assert backend.release(KEY, "p2", limit=2).handoffs == (Handoff(KEY, "w4", None),)
    assert backend.wait_for_handoff(KEY, "w4", timeout_ms=10_000)
    assert backend.acquire(Stake(KEY, "w4", limit=2, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "p1", limit=2).handoffs == (Handoff(KEY, "p3", b"msg:p3"),)
    assert backend.confirm_handoff(KEY, "p3", ttl_ms=60_000)
    for holder in ["p3", "w4"]:
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
        assert backend.release(KEY, holder, limit=2).released
    assert_drained(env, backend)


def test_a_standby_whose_sender_dies_before_confirming_parks_again_in_its_place(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=200)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    _, sent = backend.send_standbys(KEY, limit=1, count=1)
    assert sent == (Handoff(KEY, "p1", b"msg:p1"),)
    env.wait_past(env.now_ms() + 200)  # the sender died: never enqueued, never confirmed
    assert backend.sweep(KEY, limit=1) == ReleaseResult(False, ())
    state = backend.inspect(KEY)
    assert [(w, parked) for w, _, parked in state.waiters] == [("p1", True), ("p2", True)]
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)


def test_a_standby_handed_a_slot_before_it_is_confirmed_keeps_its_payload_until_then(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=TTL)  # the confirmations below must come before it lapses
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    _, sent = backend.send_standbys(KEY, limit=1, count=1)
    # The slot is reserved for p1, but its payload is not handed out twice: its sender enqueues it.
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", None),)
    assert backend.inspect(KEY).reserved == ("p1",)
    # The sender died: the reservation lapses and p1 is back at the head, with its payload.
    wait_lapsed(env, backend, KEY, "p1")
    assert backend.sweep(KEY, limit=1) == ReleaseResult(True, (Handoff(KEY, "p1", b"msg:p1"),))
    # Or the sender confirms: the slot is held for the enqueued copy, the payload is dropped.
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000)).acquired
    _, sent = backend.send_standbys(KEY, limit=1, count=1)
    assert sent == (Handoff(KEY, "p2", b"msg:p2"),)
    assert backend.release(KEY, "p1", limit=1).handoffs == (Handoff(KEY, "p2", None),)
    assert backend.confirm_standby(KEY, "p2", b"msg:p2", ttl_ms=60_000)
    state = backend.inspect(KEY)
    assert state.reserved == () and state.holders[0][0] == "p2" and state.waiters == ()
    assert pick_up(backend, "p2").acquired
    assert backend.release(KEY, "p2", limit=1).released
    assert_drained(env, backend, lapsed=("p1",))


def test_a_standby_that_parks_again_keeps_its_place_and_a_late_confirm_leaves_it(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    backend.send_standbys(KEY, limit=1, count=1)
    # Picked up before its sender confirmed, by a worker that lets no standby block (wait_ms=0).
    reparked = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"msg:p1 again"))
    assert reparked.parked and not reparked.standby
    assert backend.confirm_standby(KEY, "p1", b"msg:p1", ttl_ms=60_000) is False
    state = backend.inspect(KEY)
    assert [(w, parked) for w, _, parked in state.waiters] == [("p1", True), ("p2", True)]
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1 again"),)


def test_a_standby_whose_entry_lapsed_is_an_ordinary_message(env: Env) -> None:
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    backend.send_standbys(KEY, limit=1, count=1)
    assert backend.confirm_standby(KEY, "p1", b"msg:p1", ttl_ms=200)
    env.wait_past(env.now_ms() + 200)  # never picked up in time (its worker died with it)
    assert backend.sweep(KEY, limit=1) == ReleaseResult(False, ())
    assert waiter_ids(backend.inspect(KEY)) == ["p2"]
    # Picked up at last (redelivered): it parks at the back like any message.
    late = pick_up(backend, "p1")
    assert late.parked and not late.standby
    assert [(w, parked) for w, _, parked in backend.inspect(KEY).waiters] == [("p2", True), ("p1", True)]


def test_a_release_sends_the_next_waiters_ahead_in_the_same_step(env: Env) -> None:
    backend = env.backend()
    for holder in ["a", "b"]:
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2", "p3", "p4"]:
        park(backend, waiter, limit=2)
    # a's slot goes to p1 (re-enqueued by the caller); then p2 and p3, the first two waiters, are
    # sent ahead, exactly as a send_standbys() right after would have.
    released = backend.release(KEY, "a", limit=2, send_ahead=2)
    assert released == ReleaseResult(
        True,
        (Handoff(KEY, "p1", b"msg:p1"),),
        (Handoff(KEY, "p2", b"msg:p2"), Handoff(KEY, "p3", b"msg:p3")),
    )
    assert backend.send_standbys(KEY, limit=2, count=2) == ((), ())  # already sent
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    for waiter in ["p2", "p3"]:
        assert backend.confirm_standby(KEY, waiter, f"msg:{waiter}".encode(), ttl_ms=60_000)
    state = backend.inspect(KEY)
    assert [(w, parked) for w, _, parked in state.waiters] == [("p2", False), ("p3", False), ("p4", True)]
    # Nobody waiting: nothing to send. Without send_ahead, a release sends nothing.
    assert backend.release(KEY, "b", limit=2).standbys == ()
    assert pick_up(backend, "p2", limit=2).acquired
    assert backend.acquire(Stake(KEY, "p1", limit=2, ttl_ms=60_000)).acquired
    # p1's slot goes to the standby p3 by a push; p4, the last waiter, is sent ahead.
    assert backend.release(KEY, "p1", limit=2, send_ahead=2) == ReleaseResult(
        True, (Handoff(KEY, "p3", None),), (Handoff(KEY, "p4", b"msg:p4"),)
    )
    assert backend.confirm_standby(KEY, "p4", b"msg:p4", ttl_ms=60_000)
    assert pick_up(backend, "p3", limit=2).acquired
    assert backend.release(KEY, "p2", limit=2, send_ahead=2) == ReleaseResult(
        True, (Handoff(KEY, "p4", None),)
    )
    assert pick_up(backend, "p4", limit=2).acquired
    for holder in ["p3", "p4"]:
        assert backend.release(KEY, holder, limit=2, send_ahead=2) == ReleaseResult(True)
    assert_drained(env, backend)


def test_the_standby_window_is_the_limit_in_force_and_at_least_min_standby_window(env: Env) -> None:
    """A key with a small limit sends MIN_STANDBY_WINDOW standbys ahead, a larger one up to its limit."""
    backend = env.backend()
    wide = f"{KEY}-wide"
    for key, limit in [(KEY, 1), (wide, MIN_STANDBY_WINDOW + 1)]:
        for holder in range(limit):
            assert backend.acquire(Stake(key, f"h{holder}", limit=limit, ttl_ms=60_000)).acquired
        waiters = [f"p{i}" for i in range(MIN_STANDBY_WINDOW + 3)]
        for waiter in waiters:
            park(backend, waiter, limit=limit, key=key)
        window = max(limit, MIN_STANDBY_WINDOW)
        _, sent = backend.send_standbys(key, limit=limit, count=100)
        assert [s.waiter_id for s in sent] == waiters[:window]  # the first ones, in FIFO order
        assert backend.send_standbys(key, limit=limit, count=100) == ((), ())  # already sent
        # A release sends the waiter that enters the window as the first one is handed the slot.
        released = backend.release(key, "h0", limit=limit, send_ahead=100)
        assert [h.waiter_id for h in released.handoffs] == ["p0"]
        assert [s.waiter_id for s in released.standbys] == [waiters[window]]
    # The window is the limit in force: raised at run time by one, it reaches the last waiter (the
    # new slot goes to the oldest waiter, p1).
    assert [h.waiter_id for h in backend.set_limit(wide, MIN_STANDBY_WINDOW + 2).handoffs] == ["p1"]
    _, sent = backend.send_standbys(wide, limit=MIN_STANDBY_WINDOW + 1, count=100)
    assert [s.waiter_id for s in sent] == [waiters[-1]]


def test_no_standby_is_sent_while_the_key_is_halted(env: Env) -> None:
    backend = env.backend()
    backend.set_limit(KEY, 0)
    park(backend, "p1")
    assert backend.send_standbys(KEY, limit=1, count=1) == ((), ())
    assert backend.send_standbys(KEY, limit=1, count=8) == ((), ())  # not MIN_STANDBY_WINDOW either
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).parked is False
    assert backend.release(KEY, "a", limit=1, send_ahead=1) == ReleaseResult(False)
    assert [(w, parked) for w, _, parked in backend.inspect(KEY).waiters] == [("p1", True)]
    assert backend.set_limit(KEY, None).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)


# --- Limits -------------------------------------------------------------------------------------


def test_set_limit_halts_releases_and_clears(env: Env) -> None:
    backend = env.backend()
    assert backend.get_limit(KEY) is None
    assert backend.set_limit(KEY, 0, default=1).handoffs == ()
    assert backend.get_limit(KEY) == 0
    halted = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000))
    assert not halted.acquired and halted.limit == 0 and not halted.parked
    for waiter in ["p1", "p2", "p3"]:
        park(backend, waiter)
    assert backend.sweep(KEY, limit=1).handoffs == ()  # halted: the waiters stay
    assert waiter_ids(backend.inspect(KEY)) == ["p1", "p2", "p3"]
    raised = backend.set_limit(KEY, 2, default=1)  # raising it releases waiters at once
    assert raised.handoffs == (Handoff(KEY, "p1", b"msg:p1"), Handoff(KEY, "p2", b"msg:p2"))
    for waiter in ["p1", "p2"]:
        assert backend.confirm_handoff(KEY, waiter, ttl_ms=60_000)
    assert backend.set_limit(KEY, None, default=1).handoffs == ()  # cleared: back to the default
    assert backend.get_limit(KEY) is None and backend.inspect(KEY).limit is None
    assert backend.release(KEY, "p1", limit=1).handoffs == ()  # p2 still holds: 1 of 1
    assert backend.release(KEY, "p2", limit=1).handoffs == (Handoff(KEY, "p3", b"msg:p3"),)
    with pytest.raises(ValueError):
        backend.set_limit(KEY, -1)


def test_limited_keys_are_found_through_the_limits_index(env: Env) -> None:
    backend = env.backend()
    other = env.another_client(backend)
    assert backend.limit_keys() == []
    backend.set_limit(KEY, 0)
    other.set_limit("slots:other", 4)
    other.set_limit("slots:other", 5)  # set again: listed once
    assert backend.limit_keys() == ["slots:other", KEY]  # no holder, no waiter: found all the same
    assert backend.waiting_keys() == []
    backend.set_limit(KEY, None)
    assert other.limit_keys() == ["slots:other"]
    backend.set_limit(KEY, None)  # clearing an unset limit is harmless
    assert backend.limit_keys() == ["slots:other"]
    assert backend.acquire(Stake("slots:other", "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.release("slots:other", "a", limit=1).released
    assert_drained(env, backend, key="slots:other", limit=5)
    other.set_limit("slots:other", None)
    assert_drained(env, backend, key="slots:other")
    assert backend.limit_keys() == []


def test_a_lowered_limit_evicts_nobody(env: Env) -> None:
    backend = env.backend()
    for holder in "abc":
        assert backend.acquire(Stake(KEY, holder, limit=3, ttl_ms=60_000)).acquired
    backend.set_limit(KEY, 1)
    assert backend.acquire(Stake(KEY, "a", limit=3, ttl_ms=60_000)).acquired  # re-entrant still works
    assert not backend.acquire(Stake(KEY, "d", limit=3, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "b", limit=3).released
    assert not backend.acquire(Stake(KEY, "d", limit=3, ttl_ms=60_000)).acquired  # 2 holders > 1


# --- Memory -------------------------------------------------------------------------------------


def test_nothing_is_left_after_the_work_drains_but_the_limit(env: Env) -> None:
    backend = env.backend(handoff_ttl_ms=10_000)
    backend.set_limit(KEY, 1)
    assert backend.acquire(Stake(KEY, "a", limit=5, ttl_ms=60_000)).acquired
    park(backend, "p1")
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.acquire(Stake(KEY, "dead", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=1)).parked
    env.wait_past(backend.inspect(KEY).waiters[-1][1] + 1)  # its thread died: dropped
    [handoff] = backend.release(KEY, "a", limit=5).handoffs
    assert handoff.waiter_id == "p1"
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.acquire(Stake(KEY, "p1", limit=5, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "p1", limit=5).handoffs == (Handoff(KEY, "w", None),)
    assert backend.wait_for_handoff(KEY, "w", timeout_ms=10_000)
    assert backend.acquire(Stake(KEY, "w", limit=5, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "w", limit=5).handoffs == ()
    assert_drained(env, backend, limit=1)


def test_a_drained_key_leaves_the_waiting_keys_index_at_once(env: Env) -> None:
    # A grace far longer than the test: on a standalone Redis (and in memory) the index is kept
    # in the same step as the waiters, so it does not matter; on a Redis Cluster it is the
    # documented time a drained key's entry may stay.
    backend = env.backend(index_grace_ms=3_600_000)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.waiting_keys() == [KEY]
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.waiting_keys() == [KEY]  # an unconfirmed reservation and a waiter
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.release(KEY, "p1", limit=1).handoffs == (Handoff(KEY, "w", None),)
    # w was handed the slot: nobody waits and nothing is unconfirmed, though w still holds.
    if env.kind == "cluster":
        assert backend.waiting_keys() == [KEY]  # kept for index_grace_ms...
        assert env.backend(index_grace_ms=0).waiting_keys() == []  # ...and dropped after it
    else:
        assert backend.waiting_keys() == []
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "w", limit=1).released
    assert dataclasses.replace(backend.inspect(KEY), token=None) == KeyState((), (), (), None, None)
    if env.client is not None:
        assert env.stored() == {f"{env.namespace}:{{{KEY}}}:token"}  # it expires by itself


def test_a_park_racing_the_drain_is_never_left_unindexed(env: Env) -> None:
    # The holder releases and the key falls idle while another client parks on it, in every
    # order the two round trips can take: whichever lands last, the parked waiter is indexed.
    backend = env.backend()
    other = env.another_client(backend)
    for round_ in range(50):
        holder, waiter = f"a{round_}", f"p{round_}"
        assert backend.acquire(Stake(KEY, holder, limit=1, ttl_ms=60_000)).acquired
        parked = threading.Event()

        def park_now(waiter: str = waiter, parked: threading.Event = parked) -> None:
            result = other.acquire(Stake(KEY, waiter, limit=1, ttl_ms=60_000), wait=Waiter(payload=b"m"))
            if result.parked:
                parked.set()

        thread = threading.Thread(target=park_now)
        thread.start()
        released = backend.release(KEY, holder, limit=1)
        thread.join(MARGIN_S)
        state = backend.inspect(KEY)
        if parked.is_set() and not released.handoffs:
            assert waiter_ids(state) == [waiter] and KEY in backend.waiting_keys()
            assert backend.cancel_wait(KEY, waiter, limit=1) == ReleaseResult(False, ())
        elif released.handoffs:
            assert backend.confirm_handoff(KEY, waiter, ttl_ms=60_000)
            assert backend.release(KEY, waiter, limit=1).released
        else:  # the waiter came after the release: it took the idle key
            assert backend.release(KEY, waiter, limit=1).released
        assert_drained(env, backend)


def test_a_drained_key_keeps_its_last_token_and_a_dedup_lock_keeps_none(env: Env) -> None:
    """A key's last fencing token outlives its other state (``stale_ttl_ms``), so the next token
    is above it even if the clock that issues it is behind (a promoted replica:
    tests/test_failover.py); a lock that fences nothing (try_lock, deduplication) issues none and
    keeps none, on its fast path and on the generic one (a re-entrant try_lock) alike."""
    backend = env.backend()
    dedup = "dedup:report"
    assert backend.try_lock(dedup, "m1", ttl_ms=60_000).acquired
    again = backend.try_lock(dedup, "m1", ttl_ms=60_000)  # re-entrant: not the fast path on Redis
    assert again.acquired and again.token is None
    # The dedup lock's holder starts: an unfenced acquire (deduplication's) keeps none either.
    started = backend.acquire(Stake(dedup, "m1", limit=1, ttl_ms=60_000, fenced=False))
    assert started.acquired and started.token is None
    assert backend.release(dedup, "m1", limit=1).released
    assert backend.inspect(dedup).token is None
    assert_drained(env, backend, key=dedup)  # nothing at all is left
    first = backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000))
    assert backend.release(KEY, "a", limit=1).released
    assert backend.inspect(KEY).token == first.token
    assert_drained(env, backend)  # but the token
    assert first.token is not None
    assert (backend.acquire(Stake(KEY, "b", limit=1, ttl_ms=60_000)).token or 0) > first.token


def test_a_key_whose_holders_all_died_vanishes_by_itself(redis_env: Env) -> None:
    backend = redis_env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=200)).acquired
    assert backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=300)).acquired
    assert redis_env.client is not None
    assert redis_env.stored()
    wait_lapsed(redis_env, backend, KEY, "b")
    # Nobody touched it: it expired, all but its last token, which expires later by itself.
    token = f"{redis_env.namespace}:{{{KEY}}}:token"
    assert redis_env.stored() == {token}
    assert 0 < redis_env.client.pttl(token) <= backend.stale_ttl_ms


def test_holders_of_a_key_nobody_waits_for_come_and_go_and_it_still_expires(env: Env) -> None:
    """A key under its limit with nobody waiting (on Redis, the scripts' fast paths): a holder
    joins others, one of several leaves, a holder re-acquires with a later deadline; tokens
    grow, the limit holds, the others keep their slots, and once the last deadline passes
    nothing is left but the last token (on Redis: every key expired by itself)."""
    backend = env.backend()
    a = backend.acquire(Stake(KEY, "a", limit=2, ttl_ms=400))
    b = backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=200))  # its deadline is not the latest
    assert a.acquired and b.acquired and (b.token or 0) > (a.token or 0)
    refused = backend.acquire(Stake(KEY, "c", limit=2, ttl_ms=60_000))
    assert not refused.acquired and set(refused.holders) == {"a", "b"}
    assert backend.release(KEY, "a", limit=2).released  # one of two leaves: b keeps its slot
    assert [holder for holder, _ in backend.inspect(KEY).holders] == ["b"]
    again = backend.acquire(Stake(KEY, "b", limit=2, ttl_ms=300))  # re-entrant: the latest deadline now
    assert again.acquired and (again.token or 0) > (b.token or 0)
    assert backend.inspect(KEY).holder_info[0][0] == "b"
    wait_lapsed(env, backend, KEY, "b")
    if env.client is not None:
        token = f"{env.namespace}:{{{KEY}}}:token"
        assert env.stored() == {token}
    assert backend.acquire(Stake(KEY, "d", limit=1, ttl_ms=60_000)).acquired  # the lapsed holder is gone


def test_a_reservation_among_several_holders_is_taken_up_by_its_runner_only(env: Env) -> None:
    """A send's reservation that is neither the only holder nor the latest deadline (on Redis, the
    fast path's ZADD NX finds it held): its runner takes it up, keeping its since and info, without
    counting twice; another runner is refused as running, and nothing changes."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=3, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "r", limit=3, ttl_ms=30_000, info="job")).acquired
    [(_, since, _)] = [entry for entry in backend.inspect(KEY).holder_info if entry[0] == "r"]
    assert backend.acquire(Stake(KEY, "r", limit=3, ttl_ms=40_000, runner="w1")).acquired
    state = backend.inspect(KEY)
    assert ("r", since, "job") in state.holder_info and len(state.holders) == 2
    other = backend.acquire(Stake(KEY, "r", limit=3, ttl_ms=50_000, runner="w2"))
    assert other.running and backend.inspect(KEY).holders == state.holders
    assert backend.acquire(Stake(KEY, "b", limit=3, ttl_ms=60_000)).acquired  # a new one under the limit
    assert not backend.acquire(Stake(KEY, "c", limit=3, ttl_ms=60_000)).acquired


def test_a_slot_handed_on_by_the_last_holder_still_expires(env: Env) -> None:
    """Regression (found by tests/test_model.py): a release that removed the last holder and
    handed its slot on in the same step re-created the holders zset without an expiry (and kept
    the waiters' meta hash, which has none), so a woken waiter whose thread died before taking
    its slot up left both in Redis for good: nothing was queued, so no sweep ever came."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w", None),)
    assert backend.waiting_keys() == []  # w's thread dies here: nobody touches the key again
    if env.client is not None:
        names = env.stored()
        assert f"{env.namespace}:{{{KEY}}}:holders" in names
        assert {name for name in names if env.client.pttl(name) == -1} == set()


def test_the_limit_recorded_for_a_keys_waiters_goes_with_them(env: Env) -> None:
    """The default limit recorded when a waiter queues serves the queue: once it is empty, a
    process that does not know the key's limit finds none (on Redis the meta hash, which never
    expires, is gone; the memory backend forgets it too)."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w", None),)
    assert backend.wait_for_handoff(KEY, "w", timeout_ms=0) is not None
    unknown = backend.acquire(Stake(KEY, "p1", limit=None, ttl_ms=60_000), wait=Waiter(payload=b"msg:p1"))
    assert unknown.parked and unknown.limit == 0  # nothing recorded any more, and p1 records nothing
    assert backend.release(KEY, "w", limit=None).handoffs == ()  # so nothing is guessed
    assert backend.sweep(KEY, limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)  # its own app's
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.release(KEY, "p1", limit=1).released
    assert_drained(env, backend)


def test_waiters_and_payloads_never_expire_and_a_sweep_recovers_them(redis_env: Env) -> None:
    backend = redis_env.backend(handoff_ttl_ms=1_000)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=200)).acquired
    park(backend, "p1")
    park(backend, "p2")
    backend.release(KEY, "a", limit=1)  # p1 is handed the slot; then everybody dies
    deadline = deadline_of(backend, KEY, "p1")
    assert redis_env.client is not None
    # Holder-derived state expires with the last holder (its actual vanishing is the test above).
    holders_expire_at = redis_env.client.pexpiretime(f"{redis_env.namespace}:{{{KEY}}}:holders")
    assert 0 < holders_expire_at <= deadline
    names = redis_env.stored()
    assert all(
        redis_env.client.pexpiretime(name) == -1 for name in names if name.endswith(("waiters", "payloads"))
    )
    redis_env.wait_past(deadline)
    assert KEY in backend.waiting_keys()  # a worker's sweep finds the key...
    swept = backend.sweep(KEY, limit=1)  # ...and p1 is back first, with its payload
    assert swept.released and swept.handoffs == (Handoff(KEY, "p1", b"msg:p1"),)


def test_a_key_is_due_for_a_sweep_once_a_deadline_passed_and_swept_in_batches(env: Env) -> None:
    """Invariant: a key with waiters is in due_keys() no later than its earliest deadline.

    On a standalone Redis it is not there before (so an idle sweep costs what is due, not what
    waits); the other backends may list every waiting key.
    """
    backend = env.backend(handoff_ttl_ms=60_000)
    other = "other-key"
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=300)).acquired
    assert backend.acquire(Stake(other, "b", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    park(backend, "p2", key=other)
    if env.kind == "redis":
        assert backend.due_keys().keys == []  # every deadline is ahead: nothing to look at
    wait_lapsed(env, backend, KEY, "a")
    due = backend.due_keys().keys
    assert KEY in due
    if env.kind == "redis":
        assert due == [KEY]
    [swept] = backend.sweep_many([(KEY, 1)])
    assert swept.handoffs == (Handoff(KEY, "p1", b"msg:p1"),)  # (a's entry may have expired with it)
    if env.kind == "redis":
        assert backend.due_keys().keys == []  # due again at p1's reservation deadline, 60 s on
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=swept.handoffs[0].generation)
    for key, holder in [(KEY, "p1"), (other, "b")]:
        backend.release(KEY if key == KEY else other, holder, limit=1)
    assert backend.sweep_many([]) == []


def test_due_keys_tells_when_the_first_prompt_key_ahead_is_due(env: Env) -> None:
    """Invariant: due_keys(prompt, within_ms) answers in how many ms the first key with a prompt
    prefix is due, if within ``within_ms`` (what the sweep sleeps until), in the same call.

    A key of another prefix due sooner is passed over, and a debounce send that moves its run later
    moves the answer; the Cluster backend, whose index holds no due times, answers None (its sweep
    keeps to its interval).
    """
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=10_000)).acquired
    park(backend, "p1")  # KEY is due at a's lease end, before the run
    backend.debounce("debounce:k", "m1", b"run", wait_ms=20_000, max_wait_ms=60_000)
    due = backend.due_keys(["debounce:"], within_ms=25_000)
    if env.kind == "cluster":
        assert due.prompt_in_ms is None
        return
    assert due.keys == []
    assert due.prompt_in_ms is not None and 10_000 < due.prompt_in_ms <= 20_000
    assert backend.due_keys(["debounce:"], within_ms=15_000).prompt_in_ms is None  # not that soon
    assert backend.due_keys([], within_ms=25_000).prompt_in_ms is None  # no prompt prefix asked
    backend.debounce("debounce:k", "m2", b"run", wait_ms=22_000, max_wait_ms=60_000)
    later = backend.due_keys(["debounce:"], within_ms=25_000).prompt_in_ms
    assert later is not None and 20_000 < later <= 22_000  # a send moves the key's due time later


# --- Redis specifics ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["plain", "with{braces}inside", "a}b{c", "{leading}", "x{}y"])
def test_every_key_of_a_guard_key_is_in_one_cluster_slot(redis_env: Env, key: str) -> None:
    backend = redis_env.backend()
    assert backend.acquire(Stake(key, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1", key=key)
    assert backend.acquire(Stake(key, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    park(backend, "p2", key=key)
    assert backend.set_limit(key, 3).handoffs == (Handoff(key, "p1", b"msg:p1"), Handoff(key, "w", None))
    names = redis_env.stored(":{*")
    suffixes = {"holders", "waiters", "payloads", "reserved", "token", "limit", "info", "meta", "wake:w"}
    assert names == {f"{redis_env.namespace}:{{{key}}}:{suffix}" for suffix in suffixes}
    assert len({key_slot(name.encode()) for name in names}) == 1


@pytest.mark.parametrize("key", ["", "}starts-with-a-closing-brace"])
def test_keys_that_would_leave_the_hash_tag_empty_are_rejected(env: Env, key: str) -> None:
    backend = env.backend()
    calls: list[Callable[[], object]] = [
        lambda: backend.acquire(Stake(key, "a", limit=1, ttl_ms=1000)),
        lambda: backend.acquire(Stake(key, "a", limit=1, ttl_ms=1000), wait=Waiter(payload=b"m")),
        lambda: backend.renew(key, "a", ttl_ms=1000),
        lambda: backend.release(key, "a", limit=1),
        lambda: backend.confirm_handoff(key, "a", ttl_ms=1000),
        lambda: backend.wait_for_handoff(key, "a", timeout_ms=0),
        lambda: backend.cancel_wait(key, "a", limit=1),
        lambda: backend.sweep(key, limit=1),
        lambda: backend.set_limit(key, 1),
        lambda: backend.get_limit(key),
        lambda: backend.inspect(key),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^a guard key must be non-empty and must not start with '}'"):
            call()
    assert backend.waiting_keys() == [] and backend.limit_keys() == []


def test_wait_for_handoff_outlasts_the_clients_socket_timeout(env: Env) -> None:
    # redis-py 8 clients time a read out after socket_timeout (5 s by default): a longer wait is
    # made of shorter BLPOPs, transparently.
    backend = env.backend(socket_timeout=0.3)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert backend.wait_for_handoff(KEY, "w", timeout_ms=1000) is None  # timed out, no error
    woken: list[Woken | None] = []
    started = env.now_ms()
    thread = threading.Thread(
        target=lambda: woken.append(backend.wait_for_handoff(KEY, "w", timeout_ms=60_000))
    )
    thread.start()
    env.wait_past(started + 800)  # a wait on time itself: past a few socket timeouts
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "w", None),)
    thread.join(MARGIN_S)
    assert len(woken) == 1 and woken[0] is not None
    assert backend.acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000)).acquired
    assert backend.release(KEY, "w", limit=1).released
    assert_drained(env, backend)


def test_a_client_that_decodes_responses_works_too(redis_env: Env) -> None:
    backend = redis_env.backend(decode=True)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.inspect(KEY).reserved == ("p1",)
    assert backend.waiting_keys() == [KEY]


def test_an_unreachable_redis_raises_backend_unavailable() -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
    backend = RedisBackend(client)
    with pytest.raises(BackendUnavailable):
        backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=1000))
    with pytest.raises(BackendUnavailable):
        backend.renew_many([(KEY, "a", 1000)])
    with pytest.raises(BackendUnavailable):
        backend.waiting_keys()
    client.close()


def test_scripts_are_reloaded_after_a_function_or_script_flush(redis_env: Env) -> None:
    """A call refused for want of its code (a restart without persistence, a flush) loads it and runs."""
    backend = redis_env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    client = redis_env.client
    assert client is not None

    def flush() -> None:
        client.function_flush()
        client.script_flush()

    flush()
    assert backend.renew_many([(KEY, "a", 60_000)]) == [True]  # pipelined
    flush()
    park(backend, "p1")  # pipelined with the index update
    flush()
    assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)  # one call


# --- Failure model: other applications, slow pushes ------------------------------------------


def test_a_process_that_does_not_know_a_keys_limit_uses_the_one_recorded_with_its_waiters(env: Env) -> None:
    """Invariant: a sweep by a process that cannot tell a key's actor never admits more than the
    key's own application declared (it does not guess a limit from its own actors)."""
    backend = env.backend()
    stranger = env.another_client(backend)  # before the lease starts: a cluster client is slow
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=500)).acquired
    deadline = deadline_of(backend, KEY, "a")
    for waiter in ["p1", "p2", "p3"]:
        park(backend, waiter)  # parked while "a" holds, its lease not yet lapsed
    env.wait_past(deadline)
    assert stranger.sweep(KEY, limit=None).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.set_limit(KEY, 2, default=None).handoffs == (Handoff(KEY, "p2", b"msg:p2"),)
    assert backend.set_limit(KEY, None, default=None).handoffs == ()  # back to the recorded 1
    for waiter in ["p1", "p2"]:
        assert backend.confirm_handoff(KEY, waiter, ttl_ms=60_000)
        backend.release(KEY, waiter, limit=None)
    assert backend.inspect(KEY).holders[0][0] == "p3"
    backend.release(KEY, "p3", limit=None)
    assert_drained(env, backend)


def test_parked_messages_are_handed_only_to_a_process_of_their_route(env: Env) -> None:
    """Invariant: a parked message goes back only to the broker it came from. Another
    application's process leaves it (and the parked ones after it) where it is, its slot free
    for a process of its own route; ready waiters are anyone's to wake."""
    app_a = env.backend()
    app_b = env.another_client(app_a)  # the same object in memory: each call sets its route

    def a() -> GuardBackend:
        app_a.route = "app-a"
        return app_a

    def b() -> GuardBackend:
        app_b.route = "app-b"
        return app_b

    assert a().acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    park(a(), "p1")
    park(b(), "q1")
    assert b().release(KEY, "h", limit=None).handoffs == ()
    assert b().sweep(KEY, limit=None).handoffs == ()
    assert backend_holders(a()) == []
    assert a().sweep(KEY, limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert a().confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert a().acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000)).acquired
    assert a().release(KEY, "p1", limit=1).handoffs == ()  # q1 is app B's to deliver
    assert b().sweep(KEY, limit=None).handoffs == (Handoff(KEY, "q1", b"msg:q1"),)
    assert b().confirm_handoff(KEY, "q1", ttl_ms=60_000)
    # A blocking waiter needs no delivery: app A's release wakes app B's thread.
    assert b().acquire(Stake(KEY, "w", limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked
    assert b().acquire(Stake(KEY, "q1", limit=1, ttl_ms=60_000)).acquired
    assert a().release(KEY, "q1", limit=None).handoffs == (Handoff(KEY, "w", None),)
    assert b().wait_for_handoff(KEY, "w", timeout_ms=0) is not None
    b().release(KEY, "w", limit=None)
    assert_drained(env, a())


def test_a_new_acquirer_leaves_the_slot_of_another_routes_parked_waiter(env: Env) -> None:
    """Regression (found by tests/test_model.py): on Redis, an acquire whose hand-off passed over
    a parked waiter of another route took the free slot itself, ahead of that waiter (the
    script took free slots after a hand-off to mean an empty queue). The slot is the waiter's:
    it stays free for a process of the waiter's route, as for any other operation."""
    backend = env.backend()
    other = env.another_client(backend)
    backend.route = "app-a"
    assert backend.acquire(Stake(KEY, "h", limit=1, ttl_ms=200)).acquired
    park(backend, "p1")
    wait_lapsed(env, backend, KEY, "h")
    other.route = "app-b"
    refused = other.acquire(Stake(KEY, "n", limit=1, ttl_ms=60_000))
    assert not refused.acquired and refused.handoffs == () and refused.holders == ()
    backend.route = "app-a"
    assert backend.sweep(KEY, limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000)
    assert backend.release(KEY, "p1", limit=1).released
    assert_drained(env, backend)


def test_a_standby_being_sent_behind_another_routes_waiter_is_still_handed_its_slot(env: Env) -> None:
    """Regression (found by a long run of tests/test_model.py): on Redis, a standby being sent (its
    payload not yet confirmed on the broker) that queued behind a parked waiter of another route
    was left waiting, as a parked waiter there would be; the memory backend handed it its slot.
    It is no parked waiter: its sender, of its own route, enqueues it, so it takes the slot (its
    payload is not returned) and the other route's waiter keeps its place."""
    backend = env.backend()
    other = env.another_client(backend)  # the same object for the in-memory backend: set routes as we go
    backend.route = "app-a"
    for holder in ("h1", "h2"):
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
    other.route = "app-b"
    park(other, "p1", limit=2)
    backend.route = "app-a"
    park(backend, "p2", limit=2)
    handed, sent = backend.send_standbys(KEY, limit=2, count=2)
    assert handed == () and [h.waiter_id for h in sent] == ["p2"]  # p1 is app-b's to send
    assert backend.release(KEY, "h1", limit=2).handoffs == ()  # the slot is p1's: its route hands it on
    released = backend.release(KEY, "h2", limit=2)
    assert released.handoffs == (Handoff(KEY, "p2", None),)  # its sender enqueues it
    assert [w for w, _, _ in backend.inspect(KEY).waiters] == ["p1"]
    assert backend.confirm_standby(KEY, "p2", ttl_ms=60_000, payload=b"msg:p2", generation=sent[0].generation)


def test_a_refused_acquire_names_the_first_holders_and_an_acquired_one_nobody(env: Env) -> None:
    """The reply never carries a key's whole holder set (a limit may be thousands): O(log n)."""
    backend = env.backend()
    count = HOLDERS_SHOWN + 2
    for i in range(count):
        taken = backend.acquire(Stake(KEY, f"h{i:02}", limit=count, ttl_ms=60_000 + 1_000 * i))
        assert taken.acquired and taken.holders == ()
    refused = backend.acquire(Stake(KEY, "late", limit=count, ttl_ms=60_000))
    assert not refused.acquired
    assert refused.holders == tuple(f"h{i:02}" for i in range(HOLDERS_SHOWN))  # earliest deadline first
    assert len(backend_holders(backend)) == count  # inspect lists them all
    for i in range(count):
        assert backend.release(KEY, f"h{i:02}", limit=count).released
    assert_drained(env, backend)


def block(backend: GuardBackend, waiter: str, *, limit: int) -> None:
    """Queue ``waiter`` as a ready waiter (a thread blocking for a slot)."""
    assert backend.acquire(Stake(KEY, waiter, limit=limit, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)).parked


def test_with_more_ready_waiters_than_the_window_a_slot_goes_to_the_first_ready_one_in_it(env: Env) -> None:
    """A freed slot goes to the oldest ready waiter within the window (the first `limit` waiters),
    else to the oldest waiter; ready waiters behind the window wait their turn, however many."""
    backend = env.backend()
    for holder in ("h1", "h2", "h3"):
        assert backend.acquire(Stake(KEY, holder, limit=3, ttl_ms=60_000)).acquired
    park(backend, "p1", limit=3)
    park(backend, "p2", limit=3)
    for n in range(4):
        block(backend, f"b{n}", limit=3)
    # The window is p1, p2, b0: b0 is the ready one in it.
    assert backend.release(KEY, "h1", limit=3).handoffs == (Handoff(KEY, "b0", None),)
    # Now p1, p2, b1.
    assert backend.release(KEY, "h2", limit=3).handoffs == (Handoff(KEY, "b1", None),)
    [handed] = backend.release(KEY, "h3", limit=3).handoffs
    assert handed.waiter_id == "b2"
    assert waiter_ids(backend.inspect(KEY)) == ["p1", "p2", "b3"]
    # With no ready waiter in the window (limit 2: p1, p2), the oldest is handed the slot.
    assert backend.set_limit(KEY, 2).handoffs == ()
    assert backend.release(KEY, "b0", limit=2).handoffs == ()  # b1 and b2 hold the 2 slots
    [handed] = backend.release(KEY, "b1", limit=2).handoffs
    assert (handed.waiter_id, handed.payload) == ("p1", b"msg:p1")


def test_a_hand_off_costs_the_same_whatever_the_number_of_ready_waiters(redis_env: Env) -> None:
    """A release that hands its slot to a ready waiter (a thread blocking for it) runs as many
    Redis commands with 10 of them queued as with 300 (it read each one's place in the queue), on
    a key with a small limit and on one whose window holds them all."""
    assert redis_env.client is not None
    client = redis_env.client
    backend = redis_env.backend()

    def commands() -> int:
        return sum(int(v["calls"]) for k, v in client.info("commandstats").items() if k != "cmdstat_info")

    def release_cost(ready: int, limit: int = 4) -> int:
        key = f"cost:{ready}:{limit}"
        for h in range(limit):
            assert backend.acquire(Stake(key, f"h{h}", limit=limit, ttl_ms=60_000)).acquired
        for n in range(ready):
            waited = backend.acquire(
                Stake(key, f"b{n}", limit=limit, ttl_ms=60_000), wait=Waiter(wait_ms=60_000)
            )
            assert waited.parked
        before = commands()
        assert backend.release(key, "h0", limit=limit).handoffs == (Handoff(key, "b0", None),)
        return commands() - before

    release_cost(1)  # may load the scripts (FUNCTION LOAD): not a hand-off's cost
    assert release_cost(300) == release_cost(10)
    assert release_cost(300, limit=500) == release_cost(10, limit=500)


def test_inspect_lists_at_most_the_first_waiters_asked_for(env: Env) -> None:
    """inspect(waiters=N) reads the head of a queue only (a queue may be 100,000 long)."""
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    for n in range(5):
        park(backend, f"p{n}")
    full = backend.inspect(KEY)
    assert [w for w, _, _ in full.waiters] == [f"p{n}" for n in range(5)]
    head = backend.inspect(KEY, waiters=2)
    assert head.waiters == full.waiters[:2] and head.holders == full.holders
    assert backend.inspect(KEY, waiters=0).waiters == ()
    with pytest.raises(ValueError, match="waiters"):
        backend.inspect(KEY, waiters=-1)


def backend_holders(backend: GuardBackend) -> list[str]:
    return [holder for holder, _ in backend.inspect(KEY).holders]


def test_a_stale_copy_of_a_handed_off_message_never_starts(env: Env) -> None:
    """Invariant: at most one copy of a parked message starts, however slow its deliverer.

    The deliverer of p1's first hand-off stalls past the reservation; p1 goes back to the queue
    and is handed off again. The first copy (generation g1) may still reach the broker: it is
    stale from then on, before and after the live copy ran; a redelivery of the live copy is not.
    """
    backend = env.backend(handoff_ttl_ms=200)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    for waiter in ["p1", "p2"]:
        park(backend, waiter)
    [first] = backend.release(KEY, "a", limit=1).handoffs
    wait_lapsed(env, backend, KEY, "p1")
    [second] = backend.sweep(KEY, limit=1).handoffs
    assert (first.waiter_id, second.waiter_id) == ("p1", "p1") and second.payload == b"msg:p1"
    assert first.generation is not None and second.generation is not None
    assert second.generation > first.generation
    # The stalled deliverer confirms at last: that changes nothing, the payload stays stored.
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=first.generation) is False
    assert backend.inspect(KEY).reserved == ("p1",)
    stale = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=first.generation))
    assert stale.stale and not stale.acquired and stale.handoffs == ()
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=second.generation)
    live = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=second.generation))
    assert live.acquired and not live.stale
    assert backend.release(KEY, "p1", limit=1).handoffs == (Handoff(KEY, "p2", b"msg:p2"),)
    assert backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=first.generation)).stale
    redelivered = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=second.generation))
    assert not redelivered.stale  # refused only because p2 holds the slot
    assert backend.confirm_handoff(KEY, "p2", ttl_ms=60_000)
    backend.release(KEY, "p2", limit=1)
    assert_drained(env, backend, lapsed=("p1",))


def test_a_standby_confirmed_too_late_cannot_start_beside_its_newer_copy(env: Env) -> None:
    """Invariant: a standby whose sender stalled past its deadline parks again; once it is sent
    again, the first copy is stale."""
    backend = env.backend(handoff_ttl_ms=200)
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    _, [first] = backend.send_standbys(KEY, limit=1, count=1)
    env.wait_past(env.now_ms() + 200)
    _, [second] = backend.send_standbys(KEY, limit=1, count=1)  # parked again, sent again
    assert first.generation is not None and second.generation is not None
    assert second.generation > first.generation
    assert first.payload is not None and second.payload is not None
    assert not backend.confirm_standby(KEY, "p1", first.payload, ttl_ms=60_000, generation=first.generation)
    assert backend.confirm_standby(KEY, "p1", second.payload, ttl_ms=60_000, generation=second.generation)
    assert backend.acquire(
        Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=first.generation), wait=Waiter(payload=b"msg:p1")
    ).stale
    backend.release(KEY, "a", limit=1)
    started = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=second.generation))
    assert started.acquired
    backend.release(KEY, "p1", limit=1)
    assert_drained(env, backend, lapsed=("p1",))


@pytest.mark.parametrize("first", ["redelivered copy", "hand-off"])
@pytest.mark.parametrize("picked_up", ["original", "standby"])
def test_a_copy_that_parked_after_pickup_and_is_delivered_again_never_runs_beside_its_hand_off(
    env: Env, picked_up: str, first: str
) -> None:
    """Invariant: at most one copy of a message runs, whatever the broker delivers again.

    A worker picks p1 up (the message as sent, generation ORIGINAL_GENERATION, or a standby sent
    ahead, with its send's generation), finds the key full and parks it, and dies before the
    broker's ack: the broker delivers that copy again. The slot frees and the stored copy is
    handed off. Whichever comes first, only the hand-off's copy starts: the copy delivered again
    is stale, before and after it ran (it shares the hand-off's holder id, so taking the slot
    would be two runs on one lease).
    """
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    if picked_up == "original":
        generation = ORIGINAL_GENERATION
    else:
        park(backend, "p1")
        _, [sent] = backend.send_standbys(KEY, limit=1, count=1)
        assert backend.confirm_standby(KEY, "p1", b"msg:p1", ttl_ms=60_000)
        assert sent.generation is not None
        generation = sent.generation
    again = Waiter(payload=b"msg:p1")
    parked = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=generation), wait=again)
    assert parked.parked and not parked.acquired
    [handoff] = backend.release(KEY, "a", limit=1).handoffs
    assert handoff.waiter_id == "p1" and handoff.payload == b"msg:p1" and handoff.generation is not None
    assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=handoff.generation)
    if first == "redelivered copy":
        redelivered = backend.acquire(
            Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=generation), wait=again
        )
        assert redelivered.stale and not redelivered.acquired
    live = backend.acquire(
        Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=handoff.generation), wait=again
    )
    assert live.acquired and not live.stale
    redelivered = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=generation), wait=again)
    assert redelivered.stale and not redelivered.acquired
    assert backend.release(KEY, "p1", limit=1).released
    assert backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=generation)).stale
    assert_drained(env, backend, lapsed=("p1",))


@pytest.mark.parametrize("came_back", [False, True], ids=["still away", "came back"])
@pytest.mark.parametrize("what", ["hand-off", "standby send", "standby handed a slot"])
def test_withdrawing_a_message_parked_elsewhere_never_takes_out_its_entry_after_it_came_back(
    env: Env, what: str, came_back: bool
) -> None:
    """Invariant: a parked message is never lost between two guard keys.

    A hand-off or standby send of p1 is pushed through the enqueue gate, and another guard
    parks it there: its caller withdraws it from KEY (``cancel_wait`` with that generation). From
    the other key the message may already have come back to KEY first (parked again by its
    enqueue, or taking up the reservation): then that entry is its only place, and the withdrawal
    leaves it. Without the generation the withdrawal took it out: the message was in no key at all
    (found by tests/test_combinations.py with real workers, about 1 run in 50 on a loaded machine).
    """
    backend = env.backend()
    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    if what == "hand-off":
        [sent] = backend.release(KEY, "a", limit=1).handoffs
        assert sent.payload == b"msg:p1" and backend.inspect(KEY).reserved == ("p1",)
    else:
        _, [sent] = backend.send_standbys(KEY, limit=1, count=1)
        if what == "standby handed a slot":
            assert backend.release(KEY, "a", limit=1).handoffs == (Handoff(KEY, "p1", None),)
    assert sent.generation is not None
    back = Waiter(payload=b"msg:p1 from elsewhere")
    if came_back:  # the other key handed it on at once, and its enqueue reached KEY's gate first
        again = backend.acquire(Stake(KEY, "p1", limit=1, ttl_ms=60_000), wait=back)
        assert again.acquired is (what != "standby send")
    withdrawn = backend.cancel_wait(KEY, "p1", limit=1, generation=sent.generation)
    state = backend.inspect(KEY)
    if not came_back:
        assert withdrawn.released is (what != "standby send")
        assert "p1" not in [w for w, _, _ in state.waiters] + [h for h, _ in state.holders]
    elif what == "standby send":
        assert not withdrawn.released and [(w, p) for w, _, p in state.waiters] == [("p1", True)]
        assert backend.release(KEY, "a", limit=1).handoffs[0].payload == b"msg:p1 from elsewhere"
    else:  # it took the reservation up: it holds the slot, as its enqueue was told
        assert not withdrawn.released and [h for h, _ in state.holders] == ["p1"] and state.reserved == ()
    # A withdrawal of the same generation again changes nothing either way.
    assert not backend.cancel_wait(KEY, "p1", limit=1, generation=sent.generation).released
    for holder in ("a", "p1"):
        backend.release(KEY, holder, limit=1)
    backend.cancel_wait(KEY, "p1", limit=1)
    assert_drained(env, backend)


@pytest.mark.parametrize("meanwhile", ["nothing", "handed off again", "handed off again and started"])
def test_a_copy_back_at_the_gate_from_another_guard_is_judged_by_the_generation_it_carries(
    env: Env, meanwhile: str
) -> None:
    """Invariant: a parked message starts once, and is never lost as a stale copy of itself.

    p1's hand-off went to the gate, another guard parked it there, and its caller was slow: the
    reservation lapsed and p1 is back in the queue (a copy of that generation may start). Then the
    copy comes back to this key's gate from the other guard, with the key free; the gate acquires
    with the generation it carries, at enqueue as a worker does at pickup:

    * nothing changed meanwhile: it takes the slot (even through a hand-off to itself in the same
      call, which issues a newer generation) and its copy starts;
    * p1 was handed off again meanwhile (its newer copy on the broker, or already running): the
      copy back from the other guard is stale and dropped; the newer one starts, once.

    Found by tests/test_model.py: without the generation the first case's copy was stale when
    picked up (lost), and the last case's took the running holder's slot again (started twice).
    """
    backend = env.backend(handoff_ttl_ms=TTL)

    def copy_acquires(generation: int | None) -> AcquireResult:  # at the gate, or picked up
        return backend.acquire(
            Stake(KEY, "p1", limit=1, ttl_ms=60_000, generation=generation), wait=Waiter(payload=b"msg:p1")
        )

    assert backend.acquire(Stake(KEY, "a", limit=1, ttl_ms=60_000)).acquired
    park(backend, "p1")
    [first] = backend.release(KEY, "a", limit=1).handoffs
    assert first.generation is not None
    wait_lapsed(env, backend, KEY, "p1")
    newer = None
    if meanwhile != "nothing":
        [newer] = backend.sweep(KEY, limit=1).handoffs
        assert newer.generation is not None and newer.generation != first.generation
        assert backend.confirm_handoff(KEY, "p1", ttl_ms=60_000, generation=newer.generation)
    if meanwhile == "handed off again and started":
        assert newer is not None and copy_acquires(newer.generation).acquired
    back = copy_acquires(first.generation)
    if meanwhile == "nothing":
        assert back.acquired and not back.stale
        assert copy_acquires(first.generation).acquired
    else:
        assert back.stale and not back.acquired
        assert newer is not None
        if meanwhile == "handed off again":
            assert copy_acquires(newer.generation).acquired
    assert backend.release(KEY, "p1", limit=1).released
    assert_drained(env, backend, lapsed=("p1",))


def test_a_message_picked_up_with_room_costs_no_generation_record(env: Env) -> None:
    """The common case stays as cheap as before: the original copy of a message that never parked
    acquires and releases, and leaves nothing behind (no record of which copy may start)."""
    backend = env.backend()
    for _ in range(2):
        started = backend.acquire(
            Stake(KEY, "m1", limit=1, ttl_ms=60_000, generation=ORIGINAL_GENERATION),
            wait=Waiter(payload=b"msg:m1"),
        )
        assert started.acquired and not started.stale
        assert backend.release(KEY, "m1", limit=1).released
    assert_drained(env, backend)


def test_a_free_slot_kept_for_another_routes_waiter_is_not_taken_by_a_newcomer(env: Env) -> None:
    """Invariant: FIFO holds across routes. A slot left free for another application's parked
    waiter (its own sweep hands it over) is not taken by a new acquirer of this route."""
    app_a = env.backend()
    app_b = env.another_client(app_a)
    app_a.route = "app-a"
    assert app_a.acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    park(app_a, "p1")
    app_b.route = "app-b"
    assert app_b.release(KEY, "h", limit=None).handoffs == ()
    newcomer = app_b.acquire(Stake(KEY, "n", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"msg:n"))
    assert not newcomer.acquired and newcomer.parked
    app_a.route = "app-a"
    assert app_a.sweep(KEY, limit=1).handoffs == (Handoff(KEY, "p1", b"msg:p1"),)


# --- The send-time lock (try_lock) -------------------------------------------------------------


def test_try_lock_takes_a_free_key_and_names_the_holder_when_held(env: Env) -> None:
    backend = env.backend()
    other = env.another_client(backend)
    before = env.now_ms()
    taken = backend.try_lock(KEY, "m1", ttl_ms=10_000, info="refresh")
    assert (taken.acquired, taken.token, taken.holders, taken.limit, taken.handoffs) == (
        True, None, (), 1, ()
    )  # fmt: skip
    assert before + 10_000 <= deadline_of(backend, KEY, "m1") <= env.now_ms() + 10_000
    [(holder, since, info)] = backend.inspect(KEY).holder_info
    assert (holder, info) == ("m1", "refresh") and before <= since <= env.now_ms()
    refused = other.try_lock(KEY, "m2", ttl_ms=10_000, info="refresh")
    assert (refused.acquired, refused.token, refused.holders, refused.parked) == (False, None, ("m1",), False)
    assert backend_holders(backend) == ["m1"] and backend.inspect(KEY).waiters == ()
    # A lock taken so is an ordinary limit-1 lease: renewed, re-entered, released by its holder only.
    assert backend.renew(KEY, "m1", ttl_ms=60_000)
    again = backend.try_lock(KEY, "m1", ttl_ms=30_000, info="other")
    assert again.acquired and again.token is None and backend_holders(backend) == ["m1"]
    assert ("m1", since, "refresh") in backend.inspect(KEY).holder_info  # keeps its since and info
    assert not backend.release(KEY, "m2", limit=1).released
    assert backend.release(KEY, "m1", limit=1).released
    assert_drained(env, backend)
    assert other.try_lock(KEY, "m2", ttl_ms=10_000).acquired  # free again
    assert backend.acquire(Stake(KEY, "m2", limit=1, ttl_ms=10_000)).token is not None  # the holder starts
    assert backend.release(KEY, "m2", limit=1).released
    assert_drained(env, backend)


def test_try_lock_never_takes_the_lock_from_a_queued_rerun(env: Env) -> None:
    """A ``reschedule_once`` rerun parks in the lock's queue (``limit=0``): while it waits, a new
    send is refused, whether the holder is live or lapsed (then the rerun is handed the lock)."""
    backend = env.backend()
    # 1 s: a loaded machine can stall longer than a shorter lock between the holder's lock and the
    # refused send below, and the lapse this test waits for later would come too early.
    assert backend.try_lock(KEY, "h", ttl_ms=1_000).acquired
    rerun = backend.acquire(Stake(KEY, "rerun", limit=0, ttl_ms=60_000), wait=Waiter(payload=b"msg:rerun"))
    assert rerun.parked and rerun.holders == ("h",)
    refused = backend.try_lock(KEY, "m1", ttl_ms=10_000)
    assert (refused.acquired, refused.holders, refused.handoffs) == (False, ("h",), ())
    wait_lapsed(env, backend, KEY, "h")  # the holder's producer died: its lock lapsed
    late = backend.try_lock(KEY, "m2", ttl_ms=10_000)
    assert (late.acquired, late.holders) == (False, ("rerun",))
    assert late.handoffs == (Handoff(KEY, "rerun", b"msg:rerun"),)  # to re-enqueue
    assert backend.confirm_handoff(KEY, "rerun", ttl_ms=60_000, generation=late.handoffs[0].generation)
    assert not backend.try_lock(KEY, "m3", ttl_ms=10_000).acquired
    assert backend.release(KEY, "rerun", limit=1).released
    assert_drained(env, backend)


def test_try_lock_respects_a_run_time_limit(env: Env) -> None:
    backend = env.backend()
    backend.set_limit(KEY, 0)
    halted = backend.try_lock(KEY, "m1", ttl_ms=10_000)
    assert (halted.acquired, halted.holders, halted.limit) == (False, (), 0)
    backend.set_limit(KEY, 2)
    assert backend.try_lock(KEY, "m1", ttl_ms=10_000).acquired
    second = backend.try_lock(KEY, "m2", ttl_ms=10_000)
    assert (second.acquired, second.limit) == (True, 2)
    assert not backend.try_lock(KEY, "m3", ttl_ms=10_000).acquired
    for holder in ("m1", "m2"):
        assert backend.release(KEY, holder, limit=1).released
    assert_drained(env, backend, limit=2)


def test_try_lock_checks_its_numbers_and_key(env: Env) -> None:
    backend = env.backend()
    for ttl in (0, -1, 366 * 86_400_000 + 1):
        with pytest.raises(ValueError, match="ttl_ms"):
            backend.try_lock(KEY, "m1", ttl_ms=ttl)
    with pytest.raises(ValueError):
        backend.try_lock("", "m1", ttl_ms=1_000)
    assert_drained(env, backend)


def test_a_lapsed_send_lock_lets_the_next_send_in(env: Env) -> None:
    backend = env.backend()
    assert backend.try_lock(KEY, "m1", ttl_ms=200).acquired
    wait_lapsed(env, backend, KEY, "m1")
    assert backend.try_lock(KEY, "m2", ttl_ms=60_000).acquired
    assert not backend.renew(KEY, "m1", ttl_ms=60_000)  # never revived
    assert backend_holders(backend) == ["m2"]
    assert backend.release(KEY, "m2", limit=1).released
    assert_drained(env, backend)


def test_a_send_lock_expires_with_its_holder(redis_env: Env) -> None:
    backend = redis_env.backend()
    client = redis_env.client
    assert client is not None
    assert backend.try_lock(KEY, "m1", ttl_ms=300, info="refresh").acquired
    deadline = deadline_of(backend, KEY, "m1")
    names = {f"{redis_env.namespace}:{{{KEY}}}:{suffix}" for suffix in ("holders", "info")}
    assert redis_env.stored() == names  # no token, no queue: nothing else
    assert {client.pexpiretime(name) for name in names} == {deadline}
    assert backend.renew(KEY, "m1", ttl_ms=400)  # a confirmation moves them all
    deadline = deadline_of(backend, KEY, "m1")
    assert {client.pexpiretime(name) for name in names} == {deadline}
    redis_env.wait_past(deadline)
    assert redis_env.stored() == set()  # its producer died: nothing is left


def test_the_stale_copy_window_is_a_setting_of_each_backend(env: Env) -> None:
    backend = env.backend()
    made = (
        MemoryBackend(stale_ttl_ms=60_000)
        if env.kind == "memory"
        else RedisBackend(cast(Any, backend).client, namespace=env.namespace, stale_ttl_ms=60_000)
    )
    assert made.stale_ttl_ms == 60_000
    with pytest.raises(ValueError, match="stale_ttl_ms"):
        MemoryBackend(stale_ttl_ms=0)


# --- summaries: the overview of many keys -----------------------------------------------------


def test_summaries_count_holders_waiters_and_limits_without_changing_anything(env: Env) -> None:
    backend = env.backend()
    other = "slots:other"
    assert backend.acquire(Stake(KEY, "h1", limit=2, ttl_ms=60_000, info="deliver")).acquired
    assert backend.acquire(Stake(KEY, "h2", limit=2, ttl_ms=60_000)).acquired
    park(backend, "w1", limit=2)
    blocking = backend.acquire(
        Stake(KEY, "w2", limit=2, ttl_ms=60_000, info="report"), wait=Waiter(wait_ms=60_000)
    )
    assert blocking.parked
    park(backend, "w3", limit=2)
    backend.set_limit(other, 0)
    before = backend.inspect(KEY)

    summary, idle = backend.summaries([KEY, other], waiters=2)

    assert backend.inspect(KEY) == before  # read only
    assert (summary.key, summary.holders, summary.waiters, summary.reserved) == (KEY, 2, 3, 0)
    assert summary.oldest_since_ms == before.waiters[0][1]
    assert (summary.limit, summary.recorded_limit, summary.limit_in_force) == (None, 2, 2)
    assert [(w.waiter_id, w.since_ms) for w in summary.first] == [(w, s) for w, s, _ in before.waiters[:2]]
    assert [w.payload for w in summary.first] == [b"msg:w1", None]
    assert summary.first[1].info == "report"
    assert (idle.holders, idle.waiters, idle.oldest_since_ms, idle.limit, idle.limit_in_force) == (
        0,
        0,
        None,
        0,
        0,
    )
    [plain] = backend.summaries([KEY])
    assert plain.first == () and plain.oldest_since_ms == summary.oldest_since_ms


def test_summaries_of_many_keys_come_back_in_order(env: Env) -> None:
    backend = env.backend()
    keys = [f"slots:many:{i}" for i in range(25)]
    for i, key in enumerate(keys):
        assert backend.acquire(Stake(key, f"h{i}", limit=1, ttl_ms=60_000)).acquired
        if i % 2:
            park(backend, f"w{i}", key=key)
    if isinstance(backend, RedisBackend):
        backend.SUMMARY_CHUNK = 10  # several pipelines
    got = backend.summaries(keys, waiters=1)
    assert [s.key for s in got] == keys
    assert [s.waiters for s in got] == [i % 2 for i in range(25)]
    assert [[w.waiter_id for w in s.first] for s in got] == [[f"w{i}"] if i % 2 else [] for i in range(25)]
    assert backend.summaries([]) == []


def test_summaries_show_a_debounce_keys_pending_run_due_time_and_superseded_sends(env: Env) -> None:
    """A debounce key's summary: its pending run (the first waiter), when it is due (its timer
    holder's deadline), and how many sends of the burst it superseded (kept by the send's own
    script; a message sent again is not one); a burst after the queue emptied counts from 0."""
    backend = env.backend()
    key = "debounce:doc"
    for waiter in ("m1", "m2", "m2", "m3"):
        backend.debounce(key, waiter, f"msg:{waiter}".encode(), wait_ms=60_000, max_wait_ms=120_000)

    [summary, plain] = backend.summaries([key, KEY], waiters=1)

    assert (summary.waiters, [(w.waiter_id, w.payload) for w in summary.first]) == (1, [("m3", b"msg:m3")])
    assert summary.due_ms == dict(backend.inspect(key).holders)[DEBOUNCE_TIMER]
    assert summary.superseded == 2
    assert (plain.due_ms, plain.superseded) == (None, None)
    backend.cancel_wait(key, "m3", limit=1)  # the queue empties: the burst is over
    backend.debounce(key, "m4", b"msg:m4", wait_ms=60_000, max_wait_ms=120_000)
    [summary] = backend.summaries([key])
    assert (summary.waiters, summary.superseded) == (1, 0)


def test_summaries_check_their_keys_and_count(env: Env) -> None:
    backend = env.backend()
    with pytest.raises(ValueError, match="key"):
        backend.summaries([""])
    with pytest.raises(ValueError, match="waiters"):
        backend.summaries([KEY], waiters=-1)
