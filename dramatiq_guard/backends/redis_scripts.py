"""The guard's Lua scripts on one Redis: one function library where the server allows it, else EVALSHA.

Every script lives in ``backends/lua/`` and is run in one of two ways, from the
same sources:

* **As a function** (``FCALL``, Redis 7.0 and later): all the scripts are
  functions of one library, loaded once per server (``FUNCTION LOAD``), named
  after a digest of their code (``dramatiq_guard_<digest>``; its functions
  ``dramatiq_guard_<digest>_<script>``), so two versions of dramatiq-guard on
  one Redis each call their own. The shared prelude (``_bounds.lua``,
  ``_prelude.lua``: ~120 locals and closures) is set up once, when the library
  loads; each call only resets its per-call values (``begin()`` in
  ``_prelude.lua``). As a script, that set-up is paid on every call that gets
  past a fast path: ~15 us of Redis time, a quarter of a contended hand-off's.
* **As a script** (``EVALSHA``), when the server refuses functions: an older
  Redis (no ``FCALL``), or an ACL user not allowed ``FUNCTION LOAD`` or
  ``FCALL``. The first refusal switches the backend to scripts for the life of
  the process, with a warning that says why.

A call refused because its code is not on the server (``NOSCRIPT``,
``Function not found``: a restart without persistence, ``SCRIPT FLUSH``,
``FUNCTION FLUSH``, a new Cluster primary) did nothing; the caller loads the
code (:meth:`ScriptLibrary.load`) and runs the call again. A library loads
with ``REPLACE``: a library of that name holds this very code.

On a full ``noeviction`` Redis (at ``maxmemory``) a function is refused whole,
before its first command, unless its flags say otherwise: the read-only
scripts (``inspect``, ``summaries``, ``due``) are ``no-writes`` functions, and
those that take state away (``release``, ``cancel_wait``, ``sweep``,
``unindex``: a release may hand its slot on, which writes about what it
frees) are ``allow-oom``, so a full Redis can still be inspected and drained
of its holders, as it could with scripts (a script is refused there only at
its first write that may grow memory, once nothing was written yet). Every
other operation fails closed (``BackendUnavailable``), either way. The library
itself loads with ``FUNCTION LOAD``, which a full Redis refuses too: a process
that finds the library gone then (a restart without persistence) fails closed
until there is room.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterable
from importlib import resources
from typing import Any, NamedTuple

from redis.exceptions import NoPermissionError, NoScriptError, RedisError, ResponseError

__all__ = ["LuaScript", "ScriptLibrary", "load_lua"]

logger = logging.getLogger("dramatiq_guard.backends.redis")

#: What the name of every version's library starts with.
LIBRARY_PREFIX = "dramatiq_guard_"
#: The per-key scripts: ``_bounds.lua``, the fast path if any, ``_prelude.lua``, then the script.
PRELUDE_SCRIPTS = (
    "acquire",
    "release",
    "confirm_handoff",
    "cancel_wait",
    "sweep",
    "set_limit",
    "inspect",
    "standby",
)
#: Scripts with a common path run before the prelude (``lua/<name>_fast.lua``): see docs/redis.md.
FAST_PATHS = ("acquire", "release")
#: Scripts of their own, without the prelude: the lean common paths, and those of other slots.
LEAN_SCRIPTS = ("lock", "renew", "unindex", "due", "summaries", "health")
#: The flags of the functions that have any (see above): read-only, or taking state away.
FLAGS = {
    **dict.fromkeys(("inspect", "summaries", "due"), "no-writes"),
    **dict.fromkeys(("release", "cancel_wait", "sweep", "unindex"), "allow-oom"),
}


def load_lua(name: str) -> str:
    """The text of ``backends/lua/<name>.lua``."""
    return resources.files("dramatiq_guard.backends").joinpath(f"lua/{name}.lua").read_text("utf-8")


class LuaScript(NamedTuple):
    """One guard script: its name, its text as a script, its SHA1, and its name as a function."""

    name: str
    source: str
    sha: str
    function: str


class _Code(NamedTuple):
    library: str
    code: str
    scripts: dict[str, LuaScript]


def _fast_and_rest(name: str) -> tuple[str, str]:
    """A script's fast path ('' if none: it returns early, or falls through), and what runs after it."""
    if name not in PRELUDE_SCRIPTS:
        return "", load_lua(name)
    fast = load_lua(f"{name}_fast") + "\n" if name in FAST_PATHS else ""
    return fast, "begin()\n" + load_lua(name)


