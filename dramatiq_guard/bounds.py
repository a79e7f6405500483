"""The bounds of every duration and count dramatiq-guard accepts (docs/design.md).

The Lua scripts get them from here too (:mod:`dramatiq_guard.backends.redis_layout`).
"""

from __future__ import annotations

#: The longest duration an option, a setting or a backend call takes: 366 days, in ms.
MAX_DURATION_MS = 366 * 24 * 60 * 60 * 1000

#: The longest retention (and prune age) the idempotency ledger takes: 36,600 days, in ms.
MAX_RETENTION_MS = 100 * MAX_DURATION_MS

#: The largest limit or count: 2**31 - 1.
MAX_COUNT = 2**31 - 1

#: The priorities a waiter takes (an actor's Dramatiq ``priority``): from -2048 to 2048.
MAX_PRIORITY = 2048
