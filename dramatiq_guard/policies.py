"""Actor options and the frozen policies they turn into.

The one place that turns an option (a shorthand, a dict or a policy) into a
policy, and that words the error when it cannot (naming the actor, the option,
the value and the allowed forms). Durations and limits: :mod:`dramatiq_guard.bounds`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import ClassVar, Literal, TypeVar, cast, get_args

from dramatiq_guard.backends.checks import check_count
from dramatiq_guard.bounds import MAX_DURATION_MS, MAX_RETENTION_MS
from dramatiq_guard.errors import GuardOptionError
from dramatiq_guard.keys import KeySpec

Duration = int | datetime.timedelta
DedupStrategy = Literal["until_executing", "until_executed", "until_expired"]
OnDuplicate = Literal["drop", "raise", "reschedule_once"]
OnBusy = Literal["drop", "wait", "park"]


def duration_ms(
    value: object, *, what: str, allow_none: bool = False, minimum: int = 0, maximum: int = MAX_DURATION_MS
) -> int | None:
    """``value`` (int ms, not a bool, or a timedelta; None if ``allow_none``) in ms, from ``minimum``
    to ``maximum``; else a :class:`ValueError` naming ``what``."""
    if value is None and allow_none:
        return None
    if isinstance(value, datetime.timedelta):
        ms = value // datetime.timedelta(milliseconds=1)
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise ValueError(
            f"{what} must be integer milliseconds or a datetime.timedelta"
            f"{' or None' if allow_none else ''}, not {value!r}"
        )
    if ms < 0:
        raise ValueError(f"{what} must not be negative, not {value!r}")
    if ms < minimum:
        raise ValueError(f"{what} must be at least {minimum} ms, not {value!r}")
    if ms > maximum:
        raise ValueError(
            f"{what} must be at most {maximum // 86_400_000} days ({maximum} ms)"
            f"{' or None' if allow_none else ''}, not {value!r}"
        )
    return ms


def timeout_s(value: object, *, what: str) -> float | None:
    """``value`` (seconds, not a bool, or a timedelta; None: no timeout) as float seconds, up to 366 days;
    else a :class:`ValueError` naming ``what``."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(
            f"{what} must be seconds (an int or a float), a datetime.timedelta or None, not {value!r}"
        )
    if not 0 <= seconds <= MAX_DURATION_MS / 1000:  # also refuses nan
        raise ValueError(
            f"{what} must be from 0 to 366 days ({MAX_DURATION_MS // 1000} s) or None, not {value!r}"
        )
    return seconds


def key_spec(value: object) -> KeySpec:
    """Validate a ``key`` field: a callable, a list of argument names, or None (else :class:`ValueError`)."""
    if value is None or callable(value):
        return cast(KeySpec, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(name, str) for name in value):
        return tuple(value)
    raise ValueError(
        f"key must be a callable of the actor's arguments returning a str, "
        f"a non-empty list of argument names, or None (all arguments), not {value!r}"
    )


def _choice(value: object, choices: tuple[str, ...], *, what: str) -> str:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return str(value)


