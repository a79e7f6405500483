"""Guard keys: how a message's arguments become the key of a lock or a limit.

A ``key`` option takes one of three forms:

* a callable of the actor's arguments returning a string. The string is used
  as given, so two actors whose callables return the same string share a
  lock or a limit;
* a list of argument names, resolved through the actor's signature (so
  ``f(1, b=2)`` and ``f(a=1, b=2)`` agree, and defaults count as passed);
* absent: all the arguments, resolved the same way.

The last two are scoped to the actor and digested: the key is
``"<actor_name>:<digest>"`` where the digest is the SHA-256 of the canonical
JSON of a mapping from argument name to value.

Canonical JSON is :func:`json.dumps` with sorted keys, ``(",", ":")``
separators, ``ensure_ascii=False``, ``allow_nan=False``, encoded as UTF-8.
Tuples encode as lists; floats use Python's shortest round-tripping repr,
which has been the same since Python 3.1. The digest of the same arguments is
therefore the same across processes, machines and Python versions; the test
vectors in ``tests/data/key_vectors.json`` pin it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

#: A ``key`` option as users write it (after validation).
KeySpec = Callable[..., str] | tuple[str, ...] | None


#: The encoder of :func:`canonical_json` (made once: json.dumps with options makes one per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON (see the module docstring).

    Raises:
      TypeError: If ``value`` holds something JSON cannot encode.
      ValueError: If ``value`` holds a NaN or an infinity.
    """
    return _CANONICAL.encode(value).encode("utf-8")


def digest(value: Any) -> str:
    """The hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


class KeyResolver:
    """Turns a message's arguments into a guard key, for one actor and one key spec.

    Parameters:
      actor_name(str): The actor's name (scopes digested keys).
      fn(Callable): The actor's function (its signature resolves names).
      spec(KeySpec): The key option: a callable, a tuple of argument names, or None.

    Raises:
      ValueError: If ``spec`` names an argument the function does not take.
    """

    def __init__(self, actor_name: str, fn: Callable[..., Any], spec: KeySpec) -> None:
        self.actor_name = actor_name
        self.spec = spec
        self.signature = inspect.signature(fn)
        #: The parameter names, when every parameter can be passed by position and none is
        #: variadic: then a call with exactly that many positional arguments and no keywords
        #: binds each name to its argument, without Signature.bind (the common case, per message).
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        every = self.signature.parameters.values()
        self._positional: tuple[str, ...] | None = (
            tuple(p.name for p in every) if all(p.kind in kinds for p in every) else None
        )
        if isinstance(spec, tuple):
            params = self.signature.parameters
            unknown = [name for name in spec if name not in params]
            if unknown:
                raise ValueError(
                    f"key names argument(s) {', '.join(map(repr, unknown))} that "
                    f"{actor_name}() does not take; its arguments are {', '.join(params) or 'none'}"
                )

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The guard key of a call with ``args`` and ``kwargs``.

        Raises:
          TypeError: If the arguments do not fit the actor's signature, or a
            key callable returned something other than a string.
        """
        if callable(self.spec):
            key = self.spec(*args, **kwargs)
            if not isinstance(key, str):
                raise TypeError(
                    f"the key callable of {self.actor_name} returned {key!r}; it must return a str"
                )
            return key
        names = self._positional
        if names is not None and not kwargs and len(args) == len(names):
            arguments = dict(zip(names, args, strict=True))  # what bind() and apply_defaults() give here
        else:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
        if self.spec is not None:
            arguments = {name: arguments[name] for name in self.spec}
        return f"{self.actor_name}:{digest(arguments)}"
