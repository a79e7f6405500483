"""The guard's Lua scripts on one Redis: one function library where the server allows it, else
EVALSHA (``docs/redis.md``, "How the scripts reach Redis")."""

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

from dramatiq_guard.backends.redis_layout import (
    LAYOUTS,
    SCRIPTS,
    lua_binding,
    lua_checks,
    lua_constants,
    lua_prologue,
)
from dramatiq_guard.errors import BackendRefused

logger = logging.getLogger("dramatiq_guard.backends.redis")

#: What the name of every version's library starts with.
LIBRARY_PREFIX = "dramatiq_guard_"
#: The scripts of one guard key, run with the prelude (``_lease``, ``_handoff``, ``_index``).
PRELUDE_SCRIPTS = tuple(SCRIPTS.values())
#: The prelude's files, in order: per-call state, holders and token; hand-off; the index and finish().
PRELUDE = ("_lease", "_handoff", "_index")
#: Scripts with a common path run before the prelude is set up (``lua/<name>_fast.lua``).
FAST_PATHS = ("acquire", "release")
#: Scripts without the prelude: the lean common paths, and those of other slots.
LEAN_SCRIPTS = tuple(name for name in LAYOUTS if name not in PRELUDE_SCRIPTS)
#: Function flags: read-only scripts run on a full Redis, and so do those that take state away.
FLAGS = {
    **dict.fromkeys(("inspect", "summaries", "due"), "no-writes"),
    **dict.fromkeys(("release", "cancel_wait", "sweep", "unindex", "forget_copy"), "allow-oom"),
}
#: How long a process's record of the library it runs lasts after its sweep refreshed it (ms; at
#: least: three sweep intervals if longer).
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


def prelude() -> str:
    """The text of the prelude's files, as put in front of the per-key scripts."""
    return "\n".join(load_lua(name) for name in PRELUDE) + "\n"


def _fast_and_rest(name: str) -> tuple[str, str]:
    """A script's prologue and fast path (run before the prelude is set up), and what runs after it."""
    top = lua_prologue(name) + lua_checks(name)
    if name not in PRELUDE_SCRIPTS:
        return top, load_lua(name)
    fast = load_lua(f"{name}_fast") + "\n" if name in FAST_PATHS else ""
    return top + fast, "begin()\n" + load_lua(name)


@functools.cache
def _code() -> tuple[str, str, dict[str, LuaScript]]:
    """The scripts' texts and the library's, made once per process.

    As a script: the constants, (per key) the binding, ``_common.lua``, the prologue and fast path,
    (per key) the prelude, ``begin()``, the script. As a function the shared parts are at the top of
    the library, once, and each call runs the rest.
    """
    constants, common, binding, shared = lua_constants(), load_lua("_common") + "\n", lua_binding(), prelude()
    split = {name: _fast_and_rest(name) for name in (*PRELUDE_SCRIPTS, *LEAN_SCRIPTS)}
    # KEYS and ARGV are the library's locals, set first by every call. The names carry a digest of
    # the code, which is made with a placeholder in their place.
    parts = ["#!lua name=@LIBRARY@\nlocal KEYS, ARGV\n", constants, binding, common, shared]
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
        if name in PRELUDE_SCRIPTS:
            source = constants + binding + common + fast + shared + rest
        else:
            source = constants + common + fast + rest
        sha = hashlib.sha1(source.encode()).hexdigest()
        scripts[name] = LuaScript(name, source, sha, f"{library}_{name}")
    return library, code.replace("@LIBRARY@", library), scripts


def _refuses_functions(error: RedisError) -> bool:
    """Whether ``error`` is the server refusing ``FCALL`` or ``FUNCTION LOAD``: an older server, or NOPERM."""
    message = str(error)
    return isinstance(error, NoPermissionError) or any(
        refusal in message for refusal in ("unknown command", "unknown subcommand", "exist in Redis commands")
    )


