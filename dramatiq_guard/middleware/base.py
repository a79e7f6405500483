"""What every guard middleware shares: its option, its backend, its per-message state.

A guard middleware parses its option at ``@dramatiq.actor`` time, is constructible with no
arguments (its backend is resolved lazily from its broker), joins the enqueue gate if it defines
``before_push``, and keeps per-execution state on the message proxy (:func:`execution_state`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, ClassVar, Generic, TypeVar, cast

import dramatiq
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy

from dramatiq_guard.backends.base import GuardBackend
from dramatiq_guard.bounds import MAX_PRIORITY
from dramatiq_guard.delivery import Courier
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.gate import gate_for
from dramatiq_guard.keys import KeyResolver
from dramatiq_guard.policies import Policy, option_error, parse_policies
from dramatiq_guard.resolve import resolve_backend

P = TypeVar("P", bound=Policy)

logger = logging.getLogger("dramatiq_guard.middleware")


@dataclasses.dataclass(frozen=True)
class ActorGuard(Generic[P]):
    """A guarded actor's parsed policy, its key resolver, and its Dramatiq ``priority`` (its waiters'
    place among a key's: clamped to :data:`~dramatiq_guard.bounds.MAX_PRIORITY` each way); ``index``:
    its place in the actor's list of policies of the option (0: the first, or the only one)."""

    actor_name: str
    policy: P
    resolve_key: KeyResolver
    priority: int = 0
    index: int = 0

    @functools.cached_property  # asked on every send and pickup; made of fields that never change
    def scope(self) -> str:
        """The actor's name, and ``#<index>`` for a later guard of a list: it scopes the guard's
        digested keys, its run-time default limit and its state on a message."""
        return guard_scope(self.actor_name, self.index)

    @functools.cached_property  # asked of every message's key: an attribute once made
    def keyed_by_callable(self) -> bool:
        """Whether the guard's key is its ``key`` callable's (else a digest of arguments, which names
        the guard's scope)."""
        return callable(self.resolve_key.spec)

    @functools.cached_property  # read in every hook of a guarded message: an attribute once made
    def slot(self) -> str:
        """Where this guard's state lives in a message's :class:`ExecutionState`: its option's name,
        ``#<index>`` added for a later guard of a list."""
        option = self.policy.option
        return f"{option}#{self.index}" if self.index else option

    def key_of(self, message: Message[Any] | MessageProxy) -> str:
        """The guard key of a message of this actor (before the capability prefix)."""
        return self.resolve_key(message.args, message.kwargs)


def guard_scope(actor_name: str, index: int) -> str:
    """What scopes the ``index``-th guard of an actor's option (see :attr:`ActorGuard.scope`)."""
    return f"{actor_name}#{index}" if index else actor_name


@dataclasses.dataclass
class ExecutionState:
    """What the guards know about one execution (one pickup) of one message: whether a guard parked it
    (the skip that follows is not a terminal event), and each capability's state by option name."""

    parked: bool = False
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


#: The attribute of a MessageProxy that holds its ExecutionState. (A proxy
#: defines ``__eq__`` without ``__hash__``, so it cannot key a dict.) A hook that only reads the
#: state reads it in ``message.__dict__`` (absent if no guard made one).
STATE_ATTRIBUTE = "_dramatiq_guard_state"


def fail_open(allowed: bool, error: BackendUnavailable, instead: str) -> None:
    """The backend is unavailable: re-raise ``error`` (fail closed), unless failing open is ``allowed``:
    then log a warning saying what happens ``instead`` (e.g. "job(1) runs unguarded")."""
    if not allowed:
        raise error
    logger.warning("The guard backend is unavailable: %s (fail_open).", instead, exc_info=True)


def execution_state(message: MessageProxy) -> ExecutionState:
    """The state of this execution of ``message``, shared by all guard middlewares."""
    attributes = message.__dict__
    state: ExecutionState | None = attributes.get(STATE_ATTRIBUTE)
    # dict.setdefault is atomic: two threads that race here share one state.
    return state if state is not None else attributes.setdefault(STATE_ATTRIBUTE, ExecutionState())


@dataclasses.dataclass(slots=True, eq=False)
class ActorPlan:
    """What a guard middleware keeps of one actor between its messages (:meth:`GuardMiddleware.plan`),
    for ``broker`` and the ``middleware`` list it was made from; each part is asked at its first use.

    ``alone``: :meth:`GuardMiddleware.enqueues_alone`'s answer; ``group``: the actor's slots
    middlewares that decide together (:func:`~dramatiq_guard.middleware.slots.base.composed`);
    ``send``: what each of the actor's sends needs, the capability's own.
    """

    broker: Broker
    middleware: list[dramatiq.Middleware]
    alone: bool | None = None
    group: list[Any] | None = None
    send: Any = None


