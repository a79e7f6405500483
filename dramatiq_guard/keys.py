"""Guard keys: how a message's arguments become the key of a lock or a limit, as a ``key`` callable's
str or ``"<actor_name>:<sha256 of canonical JSON>"`` (docs/design.md, "Keys")."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from dramatiq_guard.errors import GuardError, GuardKeyError

#: A ``key`` option as users write it (after validation).
KeySpec = Callable[..., str] | tuple[str, ...] | None


#: The encoder of :func:`canonical_json` (made once: json.dumps with options makes one per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON (sorted keys, no spaces, UTF-8); TypeError or ValueError (a NaN, an
    infinity) if JSON cannot encode it."""
    return _CANONICAL.encode(value).encode("utf-8")


def digest(value: Any) -> str:
    """The hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


#: What a digested key takes (the end of a GuardKeyError's message).
DIGEST_ALLOWS = (
    "A key without a callable digests the actor's arguments (or the ones it names) as JSON: "
    "str of valid Unicode (no lone surrogates), int, finite float, bool, None, and lists, tuples "
    "and dicts with str keys of these. Send such values, or give the option a key that leaves "
    "this argument out (a list of names, or a callable returning a str)"
)
#: What a key callable must return (the end of a GuardKeyError's message).
CALLABLE_ALLOWS = "A key callable must return a str of valid Unicode (no lone surrogates)"

#: What a key a message carries must be (:func:`is_message_key`).
MESSAGE_KEY_RULE = "must be a non-empty str of valid Unicode (no lone surrogates)"

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


def lone_surrogate(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (which UTF-8, and so Redis and SQL, cannot take), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate ({text[e.start]!r} at index {e.start})"
    return None


def is_message_key(value: object) -> TypeGuard[str]:
    """Whether ``value`` may be a key a message carries (a send's ``dedup_key`` or ``idempotency_key``
    option): it :data:`MESSAGE_KEY_RULE`."""
    return isinstance(value, str) and bool(value) and not lone_surrogate(value)


def flaw(value: Any, path: str, seen: frozenset[int] = frozenset()) -> str | None:
    """What in ``value`` (called ``path``) canonical JSON cannot encode, or None if nothing.

    Walks ``value`` as :func:`canonical_json` does; only called once an encode failed.
    """
    if isinstance(value, str):
        where = lone_surrogate(value)
        return f"{path} is a str with {where}" if where else None
    if isinstance(value, float):
        if math.isnan(value):
            return f"{path} is a NaN"
        return f"{path} is an infinity ({value!r})" if math.isinf(value) else None
    if value is None or isinstance(value, int):
        return None
    if isinstance(value, (list, tuple, dict)):
        if id(value) in seen:
            return f"{path} contains itself (a circular reference)"
        inner = seen | {id(value)}
        if isinstance(value, dict):
            return _dict_flaw(value, path, inner)
        return next((f for i, item in enumerate(value) if (f := flaw(item, f"{path}[{i}]", inner))), None)
    return f"{path} is {_short.repr(value)} of type {type(value).__qualname__}, which JSON cannot encode"


def _dict_flaw(value: dict[Any, Any], path: str, seen: frozenset[int]) -> str | None:
    """:func:`flaw` of a dict: its keys (str, or a number, bool or None of one type), then its values."""
    for name in value:
        if isinstance(name, str):
            where = lone_surrogate(name)
            if where:
                return f"{path} has a key with {where}"
        elif not (name is None or isinstance(name, (int, float))):
            kind = type(name).__qualname__
            return f"{path} has a key {_short.repr(name)} of type {kind}, which JSON cannot encode"
    found = next((f for k, v in value.items() if (f := flaw(v, f"{path}[{k!r}]", seen))), None)
    if found is None and len({type(name) for name in value}) > 1:
        kinds = ", ".join(sorted({type(name).__qualname__ for name in value}))
        return f"{path} has keys of several types ({kinds}), which cannot be sorted"
    return found


def _plain_signature(signature: inspect.Signature) -> str:
    """``signature`` without annotations, as users read it in an error."""
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))


class KeyResolver:
    """Turns the arguments of a call of ``fn`` (actor ``actor_name``) into a guard key by ``spec`` (a
    callable, a tuple of argument names, or None), for the actor option ``option`` (errors name it);
    digested keys are scoped by ``scope`` (a later guard of an option's list: ``<actor>#<index>``),
    else by the actor's name. :class:`ValueError` if ``spec`` names an argument ``fn`` does not take.
    """

    def __init__(
        self,
        actor_name: str,
        fn: Callable[..., Any],
        spec: KeySpec,
        *,
        option: str = "guard",
        scope: str | None = None,
    ) -> None:
        self.actor_name = actor_name
        self.scope = scope or actor_name
        self.spec = spec
        self.option = option
        self.signature = inspect.signature(fn)
        #: The parameter names if all are positional and none variadic: a call with that many
        #: positional arguments then binds them without Signature.bind (the common case).
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        every = self.signature.parameters.values()
        self._positional: tuple[str, ...] | None = (
            tuple(p.name for p in every) if all(p.kind in kinds for p in every) else None
        )
        self._arity = -1 if self._positional is None else len(self._positional)
        # The spec by its kind, read on every send.
        self._fn: Callable[..., str] | None = spec if callable(spec) else None
        self._names: tuple[str, ...] | None = spec if isinstance(spec, tuple) else None
        if isinstance(spec, tuple):
            params = self.signature.parameters
            unknown = [name for name in spec if name not in params]
            if unknown:
                raise ValueError(
                    f"key names argument(s) {', '.join(map(repr, unknown))} that "
                    f"{actor_name}() does not take; its arguments are {', '.join(params) or 'none'}"
                )

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The guard key of a call with ``args`` and ``kwargs``; :class:`GuardKeyError` if they do not fit
        the actor's signature, a digested argument cannot be encoded, or a key callable raised or
        returned something other than a str of valid Unicode."""
        fn = self._fn
        if fn is not None:
            try:
                key = fn(*args, **kwargs)
            except GuardError:
                raise
            except Exception as e:
                raise self._error(f"its key callable raised {type(e).__name__}: {e}", CALLABLE_ALLOWS) from e
            if not isinstance(key, str):
                what = f"{_short.repr(key)} (of type {type(key).__qualname__}), not a str"
                raise self._error(f"its key callable returned {what}", CALLABLE_ALLOWS)
            if not key.isascii() and (where := lone_surrogate(key)):
                raise self._error(f"its key callable returned a str with {where}", CALLABLE_ALLOWS)
            return key
        names = self._positional
        if names is not None and not kwargs and len(args) == self._arity:
            arguments = dict(zip(names, args, strict=True))  # what bind() and apply_defaults() give here
        else:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise self._error(
                    f"the arguments do not fit {self.actor_name}{_plain_signature(self.signature)}: {e}",
                    f"Send the arguments {self.actor_name}() takes",
                ) from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
        if self._names is not None:
            arguments = {name: arguments[name] for name in self._names}
        return f"{self.scope}:{self._digest(arguments)}"

    def _digest(self, arguments: dict[str, Any]) -> str:
        """:func:`digest` of ``arguments``, or the GuardKeyError that names what it cannot take."""
        try:
            return digest(arguments)
        except RecursionError:
            raise self._error("the arguments are nested too deeply to encode", DIGEST_ALLOWS) from None
        except (TypeError, ValueError) as e:  # UnicodeEncodeError is a ValueError
            found = next((f for name, v in arguments.items() if (f := flaw(v, f"argument {name!r}"))), None)
            raise self._error(found or str(e), DIGEST_ALLOWS) from None

    def _error(self, reason: str, allowed: str) -> GuardKeyError:
        return GuardKeyError(self.actor_name, self.option, reason, allowed)