def _flag(value: object, *, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, not {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DedupPolicy:
    """Enqueue-time deduplication (the ``dedup`` actor option).

    Parameters:
      strategy: When the lock is released: ``"until_executing"`` (when the
        holder starts), ``"until_executed"`` (when it finishes for good) or
        ``"until_expired"`` (after ``ttl``, whatever happens).
      key: What makes two messages duplicates (see :mod:`dramatiq_guard.keys`).
      ttl: The most a lock lives, in ms or a timedelta. Default: one hour.
      on_duplicate: ``"drop"`` (``send()`` returns normally), ``"raise"`` or
        ``"reschedule_once"`` (only with ``strategy="until_executed"``).
      including_scheduled: Whether delayed messages are deduplicated too.
      fail_open: Enqueue unguarded when the backend is unreachable (default:
        fail closed, ``send()`` raises).
    """

    option: ClassVar[str] = "dedup"

    strategy: DedupStrategy
    key: KeySpec = None
    ttl: Duration = 3_600_000
    on_duplicate: OnDuplicate = "drop"
    including_scheduled: bool = False
    fail_open: bool = False

    def __post_init__(self) -> None:
        _choice(self.strategy, get_args(DedupStrategy), what="strategy")
        _set(self, "key", key_spec(self.key))
        _set(self, "ttl", duration_ms(self.ttl, what="ttl"))
        if self.ttl_ms == 0:
            raise ValueError("ttl must be positive")
        _choice(self.on_duplicate, get_args(OnDuplicate), what="on_duplicate")
        if self.on_duplicate == "reschedule_once" and self.strategy != "until_executed":
            raise ValueError(
                "on_duplicate 'reschedule_once' needs strategy 'until_executed' (with 'until_executing' "
                "a send while the holder runs is enqueued anyway; 'until_expired' has no finish to run after)"
            )
        _flag(self.including_scheduled, what="including_scheduled")
        _flag(self.fail_open, what="fail_open")

    @property
    def ttl_ms(self) -> int:
        """``ttl`` in milliseconds."""
        return self.ttl  # type: ignore[return-value]  # an int since __post_init__ (read per message: no cast call)

    @classmethod
    def from_shorthand(cls, value: object) -> DedupPolicy | None:
        """``"until_executed"`` and the like (None: ``value`` is no shorthand)."""
        is_strategy = isinstance(value, str) and value in get_args(DedupStrategy)
        return cls(strategy=cast(DedupStrategy, value)) if is_strategy else None


@dataclasses.dataclass(frozen=True)
class MutexPolicy:
    """Execution-time mutual exclusion (the ``mutex`` actor option).

    Parameters:
      key: Which messages exclude each other (default: the actor's messages
        with the same arguments; see :mod:`dramatiq_guard.keys`).
      ttl: The most a holder keeps the lock, renewals included (None: as long
        as it runs).
      on_busy: ``"drop"`` (default, non-blocking), ``"wait"`` (block the worker
        thread up to ``wait``) or ``"park"`` (wait in the lockwait area).
      wait: How long ``on_busy="wait"`` blocks. Default: one minute.
      fail_open: Run unguarded when the backend is unreachable.
    """

    option: ClassVar[str] = "mutex"

    key: KeySpec = None
    ttl: Duration | None = None
    on_busy: OnBusy = "drop"
    wait: Duration = 60_000
    fail_open: bool = False

    def __post_init__(self) -> None:
        _set(self, "key", key_spec(self.key))
        _set(self, "ttl", duration_ms(self.ttl, what="ttl", allow_none=True))
        _choice(self.on_busy, get_args(OnBusy), what="on_busy")
        _set(self, "wait", duration_ms(self.wait, what="wait"))
        _flag(self.fail_open, what="fail_open")

    @property
    def ttl_ms(self) -> int | None:
        """``ttl`` in milliseconds, or None."""
        return self.ttl  # type: ignore[return-value]  # an int or None since __post_init__ (no cast call)

    @property
    def wait_ms(self) -> int:
        """``wait`` in milliseconds."""
        return cast(int, self.wait)

    @classmethod
    def from_shorthand(cls, value: object) -> MutexPolicy | None:
        """``True``."""
        return cls() if value is True else None


@dataclasses.dataclass(frozen=True)
class ConcurrencyPolicy:
    """Per-key concurrency slots (the ``concurrency`` actor option).

    Parameters:
      limit: At most this many messages per key execute at once (0 halts the
        key). A run-time limit set in the backend overrides it.
      key: Which messages share the limit (see :mod:`dramatiq_guard.keys`).
      ttl: The most a holder keeps its slot, renewals included (None: as
        long as it runs).
      fail_open: Run unguarded when the backend is unreachable.
    """

    option: ClassVar[str] = "concurrency"

    limit: int
    key: KeySpec = None
    ttl: Duration | None = None
    fail_open: bool = False

    def __post_init__(self) -> None:
        check_count(self.limit, "limit", optional=False)
        _set(self, "key", key_spec(self.key))
        _set(self, "ttl", duration_ms(self.ttl, what="ttl", allow_none=True))
        _flag(self.fail_open, what="fail_open")

    @property
    def ttl_ms(self) -> int | None:
        """``ttl`` in milliseconds, or None."""
        return self.ttl  # type: ignore[return-value]  # an int or None since __post_init__ (no cast call)

    @classmethod
    def from_shorthand(cls, value: object) -> ConcurrencyPolicy | None:
        """An int limit."""
        return cls(limit=value) if isinstance(value, int) and not isinstance(value, bool) else None


@dataclasses.dataclass(frozen=True)
class ThrottlePolicy:
    """At most ``limit`` starts per key in any window of ``period`` (the ``throttle`` actor option).

    Parameters:
      limit: At most this many starts per key in any window of ``period`` (0 halts the key;
        at most 2**31 - 1). A run-time limit set in the backend overrides it.
      period: The window, in ms or a ``timedelta`` (at least 1 ms).
      key: Which messages share the limit (see :mod:`dramatiq_guard.keys`).
      fail_open: Run unthrottled when the backend is unreachable.
    """

    option: ClassVar[str] = "throttle"

    limit: int
    period: Duration
    key: KeySpec = None
    fail_open: bool = False

    def __post_init__(self) -> None:
        check_count(self.limit, "limit", optional=False)
        _set(self, "period", duration_ms(self.period, what="period", minimum=1))
        _set(self, "key", key_spec(self.key))
        _flag(self.fail_open, what="fail_open")

    @property
    def period_ms(self) -> int:
        """``period`` in milliseconds."""
        return self.period  # type: ignore[return-value]  # an int since __post_init__ (no cast call)

    @property
    def ttl_ms(self) -> int:
        """How long a start holds its place: the period."""
        return self.period_ms

    @classmethod
    def from_shorthand(cls, value: object) -> None:
        """None: a throttle is a dict or a :class:`ThrottlePolicy`."""
        return None


@dataclasses.dataclass(frozen=True)
class DebouncePolicy:
    """One run per burst of sends of a key, with the last send's message (the ``debounce`` actor option).

    Parameters:
      wait: How long after a key's last send its run starts, in ms or a ``timedelta`` (at least 1 ms).
      max_wait: The latest a run starts after its burst's first send (at least ``wait``). None
        (the default): no bound, a burst that never pauses for ``wait`` defers its run as long.
      key: Which sends make one burst (see :mod:`dramatiq_guard.keys`).
      fail_open: Send undebounced (each send runs) when the backend is unreachable.
    """

    option: ClassVar[str] = "debounce"

    wait: Duration
    max_wait: Duration | None = None
    key: KeySpec = None
    fail_open: bool = False

    def __post_init__(self) -> None:
        wait = cast(int, duration_ms(self.wait, what="wait", minimum=1))
        max_wait = duration_ms(self.max_wait, what="max_wait", allow_none=True)
        if max_wait is not None and max_wait < wait:
            raise ValueError(f"max_wait must be None or at least wait ({wait} ms), not {self.max_wait!r}")
        _set(self, "wait", wait)
        _set(self, "max_wait", max_wait)
        _set(self, "key", key_spec(self.key))
        _flag(self.fail_open, what="fail_open")

    @property
    def wait_ms(self) -> int:
        """``wait`` in milliseconds."""
        return cast(int, self.wait)

    @property
    def max_wait_ms(self) -> int:
        """``max_wait`` in milliseconds (no bound: the longest duration there is)."""
        return MAX_DURATION_MS if self.max_wait is None else cast(int, self.max_wait)

    ttl_ms = None  # a debounced message holds no slot while it runs

    @classmethod
    def from_shorthand(cls, value: object) -> DebouncePolicy | None:
        """The wait: integer milliseconds or a ``timedelta``."""
        is_wait = isinstance(value, (int, datetime.timedelta)) and not isinstance(value, bool)
        return cls(wait=cast(Duration, value)) if is_wait else None


@dataclasses.dataclass(frozen=True)
class IdempotencyPolicy:
    """The idempotency ledger (the ``idempotency_key`` actor option).

    Parameters:
      key: A callable of the actor's arguments returning the idempotency key
        (a str), a list of argument names, or None (the ``True`` shorthand:
        each message is its own key, its ``idempotency_key`` option, else its
        ``message_id``). Required: a dict must name it.
      retention: How long completed rows are kept, up to 100 years (None: the ledger's default).
    """

    option: ClassVar[str] = "idempotency_key"

    key: KeySpec
    retention: Duration | None = None

    def __post_init__(self) -> None:
        _set(self, "key", key_spec(self.key))
        retention = duration_ms(self.retention, what="retention", allow_none=True, maximum=MAX_RETENTION_MS)
        _set(self, "retention", retention)

    @property
    def retention_ms(self) -> int | None:
        """``retention`` in milliseconds, or None."""
        return cast("int | None", self.retention)

    @classmethod
    def from_shorthand(cls, value: object) -> IdempotencyPolicy | None:
        """A callable, a list of argument names, or ``True``."""
        if value is True or callable(value) or isinstance(value, (list, tuple)):
            return cls(key=None if value is True else cast(KeySpec, value))
        return None


Policy = DedupPolicy | MutexPolicy | ConcurrencyPolicy | ThrottlePolicy | DebouncePolicy | IdempotencyPolicy
P = TypeVar("P", bound=Policy)

#: Each option's shorthands, as an error message names them (before its dict and policy forms).
_SHORTHANDS: Mapping[str, str] = {
    "dedup": '"until_executing", "until_executed" or "until_expired"; ',
    "mutex": "True; ",
    "concurrency": "an int limit; ",
    "debounce": "integer milliseconds or a datetime.timedelta (the wait); ",
    "idempotency_key": (
        "a callable of the actor's arguments returning a str; a list of argument names; "
        "True (each message is its own key: its idempotency_key option, else its message_id); "
    ),
}


#: The options that also take a list of policies: every one of them must admit a message.
LIST_OPTIONS = frozenset({"concurrency", "throttle"})


def parse_policies(cls: type[P], value: object, *, actor_name: str) -> tuple[P, ...]:
    """Turn an actor option's value into its policies: one, or (for :data:`LIST_OPTIONS`) a list's;
    :class:`GuardOptionError` as :func:`parse_policy`, and for an empty list."""
    if not isinstance(value, (list, tuple)) or cls.option not in LIST_OPTIONS:
        return (parse_policy(cls, value, actor_name=actor_name),)
    if not value:
        raise option_error(actor_name, cls.option, value, "an empty list")
    return tuple(parse_policy(cls, item, actor_name=actor_name) for item in value)


def parse_policy(cls: type[P], value: object, *, actor_name: str) -> P:
    """Turn an actor option's value (a shorthand, a dict, or a ``cls``) into a frozen ``cls``; else a
    :class:`GuardOptionError` naming the actor, the option, the value and the allowed forms."""
    try:
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - fields, key=str)
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}")
            return cls(**value)
        policy = cls.from_shorthand(value)
        if policy is None:
            raise ValueError("not one of the allowed forms")
        return cast(P, policy)
    except (TypeError, ValueError) as e:
        raise option_error(actor_name, cls.option, value, str(e)) from None


def option_error(actor_name: str, option: str, value: object, reason: str) -> GuardOptionError:
    """The error for a bad option value: names actor, option, value, reason and allowed forms."""
    cls = next(cls for cls in get_args(Policy) if cls.option == option)
    policy, keys = f"dramatiq_guard.{cls.__name__}", ", ".join(f.name for f in dataclasses.fields(cls))
    many = f"a {policy}; or a non-empty list of those (every one must admit a message)"
    forms = f"a dict with keys {keys}; " + (many if option in LIST_OPTIONS else f"or a {policy}")
    return GuardOptionError(
        f"actor {actor_name!r}: {option}={value!r} is not valid: {reason}. "
        f"{option} takes {_SHORTHANDS.get(option, '')}{forms}."
    )


def _set(obj: object, name: str, value: object) -> None:
    """Normalise a field of a frozen dataclass in ``__post_init__``."""
    object.__setattr__(obj, name, value)
