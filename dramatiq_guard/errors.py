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
    """The key of actor option ``option`` (``dedup``, ``mutex``...) of a message of ``actor_name``
    cannot be derived from its arguments: ``reason``; ``allowed`` says what the key's form allows.
    Raised where the key is derived (``send()``, before anything is pushed or written; a worker;
    ``key_for``)."""

    def __init__(self, actor_name: str, option: str, reason: str, allowed: str) -> None:
        super().__init__(
            f"actor {actor_name!r}: the {option} key of this message cannot be derived from its "
            f"arguments: {reason}. {allowed}"
        )
        self.actor_name, self.option, self.reason = actor_name, option, reason


class BackendUnavailable(GuardError):
    """The guard backend (Redis) could not be reached: the message fails closed and Retries retries it."""


class BackendRefused(BackendUnavailable):
    """The guard's Redis refused a call (``refusal``: the command or the keys): its ACL user lacks a
    permission (``NOPERM``). It fails closed like an unreachable Redis; once the permission is granted
    (``cure``), the next call succeeds (docs/redis.md, "A restricted ACL user")."""

    def __init__(self, refusal: str, cure: str = "grant the guard's ACL user that permission") -> None:
        super().__init__(
            f"the guard's Redis refused a call: {refusal}; {cure} (docs/redis.md, 'A restricted ACL user')"
        )
        self.refusal = refusal


class ReplicasBehind(BackendUnavailable):
    """Only ``acknowledged`` of the ``wanted`` replicas acknowledged a decision within ``timeout_ms``
    (``replica_waits``, Redis ``WAIT``). The operation ran on the primary but may not survive a
    failover, so it fails closed. What a caller may rely on afterwards (``send()`` took back what it
    stored, a worker's acquire is retried...): docs/failure-model.md."""

    def __init__(self, acknowledged: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"the guard's Redis backend: only {acknowledged} of {wanted} replica(s) acknowledged "
            f"a decision within {timeout_ms} ms (replica_waits={wanted}): failing closed"
        )
        self.acknowledged, self.wanted, self.timeout_ms = acknowledged, wanted, timeout_ms


class ConfigurationError(GuardError, ValueError):
    """dramatiq-guard cannot work with the broker or settings it was given."""


class LeaseLost(GuardError):
    """The lease of ``holder`` on guard key ``key`` lapsed or was taken over while it still ran."""

    def __init__(self, key: str, holder: str) -> None:
        super().__init__(f"the lease of {holder!r} on guard key {key!r} was lost before it was released")
        self.key, self.holder = key, holder


class DuplicateMessage(GuardError):
    """Raised by ``send()`` for a duplicate of an actor with ``on_duplicate="raise"``: message
    ``message_id`` was refused, as message ``holder`` holds dedup key ``key``."""

    def __init__(self, message_id: str, holder: str, key: str) -> None:
        super().__init__(
            f"message {message_id!r} is a duplicate of message {holder!r}, which holds dedup key {key!r}"
        )
        self.message_id, self.holder, self.key = message_id, holder, key


class MutexWaitTimeout(GuardError):
    """A ``mutex`` with ``on_busy="wait"`` was still held (by ``holders``) when message ``message_id``
    had waited ``wait_ms`` for guard key ``key`` (Retries retries it)."""

    def __init__(self, key: str, message_id: str, wait_ms: int, holders: tuple[str, ...] = ()) -> None:
        super().__init__(
            f"message {message_id} waited {wait_ms} ms for the mutex {key!r}{_held_by(holders)}; giving up"
        )
        self.key, self.message_id, self.wait_ms, self.holders = key, message_id, wait_ms, holders


class LockNotAcquired(GuardError):
    """``with lock:`` could not acquire the lock ``key``, held by ``holders`` (non-blocking, or
    ``blocking_timeout`` ran out)."""

    def __init__(self, key: str, holders: tuple[str, ...] = ()) -> None:
        super().__init__(f"could not acquire the lock {key!r}{_held_by(holders)}")
        self.key, self.holders = key, holders


def _held_by(holders: tuple[str, ...]) -> str:
    return f" (held by {', '.join(holders)})" if holders else ""


class EvictingRedis(ConfigurationError):
    """The guard's Redis (``where``) may evict keys: its ``maxmemory-policy`` (``policy``) is not
    ``noeviction``. Refused unless ``install(broker, allow_evicting_redis=True)`` or
    ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` says otherwise."""

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
    """The guard's Redis (``where``: server and namespace) holds state in layout ``stored``, newer
    than the ``known`` one this version reads (a downgrade); ``key`` is the record's Redis key."""

    def __init__(self, stored: int, known: int, where: str, key: str) -> None:
        super().__init__(
            f"the guard's state in {where} is in layout {stored}, written by a newer dramatiq-guard; "
            f"this one ({__version__}) reads layouts up to {known} only and would misread it: run the "
            f"newer version, or another namespace; to go back to this version, let the namespace drain "
            f"(no parked message, holder or dedup lock left) and delete the key {key!r}"
        )
        self.stored, self.known = stored, known


class PayloadTooLarge(GuardError, ValueError):
    """Message ``waiter_id``, which would park on guard key ``key``, is ``size`` bytes encoded: over
    the ``limit`` in force (the backend's ``max_payload_bytes``). Nothing is stored."""

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
    """Idempotency key ``key``, bound in the ledger to ``stored_fingerprint`` (of ``stored_payload``:
    ``{"actor", "arguments"}``, first used by message ``holder``), was used with another payload
    (``payload``, of ``fingerprint``). Not retried."""

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
