"""The bounds of every duration and count dramatiq-guard accepts.

Durations (leases, reservations, waits, locks' ``ttl``, ...) run from 0 to
:data:`MAX_DURATION_MS`, 366 days: longer than any lease, lock or wait this
guard is for, and still far inside what every layer handles exactly
(Lua's and JSON's doubles, exact to 2**53 ms; Redis's ``PEXPIRE``; Python's
``timedelta`` and SQL timestamps). A longer value is a mistake (seconds
multiplied twice, a timestamp given as a duration); where "no limit" is
meant, the option takes None.

The idempotency ledger's durations (``retention``, the age given to
``prune``) only set SQL timestamps, where a row kept for years is a
legitimate choice, so they run up to :data:`MAX_RETENTION_MS`, 100 years of
366 days.

Limits and counts (a concurrency limit, how many waiters to send ahead)
run from 0 to :data:`MAX_COUNT`, the largest 32-bit signed integer.

The Lua scripts of the Redis backend hold their own copy of both numbers
(``backends/lua/_prelude.lua``, ``validate_args``); a test keeps them equal.
"""

from __future__ import annotations

#: The longest duration an option, a setting or a backend call takes: 366 days, in ms.
MAX_DURATION_MS = 366 * 24 * 60 * 60 * 1000

#: The longest retention (and prune age) the idempotency ledger takes: 36,600 days, in ms.
MAX_RETENTION_MS = 100 * MAX_DURATION_MS

#: The largest limit or count: 2**31 - 1.
MAX_COUNT = 2**31 - 1

__all__ = ["MAX_COUNT", "MAX_DURATION_MS", "MAX_RETENTION_MS"]