@functools.cache
def _code() -> _Code:
    """The scripts' texts and the library's (read once per process: they are the package's files).

    A per-key script as a script: ``_bounds.lua``, its fast path, ``_prelude.lua``, ``begin()``,
    the script (the fast path runs before the prelude is set up). As a function: ``_bounds.lua``
    and ``_prelude.lua`` once, at the top of the library, and per call the fast path, ``begin()``,
    the script.
    """
    bounds, prelude = load_lua("_bounds") + "\n", load_lua("_prelude") + "\n"
    split = {name: _fast_and_rest(name) for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS)}
    # KEYS and ARGV are the library's own locals (a function gets them as arguments; the prelude and
    # the scripts read them as they would a script's globals), set first by every call. The names
    # carry a digest of the code, which is made with a placeholder in their place.
    parts = ["#!lua name=@LIBRARY@\nlocal KEYS, ARGV\n", bounds, prelude]
    for name, (fast, rest) in split.items():
        flags = f"{{'{FLAGS[name]}'}}" if name in FLAGS else "{}"
        parts.append(
            f"redis.register_function{{function_name='@LIBRARY@_{name}', flags={flags}, "
            f"callback=function(keys, args)\nKEYS, ARGV = keys, args\n{fast}{rest}\nend}}\n"
        )
    code = "".join(parts)
    library = LIBRARY_PREFIX + hashlib.sha1(code.encode()).hexdigest()[:16]
    scripts: dict[str, LuaScript] = {}
    for name, (fast, rest) in split.items():
        source = bounds + fast + prelude + rest if name in PRELUDE_SCRIPTS else rest
        scripts[name] = LuaScript(
            name, source, hashlib.sha1(source.encode()).hexdigest(), f"{library}_{name}"
        )
    return _Code(library, code.replace("@LIBRARY@", library), scripts)


def _refuses_functions(error: RedisError) -> bool:
    """Whether ``error`` is the server refusing a function command (``FCALL``, ``FUNCTION LOAD``).

    An older server: "unknown command 'fcall'" or "unknown subcommand" (from a
    Redis Cluster client: "FCALL command doesn't exist in Redis commands"); an
    ACL user without the command: NOPERM.
    """
    message = str(error)
    return isinstance(error, NoPermissionError) or any(
        refusal in message for refusal in ("unknown command", "unknown subcommand", "exist in Redis commands")
    )


class ScriptLibrary:
    """The guard's scripts on one Redis (or Redis Cluster), as functions until the server refuses them.

    One per backend: whether the server takes functions is learnt on the
    first call (and kept for the life of the process).
    """

    def __init__(self) -> None:
        code = _code()
        self.library = code.library
        self.code = code.code
        self._scripts = code.scripts
        #: Whether calls are FCALLs (else EVALSHAs).
        self.functions = True

    def __getitem__(self, name: str) -> LuaScript:
        return self._scripts[name]

    def command(self, script: LuaScript, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        """The command that runs ``script`` (``FCALL`` or ``EVALSHA``, its numkeys, keys and args)."""
        if self.functions:
            return ("FCALL", script.function, len(keys), *keys, *args)
        return ("EVALSHA", script.sha, len(keys), *keys, *args)

    def missing(self, error: RedisError) -> bool:
        """Whether a call refused with ``error`` did nothing because its code is not on the server.

        A refusal of functions themselves (``FCALL`` unknown, or not allowed
        to this user) switches to scripts here: the call is missing its script.
        """
        if isinstance(error, NoScriptError):
            return True
        message = str(error)
        if isinstance(error, ResponseError) and message.startswith("Function not found"):
            return True
        if _refuses_functions(error) and "fcall" in message.lower():
            self._use_scripts(message)
            return True
        return False

    def load(self, client: Any, scripts: Iterable[LuaScript]) -> None:
        """Put the code of ``scripts`` on the server: the whole library, or (as scripts) each one.

        ``client`` is the backend's (on a Redis Cluster, the cluster client: it
        loads on every primary). A server that refuses ``FUNCTION LOAD``
        switches the backend to scripts.

        Raises:
          redis.RedisError: If the server cannot be reached, or refuses to
            load a script.
        """
        if self.functions:
            try:
                self.load_functions(client)
                return
            except ResponseError as exc:
                if not _refuses_functions(exc):
                    raise
                self._use_scripts(str(exc))
        for script in {script.name: script for script in scripts}.values():
            client.script_load(script.source)

    def load_functions(self, client: Any) -> None:
        """``FUNCTION LOAD REPLACE`` this version's library (a library of that name holds this very code).

        Raises:
          redis.RedisError: If the server cannot be reached, or refuses it.
        """
        client.function_load(self.code, replace=True)

    def libraries(self, client: Any) -> dict[str, int]:
        """Every dramatiq-guard library on the server (this version's and others'), with its function count.

        ``client`` is a client of one server (on a Redis Cluster, of one primary).
        """
        found: dict[str, int] = {}
        for entry in client.function_list(library=f"{LIBRARY_PREFIX}*"):
            fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
            name = fields.get(b"library_name", fields.get("library_name"))
            functions = fields.get(b"functions", fields.get("functions")) or []
            found[name.decode() if isinstance(name, bytes) else str(name)] = len(functions)
        return found

    def prune(self, client: Any) -> list[str]:
        """Delete the dramatiq-guard libraries of other versions from the server; return their names.

        Never unsafe: a process still running another version finds its
        library missing at its next call and loads it again (the call did
        nothing); prune once every application runs this version.
        """
        others = sorted(name for name in self.libraries(client) if name != self.library)
        for name in others:
            client.function_delete(name)
        return others

    def _use_scripts(self, why: str) -> None:
        if self.functions:
            self.functions = False
            logger.warning(
                "dramatiq-guard: this Redis refuses functions (%s): the guard runs its scripts with EVALSHA, "
                "which sets their shared prelude up on every call (about 15 us more Redis time per "
                "operation on a key with waiters). Redis 7 and an ACL that allows FCALL avoid it (a user "
                "not allowed FUNCTION LOAD needs the library loaded for it: "
                "'dramatiq-guard functions load').",
                why,
            )
