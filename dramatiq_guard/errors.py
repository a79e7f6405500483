"""Exceptions raised by dramatiq-guard.

Every exception a guard middleware raises from a Dramatiq hook subclasses
:class:`dramatiq.middleware.MiddlewareError`: Dramatiq re-raises only those
from ``before_*`` hooks and swallows (logs) anything else, which would let a
guarded message run unguarded.
"""

from __future__ import annotations

import reprlib
from typing import Any

from dramatiq.middleware import MiddlewareError

from dramatiq_guard._version import __version__


class GuardError(MiddlewareError):
    """Base class for every dramatiq-guard error."""


class GuardOptionError(GuardError, ValueError):
    """An actor option or a setting has a value that is not allowed.

    It is a :class:`ValueError` (what a user expects from a bad argument) and
    a :class:`~dramatiq.middleware.MiddlewareError` (so Dramatiq lets it out
    of ``before_declare_actor`` and ``@dramatiq.actor`` fails at declaration).
    """


class GuardKeyError(GuardOptionError):
    """A message's guard key cannot be derived from its arguments.

    Raised where the key is derived: by ``send()`` (nothing is pushed, and
    nothing of the message is written to the backend), by a worker that
    picks up a message sent without the guard, and by ``key_for``. A
    :class:`ValueError` (through :class:`GuardOptionError`) and a
    :class:`~dramatiq.middleware.MiddlewareError`.

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
        self.actor_name = actor_name
        self.option = option
        self.reason = reason


class BackendUnavailable(GuardError):
    """The guard backend (Redis) could not be reached.

    Raised instead of running a guarded message unguarded: the Retries
    middleware retries the message later (fail closed).
    """


class BackendRefused(BackendUnavailable):
    """The guard's Redis refused a call: its ACL user lacks a permission the guard needs (``NOPERM``).

    It fails closed like an unreachable Redis (``fail_open`` applies, the
    Retries middleware retries the message): the message names what was
    refused. Nothing in the process is changed by it, so once an operator
    grants the permission (or loads the guard's function library: see
    ``docs/redis.md``, "A restricted ACL user"), the next call succeeds.

    Parameters:
      refusal(str): What was refused (Redis's ``NOPERM`` reply names the
        command or the keys).
      cure(str): What an operator should do.
    """

    def __init__(self, refusal: str, cure: str = "grant the guard's ACL user that permission") -> None:
        super().__init__(
            f"the guard's Redis refused a call: {refusal}; {cure} (docs/redis.md, 'A restricted ACL user')"
        )
        self.refusal = refusal


class ReplicasBehind(BackendUnavailable):
    """Fewer replicas than asked acknowledged a decision in time (``replica_waits``, Redis ``WAIT``).

    Raised after the operation ran on the primary: it may not survive a
    failover, so it fails closed, as if Redis had been unreachable. What the
    caller can rely on (the same holds for a connection lost after a call was
    sent, which is a plain :class:`BackendUnavailable`):

    * ``send()`` that raises this left nothing a retry trips on: a dedup
      lock, a slot reserved or a message parked for it was taken back, by its
      message id, before the error reached the caller
      (:meth:`GuardBackend.take_back
      <dramatiq_guard.backends.GuardBackend.take_back>`), so a new ``send()``
      is neither dropped as a duplicate nor run beside a parked copy; with
      ``fail_open=True`` the message is pushed unguarded and nothing of it is
      kept. So is a :class:`~dramatiq_guard.lock.Lock`'s acquire. (A
      ``reschedule_once`` rerun asked for by a duplicate stays asked for: a
      retry asks for the same one, whose id comes from the holder's.)
    * If the take-back failed too (logged; Redis gone), what the call may have
      done lapses on its own: a dedup lock within ``pending_ttl``, a
      reservation within ``pickup_ttl``, a lock within ``lease_ttl``; a parked
      message stays parked and runs once. A retry that sends the same message
      again (``broker.enqueue(message)``: same ``message_id``) joins what is
      there instead of adding a second copy; a new ``send()`` may not.
    * A worker's acquire takes nothing back (another copy of the message may
      hold the key): the message fails and is retried. A slot it got keeps
      the retry out (deferred) until its lease lapses; a message it parked
      runs from there, and the retried copy is skipped as stale. A blocking
      wait (``on_busy="wait"``, a standby, a blocking lock) leaves its place
      or lapses within seconds.
    * A release may have freed the slot (the message is done anyway); a
      renewal, a hand-off's confirmation, a withdrawal, a sweep or a limit
      may have been done: each is idempotent, and a retry is safe. A
      hand-off the lost answer carried is nobody's to deliver: its
      reservation lapses within ``handoff_ttl_ms`` and its message waits
      again in its place; nothing is lost.

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
        self.acknowledged = acknowledged
        self.wanted = wanted
        self.timeout_ms = timeout_ms


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
        self.key = key
        self.holder = holder


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
        self.message_id = message_id
        self.holder = holder
        self.key = key


