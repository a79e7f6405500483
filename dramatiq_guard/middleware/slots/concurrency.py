"""The ``concurrency`` actor option: at most N messages per key execute at a time (docs/slots.md)."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import Broker

from dramatiq_guard.backends.checks import check_count
from dramatiq_guard.middleware.base import ActorGuard
from dramatiq_guard.middleware.slots.limits import ActorLimits
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.middleware.sweep import sweep_all
from dramatiq_guard.policies import ConcurrencyPolicy, OnBusy


class Concurrency(SlotsMiddleware[ConcurrencyPolicy]):
    """At most N messages per key execute at a time; the rest park (the ``concurrency`` actor option).

    ``concurrency=10``, or a dict / :class:`~dramatiq_guard.ConcurrencyPolicy`
    with ``limit``, ``key`` and ``ttl``. See ``docs/slots.md`` for the
    semantics, and :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware`
    for the parameters.
    """

    policy_class = ConcurrencyPolicy
    prefix = "concurrency"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._actor_limits = ActorLimits(self.limit_cache_ms)

    def on_busy(self, policy: ConcurrencyPolicy) -> OnBusy:
        return "park"

    def default_limit(self, guard: ActorGuard[ConcurrencyPolicy]) -> int:
        """The guard's run-time default (cached ``limit_cache``), else its option's ``limit``."""
        backend = self._backend or self.backend(self._broker_or(None))
        value = self._actor_limits.get(backend, guard.scope)
        return guard.policy.limit if value is None else value

    def set_actor_limit(
        self, actor: dramatiq.Actor[Any, Any] | str, limit: int | None, *, broker: Broker | None = None
    ) -> None:
        """Set (or with None, clear) an actor's default limit at run time, for every process.

        Processes see it within ``limit_cache``; this one sweeps the waiting
        keys of this middleware at once (a raised default hands their free
        slots on), the others' sweeps within 30 s. A per-key limit still
        overrides it. With ``concurrency=[...]`` this sets the first guard's
        default; ``"<actor>#<i>"`` names the guard at index ``i`` of the list. A ``limit`` that is not
        an int from 0 to 2**31 - 1 (or None) is a :class:`ValueError`.
        """
        name = actor if isinstance(actor, str) else actor.actor_name
        check_count(limit, "limit")
        broker = self._broker_or(broker)
        backend = self.backend(broker)
        self._actor_limits.set(backend, name, limit)
        sweep_all(backend, [(self, broker)], waiting=True)  # no key of the actor is due for it

    def get_actor_limit(
        self, actor: dramatiq.Actor[Any, Any] | str, *, broker: Broker | None = None
    ) -> int | None:
        """An actor's run-time default limit, or None."""
        name = actor if isinstance(actor, str) else actor.actor_name
        return ActorLimits.read(self.backend(self._broker_or(broker)), name)
