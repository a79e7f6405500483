"""The guard's Lua scripts on one Redis: one function library where the server allows it, else EVALSHA.

Every script lives in ``backends/lua/`` and is run in one of two ways, from the
same sources:

* **As a function** (``FCALL``, Redis 7.0 and later): all the scripts are
  functions of one library, loaded once per server (``FUNCTION LOAD``), named
  after a digest of their code (``dramatiq_guard_<digest>``; its functions
  ``dramatiq_guard_<digest>_<script>``), so two versions of dramatiq-guard on
  one Redis each call their own. The shared prelude (the layout generated
  by :mod:`~dramatiq_guard.backends.redis_layout`, ``_bounds.lua``,
  ``_prelude.lua``: ~140 locals and closures) is set up once, when the library
  loads; each call only resets its per-call values (``begin()`` in
  ``_prelude.lua``). As a script, that set-up is paid on every call that gets
  past a fast path: ~15 us of Redis time, a quarter of a contended hand-off's.
* **As a script** (``EVALSHA``), when the server refuses functions: an older
  Redis (no ``FCALL``), or an ACL user not allowed ``FUNCTION LOAD`` or
  ``FCALL``. The first refusal switches the backend to scripts for the life of
  the process, with a warning that says why. A user allowed ``FCALL`` but
  neither ``FUNCTION LOAD`` nor scripts (the restricted user of
  ``docs/redis.md``) stays on functions: while its library is missing, every
  call fails closed (:class:`~dramatiq_guard.errors.BackendRefused`, naming
  the cure), and the first call after an operator loads it runs.

A call the ACL user may not make (``NOPERM``) fails closed the same way,
wherever it is made (:func:`~dramatiq_guard.backends.redis_client.reachable`).

Which processes run which library: each worker's sweep records its own, per
namespace (``<namespace>:processes``, :meth:`ScriptLibrary.announce`), so
``dramatiq-guard functions prune`` refuses to delete a library that live
workers still call (:meth:`ScriptLibrary.running`).

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
import os
import socket
import time
from collections.abc import Iterable
from importlib import resources
from typing import Any, NamedTuple

from redis.exceptions import NoPermissionError, NoScriptError, RedisError, ResponseError

from dramatiq_guard.backends.redis_layout import lua_binding, lua_constants, lua_prologue
from dramatiq_guard.errors import BackendRefused

logger = logging.getLogger("dramatiq_guard.backends.redis")

#: What the name of every version's library starts with.
LIBRARY_PREFIX = "dramatiq_guard_"
#: The per-key scripts: the shared text, the fast path if any, ``_prelude.lua``, then the script (see _code).
PRELUDE_SCRIPTS = (
    "acquire",
    "release",
    "confirm_handoff",
    "cancel_wait",
    "sweep",
    "set_limit",
    "inspect",
    "standby",
    "forget_copy",
)
#: Scripts with a common path run before the prelude (``lua/<name>_fast.lua``): see docs/redis.md.
FAST_PATHS = ("acquire", "release")
#: Scripts of their own, without the prelude: the lean common paths, and those of other slots.
LEAN_SCRIPTS = ("lock", "renew", "unindex", "due", "summaries", "health")
#: The flags of the functions that have any (see above): read-only, or taking state away.
FLAGS = {
    **dict.fromkeys(("inspect", "summaries", "due"), "no-writes"),
    **dict.fromkeys(("release", "cancel_wait", "sweep", "unindex", "forget_copy"), "allow-oom"),
}


#: How long a process's record of the library it runs lasts after its sweep last refreshed it (at
#: least; three sweep intervals if longer): a worker that died stops counting as alive then.
PROCESS_TTL_MS = 60_000


def processes_key(namespace: str) -> str:
    """The key of the processes that run each library: zset ``"<library> <host>:<pid>"`` -> until (ms)."""
    return f"{namespace}:processes"


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
    """A script's prologue and fast path (which returns early, or falls through), and what runs after it."""
    top = lua_prologue(name)
    if name not in PRELUDE_SCRIPTS:
        return top, load_lua(name)
    fast = load_lua(f"{name}_fast") + "\n" if name in FAST_PATHS else ""
    return top + fast, "begin()\n" + load_lua(name)


