"""The in-memory guard backend, for tests with a StubBroker (one process only).

It is the :class:`~dramatiq_guard.backends.RedisBackend` itself, its Lua
scripts and all, on a Redis emulated in this process by fakeredis (with lupa
running the Lua): the semantics are written once, in ``backends/lua/``.
fakeredis comes with the ``stub`` extra (``pip install 'dramatiq-guard[stub]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dramatiq_guard.backends.base import BackendSettings, GuardBackend
from dramatiq_guard.backends.redis import RedisBackend
from dramatiq_guard.errors import ConfigurationError

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Why a :class:`MemoryBackend` cannot be made without the ``stub`` extra, and the cure.
STUB_EXTRA_MISSING = (
    "dramatiq-guard's in-memory backend (a StubBroker's, or MemoryBackend()) runs the guard's Lua "
    "scripts on fakeredis, which is not installed: pip install 'dramatiq-guard[stub]'"
)


class MemoryBackend(RedisBackend):
    """The Redis backend on a private in-process Redis (fakeredis): a store of its own.

    Thread-safe; not shared across processes, nor with any other backend. Its clock is this
    process's wall clock. It has no server to check or watch, and no replicas: its hooks are
    :class:`~dramatiq_guard.backends.GuardBackend`'s defaults. ``namespace`` and ``settings`` are
    :class:`~dramatiq_guard.backends.RedisBackend`'s.

    Raises:
      ConfigurationError: If fakeredis or lupa is not installed (the ``stub`` extra).
    """

    check_health = GuardBackend.check_health
    watch = GuardBackend.watch
    stop_watching = GuardBackend.stop_watching
    wait_for_replicas = GuardBackend.wait_for_replicas

    def __init__(self, *, namespace: str = "dramatiq-guard", **settings: Unpack[BackendSettings]) -> None:
        try:
            import fakeredis

            importlib.import_module("lupa")  # without it fakeredis imports, but refuses every script
        except ImportError:
            raise ConfigurationError(STUB_EXTRA_MISSING) from None

        #: The emulated server: a ``fakeredis.FakeRedis(server=...)`` of it sees this backend's state.
        self.server = fakeredis.FakeServer()
        super().__init__(fakeredis.FakeRedis(server=self.server), namespace=namespace, **settings)
        self._cluster = False  # fakeredis has no INFO to ask