class GuardMiddleware(dramatiq.Middleware, Generic[P]):
    """Base class of the guard middlewares.

    Parameters:
      redis: The backend: a :class:`~dramatiq_guard.backends.GuardBackend`,
        a redis-py client, a URL, or None to resolve it from the broker
        (see :mod:`dramatiq_guard.resolve`).
    """

    #: The policy class; its ``option`` is the actor option this middleware owns.
    policy_class: ClassVar[type[Policy]]
    #: The actor option this middleware owns: its policy class's (read in every hook: set once per class).
    option: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "policy_class" in vars(cls):
            cls.option = cls.policy_class.option

    def __init__(self, *, redis: Any = None) -> None:
        self._redis = redis
        self._backend: GuardBackend | None = None
        self._backend_lock = threading.Lock()
        #: Each guarded actor's guards, in the order of its option's list, by actor name.
        self.guard_lists: dict[str, tuple[ActorGuard[P], ...]] = {}
        self._plans: dict[str, ActorPlan] = {}  # per actor (:meth:`plan`)
        self._couriers: dict[int, Courier] = {}  # per broker (courier)

    @property
    def actor_options(self) -> set[str]:
        return {self.option}

    def backend(self, broker: Broker) -> GuardBackend:
        """The guard backend, resolved (and checked, as ``install()`` does) on first use: a
        ConfigurationError if none can be found, EvictingRedis if the Redis may evict keys and that
        was not allowed (``install(..., allow_evicting_redis=True)``)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    backend = resolve_backend(broker, self._redis)
                    backend.check_health()
                    self._backend = backend
        return self._backend

    def courier(self, broker: Broker) -> Courier:
        """How this capability's hand-offs go back to ``broker``: :meth:`make_courier`'s, once per broker."""
        courier = self._couriers.get(id(broker))
        if courier is None:
            courier = self._couriers[id(broker)] = self.make_courier(broker)
        return courier

    def make_courier(self, broker: Broker) -> Courier:
        """The :meth:`courier` of a capability that hands off: it says how its copies go back."""
        raise NotImplementedError(f"{type(self).__name__} hands nothing off")

    def attach(self, broker: Broker) -> None:
        """Join ``broker``'s enqueue gate if this middleware takes part in enqueues."""
        if hasattr(self, "before_push"):
            gate_for(broker).add(self)  # type: ignore[arg-type]

    def plan(self, broker: Broker, actor_name: str) -> ActorPlan:
        """What this middleware keeps of ``actor_name`` between its messages (:class:`ActorPlan`): made
        anew for another broker, once ``broker.middleware`` is no longer the list it was made from (a
        middleware added, removed or moved), and after the actor is declared again."""
        plan = self._plans.get(actor_name)
        if plan is None or plan.broker is not broker or plan.middleware != broker.middleware:
            plan = self._plans[actor_name] = ActorPlan(broker, list(broker.middleware))
        return plan

    def enqueues_alone(self, broker: Broker, actor_name: str, backend: GuardBackend) -> bool:
        """Whether this is the only enqueue-time guard of ``actor_name`` on ``broker`` and ``backend`` can
        push its messages itself (asked once per :meth:`plan`): its decision and the push may go in one
        step."""
        plan = self.plan(broker, actor_name)
        if plan.alone is None:  # (BackendUnavailable from enqueues_on: asked again at the next call)
            alone = gate_for(broker).sole_guard(actor_name, self)  # type: ignore[arg-type]
            plan.alone = alone and backend.enqueues_on(broker)
        return plan.alone

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        self._plans.pop(actor.actor_name, None)  # every middleware hears each declaration: made anew
        value = actor.options.get(self.option)
        if value is None or value is False:
            if self.guard_lists.pop(actor.actor_name, None) is not None and hasattr(self, "before_push"):
                gate_for(broker).changed()  # no longer guarded here
            return
        policies = parse_policies(self.policy_class, value, actor_name=actor.actor_name)
        priority = max(-MAX_PRIORITY, min(int(actor.priority), MAX_PRIORITY))
        guards = []
        for index, policy in enumerate(policies):
            scope = guard_scope(actor.actor_name, index)
            try:
                resolver = KeyResolver(
                    actor.actor_name, actor.fn, policy.key, option=self.option, scope=scope
                )
            except ValueError as e:
                raise option_error(actor.actor_name, self.option, value, str(e)) from None
            guards.append(ActorGuard(actor.actor_name, cast(P, policy), resolver, priority, index))
        self.guard_lists[actor.actor_name] = tuple(guards)
        self.attach(broker)

    def guards_actor(self, actor_name: str) -> bool:
        """Whether ``actor_name`` declared this middleware's option (the enqueue gate skips the rest)."""
        return actor_name in self.guard_lists

    def guard_of(self, message: Message[Any] | MessageProxy) -> ActorGuard[P] | None:
        """The (first) guard of ``message``'s actor, or None if it is not guarded by this middleware."""
        guards = self.guards_of(message)
        return guards[0] if guards else None

    def guards_of(self, message: Message[Any] | MessageProxy) -> tuple[ActorGuard[P], ...]:
        """Every guard of ``message``'s actor, in its option's order (empty if it is not guarded here)."""
        # Every guard middleware asks this in every hook of every message: a proxy's actor name is
        # read from its message, not through its __getattr__.
        return self.guard_lists.get(message.__dict__.get("_message", message).actor_name, ())
