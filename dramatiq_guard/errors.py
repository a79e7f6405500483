"""Exceptions raised by dramatiq-guard (each a Dramatiq ``MiddlewareError``: see docs/design.md)."""

from __future__ import annotations

import reprlib
from typing import Any

from dramatiq.middleware import MiddlewareError

from dramatiq_guard._version import __version__


class GuardError(MiddlewareError):
    """Base class for every dramatiq-guard error."""


class GuardOptionError(GuardError, ValueError):
    """An actor option or a setting has a value that is not allowed (raised at ``@dramatiq.actor``)."""


class GuardKeyError(GuardOptionError):
    """A message's guard key cannot be derived from its arguments.

    Raised where the key is derived (``send()``, before anything is pushed
    or written; a worker; ``key_for``).

    Parameters:
      actor_name(str): The message's actor.
      option(str): The actor option whose key could not be derived
        (``dedup``, ``mutex``, ``concurrency``, ``idempotency_key``).
      reason(str): What is wrong.
      allowed(str): What the key's form allows.
    """

    def __init__(self, actor_name: str, option: str, reason: str, allowed: str) -> None:
        super().__init__(
            f"actor {actor_name!r}: the {option} key of this message cannot be derived from its "
            f"arguments: {reason}. {allowed}"
        )
        self.actor_name, self.option, self.reason = actor_name, option, reason


class BackendUnavailable(GuardError):
    """The guard backend (Redis) could not be reached: the message fails closed and Retries retries it."""


class BackendRefused(BackendUnavailable):
    """The guard's Redis refused a call: its ACL user lacks a permission (``NOPERM``).

    It fails closed like an unreachable Redis; once the permission is
    granted, the next call succeeds (docs/redis.md, "A restricted ACL user").

    Parameters:
      refusal(str): What was refused (the command or the keys).
      cure(str): What an operator should do.
    """

    def __init__(self, refusal: str, cure: str = "grant the guard's ACL user that permission") -> None:
        super().__init__(
            f"the guard's Redis refused a call: {refusal}; {cure} (docs/redis.md, 'A restricted ACL user')"
        )
        self.refusal = refusal


class ReplicasBehind(BackendUnavailable):
    """Fewer replicas than asked acknowledged a decision in time (``replica_waits``, Redis ``WAIT``).

    The operation ran on the primary but may not survive a failover, so it
    fails closed. What a caller may rely on afterwards (``send()`` took back
    what it stored, a worker's acquire is retried...): docs/failure-model.md.

    Attributes:
      acknowledged(int): How many replicas acknowledged.
      wanted(int): How many were asked for.
      timeout_ms(int): How long the primary waited for them.
    """

    def __init__(self, acknowledged: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"the guard's Redis backend: only {acknowledged} of {wanted} replica(s) acknowledged "
            f"a decision within {timeout_ms} ms (replica_waits={wanted}): failing closed"
        )
        self.acknowledged, self.wanted, self.timeout_ms = acknowledged, wanted, timeout_ms


class ConfigurationError(GuardError, ValueError):
    """dramatiq-guard cannot work with the broker or settings it was given."""


class LeaseLost(GuardError):
    """A holder's lease lapsed or was taken over while it was still running.

    Parameters:
      key(str): The guard key.
      holder(str): The holder that lost it.
    """

    def __init__(self, key: str, holder: str) -> None:
        super().__init__(f"the lease of {holder!r} on guard key {key!r} was lost before it was released")
        self.key, self.holder = key, holder


class DuplicateMessage(GuardError):
    """Raised by ``send()`` for a duplicate of an actor with ``on_duplicate="raise"``.

    Parameters:
      message_id(str): The refused message's id.
      holder(str): The message id of the message holding the lock.
      key(str): The guard key.
    """

    def __init__(self, message_id: str, holder: str, key: str) -> None:
        super().__init__(
            f"message {message_id!r} is a duplicate of message {holder!r}, which holds dedup key {key!r}"
        )
        self.message_id, self.holder, self.key = message_id, holder, key


class MutexWaitTimeout(GuardError):
    """A ``mutex`` with ``on_busy="wait"`` was still held when ``wait`` ran out (Retries retries it).

    Parameters:
      key(str): The guard key.
      message_id(str): The message that waited.
      wait_ms(int): How long it waited.
      holders(tuple[str, ...]): Who held the key when it gave up.
    """

    def __init__(self, key: str, message_id: str, wait_ms: int, holders: tuple[str, ...] = ()) -> None:
        super().__init__(
            f"message {message_id} waited {wait_ms} ms for the mutex {key!r}{_held_by(holders)}; giving up"
        )
        self.key, self.message_id, self.wait_ms, self.holders = key, message_id, wait_ms, holders


