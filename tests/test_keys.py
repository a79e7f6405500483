"""Key derivation: pinned digests, signature-resolved names, scoping."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

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
    with pytest.raises(TypeError, match="must return a str"):
        resolve((7,), {})


def test_unknown_argument_names_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"'customer'.*user_id, scope, extra, flags"):
        KeyResolver("refresh", refresh, ("customer",))


def test_arguments_that_do_not_fit_the_signature_are_a_type_error() -> None:
    resolve = KeyResolver("refresh", refresh, None)
    with pytest.raises(TypeError):
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


def test_too_many_positional_arguments_are_still_a_type_error() -> None:
    resolve = KeyResolver("send_report", send_report, None)
    with pytest.raises(TypeError):
        resolve((7, "2026-11", "pdf", "extra"), {})
