"""Bad input (DESIGN §5): every duration bounded at declaration, every script validates first.

Durations run from 0 to 366 days (the ledger's retention and prune age: 100
years); limits and counts from 0 to 2**31 - 1 (``dramatiq_guard/bounds.py``).
Declaration errors name the actor or setting, the value and the range. The
backends refuse an out-of-range number before touching anything, in Python
and again in each per-key Lua script, which is called directly here (past the
Python checks) to show that a refused call leaves no key behind: Redis does
not roll back a script that fails half-way.

The backend tests reuse the contract suite's ``env`` (memory, Redis, a Redis
Cluster node).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from test_backend_contract import KEY, Env, _env, env, redis_cluster_url

import dramatiq_guard
from dramatiq_guard.backends import GuardBackend, MemoryBackend, RedisBackend, Stake, Waiter
from dramatiq_guard.cli import main
from dramatiq_guard.errors import GuardOptionError
from dramatiq_guard.ledger import Ledger
from dramatiq_guard.lock import Lock
from dramatiq_guard.middleware.dedup import Deduplication
from dramatiq_guard.middleware.idempotency import Idempotency
from dramatiq_guard.middleware.slots import Concurrency, Mutex
from dramatiq_guard.policies import DedupPolicy, MutexPolicy

__all__ = ["env", "redis_cluster_url"]  # fixtures of the contract suite, used here

MAX_MS = 366 * 24 * 3600 * 1000
ABSURD = 10**19  # ms: about 317 million years, and above 2**63
TOO_LONG = datetime.timedelta(days=367)


# --- declaration ------------------------------------------------------------------------------


@pytest.fixture
def broker(restore_global_broker: None) -> Any:
    broker = StubBroker()
    dramatiq_guard.install(broker)
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("dedup", {"strategy": "until_executed", "ttl": ABSURD}, "ttl"),
        ("dedup", {"strategy": "until_expired", "ttl": TOO_LONG}, "ttl"),
        ("mutex", {"ttl": ABSURD}, "ttl"),
        ("mutex", {"on_busy": "wait", "wait": TOO_LONG}, "wait"),
        ("concurrency", {"limit": 2, "ttl": MAX_MS + 1}, "ttl"),
        ("concurrency", {"limit": 2**31}, "limit"),
        ("idempotency_key", {"key": ["n"], "retention": ABSURD}, "retention"),
    ],
)
def test_an_absurd_option_fails_at_declaration_naming_actor_option_value_and_range(
    broker: Any, option: str, value: dict[str, Any], field: str
) -> None:
    with pytest.raises(GuardOptionError) as raised:
        declare: Any = dramatiq.actor
        declare(lambda n: None, actor_name="nightly", **{option: value})
    message = str(raised.value)
    assert "'nightly'" in message and f"{option}=" in message and repr(value) in message
    bound = r"(at most|an integer from 0 to) (366 days|36600 days|2147483647)"
    assert re.search(rf"\b{field} must be {bound}", message), message


def test_the_bounds_themselves_are_accepted() -> None:
    assert DedupPolicy(strategy="until_expired", ttl=MAX_MS).ttl_ms == MAX_MS
    assert MutexPolicy(ttl=datetime.timedelta(days=366), wait=MAX_MS).ttl_ms == MAX_MS
    assert dramatiq_guard.ConcurrencyPolicy(limit=2**31 - 1).limit == 2**31 - 1


@pytest.mark.parametrize(
    ("make", "setting"),
    [
        (lambda: Mutex(lease_ttl=ABSURD), "lease_ttl"),
        (lambda: Concurrency(pickup_ttl=TOO_LONG), "pickup_ttl"),
        (lambda: Concurrency(sweep_interval=ABSURD), "sweep_interval"),
        (lambda: Mutex(standby_wait=ABSURD), "standby_wait"),
        (lambda: Mutex(limit_cache=ABSURD), "limit_cache"),
        (lambda: Deduplication(pending_ttl=ABSURD), "pending_ttl"),
        (lambda: Idempotency(retention=ABSURD), "retention"),
        (lambda: Ledger("sqlite://", retention=datetime.timedelta(days=36_601)), "retention"),
        (lambda: Lock("report", lease_ttl=ABSURD), "lease_ttl"),
        (lambda: Lock("report", ttl=TOO_LONG), "ttl"),
        (lambda: Lock("report", blocking_timeout=1e12), "blocking_timeout"),
        (lambda: Lock("report", blocking_timeout=-1), "blocking_timeout"),
        (lambda: Lock("report", blocking_timeout=float("nan")), "blocking_timeout"),
        (lambda: MemoryBackend(handoff_ttl_ms=ABSURD), "handoff_ttl_ms"),
        (lambda: MemoryBackend(handoff_ttl_ms=0), "handoff_ttl_ms"),
    ],
)
def test_an_absurd_setting_fails_at_construction_naming_it_and_the_range(
    make: Callable[[], object], setting: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{setting} must be .*(366 days|36600 days|{MAX_MS})") as raised:
        make()
    assert "not " in str(raised.value) or "got " in str(raised.value)


def test_install_passes_an_absurd_setting_on_to_its_error(restore_global_broker: None) -> None:
    with pytest.raises(ValueError, match="lease_ttl must be at most 366 days"):
        dramatiq_guard.install(StubBroker(), lease_ttl=ABSURD)


def test_a_lock_refuses_an_absurd_blocking_timeout_at_acquire_too() -> None:
    lock = Lock("report", redis=MemoryBackend())
    with pytest.raises(ValueError, match="blocking_timeout must be"):
        lock.acquire(blocking_timeout=datetime.timedelta(days=400))
    assert not lock.locked()


def test_the_ledger_takes_years_but_not_centuries(tmp_path: Path) -> None:
    two_years = datetime.timedelta(days=730)
    assert dramatiq_guard.IdempotencyPolicy(key=("n",), retention=two_years).retention_ms == 730 * 86_400_000
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite3'}", retention=two_years)
    ledger.run("k", lambda: 1, actor_name="t", payload={}, fingerprint="f", holder="m")
    assert ledger.prune(older_than=datetime.timedelta(days=400)) == 0
    with pytest.raises(ValueError, match="older_than must be at most 36600 days"):
        ledger.prune(older_than=ABSURD)
    assert ledger.get("k") is not None


@pytest.mark.parametrize(
    "argv",
    [
        ["limit", "set", "k", str(2**31)],
        ["ledger", "prune", "--older-than", "36601d", "--ledger", "sqlite://"],
    ],
)
def test_the_command_line_refuses_out_of_range_numbers_as_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "must be" in capsys.readouterr().err


# --- the backends, in Python ------------------------------------------------------------------


def _stored(env: Env) -> set[str]:
    return env.stored() if env.client is not None else set()


BAD_CALLS: list[tuple[str, Callable[[GuardBackend], object], str]] = [
    ("ttl absurd", lambda b: b.acquire(Stake(KEY, "h", limit=1, ttl_ms=ABSURD)), "ttl_ms"),
    ("ttl zero", lambda b: b.acquire(Stake(KEY, "h", limit=1, ttl_ms=0)), "ttl_ms"),
    ("ttl bool", lambda b: b.acquire(Stake(KEY, "h", limit=1, ttl_ms=True)), "ttl_ms"),
    ("limit negative", lambda b: b.acquire(Stake(KEY, "h", limit=-1, ttl_ms=1000)), "limit"),
    (
        "wait absurd",
        lambda b: b.acquire(Stake(KEY, "h", limit=0, ttl_ms=1000), wait=Waiter(wait_ms=ABSURD)),
        "wait_ms",
    ),
    (
        "wait negative",
        lambda b: b.acquire(Stake(KEY, "h", limit=0, ttl_ms=1000), wait=Waiter(payload=b"m", wait_ms=-1)),
        "wait_ms",
    ),
    ("renew absurd", lambda b: b.renew(KEY, "h", ttl_ms=ABSURD), "ttl_ms"),
    ("renew negative", lambda b: b.renew(KEY, "h", ttl_ms=-1), "ttl_ms"),
    ("renew_many absurd", lambda b: b.renew_many([(KEY, "h", 1000), (KEY, "h", ABSURD)]), "ttl_ms"),
    ("release send_ahead", lambda b: b.release(KEY, "h", limit=1, send_ahead=-1), "send_ahead"),
    ("confirm_handoff", lambda b: b.confirm_handoff(KEY, "h", ttl_ms=ABSURD), "ttl_ms"),
    ("send_standbys", lambda b: b.send_standbys(KEY, limit=1, count=-1), "count"),
    ("confirm_standby", lambda b: b.confirm_standby(KEY, "h", b"m", ttl_ms=0), "ttl_ms"),
    ("wait_for_handoff", lambda b: b.wait_for_handoff(KEY, "h", timeout_ms=ABSURD), "timeout_ms"),
    ("cancel_wait", lambda b: b.cancel_wait(KEY, "h", limit=-1), "limit"),
    ("sweep", lambda b: b.sweep(KEY, limit=2**31), "limit"),
    ("set_limit absurd", lambda b: b.set_limit(KEY, ABSURD), "limit"),
    ("set_limit negative", lambda b: b.set_limit(KEY, -1), "limit"),
    ("set_limit default", lambda b: b.set_limit(KEY, 1, default=-1), "default"),
]


@pytest.mark.parametrize(
    ("call", "what"), [(c, w) for _, c, w in BAD_CALLS], ids=[n for n, _, _ in BAD_CALLS]
)
def test_a_backend_refuses_an_out_of_range_number_and_stores_nothing(
    env: Env, call: Callable[[GuardBackend], object], what: str
) -> None:
    backend = env.backend()
    with pytest.raises(ValueError, match=rf"^{what} must be an integer from -?\d+ to \d+"):
        call(backend)
    assert _stored(env) == set()
    assert backend.inspect(KEY).holders == () and backend.get_limit(KEY) is None


def test_a_redis_backend_refuses_an_absurd_setting(redisdb: redis.Redis) -> None:
    with pytest.raises(ValueError, match="handoff_ttl_ms must be an integer from 1 to"):
        RedisBackend(redisdb, handoff_ttl_ms=ABSURD)
    with pytest.raises(ValueError, match="index_grace_ms must be an integer from 0 to"):
        RedisBackend(redisdb, index_grace_ms=-1)


# --- the scripts, called directly -------------------------------------------------------------


def _script(backend: RedisBackend, name: str, *args: Any, default_limit: Any = 1) -> Any:
    """Run a per-key script as the backend would, without its Python checks."""
    return backend._call(backend.scripts[name], backend._keys(KEY), backend._args(default_limit, *args))


NOT_SANE = [str(ABSURD), "-5", "1e3", "1.5", "0x10", "inf", "nan", " 12", "", "12abc", "9" * 40]


@pytest.fixture(params=["redis", "cluster"])
def redis_env(request: pytest.FixtureRequest, unique_name: str) -> Iterator[Env]:
    """The contract suite's ``env`` on Redis only: the Lua scripts are the Redis backend's."""
    made = _env(request, request.param, unique_name)
    yield made
    made.close()


@pytest.mark.parametrize("ttl", NOT_SANE)
def test_acquire_with_an_insane_ttl_writes_nothing(redis_env: Env, ttl: str) -> None:
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    with pytest.raises(redis.ResponseError) as raised:
        _script(backend, "acquire", "h", ttl, "", b"", 0, "")
    assert redis_env.stored() == set()  # no holder left without an expiry
    assert "ttl_ms must be an integer from 1 to 31622400000" in str(raised.value)


@pytest.mark.parametrize("ttl", [*NOT_SANE, "0"])
def test_the_send_lock_with_an_insane_ttl_writes_nothing(redis_env: Env, ttl: str) -> None:
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    with pytest.raises(redis.ResponseError, match="ttl_ms must be an integer from 1 to 31622400000"):
        backend._call(backend.scripts["lock"], [backend._prefix(KEY)], ["h", ttl, ""])
    assert redis_env.stored() == set()


@pytest.mark.parametrize(
    ("name", "args", "what"),
    [
        ("acquire", ("h", 1000, "park", b"m", "-1", ""), "wait_ms"),
        ("acquire", ("h", 1000, "block", b"", str(ABSURD), ""), "wait_ms"),
        ("acquire", ("h", 1000, "park", b"m", 0, "", "", "1", "", "2049"), "priority"),
        ("acquire", ("h", 1000, "park", b"m", 0, "", "", "1", "", "-1e3"), "priority"),
        ("confirm", ("handoff", "h", str(ABSURD), ""), "ttl_ms"),
        ("release", ("h", "-1"), "send_ahead"),
        ("standby", ("1e9",), "count"),
        ("confirm", ("standby", "h", str(ABSURD), "", b"m"), "ttl_ms"),
        ("set_limit", (str(ABSURD),), "limit"),
        ("set_limit", ("1e3",), "limit"),
        ("set_limit", ("-1",), "limit"),
    ],
)
def test_each_script_checks_its_numbers_before_any_write(
    redis_env: Env, name: str, args: tuple[Any, ...], what: str
) -> None:
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    with pytest.raises(redis.ResponseError, match=rf"{what} must be an integer from"):
        _script(backend, name, *args)
    assert redis_env.stored() == set()


@pytest.mark.parametrize("name", ["acquire", "sweep", "cancel_wait", "release"])
def test_the_common_numbers_are_checked_too(redis_env: Env, name: str) -> None:
    args = {"acquire": ("h", 1000, "", b"", 0, ""), "cancel_wait": ("h",), "release": ("h", 0)}.get(name, ())
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    with pytest.raises(redis.ResponseError, match="default_limit must be an integer from 0 to 2147483647"):
        _script(backend, name, *args, default_limit="-1")
    backend.handoff_ttl_ms = ABSURD
    with pytest.raises(redis.ResponseError, match="handoff_ttl_ms must be an integer from 1 to"):
        _script(backend, name, *args)
    assert redis_env.stored() == set()


def test_a_renewal_with_an_insane_ttl_leaves_the_lease_as_it_was(redis_env: Env) -> None:
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    assert backend.acquire(Stake(KEY, "h", limit=1, ttl_ms=60_000)).acquired
    before = backend.inspect(KEY)
    stored = redis_env.stored()
    for ttl in NOT_SANE:
        with pytest.raises(redis.ResponseError, match="ttl_ms must be an integer from 0 to"):
            backend._call(backend.scripts["renew"], [backend._prefix(KEY)], ["h", ttl])
    assert backend.inspect(KEY) == before and redis_env.stored() == stored


def test_a_renewal_batch_with_one_insane_ttl_renews_none_of_it(redis_env: Env) -> None:
    """renew.lua checks every lease of a batch before its first write."""
    backend = redis_env.backend()
    assert isinstance(backend, RedisBackend)
    for holder in ("h1", "h2"):  # one key: a batch's keys may share a cluster slot
        assert backend.acquire(Stake(KEY, holder, limit=2, ttl_ms=60_000)).acquired
    before = backend.inspect(KEY)
    keys = [backend._prefix(KEY)] * 2
    for ttl in NOT_SANE:
        with pytest.raises(redis.ResponseError, match="ttl_ms must be an integer from 0 to"):
            backend._call(backend.scripts["renew"], keys, ["h1", 120_000, "h2", ttl])
    per_lease = re.escape("renew takes 1 KEYS (its prefix) and 2 ARGV per lease")
    with pytest.raises(redis.ResponseError, match=per_lease):
        backend._call(backend.scripts["renew"], keys, ["h1", 120_000])
    with pytest.raises(redis.ResponseError, match="per lease, got 2 and 3"):
        backend._call(backend.scripts["renew"], keys, ["h1", 120_000, "h2"])
    assert backend.inspect(KEY) == before


def test_the_bounds_are_366_days_and_the_largest_32_bit_integer() -> None:
    """The Lua scripts get them from the same module (backends/redis_layout.py, test_redis_layout.py)."""
    from dramatiq_guard import bounds

    assert bounds.MAX_DURATION_MS == MAX_MS and bounds.MAX_COUNT == 2**31 - 1
