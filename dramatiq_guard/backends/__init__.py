"""Guard backends: the atomic operations behind every capability."""

from dramatiq_guard.backends.base import (
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    ReleaseResult,
    Waiter,
    Woken,
)
from dramatiq_guard.backends.memory import MemoryBackend
from dramatiq_guard.backends.redis import RedisBackend

__all__ = [
    "AcquireResult",
    "GuardBackend",
    "Handoff",
    "KeyState",
    "MemoryBackend",
    "RedisBackend",
    "ReleaseResult",
    "Waiter",
    "Woken",
]
