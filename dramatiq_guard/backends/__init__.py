"""Guard backends: the atomic operations behind every capability."""

from dramatiq_guard.backends.base import (
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    KeySummary,
    ReleaseResult,
    Stake,
    Waiter,
    WaiterPeek,
    Woken,
)
from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.backends.values import AcquireOutcome

__all__ = [
    "AcquireOutcome",
    "AcquireResult",
    "GuardBackend",
    "Handoff",
    "KeyState",
    "KeySummary",
    "MemoryBackend",
    "RedisBackend",
    "ReleaseResult",
    "Stake",
    "Waiter",
    "WaiterPeek",
    "Woken",
]
