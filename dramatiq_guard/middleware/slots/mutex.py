"""The ``mutex`` actor option: at most one message per key executes at a time (docs/slots.md)."""

from __future__ import annotations

import itertools
from typing import Any

from dramatiq_guard.middleware.base import ActorGuard
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.policies import MutexPolicy, OnBusy


class Mutex(SlotsMiddleware[MutexPolicy]):
    """At most one message per key executes at a time (the ``mutex`` actor option).

    ``mutex=True``, or a dict / :class:`~dramatiq_guard.MutexPolicy` with
    ``key``, ``ttl``, ``on_busy`` (``"drop"``, ``"wait"`` or ``"park"``) and
    ``wait``. See ``docs/slots.md`` for the semantics, and
    :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware` for the parameters. ``dropped``: how
    many messages this process dropped because their mutex was held (they count as deduplicated).
    """

    policy_class = MutexPolicy
    prefix = "mutex"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._dropped = itertools.count()
        self.dropped = 0

    def on_busy(self, policy: MutexPolicy) -> OnBusy:
        return policy.on_busy

    def default_limit(self, guard: ActorGuard[MutexPolicy]) -> int:
        return 1

    def wait_ms(self, policy: MutexPolicy) -> int:
        return policy.wait_ms

    def count_drop(self) -> None:
        self.dropped = next(self._dropped) + 1

    def sweep_limit(self, key: str) -> int:
        return 1
