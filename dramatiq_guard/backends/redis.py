"""The Redis guard backend: each operation is one Lua script on one Cluster slot.

It implements the contract of :mod:`dramatiq_guard.backends.base` (the model
and its words are there). How the state lives in Redis (the key layout, one
hash tag per guard key, the two indexes on a standalone Redis and on a Redis
Cluster, what expires when) is in ``docs/redis.md``. The scripts are in
``backends/lua/``: ``_prelude.lua`` (shared by every per-key script but
``lock.lua`` and ``renew.lua``, the lean common paths) holds reclaim,
hand-off and the cost model; the client side (what redis-py may
raise, how long one call can block, pipelining) is in
:mod:`dramatiq_guard.backends.redis_client`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import redis
import redis.cluster

from dramatiq_guard.backends import redis_health, redis_watch
from dramatiq_guard.backends import redis_layout as layout
from dramatiq_guard.backends.base import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HOLDERS_SHOWN,
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    KeySummary,
    ReleaseResult,
    Waiter,
    WaiterPeek,
    Woken,
    check_acquire,
    check_count,
    check_key,
    check_ms,
)
from dramatiq_guard.backends.checks import check_replica_waits
from dramatiq_guard.backends.redis_client import (
    DEFAULT_SOCKET_TIMEOUT_S,
    RedisClient,
    ReplicaWaits,
    ScriptCall,
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
from dramatiq_guard.backends.values import AcquireOutcome, Stake

__all__ = ["DEFAULT_SOCKET_TIMEOUT_S", "RedisBackend", "RedisClient", "replica_waits_of"]


#: The most leases one ``renew.lua`` call renews (:meth:`RedisBackend.renew_many`): a batch of
#: renewals shares one script call's overhead, and no call keeps Redis busy for long.
RENEWALS_PER_CALL = 200


def replica_waits_of(count: int, timeout_ms: int) -> ReplicaWaits | None:
    """The replica waits asked for, checked: None for a count of 0.

    Raises:
      ValueError: If ``count`` or ``timeout_ms`` is out of range (:func:`check_replica_waits`).
    """
    check_replica_waits(count, timeout_ms)
    return ReplicaWaits(count, timeout_ms) if count else None


def _key_names(namespace: str, key: str) -> KeyNames:
    """The Redis keys of guard key ``key``.

    Raises:
      ValueError: If ``key`` is not allowed.
    """
    check_key(key)
    prefix = f"{namespace}:{{{key}}}:"
    return KeyNames._make([prefix + suffix for suffix in KeyNames._fields])


#: The same, cached for the keys messages use (a message's acquire and release both need them); reads
#: (inspect, get_limit: the command, the dashboard) do not cache, so made-up keys cost nothing kept.
_used_key_names = functools.lru_cache(maxsize=4096)(_key_names)


class RedisBackend(GuardBackend):
    """The guard backend on Redis (or Redis Cluster).

    Each mutating operation is one Lua script: a function of the guard's
    library (FCALL) where the server allows, else EVALSHA (see
    :mod:`~dramatiq_guard.backends.redis_scripts`).
    Works with clients made with or without ``decode_responses``; with
    ``decode_responses=True`` parked payloads must be UTF-8 (Dramatiq's
    default JSON encoding is). Every operation raises
    :class:`~dramatiq_guard.errors.BackendUnavailable` if Redis cannot be
    reached (or refuses writes when full).

    Parameters:
      client(Redis|RedisCluster): The redis-py client. It is not closed by
        :meth:`close` (it may be shared, e.g. with a RedisBroker).
      namespace(str): The prefix of every key; must not contain braces.
      handoff_ttl_ms(int): How long a slot handed to a waiter stays reserved.
      index_grace_ms(int): On a Redis Cluster only (see the module
        docstring): how long an entry of the waiting-keys index is kept after
        its key has no waiter left. It must exceed the clock skew between
        clients plus the longest a park can be in flight.
      max_payload_bytes(int): The largest parked message stored (see
        :class:`~dramatiq_guard.backends.GuardBackend`).
      stale_ttl_ms(int): How long a waiter's live generation (after its
        hand-off lapsed, or a copy of it picked up parked), and a key's last
        fencing token, are remembered (see
        :class:`~dramatiq_guard.backends.GuardBackend`).
      replica_waits(int): How many replicas must acknowledge every decision
        (acquire, park, renew, release, hand-off, limit) before it stands:
        each script is followed, on the same connection (on a Redis Cluster,
        to the node owning the key's slot), by Redis ``WAIT``. 0 (the
        default): none, replication is asynchronous and a failover may lose
        the decisions of its last moments (see ``docs/redis.md``,
        "Failover").
      replica_wait_timeout_ms(int): How long the primary waits for them. If
        fewer acknowledge in time, the operation fails closed: it raises
        :class:`~dramatiq_guard.errors.ReplicasBehind` (a
        :class:`~dramatiq_guard.errors.BackendUnavailable`), though it was
        done on the primary (see that exception). It must stay below the
        client's ``socket_timeout``.

    Raises:
      ValueError: If ``namespace`` is empty or contains a brace, or a
        duration is out of range (:func:`~dramatiq_guard.backends.base.check_ms`).
    """

    #: How many keys :meth:`sweep_many` sends in one pipelined round trip.
    SWEEP_BATCH = 100

    def __init__(  # noqa: PLR0913
        self,
        client: RedisClient,
        *,
        namespace: str = "dramatiq-guard",
        handoff_ttl_ms: int = 10_000,
        index_grace_ms: int = 60_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        stale_ttl_ms: int = 86_400_000,
        replica_waits: int = 0,
        replica_wait_timeout_ms: int = 1_000,
    ) -> None:
        super().__init__(
            handoff_ttl_ms=handoff_ttl_ms, max_payload_bytes=max_payload_bytes, stale_ttl_ms=stale_ttl_ms
        )
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"a guard namespace must be non-empty and contain no braces, got {namespace!r}")
        check_ms(index_grace_ms, "index_grace_ms", minimum=0)
        self.replicas = replica_waits_of(replica_waits, replica_wait_timeout_ms)
        self.client = client
        self.namespace = namespace
        self.index_grace_ms = index_grace_ms
        self._index = f"{namespace}:waiting"
        self._limits_index = f"{namespace}:limits"
        # On a standalone Redis the scripts keep the indexes themselves (see the
        # module docstring); known on first use (_in_cluster).
        self._cluster: bool | None = True if isinstance(client, redis.cluster.RedisCluster) else None
        self._owns_client = False
        #: The scripts, as functions of one library where the server allows (see redis_scripts).
        self.scripts = ScriptLibrary()
        self._client_timeouts: Timeouts | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Make a backend with its own client, from a ``redis://`` (or ``rediss://``, ``unix://``) URL.

        The client's ``socket_timeout`` and ``socket_connect_timeout`` are
        :data:`DEFAULT_SOCKET_TIMEOUT_S` (5 s) unless the URL sets them
        (``?socket_timeout=2&socket_connect_timeout=2``), so no call waits
        for a silent Redis longer than that (redis-py's ``from_url`` retries
        no timed-out call).

        Parameters:
          url(str): The Redis URL.
          **options: The keyword arguments of :class:`RedisBackend`.

        Returns:
          RedisBackend: A backend whose :meth:`close` closes its client.
        """
        client = redis.Redis.from_url(
            url, socket_timeout=DEFAULT_SOCKET_TIMEOUT_S, socket_connect_timeout=DEFAULT_SOCKET_TIMEOUT_S
        )
        backend = cls(client, **options)
        backend._owns_client = True
        return backend

    def timeouts(self) -> Timeouts:
        """The client's timeouts and retries in force (read once)."""
        if self._client_timeouts is None:
            self._client_timeouts = timeouts_of(self.client)
        return self._client_timeouts

    def slow_call_warning(self, shortest_lease_ms: int) -> str | None:
        """Why one call could block longer than ``shortest_lease_ms`` on a silent Redis, or None.

        See :func:`dramatiq_guard.backends.redis_client.slow_call_warning`. With
        replica waits, also says so when the client's ``socket_timeout`` does not
        leave room for ``replica_wait_timeout_ms``: a decision whose replicas are
        slow would then fail as a timeout of the connection, not as
        :class:`~dramatiq_guard.errors.ReplicasBehind` (closed either way).
        """
        warnings = [slow_call_warning(self.client, self.timeouts(), shortest_lease_ms)]
        socket_timeout = self.timeouts().socket_timeout
        waits = self.replicas
        if waits is not None and socket_timeout is not None and socket_timeout * 1000 <= waits.timeout_ms:
            warnings.append(
                f"dramatiq-guard: replica_wait_timeout_ms={waits.timeout_ms} is not below the guard "
                f"client's socket_timeout ({socket_timeout:g} s): a decision whose replicas are slow "
                f"fails as a connection timeout. Set replica_wait_timeout_ms below it."
            )
        found = [warning for warning in warnings if warning is not None]
        return " ".join(found) if found else None

    def check_health(self, *, allow_evicting: bool | None = None) -> None:
        """Refuse an evicting Redis, warn of one that does not persist (``redis_health.check``)."""
        redis_health.check(self, allow_evicting=allow_evicting)

    def watch(self, interval_s: float) -> None:
        """Find state Redis lost, keep this process's record of its library (``redis_watch.watch``)."""
        redis_watch.watch(self, interval_s)

    def stop_watching(self) -> None:
        """Withdraw this process's record of its function library (``redis_watch.leave``)."""
        redis_watch.leave(self)

    def wait_for_replicas(self, count: int, timeout_ms: int) -> None:
        """Follow every script with ``WAIT count timeout_ms`` (0: keep the waits set before)."""
        replicas = replica_waits_of(count, timeout_ms)
        if replicas is not None:
            self.replicas = replicas

    # -- keys ---------------------------------------------------------------

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
        return _used_key_names(self.namespace, key)

    def _keys(self, key: str, *, cached: bool = True) -> list[str]:
        """The KEYS of a per-key script: the key's names, then the waiting-keys index (standalone only)."""
        names = (_used_key_names if cached else _key_names)(self.namespace, key)
        return list(names) if self._in_cluster() else [*names, self._index]

    def _wake_prefix(self, key: str) -> str:
        return f"{self.namespace}:{{{key}}}:wake:"

    @staticmethod
    def _check_waiter(waiter_id: str) -> None:
        if "}" in waiter_id:
            raise ValueError(f"a waiter id must not contain '}}', got {waiter_id!r}")

    def _args(self, key: str, default_limit: int | None, *args: str | int | bytes) -> list[str | int | bytes]:
        """The ARGV of a per-key script: the values Python owns (``redis_layout.CallArgs``), then its own."""
        limit: str | int = "" if default_limit is None else default_limit
        return [
            *layout.CallArgs(
                wake=self._wake_prefix(key),
                handoff_ttl_ms=self.handoff_ttl_ms,
                wake_ttl_ms=self.wake_ttl_ms,
                key=key,
                default_limit=limit,
                route=self.route,
                stale_ttl_ms=self.stale_ttl_ms,
            ),
            *args,
        ]

    def _run(
        self, key: str, default_limit: int | None, own: tuple[Any, ...], extra_key: str | None = None
    ) -> Any:
        """Run the per-key script whose own arguments are ``own`` (a ``redis_layout`` tuple)."""
        script, keys, args = self._script_call(key, default_limit, own)
        if extra_key is not None and not self._in_cluster():
            keys.append(extra_key)
        return self._call(script, keys, args)

    def _script_call(self, key: str, default_limit: int | None, own: tuple[Any, ...]) -> ScriptCall:
        """The per-key script whose own arguments are ``own``, its KEYS and its ARGV (run or pipelined)."""
        return self.scripts[layout.SCRIPTS[type(own)]], self._keys(key), self._args(key, default_limit, *own)

    def _call(self, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
        """Run one script; with replica waits, followed by a ``WAIT`` on its connection."""
        [reply] = run_scripts(self.client, self.scripts, [(script, keys, args)], replicas=self.replicas)
        return reply

    def _handoffs(self, key: str, flat: list[Any]) -> tuple[Handoff, ...]:
        """Decode ``waiter, payload-or-nil, generation-or-nil`` triples (no payload: a woken waiter)."""
        if not flat:
            return ()
        return tuple(
            Handoff(
                key,
                text(flat[i]),
                None if flat[i + 1] is None else data(flat[i + 1]),
                None if flat[i + 2] is None else int(flat[i + 2]),
            )
            for i in range(0, len(flat), 3)
        )

    def _acquire_reply(self, key: str, reply: list[Any], sent: float) -> AcquireResult:
        """Decode acquire.lua's ``{acquired, token, limit, queued, holders, handoffs[, lapses_in_ms]}``."""
        acquired, token, in_force, queued, holders, handoffs, *lapses_in = reply
        outcome = AcquireOutcome.ACQUIRED if acquired else AcquireOutcome.refusal(text(queued))
        return AcquireResult(
            outcome,
            token=None if token is None else int(token),
            holders=tuple(text(h) for h in holders),
            limit=int(in_force),
            handoffs=self._handoffs(key, handoffs),
            valid_from=sent,
            lapses_in_ms=int(lapses_in[0]) if lapses_in else None,
        )

    def _release_reply(self, key: str, reply: list[Any]) -> ReleaseResult:
        """Decode ``{released, handoffs[, standbys]}`` (release, cancel_wait, sweep, set_limit)."""
        released, handoffs, *standbys = reply
        sent = self._handoffs(key, standbys[0]) if standbys else ()
        return ReleaseResult(bool(released), self._handoffs(key, handoffs), sent)

    def _inspect_reply(self, reply: list[Any]) -> KeyState:
        """Decode inspect.lua's ``{holders, waiters, parked flags, reserved, limit, token, info}``."""
        holders, waiters, parked, reserved, limit, token, info = reply
        meta = {text(info[i]): text(info[i + 1]).partition("|") for i in range(0, len(info), 2)}
        return KeyState(
            holders=tuple((text(holders[i]), int(float(holders[i + 1]))) for i in range(0, len(holders), 2)),
            waiters=tuple(
                (text(waiters[i]), int(float(waiters[i + 1])) // 1000, bool(parked[i // 2]))
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

    # -- operations ---------------------------------------------------------

    def acquire(self, stake: Stake, wait: Waiter | None = None) -> AcquireResult:
        check_acquire(stake, wait)
        key = stake.key
        self.check_payload(key, stake.holder, wait)
        if wait is not None:
            self._check_waiter(stake.holder)
        own = layout.AcquireArgs(
            holder=stake.holder,
            ttl_ms=stake.ttl_ms,
            mode="" if wait is None else "park" if wait.payload is not None else "block",
            payload=b"" if wait is None or wait.payload is None else wait.payload,
            wait_ms=0 if wait is None else wait.wait_ms,
            info=stake.info or "",
            generation="" if stake.generation is None else stake.generation,
            fenced="1" if stake.fenced else "0",
            runner=stake.runner or "",
        )
        sent = time.monotonic()  # the result's valid_from: Redis counts the ttl from later
        if wait is not None and self._in_cluster():
            [reply] = run_scripts(
                self.client,
                self.scripts,
                [self._script_call(key, stake.limit, own)],
                zadd_first=(self._index, key),
                replicas=self.replicas,
            )
        else:
            reply = self._run(key, stake.limit, own)
        return self._acquire_reply(key, reply, sent)

    def try_lock(self, key: str, holder: str, *, ttl_ms: int, info: str | None = None) -> AcquireResult:
        """Take ``key`` as a limit-1 lock if it is free; see :meth:`GuardBackend.try_lock`.

        One small script (``lua/lock.lua``, without the prelude) decides a
        free key (6 Redis commands in the script) and a key held by another
        (4); anything else (a waiter or reservation, a run-time limit, a
        lapsed holder, the holder itself) goes on to :meth:`acquire`, a
        second round trip, which issues no token either: a dedup lock's key
        keeps no fencing token once it drains (see ``docs/redis.md``).

        Raises:
          BackendUnavailable: If Redis cannot be reached.
          ValueError: If ``key`` or ``ttl_ms`` is not allowed.
        """
        check_ms(ttl_ms, "ttl_ms")
        names = self._names(key)
        sent = time.monotonic()
        own = layout.LockArgs(holder=holder, ttl_ms=ttl_ms, info=info or "")
        status, holders = self._call(self.scripts["lock"], list(layout.lock_keys(names)), list(own))
        if int(status) < 0:
            return self.acquire(Stake(key, holder, 1, ttl_ms, info=info, fenced=False))
        acquired = int(status) == 1
        return AcquireResult(
            AcquireOutcome.ACQUIRED if acquired else AcquireOutcome.BUSY,
            token=None,
            holders=() if acquired else tuple(text(h) for h in holders[:HOLDERS_SHOWN]),
            limit=1,
            valid_from=sent,
        )

    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        """Extend ``holder``'s lease; see :meth:`GuardBackend.renew`.

        A small script of its own (``lua/renew.lua``, without the prelude):
        it touches only the holder's entry and the expiry of its key.
        """
        check_ms(ttl_ms, "ttl_ms", minimum=0)
        own = layout.LeaseArgs(holder=holder, ttl_ms=ttl_ms)
        [renewed] = self._call(self.scripts["renew"], self._renew_keys(key), list(own))
        return bool(renewed)

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew several leases in one round trip; see :meth:`GuardBackend.renew_many`.

        ``lua/renew.lua`` renews up to :data:`RENEWALS_PER_CALL` leases per
        call (the calls pipelined): one script's overhead for a batch, not one
        per lease. On a standalone Redis any leases share a call; on a Redis
        Cluster, where a script's keys share one slot, the leases of one guard
        key do (the holders of a wide concurrency limit).
        """
        if not leases:
            return []
        for _, _, ttl_ms in leases:
            check_ms(ttl_ms, "ttl_ms", minimum=0)
        if self._in_cluster():
            by_key: dict[str, list[int]] = {}
            for i, (key, _, _) in enumerate(leases):
                by_key.setdefault(key, []).append(i)
            groups = list(by_key.values())
        else:
            groups = [list(range(len(leases)))]
        chunks = [g[s : s + RENEWALS_PER_CALL] for g in groups for s in range(0, len(g), RENEWALS_PER_CALL)]
        calls: list[ScriptCall] = []
        for chunk in chunks:
            keys: list[str] = []
            args: list[str | int] = []
            for i in chunk:
                key, holder, ttl_ms = leases[i]
                keys += self._renew_keys(key)
                args += layout.LeaseArgs(holder=holder, ttl_ms=ttl_ms)
            calls.append((self.scripts["renew"], keys, args))
        renewed = [False] * len(leases)
        for chunk, reply in zip(
            chunks, run_scripts(self.client, self.scripts, calls, replicas=self.replicas), strict=True
        ):
            for i, answer in zip(chunk, reply, strict=True):
                renewed[i] = bool(answer)
        return renewed

    def _renew_keys(self, key: str) -> list[str]:
        return list(layout.lease_keys(self._names(key)))

    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        """Give up ``holder``'s slot; see :meth:`GuardBackend.release`."""
        return self._release_reply(key, self._call(*self._release_call(key, holder, limit, send_ahead)))

    def release_many(self, releases: Sequence[tuple[str, str, int | None, int]]) -> list[ReleaseResult]:
        """Release several holders in one pipelined round trip; see :meth:`GuardBackend.release_many`."""
        if not releases:
            return []
        calls = [self._release_call(*release) for release in releases]
        replies = run_scripts(self.client, self.scripts, calls, replicas=self.replicas)
        return [self._release_reply(key, reply) for (key, *_), reply in zip(releases, replies, strict=True)]

    def _release_call(self, key: str, holder: str, limit: int | None, send_ahead: int) -> ScriptCall:
        """The checked ``release.lua`` call of one release (run alone, or pipelined with others)."""
        check_count(limit, "limit")
        check_count(send_ahead, "send_ahead")
        own = layout.ReleaseArgs(holder=holder, standbys=send_ahead)
        return self._script_call(key, limit, own)

    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a handed-off parked message was re-enqueued; see :meth:`GuardBackend.confirm_handoff`."""
        check_ms(ttl_ms, "ttl_ms")
        gen = "" if generation is None else generation
        own = layout.ConfirmHandoffArgs(waiter=waiter_id, ttl_ms=ttl_ms, generation=gen)
        return bool(self._run(key, 0, own))

    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        """Send the oldest parked waiters ahead as standbys; see :meth:`GuardBackend.send_standbys`."""
        check_count(limit, "limit")
        check_count(count, "count")
        handoffs, sent = self._run(key, limit, layout.StandbyArgs(op="send", standbys=count))
        return self._handoffs(key, handoffs), self._handoffs(key, sent)

    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a standby was enqueued; see :meth:`GuardBackend.confirm_standby`."""
        check_ms(ttl_ms, "ttl_ms")
        gen = "" if generation is None else generation
        own = layout.StandbyArgs(
            op="confirm", waiter=waiter_id, ttl_ms=ttl_ms, payload=payload, generation=gen
        )
        return bool(self._run(key, 0, own))

    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """Block on the waiter's wake list (BLPOP); see :meth:`GuardBackend.wait_for_handoff`.

        A BLPOP that outlasts the client's ``socket_timeout`` would fail as a
        timeout of the connection, so the wait is made of BLPOPs that each end
        safely before it (see :meth:`_blocking_chunk_s`); a push that lands
        between two of them stays in the list for the next.
        """
        self._check_waiter(waiter_id)
        check_key(key)
        check_ms(timeout_ms, "timeout_ms", minimum=0)
        wake = self._wake_prefix(key) + waiter_id
        chunk_s = self._blocking_chunk_s()
        give_up = time.monotonic() + timeout_ms / 1000
        with reachable():
            while True:
                remaining = give_up - time.monotonic()
                if remaining < 0.001:  # BLPOP's resolution; 0 would block forever
                    token = cast("bytes | str | None", self.client.lpop(wake))
                    return None if token is None else self.woken(int(token))
                timeout = remaining if chunk_s is None else min(remaining, chunk_s)
                popped = cast("tuple[Any, bytes | str] | None", self.client.blpop([wake], timeout=timeout))
                if popped is not None:
                    return self.woken(int(popped[1]))

    def _blocking_chunk_s(self) -> float | None:
        """The longest BLPOP the client's ``socket_timeout`` allows, or None (no timeout).

        A second less than the socket timeout, or half of it if that is 2 s
        or less: room for the round trip on top of the server-side wait. The
        timeout in force counts, redis-py's default included (a client made
        from a URL does not list it in its connection kwargs).
        """
        socket_timeout = self.timeouts().socket_timeout
        if socket_timeout is None:
            return None
        return max(socket_timeout - 1.0, socket_timeout / 2)

    def forget_parked_copy(self, key: str, waiter_id: str) -> bool:
        """The broker acked the parked copy of ``waiter_id``; see :meth:`GuardBackend.forget_parked_copy`."""
        self._check_waiter(waiter_id)
        return bool(self._run(key, None, layout.ForgetCopyArgs(waiter=waiter_id)))

    def cancel_wait(
        self, key: str, waiter_id: str, *, limit: int | None, generation: int | None = None
    ) -> ReleaseResult:
        """Leave the waiters of ``key``; see :meth:`GuardBackend.cancel_wait`."""
        self._check_waiter(waiter_id)
        check_count(limit, "limit")
        gen = "" if generation is None else generation
        own = layout.CancelWaitArgs(waiter=waiter_id, generation=gen)
        return self._release_reply(key, self._run(key, limit, own))

    def sweep(self, key: str, *, limit: int | None) -> ReleaseResult:
        """Reclaim lapsed holders and hand free slots on; see :meth:`GuardBackend.sweep`.

        Returns:
          ReleaseResult: ``released`` tells whether any lapsed holder was reclaimed.
          Holders that lapsed after the key's last deadline expired with it and are
          not counted (an unconfirmed reservation among them is: it goes back to the
          queue).
        """
        check_count(limit, "limit")
        return self._release_reply(key, self._run(key, limit, layout.SweepArgs()))

    def sweep_many(self, keys: Sequence[tuple[str, int | None]]) -> list[ReleaseResult]:
        """:meth:`sweep` each ``(key, limit)`` in pipelined batches of :attr:`SWEEP_BATCH`."""
        results: list[ReleaseResult] = []
        for first in range(0, len(keys), self.SWEEP_BATCH):
            batch = keys[first : first + self.SWEEP_BATCH]
            for _, limit in batch:
                check_count(limit, "limit")
            calls = [self._script_call(key, limit, layout.SweepArgs()) for key, limit in batch]
            replies = run_scripts(self.client, self.scripts, calls)
            results.extend(self._release_reply(key, r) for (key, _), r in zip(batch, replies, strict=True))
        return results

    def due_keys(self) -> list[str]:
        """The waiting keys due for a sweep now; see :meth:`GuardBackend.due_keys`.

        On a standalone Redis: the index entries scored up to now (the scripts
        keep each at the key's earliest deadline, ``_prelude.lua`` ``next_due``).
        On a Redis Cluster the index is not kept by the scripts: every waiting key.
        """
        if self._in_cluster():
            return self.waiting_keys()
        [due] = run_scripts(self.client, self.scripts, [(self.scripts["due"], [self._index], [])])
        return [text(k) for k in due]

    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        """Set or clear the run-time limit; see :meth:`GuardBackend.set_limit`.

        Returns:
          ReleaseResult: ``released`` is always False (nobody is evicted).

        Raises:
          ValueError: If ``limit`` or ``default`` is out of range (:func:`check_count`).
        """
        if limit is not None:
            check_count(limit, "limit")
        check_count(default, "default")
        value = "" if limit is None else limit
        if not self._in_cluster():
            return self._release_reply(
                key,
                self._run(key, default, layout.SetLimitArgs(limit=value), extra_key=self._limits_index),
            )
        # A cluster: the index is in another slot. The key is added before its
        # limit is set and removed after it is cleared, so a limit is never
        # left unindexed by a failure in between.
        check_key(key)
        if limit is not None:
            with reachable():
                self.client.sadd(self._limits_index, key)
        result = self._release_reply(key, self._run(key, default, layout.SetLimitArgs(limit=value)))
        if limit is None:
            with reachable():
                self.client.srem(self._limits_index, key)
        return result

    def get_limit(self, key: str) -> int | None:
        """The run-time limit of ``key``, or None."""
        with reachable():
            value = self.client.get(_key_names(self.namespace, key).limit)
        return None if value is None else int(value)

    def inspect(self, key: str, *, waiters: int | None = None) -> KeyState:
        """A snapshot of ``key``, read atomically by one script (it reclaims nothing).

        ``waiters``: at most this many of the first waiters (None: all); see
        :meth:`GuardBackend.inspect`.
        """
        if waiters is not None:
            check_count(waiters, "waiters")
        args = self._args(key, 0, *layout.InspectArgs(waiters="" if waiters is None else waiters))
        return self._inspect_reply(self._call(self.scripts["inspect"], self._keys(key, cached=False), args))

    def waiting_keys(self) -> list[str]:
        """Keys in the waiting-keys index (see the module docstring).

        On a standalone Redis the index is exact: the keys that have a waiter
        or an unconfirmed reservation. On a Redis Cluster an entry is dropped
        here when its key has no waiter and no unconfirmed reservation and it
        was last refreshed more than ``index_grace_ms`` ago; the drop is
        conditional on the entry not being refreshed meanwhile, so a
        concurrent park never loses its entry.
        """
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
            for k in stale:
                names = self._names(k)
                pipe.zcard(names.waiters)
                pipe.hlen(names.reserved)
            counts = pipe.execute()
            empty = [k for i, k in enumerate(stale) if counts[2 * i] == 0 and counts[2 * i + 1] == 0]
        dropped = run_scripts(
            self.client,
            self.scripts,
            [
                (self.scripts["unindex"], [self._index], list(layout.UnindexArgs(member=k, cutoff_ms=cutoff)))
                for k in empty
            ],
        )
        gone = {k for k, result in zip(empty, dropped, strict=True) if result}
        return [k for k, _ in entries if k not in gone]

    def limit_keys(self) -> list[str]:
        """Keys that have a run-time limit, from the limits index kept by :meth:`set_limit`."""
        with reachable():
            return sorted(text(k) for k in self.client.smembers(self._limits_index))

    #: How many keys :meth:`summaries` reads per pipeline.
    SUMMARY_CHUNK = 1000

    def summaries(self, keys: Sequence[str], *, waiters: int = 0) -> list[KeySummary]:
        """A few numbers about each key; see :meth:`GuardBackend.summaries`.

        Per key a ZCARD of its holders and waiters, a ZRANGE of its first
        waiters, an HLEN of its reservations, a GET of its run-time limit
        and an HGET of its recorded one, a thousand keys at a time: on a
        standalone Redis in one read-only script call (``lua/summaries.lua``,
        so a thousand keys cost one command), on a Redis Cluster pipelined
        (redis-py routes each command to its slot). With ``waiters`` > 0, a
        pipeline then reads the first waiters' payloads and infos (HMGET).
        """
        check_count(waiters, "waiters")
        for key in keys:
            check_key(key)
        pairs = [(key, f"{self.namespace}:{{{key}}}:") for key in keys]
        summaries: list[KeySummary] = []
        for start in range(0, len(pairs), self.SUMMARY_CHUNK):
            summaries.extend(self._summary_chunk(pairs[start : start + self.SUMMARY_CHUNK], waiters))
        return summaries

    def _summary_counts(self, chunk: list[tuple[str, str]], first: int) -> list[Any]:
        """Six replies per key: ZCARD H, ZCARD W, its first waiters WITHSCORES, HLEN R, GET L, HGET M limit.

        On a standalone Redis one script call (``lua/summaries.lua``) reads a
        whole chunk; on a cluster, whose keys are in many slots, a pipeline.
        """
        if not self._in_cluster():
            keys = [p + suffix for _, p in chunk for suffix in layout.LAYOUTS["summaries"].each_keys]
            own = layout.SummariesArgs(first=first)
            [reply] = run_scripts(self.client, self.scripts, [(self.scripts["summaries"], keys, list(own))])
            if isinstance(reply, Exception):
                raise reply
            flat: list[Any] = []
            for holders, count, oldest, reserved, limit, recorded in reply:
                pairs = [(oldest[j], oldest[j + 1]) for j in range(0, len(oldest), 2)]
                flat += [holders, count, pairs, reserved, limit, recorded]
            return flat
        pipe = self.client.pipeline(transaction=False)
        for _, p in chunk:  # p: the prefix of the key's names (see _names)
            pipe.zcard(p + "holders")
            pipe.zcard(p + "waiters")
            pipe.zrange(p + "waiters", 0, first - 1, withscores=True)
            pipe.hlen(p + "reserved")
            pipe.get(p + "limit")
            pipe.hget(p + "meta", "limit")
        return list(pipe.execute())

    def _summary_chunk(self, chunk: list[tuple[str, str]], waiters: int) -> list[KeySummary]:
        with reachable():
            replies = self._summary_counts(chunk, max(waiters, 1))
            firsts = [
                [(text(w), int(float(score)) // 1000) for w, score in replies[6 * i + 2]][:waiters]
                for i in range(len(chunk))
            ]
            details: Iterator[Any] = iter(())
            if any(firsts):
                pipe = self.client.pipeline(transaction=False)
                for (_, p), first in zip(chunk, firsts, strict=True):
                    if first:
                        pipe.hmget(p + "payloads", [w for w, _ in first])
                        pipe.hmget(p + "info", [w for w, _ in first])
                details = iter(pipe.execute())
        summaries = []
        for i, (key, _) in enumerate(chunk):
            holders, count, oldest, reserved, limit, recorded = replies[6 * i : 6 * i + 6]
            peeks: tuple[WaiterPeek, ...] = ()
            if firsts[i]:
                payloads, infos = next(details), next(details)
                peeks = tuple(
                    WaiterPeek(
                        w,
                        since,
                        None if payload is None else data(payload),
                        None if info is None else (text(info).partition("|")[2] or None),
                    )
                    for (w, since), payload, info in zip(firsts[i], payloads, infos, strict=True)
                )
            summaries.append(
                KeySummary(
                    key,
                    holders=int(holders),
                    waiters=int(count),
                    reserved=int(reserved),
                    oldest_since_ms=int(float(oldest[0][1])) // 1000 if oldest else None,
                    limit=None if limit is None else int(limit),
                    recorded_limit=None if recorded is None else int(recorded),
                    first=peeks,
                )
            )
        return summaries

    def close(self) -> None:
        """Close the client if this backend made it (:meth:`from_url`)."""
        if self._owns_client:
            self.client.close()

    def now_ms(self) -> int:
        """Now on Redis's clock (``TIME``), the one the scripts decide by; on a Cluster, the wall clock."""
        if not isinstance(self.client, redis.Redis):
            return super().now_ms()
        with reachable():
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000