class LockNotAcquired(GuardError):
    """``with lock:`` could not acquire the lock (non-blocking, or ``blocking_timeout`` ran out).

    Parameters:
      key(str): The guard key.
      holders(tuple[str, ...]): Who held it.
    """

    def __init__(self, key: str, holders: tuple[str, ...] = ()) -> None:
        super().__init__(f"could not acquire the lock {key!r}{_held_by(holders)}")
        self.key, self.holders = key, holders


def _held_by(holders: tuple[str, ...]) -> str:
    return f" (held by {', '.join(holders)})" if holders else ""


class EvictingRedis(ConfigurationError):
    """The guard's Redis may evict keys (its ``maxmemory-policy`` is not ``noeviction``).

    Refused unless ``install(broker, allow_evicting_redis=True)`` or
    ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` says otherwise.

    Parameters:
      policy(str): The ``maxmemory-policy`` the server reported.
      where(str): Which server (for the message).
    """

    def __init__(self, policy: str, where: str) -> None:
        super().__init__(
            f"the guard's Redis ({where}) has maxmemory-policy {policy!r}, so it may evict the guard's "
            f"keys (parked messages, dedup locks, holders) and lose messages silently; set "
            f"'maxmemory-policy noeviction' in its redis.conf (or CONFIG SET maxmemory-policy noeviction), "
            f"or give the guard a Redis of its own; to run on it anyway, pass allow_evicting_redis=True "
            f"to dramatiq_guard.install() or set DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS=1"
        )
        self.policy = policy


class LayoutTooNew(ConfigurationError):
    """The guard's Redis holds state in a layout newer than this version reads (a downgrade).

    Parameters:
      stored(int): The layout recorded in Redis.
      known(int): The newest layout this version reads.
      where(str): Which server and namespace (for the message).
      key(str): The Redis key of the record.
    """

    def __init__(self, stored: int, known: int, where: str, key: str) -> None:
        super().__init__(
            f"the guard's state in {where} is in layout {stored}, written by a newer dramatiq-guard; "
            f"this one ({__version__}) reads layouts up to {known} only and would misread it: run the "
            f"newer version, or another namespace; to go back to this version, let the namespace drain "
            f"(no parked message, holder or dedup lock left) and delete the key {key!r}"
        )
        self.stored, self.known = stored, known


class PayloadTooLarge(GuardError, ValueError):
    """A message that would park is larger than the backend's ``max_payload_bytes`` (nothing is stored).

    Parameters:
      key(str): The guard key.
      waiter_id(str): The message id.
      size(int): The encoded message's size in bytes.
      limit(int): The bound in force.
    """

    def __init__(self, key: str, waiter_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"message {waiter_id!r} is {size} bytes encoded, more than the {limit} bytes a message "
            f"waiting on guard key {key!r} may take in Redis; nothing was stored. Send a reference "
            f"to the data instead of the data, or raise the bound: "
            f"dramatiq_guard.install(broker, max_payload_bytes=...) (or the backend's max_payload_bytes)"
        )
        self.key, self.waiter_id, self.size, self.limit = key, waiter_id, size, limit


# -- the idempotency ledger (IdempotencyConflict and UnstorableResult are not retried: docs/ledger.md) --

_repr = reprlib.Repr()
_repr.maxstring = 200
_repr.maxother = 200
_repr.maxlevel = 4


class LedgerError(GuardError):
    """Base class of the idempotency ledger's errors."""


class IdempotencyConflict(LedgerError):
    """An idempotency key already in the ledger was used with a different payload (not retried).

    Parameters:
      key(str): The idempotency key.
      stored_fingerprint(str): The fingerprint the key is bound to.
      fingerprint(str): The fingerprint of the message that was refused.
      stored_payload: The payload the key is bound to (``{"actor", "arguments"}``).
      payload: The refused message's payload.
      holder(str): The message that first used the key (its ``message_id``).
    """

    def __init__(
        self,
        key: str,
        *,
        stored_fingerprint: str,
        fingerprint: str,
        stored_payload: Any,
        payload: Any,
        holder: str | None,
    ) -> None:
        super().__init__(
            f"idempotency key {key!r} is bound to another payload: it was first used by message "
            f"{holder!r} with fingerprint {stored_fingerprint} ({_repr.repr(stored_payload)}), "
            f"this message has fingerprint {fingerprint} ({_repr.repr(payload)}). "
            f"A key must identify one operation; use a new key for a different payload."
        )
        self.key, self.holder = key, holder
        self.fingerprint, self.stored_fingerprint = fingerprint, stored_fingerprint
        self.payload, self.stored_payload = payload, stored_payload


class UnstorableResult(LedgerError, TypeError):
    """The actor returned a value the ledger cannot store as JSON (nothing is committed; not retried)."""
