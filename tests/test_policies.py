"""Option parsing: the three forms of each option, and errors that name what was wrong."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from dramatiq_guard.errors import GuardOptionError
from dramatiq_guard.policies import (
    ConcurrencyPolicy,
    DedupPolicy,
    IdempotencyPolicy,
    MutexPolicy,
    parse_policy,
)


def key_fn(*args: Any, **kwargs: Any) -> str:
    return "k"


@pytest.mark.parametrize(
    ("cls", "value", "expected"),
    [
        (DedupPolicy, "until_executed", DedupPolicy(strategy="until_executed")),
        (
            DedupPolicy,
            {"strategy": "until_expired", "ttl": datetime.timedelta(seconds=5), "key": ["a"]},
            DedupPolicy(strategy="until_expired", ttl=5000, key=("a",)),
        ),
        (MutexPolicy, True, MutexPolicy()),
        (MutexPolicy, {"on_busy": "wait", "wait": 250}, MutexPolicy(on_busy="wait", wait=250)),
        (ConcurrencyPolicy, 10, ConcurrencyPolicy(limit=10)),
        (ConcurrencyPolicy, {"limit": 0, "key": key_fn}, ConcurrencyPolicy(limit=0, key=key_fn)),
        (IdempotencyPolicy, key_fn, IdempotencyPolicy(key=key_fn)),
        (IdempotencyPolicy, ["transfer_id"], IdempotencyPolicy(key=("transfer_id",))),
    ],
)
def test_each_form_gives_the_same_frozen_policy(cls: Any, value: Any, expected: Any) -> None:
    policy = parse_policy(cls, value, actor_name="a")
    assert policy == expected
    assert parse_policy(cls, policy, actor_name="a") is policy
    with pytest.raises(AttributeError):
        policy.key = None


def test_durations_are_milliseconds_or_timedeltas() -> None:
    assert MutexPolicy(ttl=datetime.timedelta(minutes=1)).ttl_ms == 60_000
    assert MutexPolicy(ttl=1500).ttl_ms == 1500
    assert MutexPolicy().ttl_ms is None


@pytest.mark.parametrize(
    ("cls", "value", "reason"),
    [
        (DedupPolicy, "until_lunch", "not one of the allowed forms"),
        (
            DedupPolicy,
            {"strategy": "until_executed", "on_duplicate": "ignore"},
            "on_duplicate must be one of",
        ),
        (DedupPolicy, {"strategy": "until_executed", "ttl": 1.5}, "ttl must be integer milliseconds"),
        (DedupPolicy, {"strategy": "until_executed", "ttl": -1}, "ttl must not be negative"),
        (DedupPolicy, {"strategy": "until_executed", "tll": 5}, "unknown key(s) 'tll'"),
        (DedupPolicy, {"ttl": 5}, "strategy"),
        (MutexPolicy, "yes", "not one of the allowed forms"),
        (MutexPolicy, {"on_busy": "spin"}, "on_busy must be one of 'drop', 'wait', 'park'"),
        (MutexPolicy, {"key": "customer_id"}, "key must be a callable"),
        (ConcurrencyPolicy, -1, "limit must be an integer from 0 to 2147483647"),
        (ConcurrencyPolicy, True, "not one of the allowed forms"),
        (ConcurrencyPolicy, {"limit": "10"}, "limit must be an integer from 0 to 2147483647"),
        (IdempotencyPolicy, "transfer_id", "not one of the allowed forms"),
        (IdempotencyPolicy, {"retention": 5}, "key"),
    ],
)
def test_a_bad_value_names_actor_option_value_and_allowed_forms(cls: Any, value: Any, reason: str) -> None:
    with pytest.raises(GuardOptionError) as raised:
        parse_policy(cls, value, actor_name="send_report")
    message = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert "actor 'send_report'" in message
    assert f"{cls.option}={value!r}" in message
    assert reason in message
    assert f"{cls.option} takes " in message
