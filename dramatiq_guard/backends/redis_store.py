"""What :class:`~dramatiq_guard.backends.RedisBackend` stands on: its client, its key names
(``docs/redis.md``), script calls and their replies, the process hooks, and the reads."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import redis
import redis.cluster

from dramatiq_guard.backends import redis_health
from dramatiq_guard.backends import redis_layout as layout
from dramatiq_guard.backends.base import BackendSettings, GuardBackend
from dramatiq_guard.backends.checks import check_count, check_key, check_ms, check_replica_waits
from dramatiq_guard.backends.redis_client import (
    DEFAULT_SOCKET_TIMEOUT_S,
    RedisClient,
    ReplicaWaits,
    ScriptCall,
    ThreadClients,
    Timeouts,
    data,
    reachable,
    run_scripts,
    slow_call_warning,
    text,
    timeouts_of,
)
from dramatiq_guard.backends.redis_layout import KeyNames
from dramatiq_guard.backends.redis_scripts import LuaScript, ScriptLibrary
from dramatiq_guard.backends.values import Handoff, KeyState, KeySummary, ReleaseResult, WaiterPeek

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack


def replica_waits_of(count: int, timeout_ms: int) -> ReplicaWaits | None:
    """The replica waits asked for, checked (:func:`check_replica_waits`): None for a count of 0."""
    check_replica_waits(count, timeout_ms)
    return ReplicaWaits(count, timeout_ms) if count else None


def _key_names(namespace: str, key: str) -> KeyNames:
    """Guard key ``key``'s names, for the reads beside the scripts (a script makes them of its prefix)."""
    check_key(key)
    prefix = layout.key_prefix(namespace, key)
    return KeyNames._make([prefix + suffix for suffix in KeyNames._fields])


def handoffs_of(key: str, flat: list[Any]) -> tuple[Handoff, ...]:
    """Decode ``waiter, payload-or-nil, generation-or-nil`` triples (no payload: a woken waiter)."""
    return tuple(
        Handoff(
            key,
            text(flat[i]),
            None if flat[i + 1] is None else data(flat[i + 1]),
            None if flat[i + 2] is None else int(flat[i + 2]),
        )
        for i in range(0, len(flat), 3)
    )


def release_of(key: str, reply: list[Any]) -> ReleaseResult:
    """Decode ``{released, handoffs[, standbys]}`` (release, cancel_wait, sweep, set_limit)."""
    released, handoffs, *standbys = reply
    sent = handoffs_of(key, standbys[0]) if standbys else ()
    return ReleaseResult(bool(released), handoffs_of(key, handoffs), sent)


