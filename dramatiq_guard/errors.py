"""Exceptions raised by dramatiq-guard.

Every exception a guard middleware raises from a Dramatiq hook subclasses
:class:`dramatiq.middleware.MiddlewareError`: Dramatiq re-raises only those
from ``before_*`` hooks and swallows (logs) anything else, which would let a
guarded message run unguarded.
"""

from __future__ import annotations

from dramatiq.middleware import MiddlewareError


class GuardError(MiddlewareError):
    """Base class for every dramatiq-guard error."""


class GuardOptionError(GuardError, ValueError):
    """An actor option or a setting has a value that is not allowed.

    It is a :class:`ValueError` (what a user expects from a bad argument) and
    a :class:`~dramatiq.middleware.MiddlewareError` (so Dramatiq lets it out
    of ``before_declare_actor`` and ``@dramatiq.actor`` fails at declaration).
    """


class BackendUnavailable(GuardError):
    """The guard backend (Redis) could not be reached.

    Raised instead of running a guarded message unguarded: the Retries
    middleware retries the message later (fail closed).
    """


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
