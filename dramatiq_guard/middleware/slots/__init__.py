"""Mutexes and concurrency slots: at most N messages per key execute at a time (docs/slots.md).

The ``mutex`` option is a one-slot limit, ``concurrency`` an N-slot one, ``throttle`` N starts per
window, ``debounce`` one run per burst of sends; docs/internals.md says
what each module of this package holds.
"""

from dramatiq_guard.errors import MutexWaitTimeout
from dramatiq_guard.middleware.slots.concurrency import Concurrency
from dramatiq_guard.middleware.slots.debounce import Debounce
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.middleware.slots.mutex import Mutex
from dramatiq_guard.middleware.slots.throttle import Throttle

__all__ = ["Concurrency", "Debounce", "Mutex", "MutexWaitTimeout", "SlotsMiddleware", "Throttle"]
