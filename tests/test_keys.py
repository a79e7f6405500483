"""Key derivation: pinned digests, signature-resolved names, scoping."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError, Retries

from dramatiq_guard import Concurrency, Deduplication, Idempotency, Mutex
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.errors import GuardKeyError, GuardOptionError
from dramatiq_guard.keys import KeyResolver, canonical_json, digest

VECTORS_FILE = pathlib.Path(__file__).parent / "data" / "key_vectors.json"
VECTORS = json.loads(VECTORS_FILE.read_text("utf-8"))["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_digest_matches_the_pinned_vector(vector: dict[str, Any]) -> None:
    assert canonical_json(vector["value"]).decode("utf-8") == vector["canonical"]
    assert digest(vector["value"]) == vector["sha256"]


def test_digest_is_the_same_in_another_process_with_another_hash_seed() -> None:
    value = VECTORS[2]["value"]
    code = f"from dramatiq_guard.keys import digest; print(digest({value!r}))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == VECTORS[2]["sha256"]


def refresh(user_id: int, scope: str = "all", *extra: int, **flags: bool) -> None:
    pass


def test_positional_keyword_and_default_calls_give_one_key() -> None:
    resolve = KeyResolver("refresh", refresh, None)
    keys = {
        resolve((1,), {}),
        resolve((1, "all"), {}),
        resolve((), {"user_id": 1}),
        resolve((), {"scope": "all", "user_id": 1}),
    }
    assert len(keys) == 1
    (key,) = keys
    expected = digest({"user_id": 1, "scope": "all", "extra": [], "flags": {}})
    assert key == f"refresh:{expected}"


def test_different_arguments_give_different_keys() -> None:
    resolve = KeyResolver("refresh", refresh, None)
    assert resolve((1,), {}) != resolve((2,), {})
    assert resolve((1,), {}) != resolve((1, "some"), {})


def test_argument_names_select_what_counts() -> None:
    resolve = KeyResolver("refresh", refresh, ("user_id",))
    assert resolve((1, "all"), {}) == resolve((), {"user_id": 1, "scope": "other"})
    assert resolve((1,), {}) == f"refresh:{digest({'user_id': 1})}"


def test_keys_are_scoped_to_the_actor() -> None:
    assert KeyResolver("a", refresh, None)((1,), {}) != KeyResolver("b", refresh, None)((1,), {})


def test_a_callable_key_is_used_as_given() -> None:
    resolve = KeyResolver("refresh", refresh, lambda user_id, *_, **__: f"user:{user_id}")
    assert resolve((7,), {}) == "user:7"


def test_a_callable_key_must_return_a_string() -> None:
    resolve = KeyResolver("refresh", refresh, lambda user_id, *_, **__: user_id)
    with pytest.raises(GuardKeyError, match="must return a str"):
        resolve((7,), {})


def test_unknown_argument_names_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"'customer'.*user_id, scope, extra, flags"):
        KeyResolver("refresh", refresh, ("customer",))


def test_arguments_that_do_not_fit_the_signature_are_refused() -> None:
    resolve = KeyResolver("refresh", refresh, None)
    with pytest.raises(GuardKeyError, match="missing a required argument: 'user_id'"):
        resolve((), {"nobody": 1})


def send_report(account: int, period: str, fmt: str = "pdf", /) -> None:
    pass


def test_a_full_positional_call_gives_the_key_signature_binding_gives() -> None:
    # Every parameter given by position, no keywords: the resolver binds by name without
    # Signature.bind (the per-message fast path); the key must be the one binding gives,
    # positional-only parameters included.
    resolve = KeyResolver("send_report", send_report, None)
    bound = KeyResolver("send_report", send_report, None).signature.bind(7, "2026-11", "pdf").arguments
    assert resolve((7, "2026-11", "pdf"), {}) == f"send_report:{digest(dict(bound))}"
    assert resolve((7, "2026-11", "pdf"), {}) == resolve((7, "2026-11"), {})
    assert KeyResolver("send_report", send_report, ("period",))((7, "2026-11", "csv"), {}) == (
        f"send_report:{digest({'period': '2026-11'})}"
    )


def test_too_many_positional_arguments_are_still_refused() -> None:
    resolve = KeyResolver("send_report", send_report, None)
    with pytest.raises(GuardKeyError, match="too many positional arguments"):
        resolve((7, "2026-11", "pdf", "extra"), {})


# --- bad input: the guard's error, naming the actor, the option, what is wrong and what is allowed


def transfer(account: str, amount: float, meta: Any = None) -> None:
    pass


class Opaque:
    pass


UNKEYABLE = [
    pytest.param(("a", float("nan")), "argument 'amount'.*NaN", id="nan"),
    pytest.param(("a", float("inf")), "argument 'amount'.*infinity", id="infinity"),
    pytest.param(("a\udc80", 1.0), "argument 'account'.*lone surrogate", id="lone-surrogate"),
    pytest.param(("a", 1.0, {"k": ["\ud800"]}), r"argument 'meta'\['k'\]\[0\].*lone surrogate", id="nested"),
    pytest.param(("a", 1.0, {"\udfff": 1}), "argument 'meta'.*lone surrogate", id="surrogate-in-a-dict-key"),
    pytest.param(
        ("a", 1.0, Opaque()),
        "argument 'meta' is <.*Opaque.*> of type Opaque, which JSON cannot encode",
        id="not-json",
    ),
    pytest.param(("a", 1.0, {1: "x", "y": 2}), "argument 'meta'.*keys", id="unsortable-keys"),
]


@pytest.mark.parametrize(("args", "what"), UNKEYABLE)
def test_arguments_a_digest_cannot_take_raise_the_guards_error(args: tuple[Any, ...], what: str) -> None:
    resolve = KeyResolver("transfer", transfer, None, option="concurrency")
    with pytest.raises(GuardKeyError, match=what) as raised:
        resolve(args, {})
    error = raised.value
    assert isinstance(error, ValueError) and isinstance(error, GuardOptionError)
    assert isinstance(error, MiddlewareError)  # Dramatiq lets it out of a before-hook
    assert (error.actor_name, error.option) == ("transfer", "concurrency")
    text = str(error)
    assert "'transfer'" in text and "concurrency" in text
    assert "finite" in text and "lone surrogates" in text  # what is allowed


def test_an_argument_a_names_key_leaves_out_does_not_count() -> None:
    resolve = KeyResolver("transfer", transfer, ("account",), option="mutex")
    assert resolve(("a", float("nan")), {}) == f"transfer:{digest({'account': 'a'})}"


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        pytest.param(lambda account, *_: 7, r"returned 7 \(of type int\), not a str", id="not-a-str"),
        pytest.param(lambda account, *_: account, "returned a str with a lone surrogate", id="surrogate"),
        pytest.param(lambda account, *_: {}[account], "key callable raised KeyError", id="raised"),
    ],
)
def test_a_key_callable_that_gives_no_usable_key_raises_the_guards_error(spec: Any, what: str) -> None:
    resolve = KeyResolver("transfer", transfer, spec, option="dedup")
    with pytest.raises(GuardKeyError, match=what) as raised:
        resolve(("a\udc80", 1.0), {})
    assert (raised.value.actor_name, raised.value.option) == ("transfer", "dedup")
    assert "'transfer'" in str(raised.value) and "dedup" in str(raised.value)
    assert "must return a str" in str(raised.value)


def test_arguments_that_do_not_fit_the_signature_raise_the_guards_error() -> None:
    resolve = KeyResolver("transfer", transfer, ("account",), option="dedup")
    with pytest.raises(GuardKeyError, match=r"missing a required argument: 'account'") as raised:
        resolve((), {"amount": 1.0})
    assert "transfer(account, amount, meta=None)" in str(raised.value)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


SENDS_REFUSED = [
    # (the actor's options, the option whose key fails, the arguments sent)
    pytest.param({"dedup": "until_executed"}, "dedup", ("a", _nested(5000)), id="dedup-too-deep"),
    pytest.param({"mutex": {"on_busy": "park"}}, "mutex", ("a", _nested(5000)), id="mutex-too-deep"),
    pytest.param({"dedup": "until_executed"}, "dedup", ("a\udc80", 1.0), id="dedup-surrogate"),
    pytest.param({"dedup": "until_executed"}, "dedup", ("a", float("nan")), id="dedup-nan"),
    pytest.param({"mutex": {"on_busy": "park"}}, "mutex", ("a", float("inf")), id="mutex-infinity"),
    pytest.param(
        {"concurrency": {"limit": 1, "key": ["account"]}},
        "concurrency",
        ("\udc80", 1.0),
        id="concurrency-names",
    ),
    pytest.param(
        {"concurrency": {"limit": 1, "key": lambda account, *_: account}},
        "concurrency",
        ("\udc80", 1.0),
        id="concurrency-callable",
    ),
    pytest.param(
        {
            "dedup": {"strategy": "until_executed", "key": ["account"]},
            "concurrency": {"limit": 1, "key": ["amount"]},
        },
        "concurrency",
        ("a", float("nan")),
        id="dedup-then-concurrency",
    ),
]


@pytest.mark.parametrize(("options", "option", "args"), SENDS_REFUSED)
def test_a_send_with_unkeyable_arguments_is_refused_leaving_nothing_in_redis(
    restore_global_broker: None,
    redisdb: redis.Redis,
    redis_url: str,
    options: dict[str, Any],
    option: str,
    args: tuple[Any, ...],
) -> None:
    backend = RedisBackend.from_url(redis_url)
    broker = StubBroker()
    for middleware in (Deduplication(redis=backend), Mutex(redis=backend), Concurrency(redis=backend)):
        broker.add_middleware(middleware, before=Retries)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="keys", **options)
    def pay(account: str, amount: float) -> None:
        pass

    with pytest.raises(GuardKeyError, match=rf"actor 'pay': the {option} key") as raised:
        pay.send(*args)
    assert raised.value.option == option
    assert broker.queues["keys"].qsize() == 0
    left = [k for k in redisdb.keys("*") if k != b"dramatiq-guard:layout"]  # recorded when installed
    assert left == [], "a refused send left something in Redis"


def test_a_send_of_a_ledger_actor_with_unkeyable_arguments_is_refused(
    restore_global_broker: None, sqlite_url: str
) -> None:
    broker = StubBroker()
    broker.add_middleware(Idempotency(ledger=sqlite_url))
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="keys", idempotency_key=lambda account, *_: account)
    def pay(account: str, amount: float) -> None:
        pass

    with pytest.raises(GuardKeyError, match=r"actor 'pay'.*idempotency_key.*lone surrogate"):
        pay.send("a\udc80", 1.0)
    with pytest.raises(GuardOptionError, match=r"actor 'pay'.*idempotency_key.*lone surrogates"):
        pay.send_with_options(args=("a", 1.0), idempotency_key="k\ud800")
    assert broker.queues["keys"].qsize() == 0
