"""dramatiq-guard: composable Dramatiq middlewares for deduplication, mutexes,
per-key concurrency slots and an SQL idempotency ledger.

Register it on your broker before importing your actors::

    import dramatiq, dramatiq_guard
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url="redis://localhost:6379/0")
    dramatiq_guard.install(broker)
    dramatiq.set_broker(broker)
"""

from dramatiq_guard._version import __version__ as __version__
from dramatiq_guard.context import current_lease, ledger_session
from dramatiq_guard.errors import (
    BackendUnavailable,
    ConfigurationError,
    GuardError,
    GuardKeyError,
    GuardOptionError,
    LeaseLost,
    ReplicasBehind,
)
from dramatiq_guard.install import install
from dramatiq_guard.lease import Lease
from dramatiq_guard.ledger import IdempotencyConflict, Ledger, LedgerError, UnstorableResult, ledger_table
from dramatiq_guard.lock import Lock, LockNotAcquired, LockRun
from dramatiq_guard.middleware.dedup import Deduplication, DuplicateMessage, deduplicated_by
from dramatiq_guard.middleware.idempotency import Idempotency
from dramatiq_guard.middleware.slots import Concurrency, Debounce, Mutex, MutexWaitTimeout, Throttle
from dramatiq_guard.policies import (
    ConcurrencyPolicy,
    DebouncePolicy,
    DedupPolicy,
    IdempotencyPolicy,
    MutexPolicy,
    ThrottlePolicy,
)

__all__ = [  # noqa: RUF022 - grouped by capability, not sorted
    # Setting up
    "install",
    # Deduplication
    "Deduplication",
    "DedupPolicy",
    "DuplicateMessage",
    "deduplicated_by",
    # Mutexes and concurrency slots
    "Mutex",
    "MutexPolicy",
    "MutexWaitTimeout",
    "Concurrency",
    "ConcurrencyPolicy",
    "Throttle",
    "ThrottlePolicy",
    "Debounce",
    "DebouncePolicy",
    # Leases, inside a guarded actor and outside (the standalone lock)
    "Lease",
    "LeaseLost",
    "current_lease",
    "Lock",
    "LockNotAcquired",
    "LockRun",
    # The idempotency ledger
    "Idempotency",
    "IdempotencyPolicy",
    "Ledger",
    "ledger_session",
    "ledger_table",
    "IdempotencyConflict",
    "LedgerError",
    "UnstorableResult",
    # Errors every guard may raise
    "GuardError",
    "GuardOptionError",
    "GuardKeyError",
    "ConfigurationError",
    "BackendUnavailable",
    "ReplicasBehind",
]
