"""What every backend checks before it touches anything: the same :class:`ValueError` from each
(Redis does not roll back a script that fails half-way); the bounds are :mod:`dramatiq_guard.bounds`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

from dramatiq_guard.bounds import MAX_COUNT, MAX_DURATION_MS, MAX_PRIORITY

if TYPE_CHECKING:
    from dramatiq_guard.backends.values import Stake, Waiter

#: The default bound on a parked message's encoded size (:attr:`GuardBackend.max_payload_bytes`).
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
#: The longest runner id :meth:`GuardBackend.acquire` takes.
MAX_RUNNER_CHARS = 200


def _is_int(value: object) -> TypeGuard[int]:
    # type() first: a plain int (every call on a worker's path) costs one builtin call, not three.
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def check_ms(value: int, what: str, *, minimum: int = 1) -> None:
    """Reject a duration (``what``) that is not an int from ``minimum`` (1 for a lease or reservation
    being taken, 0 for a wait or a renewal) to 366 days in milliseconds."""
    if not _is_int(value) or not minimum <= value <= MAX_DURATION_MS:
        raise ValueError(
            f"{what} must be an integer from {minimum} to {MAX_DURATION_MS} ms (366 days), got {value!r}"
        )


def check_count(value: object, what: str, *, optional: bool = True) -> None:
    """Reject a limit or count that is not an int from 0 to 2**31 - 1, or (if ``optional``) None: a
    limit the caller does not know."""
    if (value is not None or not optional) and (not _is_int(value) or not 0 <= value <= MAX_COUNT):
        raise ValueError(f"{what} must be an integer from 0 to {MAX_COUNT}, got {value!r}")


def check_acquire(stake: Stake, wait: Waiter | None) -> None:
    """The checks of :meth:`GuardBackend.acquire`'s numbers (the priority too) and runner (a non-empty
    str of at most :data:`MAX_RUNNER_CHARS` characters without ``|`` or ``@``)."""
    check_count(stake.limit, "limit")
    check_ms(stake.ttl_ms, "ttl_ms")
    if not _is_int(stake.priority) or abs(stake.priority) > MAX_PRIORITY:
        bounds = f"-{MAX_PRIORITY} to {MAX_PRIORITY}"
        raise ValueError(f"priority must be an integer from {bounds}, got {stake.priority!r}")
    if wait is not None:
        check_ms(wait.wait_ms, "wait_ms", minimum=0)
    runner = stake.runner
    if runner is not None and (
        not isinstance(runner, str)
        or not 0 < len(runner) <= MAX_RUNNER_CHARS
        or "|" in runner
        or "@" in runner
    ):
        raise ValueError(
            f"a runner must be a non-empty str of at most {MAX_RUNNER_CHARS} characters without "
            f"'|' or '@', got {runner!r}"
        )


def check_key(key: str) -> None:
    """Reject a guard key that is empty or starts with ``}``."""
    if not key or key.startswith("}"):
        raise ValueError(f"a guard key must be non-empty and must not start with '}}', got {key!r}")


def check_max_payload_bytes(value: int) -> int:
    """``value`` if it is a positive int, else :class:`ValueError`."""
    if not _is_int(value) or value <= 0:
        raise ValueError(f"max_payload_bytes must be a positive int (bytes), not {value!r}")
    return value


def check_replica_waits(count: int, timeout_ms: int) -> None:
    """Reject replica waits (:meth:`GuardBackend.wait_for_replicas`) of a bad count, or a
    ``timeout_ms`` under 1 (``WAIT`` with 0 would wait without end)."""
    check_count(count, "replica_waits")
    check_ms(timeout_ms, "replica_wait_timeout_ms")