@functools.cache
def _code() -> _Code:
    """The scripts' texts and the library's (made once per process: from the package's files).

    A per-key script as a script: the generated constants and binding (:mod:`redis_layout`),
    ``_bounds.lua``, its prologue and fast path, ``_prelude.lua``, ``begin()``, the script (the fast
    path runs before the prelude is set up); another script: the constants, its prologue, the
    script. As a function: the constants, ``_bounds.lua``, the binding and ``_prelude.lua`` once, at
    the top of the library, and per call the prologue, the fast path, ``begin()``, the script.
    """
    constants, shared = lua_constants(), load_lua("_bounds") + "\n" + lua_binding()
    prelude = load_lua("_prelude") + "\n"
    split = {name: _fast_and_rest(name) for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS)}
    # KEYS and ARGV are the library's own locals (a function gets them as arguments; the prelude and
    # the scripts read them as they would a script's globals), set first by every call. The names
    # carry a digest of the code, which is made with a placeholder in their place.
    parts = ["#!lua name=@LIBRARY@\nlocal KEYS, ARGV\n", constants, shared, prelude]
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
        source = constants + (shared + fast + prelude + rest if name in PRELUDE_SCRIPTS else fast + rest)
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

        A user allowed ``FCALL`` but not ``FUNCTION LOAD`` switches only if it
        may run scripts; else the backend stays on functions (an operator may
        load the library at any time) and the call fails closed.

        Raises:
          BackendRefused: If the library is missing and this user may neither
            load it nor run scripts.
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
                if not isinstance(exc, NoPermissionError):  # a server without functions
                    self._use_scripts(str(exc))
                else:
                    try:
                        self._load_scripts(client, scripts)
                    except NoPermissionError as refused:
                        raise self._missing(exc, refused) from refused
                    self._use_scripts(str(exc))
                    return
        self._load_scripts(client, scripts)

    @staticmethod
    def _load_scripts(client: Any, scripts: Iterable[LuaScript]) -> None:
        for script in {script.name: script for script in scripts}.values():
            client.script_load(script.source)

    def _missing(self, load: RedisError, scripts: RedisError) -> BackendRefused:
        """Why a call fails while this library is missing and may not be loaded by this user."""
        return BackendRefused(
            f"this version's function library {self.library} is not on the server, and the guard's ACL "
            f"user may neither load it (FUNCTION LOAD: {load}) nor run its scripts instead ({scripts})",
            cure=(
                "have an operator load it with this version of dramatiq-guard: 'dramatiq-guard --redis "
                "redis://<admin>@<host>:<port>/<db> functions load' (calls fail closed until then, and "
                "run again from the next one after)"
            ),
        )

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

        A process still running another version finds its library missing at
        its next call (which did nothing) and loads it again, if its ACL user
        may; the restricted user of ``docs/redis.md`` may not, and fails
        every call closed until an operator loads it again. So prune once
        every application runs this version: :meth:`running` says which
        workers still run which library (``dramatiq-guard functions prune``
        refuses while any does).
        """
        others = sorted(name for name in self.libraries(client) if name != self.library)
        for name in others:
            client.function_delete(name)
        return others

    def announce(self, client: Any, namespace: str, ttl_ms: int = PROCESS_TTL_MS) -> None:
        """Record that this process runs this library, until ``ttl_ms`` from now (see :meth:`running`).

        One pipelined round trip, made by each worker's sweep every
        ``ttl_ms / 4`` (:mod:`~dramatiq_guard.backends.redis_watch`): drop the
        records that lapsed, add or refresh this one, and expire the key with
        it (nothing is left once the workers are gone). Deadlines are on the
        clock of each process: the clocks' skew must stay well below
        ``ttl_ms``.

        Raises:
          redis.RedisError: If the server cannot be reached, or refuses it.
        """
        now = int(time.time() * 1000)
        key = processes_key(namespace)
        pipe = client.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {self._record(): now + ttl_ms})
        pipe.pexpire(key, ttl_ms)
        pipe.execute()

    def withdraw(self, client: Any, namespace: str) -> None:
        """Remove this process's record (its sweep stopped).

        Raises:
          redis.RedisError: If the server cannot be reached, or refuses it.
        """
        client.zrem(processes_key(namespace), self._record())

    @staticmethod
    def running(client: Any, namespace: str) -> dict[str, list[str]]:
        """The processes (``host:pid``) whose workers run each library, by library, per their records.

        Only workers record themselves (their sweep does), and only in their
        namespace; a worker that died counts until its record lapses
        (:data:`PROCESS_TTL_MS`).
        """
        now = int(time.time() * 1000)
        found: dict[str, list[str]] = {}
        for record in client.zrangebyscore(processes_key(namespace), now, "+inf"):
            library, _, process = (record.decode() if isinstance(record, bytes) else record).partition(" ")
            found.setdefault(library, []).append(process)
        return {library: sorted(processes) for library, processes in found.items()}

    def _record(self) -> str:
        return f"{self.library} {socket.gethostname()}:{os.getpid()}"

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
