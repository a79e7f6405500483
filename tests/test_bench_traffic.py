"""The bench's count of a worker's guard traffic: each command of a request named as Redis runs it."""

from __future__ import annotations

from typing import Any, cast

import redis

from bench.actors.traffic import command_names


def test_a_pipeline_is_read_as_its_commands_and_a_function_call_by_what_it_calls() -> None:
    connection: Any = cast(Any, redis.Connection)()  # redis-py's own packer (untyped)
    packed = connection.pack_commands(
        [("FCALL", "lib_acquire", 1, "k", b"\r\n" * 3000), ("GET", "k"), ("EVALSHA", "abc123", 0)]
    )
    assert list(command_names(b"".join(packed))) == ["fcall lib_acquire", "get", "evalsha abc123"]
    assert list(command_names(b"".join(connection.pack_command("PING")))) == ["ping"]