def _key_state(reply: list[Any]) -> KeyState:
    """Decode inspect.lua's ``{holders, waiters, parked flags, reserved, limit, token, info}``."""
    holders, waiters, parked, reserved, limit, token, info = reply
    meta = {text(info[i]): text(info[i + 1]).partition("|") for i in range(0, len(info), 2)}
    return KeyState(
        holders=tuple((text(holders[i]), int(float(holders[i + 1]))) for i in range(0, len(holders), 2)),
        waiters=tuple(
            (text(waiters[i]), layout.since_ms(float(waiters[i + 1])), bool(parked[i // 2]))
            for i in range(0, len(waiters), 2)
        ),
        reserved=tuple(text(r) for r in reserved),
        limit=None if limit is None else int(limit),
        token=None if token is None else int(token),
        holder_info=tuple(
            (holder, int(meta[holder][0].partition("@")[0]), meta[holder][2] or None)
            for holder in (text(h) for h in holders[::2])
            if holder in meta
        ),
    )


class RedisStore(GuardBackend):
    """The Redis side of :class:`~dramatiq_guard.backends.RedisBackend` (its parameters are there)."""

    #: How many keys :meth:`summaries` reads per pipeline.
    SUMMARY_CHUNK = 1000

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str = "dramatiq-guard",
        index_grace_ms: int = 60_000,
        replica_waits: int = 0,
        replica_wait_timeout_ms: int = 1_000,
        **settings: Unpack[BackendSettings],
    ) -> None:
        super().__init__(**settings)
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"a guard namespace must be non-empty and contain no braces, got {namespace!r}")
        check_ms(index_grace_ms, "index_grace_ms", minimum=0)
        self.replicas = replica_waits_of(replica_waits, replica_wait_timeout_ms)
        self.client = client
        #: Each thread's client for the script calls (:class:`ThreadClients`).
        self.clients = ThreadClients(client)
        self._enqueues: dict[int, tuple[Any, bool]] = {}  # per broker: the one-step enqueue (redis.py)
        # The per-key scripts' settings argument, made again when a value it holds changed (_args).
        self._settings: tuple[tuple[int, int, str], str] = ((0, 0, ""), "")
        self.namespace = namespace
        self.index_grace_ms = index_grace_ms
        self._index = f"{namespace}:waiting"
        self._limits_index = f"{namespace}:limits"
        # Whether the scripts keep the indexes (standalone) is known on first use (_in_cluster).
        self._cluster: bool | None = True if isinstance(client, redis.cluster.RedisCluster) else None
        self._owns_client = False
        #: The scripts, as functions of one library where the server allows (see redis_scripts).
        self.scripts = ScriptLibrary()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """A backend whose :meth:`close` closes its own client, made from a ``redis://`` (``rediss://``,
        ``unix://``) URL with a ``socket_timeout`` and ``socket_connect_timeout`` of
        :data:`DEFAULT_SOCKET_TIMEOUT_S` unless it sets them; ``options``: :class:`RedisBackend`'s."""
        client = redis.Redis.from_url(
            url, socket_timeout=DEFAULT_SOCKET_TIMEOUT_S, socket_connect_timeout=DEFAULT_SOCKET_TIMEOUT_S
        )
        backend = cls(client, **options)
        backend._owns_client = True
        return backend

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        """The client's timeouts and retries in force (read once)."""
        return timeouts_of(self.client)

    # -- the process's hooks (see GuardBackend) ---------------------------------------------

    def slow_call_warning(self, shortest_lease_ms: int) -> str | None:
        return slow_call_warning(self.client, self.timeouts, shortest_lease_ms, self.replicas)

    def check_health(self, *, allow_evicting: bool | None = None) -> None:
        redis_health.check(self, allow_evicting=allow_evicting)

    def watch(self, interval_s: float) -> None:
        redis_health.watch(self, interval_s)

    def stop_watching(self) -> None:
        redis_health.leave(self)

    def wait_for_replicas(self, count: int, timeout_ms: int) -> None:
        replicas = replica_waits_of(count, timeout_ms)
        if replicas is not None:  # 0 keeps the waits set before
            self.replicas = replicas

    # -- keys and script calls --------------------------------------------------------------

    def _in_cluster(self) -> bool:
        """Whether the server is a Redis Cluster node (asked once: a plain client may talk to one)."""
        if self._cluster is None:
            with reachable():
                try:
                    info = self.client.info("cluster")
                except redis.exceptions.ResponseError:  # INFO disabled: a managed standalone server
                    info = {}
            self._cluster = bool(info.get("cluster_enabled"))
        return self._cluster

    def _names(self, key: str) -> KeyNames:
        return _key_names(self.namespace, key)

    def _prefix(self, key: str) -> str:
        """The prefix of ``key``'s names: the guard key's KEYS (``redis_layout.key_prefix``), checked."""
        if not key or key[0] == "}":
            check_key(key)  # raises
        return layout.key_prefix(self.namespace, key)

    def _keys(self, key: str) -> list[str]:
        """The KEYS of a per-key script: the key's prefix, then the waiting-keys index (standalone only)."""
        return [self._prefix(key)] if self._in_cluster() else [self._prefix(key), self._index]

    def _wake_prefix(self, key: str) -> str:
        return self._prefix(key) + "wake:"

    def _args(self, default_limit: int | None, *args: str | int | bytes) -> list[str | int | bytes]:
        """The ARGV of a per-key script: the values Python owns (``redis_layout.CallArgs``), then its own.

        The settings argument is made once, and again only after ``handoff_ttl_ms``, ``stale_ttl_ms``
        or ``route`` changed (compared on each call).
        """
        values = (self.handoff_ttl_ms, self.stale_ttl_ms, self.route)
        made, settings = self._settings
        if values != made:
            settings = layout.settings_arg(
                layout.Settings(self.handoff_ttl_ms, self.wake_ttl_ms, self.stale_ttl_ms, self.route)
            )
            self._settings = (values, settings)
        return [settings, "" if default_limit is None else default_limit, *args]

    def _script_call(self, key: str, default_limit: int | None, own: tuple[Any, ...]) -> ScriptCall:
        """The per-key script whose own arguments are ``own`` (a ``redis_layout`` tuple), KEYS, ARGV."""
        check_count(default_limit, "limit")
        return self.scripts[layout.SCRIPTS[type(own)]], self._keys(key), self._args(default_limit, *own)

    def _run(self, key: str, default_limit: int | None, own: tuple[Any, ...]) -> Any:
        """Run the per-key script whose own arguments are ``own``."""
        return self._call(*self._script_call(key, default_limit, own))

    def _call(self, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
        """Run one script; with replica waits, followed by a ``WAIT`` on its connection."""
        calls = [(script, keys, args)]
        [reply] = run_scripts(self.client, self.scripts, calls, replicas=self.replicas, own=self.clients)
        return reply

    # -- the reads ----------------------------------------------------------------------------

    def get_limit(self, key: str) -> int | None:
        with reachable():
            value = self.client.get(_key_names(self.namespace, key).limit)
        return None if value is None else int(value)

    def inspect(self, key: str, *, waiters: int | None = None) -> KeyState:
        check_count(waiters, "waiters")
        args = self._args(0, *layout.InspectArgs(waiters="" if waiters is None else waiters))
        return _key_state(self._call(self.scripts["inspect"], self._keys(key), args))

    def waiting_keys(self) -> list[str]:
        """Keys in the waiting-keys index; on a Redis Cluster, drained entries past their grace dropped."""
        with reachable():
            if not self._in_cluster():
                return [text(k) for k in cast("list[bytes | str]", self.client.zrange(self._index, 0, -1))]
            raw = cast(
                "list[tuple[bytes | str, float]]", self.client.zrange(self._index, 0, -1, withscores=True)
            )
            entries = [(text(k), score) for k, score in raw]
            cutoff = int(time.time() * 1000) - self.index_grace_ms
            stale = [k for k, score in entries if score <= cutoff]
            if not stale:
                return [k for k, _ in entries]
            pipe = self.client.pipeline(transaction=False)
            for names in map(self._names, stale):
                pipe.exists(names.waiters, names.reserved)
            empty = [k for k, found in zip(stale, pipe.execute(), strict=True) if not found]
        # The drop is conditional on the entry not refreshed meanwhile: a concurrent park keeps it.
        unindex, index = self.scripts["unindex"], [self._index]
        calls = [(unindex, index, list(layout.UnindexArgs(member=k, cutoff_ms=cutoff))) for k in empty]
        dropped = run_scripts(self.client, self.scripts, calls)
        gone = {k for k, result in zip(empty, dropped, strict=True) if result}
        return [k for k, _ in entries if k not in gone]

    def limit_keys(self) -> list[str]:
        with reachable():
            return sorted(text(k) for k in self.client.smembers(self._limits_index))

    def summaries(self, keys: Sequence[str], *, waiters: int = 0) -> list[KeySummary]:
        check_count(waiters, "waiters")
        for key in keys:
            check_key(key)
        summaries: list[KeySummary] = []
        for start in range(0, len(keys), self.SUMMARY_CHUNK):
            summaries.extend(self._summary_chunk(keys[start : start + self.SUMMARY_CHUNK], waiters))
        return summaries

    def _summary_chunk(self, chunk: Sequence[str], waiters: int) -> list[KeySummary]:
        """``lua/summaries.lua`` on the whole chunk (on a Redis Cluster: once per key, pipelined),
        then the first waiters' payloads and infos."""
        prefixes = [layout.key_prefix(self.namespace, key) for key in chunk]
        groups = [[p] for p in prefixes] if self._in_cluster() else [prefixes]
        own = list(layout.SummariesArgs(first=max(waiters, 1)))
        calls = [(self.scripts["summaries"], g, own) for g in groups]
        rows = [row for reply in run_scripts(self.client, self.scripts, calls) for row in reply]
        firsts = [row[2][: 2 * waiters] for row in rows]  # waiter, place pairs
        with reachable():
            pipe = self.client.pipeline(transaction=False)
            for p, first in zip(prefixes, firsts, strict=True):
                for field in ("payloads", "info") if first else ():
                    pipe.hmget(p + field, first[::2])
            details: Iterator[Any] = iter(pipe.execute() if any(firsts) else ())
        summaries = []
        for key, (holders, count, oldest, reserved, limit, recorded, due, superseded), first in zip(
            chunk, rows, firsts, strict=True
        ):
            payloads, infos = (next(details), next(details)) if first else ((), ())
            peeks = tuple(
                WaiterPeek(
                    text(w),
                    layout.since_ms(float(place)),
                    None if pay is None else data(pay),
                    None if info is None else (text(info).partition("|")[2] or None),
                )
                for w, place, pay, info in zip(first[::2], first[1::2], payloads, infos, strict=True)
            )
            summaries.append(
                KeySummary(
                    key,
                    holders=int(holders),
                    waiters=int(count),
                    reserved=int(reserved),
                    oldest_since_ms=layout.since_ms(float(oldest[1])) if oldest else None,
                    limit=None if limit is None else int(limit),
                    recorded_limit=None if recorded is None else int(recorded),
                    first=peeks,
                    due_ms=None if due is None else int(float(due)),
                    superseded=None if superseded is None else int(superseded),
                )
            )
        return summaries

    def now_ms(self) -> int:
        """Now on Redis's clock (``TIME``), the one the scripts decide by; on a Cluster, the wall clock."""
        if not isinstance(self.client, redis.Redis):
            return super().now_ms()
        with reachable():
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def close(self) -> None:
        """Close the client if this backend made it (:meth:`from_url`)."""
        if self._owns_client:
            self.client.close()
