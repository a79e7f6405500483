"""The in-memory guard backend, for tests with a StubBroker (one process only).

It is the :class:`~dramatiq_guard.backends.RedisBackend` itself, its Lua
scripts and all, on a Redis emulated in this process by fakeredis (with lupa
running the Lua): the semantics are written once, in ``backends/lua/``.
fakeredis comes with the ``stub`` extra (``pip install 'dramatiq-guard[stub]'``).
"""

from __future__ import annotations

import importlib

from dramatiq_guard.backends.base import DEFAULT_MAX_PAYLOAD_BYTES, GuardBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.errors import ConfigurationError

#: Why a :class:`MemoryBackend` cannot be made without the ``stub`` extra, and the cure.
STUB_EXTRA_MISSING = (
    "dramatiq-guard's in-memory backend (a StubBroker's, or MemoryBackend()) runs the guard's Lua "
    "scripts on fakeredis, which is not installed: pip install 'dramatiq-guard[stub]'"
)


class MemoryBackend(RedisBackend):
    """The Redis backend on a private in-process Redis (fakeredis): a store of its own.

    Thread-safe; not shared across processes, nor with any other backend
    (each one owns its server). Its clock is this process's wall clock, read
    by the emulated ``TIME``. It has no server to check at install or to
    watch while running, and no replicas: its hooks are the contract's
    defaults (:class:`~dramatiq_guard.backends.GuardBackend`), not Redis's.

    Parameters:
      namespace(str): The prefix of every key in its server.
      handoff_ttl_ms(int): How long a slot handed to a waiter stays reserved.
      max_payload_bytes(int): The largest parked message stored (see
        :class:`~dramatiq_guard.backends.GuardBackend`).
      stale_ttl_ms(int): How long a waiter's live generation, and a key's last
        fencing token, are remembered (see :class:`~dramatiq_guard.backends.GuardBackend`).

    Raises:
      ConfigurationError: If fakeredis or lupa is not installed (the ``stub`` extra).
      ValueError: If a duration is out of range.
    """

    check_health = GuardBackend.check_health
    watch = GuardBackend.watch
    stop_watching = GuardBackend.stop_watching
    wait_for_replicas = GuardBackend.wait_for_replicas

    def __init__(
        self,
        *,
        namespace: str = "dramatiq-guard",
        handoff_ttl_ms: int = 10_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        stale_ttl_ms: int = 86_400_000,
    ) -> None:
        try:
            import fakeredis

            importlib.import_module("lupa")  # without it fakeredis imports, but refuses every script
        except ImportError:
            raise ConfigurationError(STUB_EXTRA_MISSING) from None

        #: The emulated server: a ``fakeredis.FakeRedis(server=...)`` of it sees this backend's state.
        self.server = fakeredis.FakeServer()
        super().__init__(
            fakeredis.FakeRedis(server=self.server),
            namespace=namespace,
            handoff_ttl_ms=handoff_ttl_ms,
            max_payload_bytes=max_payload_bytes,
            stale_ttl_ms=stale_ttl_ms,
        )
        self._cluster = False  # fakeredis has no INFO to ask
