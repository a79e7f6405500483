"""Mutexes and concurrency slots: at most N messages per key execute at a time.

The ``mutex`` actor option is a one-slot limit and ``concurrency`` an N-slot
limit; both are built once, in this package, on the guard backend's leases
and lockwait area (:mod:`dramatiq_guard.backends.base`). What a user needs
to know is in ``docs/slots.md``; where each part lives:

* :mod:`.middleware`: the Dramatiq hooks (acquire before a message runs,
  release after, park, drop or wait when the key is full);
* :mod:`.reservation`: enqueue time (reserve a free slot, or park at once);
* :mod:`.waits`: a worker thread blocked for a mutex (``on_busy="wait"``);
* :mod:`.standbys`: waiters sent ahead of a free slot, and the threads they block;
* :mod:`.execution`: one execution's held lease, or why it did not run;
* :mod:`.releases`: finished messages' leases released off the worker thread, in batches;
* :mod:`dramatiq_guard.middleware.sweep`: each worker's sweep of keys with waiters;
* :mod:`.limits`: default and run-time limits, and which actor a key is of;
* :mod:`.mutex`, :mod:`.concurrency`: what the two options differ in.
"""

from dramatiq_guard.errors import MutexWaitTimeout
from dramatiq_guard.middleware.slots.concurrency import Concurrency
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.middleware.slots.mutex import Mutex

__all__ = ["Concurrency", "Mutex", "MutexWaitTimeout", "SlotsMiddleware"]