class ScriptLibrary:
    """The guard's scripts on one Redis (or Redis Cluster), as functions until the server refuses them."""

    def __init__(self) -> None:
        self.library, self.code, self._scripts = _code()
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

        A refusal of ``FCALL`` itself switches to scripts: the call is missing its script.
        """
        message = str(error)
        if _refuses_functions(error) and "fcall" in message.lower():
            self._use_scripts(message)
            return True
        return isinstance(error, NoScriptError) or (
            isinstance(error, ResponseError) and message.startswith("Function not found")
        )

    def load(self, client: Any, scripts: Iterable[LuaScript]) -> None:
        """Put the code of ``scripts`` on the server (``client``'s every primary): the whole library,
        or (as scripts) each one. A server that refuses ``FUNCTION LOAD`` switches the backend to
        scripts; a user not allowed it switches only if it may run scripts, else it stays on
        functions and the call fails closed (:class:`BackendRefused`)."""
        refused: ResponseError | None = None
        if self.functions:
            try:
                return self.load_functions(client)
            except ResponseError as exc:
                if not _refuses_functions(exc):
                    raise
                refused = exc
        try:
            for script in {script.name: script for script in scripts}.values():
                client.script_load(script.source)
        except NoPermissionError as no_scripts:
            if isinstance(refused, NoPermissionError):
                raise BackendRefused(
                    f"this version's function library {self.library} is not on the server, and the guard's "
                    f"ACL user may neither load it (FUNCTION LOAD: {refused}) nor run its scripts instead "
                    f"({no_scripts})",
                    cure=(
                        "have an operator load it with this version of dramatiq-guard: 'dramatiq-guard "
                        "--redis redis://<admin>@<host>:<port>/<db> functions load' (calls fail closed "
                        "until then, and run again from the next one after)"
                    ),
                ) from no_scripts
            raise
        if refused is not None:
            self._use_scripts(str(refused))

    def load_functions(self, client: Any) -> None:
        """``FUNCTION LOAD REPLACE`` this version's library (a library of that name holds this very code)."""
        client.function_load(self.code, replace=True)

    def libraries(self, client: Any) -> dict[str, int]:
        """Every dramatiq-guard library on the server of ``client`` (one primary), with its function count."""
        found: dict[str, int] = {}
        for entry in client.function_list(library=f"{LIBRARY_PREFIX}*"):
            fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
            name = fields.get(b"library_name", fields.get("library_name"))
            functions = fields.get(b"functions", fields.get("functions")) or []
            found[name.decode() if isinstance(name, bytes) else str(name)] = len(functions)
        return found

    def prune(self, client: Any) -> list[str]:
        """Delete the dramatiq-guard libraries of other versions from the server; return their names.

        Prune once every application runs this version (docs/redis.md): :meth:`running` says which
        workers still run which library.
        """
        others = sorted(name for name in self.libraries(client) if name != self.library)
        for name in others:
            client.function_delete(name)
        return others

    def announce(self, client: Any, namespace: str, ttl_ms: int = PROCESS_TTL_MS) -> None:
        """Record that this process runs this library until ``ttl_ms`` from now (its clock), dropping
        the records that lapsed (each worker's sweep, every ``ttl_ms / 4``; see :meth:`running`)."""
        now = int(time.time() * 1000)
        key = processes_key(namespace)
        pipe = client.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {self._record(): now + ttl_ms})
        pipe.pexpire(key, ttl_ms)
        pipe.execute()

    def withdraw(self, client: Any, namespace: str) -> None:
        """Remove this process's record (its sweep stopped)."""
        client.zrem(processes_key(namespace), self._record())

    @staticmethod
    def running(client: Any, namespace: str) -> dict[str, list[str]]:
        """The processes (``host:pid``) whose workers run each library, by library, per their records.

        Only workers record themselves, in their namespace; a dead one counts until its record lapses.
        """
        found: dict[str, list[str]] = {}
        for record in client.zrangebyscore(processes_key(namespace), int(time.time() * 1000), "+inf"):
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