class MutexWaitTimeout(GuardError):
    """A ``mutex`` with ``on_busy="wait"`` was still held when ``wait`` ran out.

    The Retries middleware retries the message (it is a MiddlewareError, so
    Dramatiq does not swallow it in ``before_process_message``).

    Parameters:
      key(str): The guard key.
      message_id(str): The message that waited.
      wait_ms(int): How long it waited.
      holders(tuple[str, ...]): Who held the key when it gave up.
    """

    def __init__(self, key: str, message_id: str, wait_ms: int, holders: tuple[str, ...] = ()) -> None:
        held_by = f" (held by {', '.join(holders)})" if holders else ""
        super().__init__(
            f"message {message_id} waited {wait_ms} ms for the mutex {key!r}{held_by}; giving up"
        )
        self.key = key
        self.message_id = message_id
        self.wait_ms = wait_ms
        self.holders = holders


class LockNotAcquired(GuardError):
    """``with lock:`` could not acquire the lock (non-blocking, or ``blocking_timeout`` ran out).

    Parameters:
      key(str): The guard key.
      holders(tuple[str, ...]): Who held it.
    """

    def __init__(self, key: str, holders: tuple[str, ...] = ()) -> None:
        held_by = f" (held by {', '.join(holders)})" if holders else ""
        super().__init__(f"could not acquire the lock {key!r}{held_by}")
        self.key = key
        self.holders = holders


class EvictingRedis(ConfigurationError):
    """The guard's Redis may evict keys: its ``maxmemory-policy`` is not ``noeviction``.

    An evicted guard key is a parked message, a dedup lock or a holder lost
    without a trace, so the guard refuses such a Redis unless told otherwise
    (``install(broker, allow_evicting_redis=True)``, or the
    ``DRAMATIQ_GUARD_ALLOW_EVICTING_REDIS`` environment variable).

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

    Each namespace records the layout of its state (``<namespace>:layout``,
    see :data:`dramatiq_guard.backends.redis_health.LAYOUT`); a process whose
    version knows only older layouts would misread parked messages, holders
    and dedup locks, so it refuses to start instead.

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
        self.stored = stored
        self.known = known


class PayloadTooLarge(GuardError, ValueError):
    """A message that would park is larger than the backend's ``max_payload_bytes``.

    Raised before anything is written, so nothing of the message is stored.
    At enqueue it reaches the caller of ``send()``.

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
        self.key = key
        self.waiter_id = waiter_id
        self.size = size
        self.limit = limit


# -- the idempotency ledger (which of these Retries retries: dramatiq_guard.ledger.errors) --

_repr = reprlib.Repr()
_repr.maxstring = 200
_repr.maxother = 200
_repr.maxlevel = 4


class LedgerError(GuardError):
    """Base class of the idempotency ledger's errors."""


class IdempotencyConflict(LedgerError):
    """An idempotency key already in the ledger was used with a different payload.

    The key is bound to the payload (actor name and arguments) of its first
    use until its row expires. The stored row is left untouched. Not retried.

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
        self.key = key
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint
        self.stored_payload = stored_payload
        self.payload = payload
        self.holder = holder


class UnstorableResult(LedgerError, TypeError):
    """The actor returned a value the ledger cannot store as JSON.

    Nothing of the run is committed. Not retried: the same code would return
    the same kind of value again.
    """


__all__ = ["IdempotencyConflict", "LedgerError", "UnstorableResult"]
