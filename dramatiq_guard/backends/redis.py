"""The Redis guard backend: each operation is one Lua script on one Cluster slot.

It implements the contract of :mod:`dramatiq_guard.backends.base` (the model
and its words are there); this docstring says how the state lives in Redis.
The scripts are in ``backends/lua/``: ``_prelude.lua`` (shared by every
per-key script) holds reclaim, hand-off and the cost model.

Key layout, for namespace ``ns`` and guard key ``K`` (one hash tag per guard
key, so every script of ``K`` touches a single Redis Cluster slot)::

  ns:{K}:holders    zset  holder -> lease deadline (ms)           expires with its last holder
  ns:{K}:token      str   the last fencing token                  expires with its last holder
  ns:{K}:waiters    zset  waiter -> place in the FIFO (us)        never expires
  ns:{K}:payloads   hash  waiter -> parked message                never expires
  ns:{K}:reserved   hash  waiter -> its place, while its hand-off is unconfirmed
  ns:{K}:deadlines  zset  ready waiter (a thread blocks on it) -> when it is dropped (ms)
  ns:{K}:standbys   zset  waiter sent ahead to the broker, not picked up -> when it lapses (ms)
  ns:{K}:limit      str   the run-time limit (only this survives an idle key)
  ns:{K}:info       hash  holder -> "<since_ms>|<info>"            expires with its last holder
  ns:{K}:wake:<id>  list  a woken waiter's fencing token           expires after wake_ttl_ms
  ns:waiting        zset  guard key -> when a waiter parked (ms): the waiting-keys index
  ns:limits         set   guard keys with a run-time limit: the limits index

Redis Cluster hashes only the text between the first ``{`` and the next
``}``; since the tag starts with the guard key itself, a key that contains
braces still maps all its suffixes to one slot. An empty key, or one that
starts with ``}``, would leave the tag empty (and the keys spread over
slots), so it is rejected with a :class:`ValueError`. A namespace must not
contain braces, and a waiter id must not contain ``}`` (its wake list name
would become ambiguous).

Deadlines and fencing tokens use the server's clock (``TIME``), so clients'
clocks do not matter (except for the waiting-keys index on a Redis Cluster,
below).

The two indexes (:meth:`RedisBackend.waiting_keys`, :meth:`RedisBackend.limit_keys`)
are single keys in a slot of their own, so how they are kept depends on the client:

* On a standalone Redis (or one found through Sentinel), each per-key script
  is also given the index keys and keeps them itself, in the same atomic step
  as the change it indexes: a guard key is in ``ns:waiting`` exactly while it
  has a waiter or an unconfirmed reservation (the script that queues its first
  waiter adds it; the one that leaves it with neither removes it), and in
  ``ns:limits`` exactly while it has a run-time limit. Nothing is left in
  either index after the work drains, at once, and no interleaving can leave
  a parked waiter unindexed: the park and its index entry are one step, and so
  are the last hand-off and the entry's removal. ``index_grace_ms`` is not
  used.
* On a Redis Cluster a script may only touch its own slot, so an index cannot
  be kept in the same step. A park adds the key to ``ns:waiting`` with a ZADD
  pipelined in the same round trip, scored with the client's clock; the
  entry of a key found with no waiter and no reservation is dropped by
  :meth:`RedisBackend.waiting_keys` once it is older than ``index_grace_ms``,
  by a script that drops it only if it was not refreshed meanwhile. A removal
  in the release itself cannot be made safe there: a concurrent park's ZADD
  and its script land on two nodes in no guaranteed order, so a removal
  keyed on the release's moment could drop the entry of a park that lands
  just after it. The grace must exceed the clock skew between clients plus
  the longest a pipelined park can be in flight (the client's socket timeout
  times its retries); the default, 60 s, is that with room to spare. So on a
  cluster, a drained key's entry is left for up to ``index_grace_ms``, until
  the next ``waiting_keys()`` call after that (the workers' sweep makes one
  every few seconds). ``ns:limits`` is updated next to the limit change (added
  before a limit is set, removed after it is cleared), so a failure in
  between never leaves a limit unindexed; only two concurrent changes of the
  same key's limit can leave the index off, until the next change.

A script of a guard key uses PEXPIREAT's ``GT`` option (Redis 7.0) when it
can, and falls back to reading the latest deadline on older servers.

A Redis that stops answering without closing the connection (a frozen
primary, a partition, a stalled failover) is noticed only by the client's
``socket_timeout``: without one, a call waits until the operating system gives
up on the connection, and redis-py retries a timed-out call as many times as
its ``retry`` allows. Leases do not depend on it (they are lost on time, see
:mod:`dramatiq_guard.renewer`), but the worker threads that acquire and
release do. A client made by :meth:`RedisBackend.from_url` gets
``socket_timeout`` and ``socket_connect_timeout`` of
:data:`DEFAULT_SOCKET_TIMEOUT_S` unless its URL sets them; a client you pass
(or a RedisBroker's) is used as it is, and
:meth:`RedisBackend.slow_call_warning` says when its settings let one call
block longer than a lease (``dramatiq_guard.install`` logs it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Any, NamedTuple, TypeAlias, cast

import redis
import redis.cluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from dramatiq_guard.backends.base import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    AcquireResult,
    GuardBackend,
    Handoff,
    KeyState,
    ReleaseResult,
    Waiter,
    Woken,
    check_acquire,
    check_count,
    check_key,
    check_ms,
)
from dramatiq_guard.errors import BackendUnavailable

__all__ = ["DEFAULT_SOCKET_TIMEOUT_S", "RedisBackend", "RedisClient"]

#: A redis-py client the backend accepts.
RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster

#: ``socket_timeout`` and ``socket_connect_timeout`` (seconds) of a client made by
#: :meth:`RedisBackend.from_url` whose URL does not set them: well below a lease.
DEFAULT_SOCKET_TIMEOUT_S = 5.0


class _Timeouts(NamedTuple):
    """How long one call of a client can wait for a Redis that does not answer."""

    socket_timeout: float | None
    connect_timeout: float | None
    retries: int  # how many times a timed-out call is tried again (-1: without end)
    backoff_cap: float  # the longest pause between two tries (seconds)

    @property
    def bound_s(self) -> float | None:
        """About the longest one call can block (None: without bound)."""
        if self.socket_timeout is None or self.retries < 0:
            return None
        per_try = max(self.socket_timeout, self.connect_timeout or 0.0)
        return (1 + self.retries) * per_try + self.retries * self.backoff_cap


def _timeouts(client: RedisClient) -> _Timeouts:
    """The effective timeouts of ``client``'s connections, and its retries of a timed-out call.

    Read from a connection object made (not connected) the way its pool makes
    them, so redis-py's own defaults count too (its connection kwargs leave
    out what a URL did not set).
    """
    if isinstance(client, redis.cluster.RedisCluster):
        kwargs = dict(cast(Any, client).get_connection_kwargs())
        connection_class: Any = kwargs.pop("connection_class", redis.connection.Connection)
        retry: Any = getattr(client, "retry", None)
    else:
        kwargs = dict(client.connection_pool.connection_kwargs)
        connection_class = client.connection_pool.connection_class
        retry = None
    try:
        probe = connection_class(**kwargs)
        socket_timeout = probe.socket_timeout
        connect_timeout = probe.socket_connect_timeout
        retry = retry or getattr(probe, "retry", None)
    except Exception:  # an exotic connection class: what the kwargs say
        socket_timeout = kwargs.get("socket_timeout")
        connect_timeout = kwargs.get("socket_connect_timeout")
        retry = retry or kwargs.get("retry")
    retries, cap = 0, 0.0
    if retry is not None and any(
        issubclass(redis.exceptions.TimeoutError, error) for error in getattr(retry, "_supported_errors", ())
    ):
        retries = int(getattr(retry, "_retries", 0))
        cap = float(getattr(getattr(retry, "_backoff", None), "_cap", 0.0) or 0.0)
    return _Timeouts(
        None if socket_timeout is None else float(socket_timeout),
        None if connect_timeout is None else float(connect_timeout),
        retries,
        cap,
    )


class _KeyNames(NamedTuple):
    """The Redis keys of one guard key, in the order the scripts get them (KEYS[1..9], _prelude.lua)."""

    holders: str
    waiters: str
    payloads: str
    reserved: str
    deadlines: str
    token: str
    limit: str
    info: str
    standbys: str
    meta: str
    gens: str


_KEY_SCRIPTS = (
    "acquire",
    "renew",
    "release",
    "confirm_handoff",
    "cancel_wait",
    "sweep",
    "set_limit",
    "inspect",
    "standby",
)
_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,  # a full noeviction Redis refuses writes: fail closed
)


def _load_lua(name: str) -> str:
    return resources.files("dramatiq_guard.backends").joinpath(f"lua/{name}.lua").read_text("utf-8")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _data(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Turn redis-py's connection-level errors into :class:`BackendUnavailable`."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"the guard's Redis backend is unavailable: {exc}") from exc


class RedisBackend(GuardBackend):
    """The guard backend on Redis (or Redis Cluster).

    Each mutating operation is one Lua script, loaded once with redis-py's
    ``register_script`` (EVALSHA, falling back to loading it on NOSCRIPT).
    Works with clients made with or without ``decode_responses``; with
    ``decode_responses=True`` parked payloads must be UTF-8 (Dramatiq's
    default JSON encoding is).

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

    Raises:
      ValueError: If ``namespace`` is empty or contains a brace, or a
        duration is out of range (:func:`~dramatiq_guard.backends.base.check_ms`).
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str = "dramatiq-guard",
        handoff_ttl_ms: int = 10_000,
        index_grace_ms: int = 60_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        super().__init__(handoff_ttl_ms=handoff_ttl_ms, max_payload_bytes=max_payload_bytes)
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"a guard namespace must be non-empty and contain no braces, got {namespace!r}")
        check_ms(index_grace_ms, "index_grace_ms", minimum=0)
        self.client = client
        self.namespace = namespace
        self.index_grace_ms = index_grace_ms
        self._index = f"{namespace}:waiting"
        self._limits_index = f"{namespace}:limits"
        # On a standalone Redis the scripts keep the indexes themselves (see the
        # module docstring); known on first use (_in_cluster).
        self._cluster: bool | None = True if isinstance(client, redis.cluster.RedisCluster) else None
        self._owns_client = False
        prelude = _load_lua("_prelude")
        self._scripts: dict[str, Script] = {
            name: client.register_script(prelude + "\n" + _load_lua(name)) for name in _KEY_SCRIPTS
        }
        self._unindex = client.register_script(_load_lua("unindex"))
        self._client_timeouts: _Timeouts | None = None

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

    def _timeouts(self) -> _Timeouts:
        if self._client_timeouts is None:
            self._client_timeouts = _timeouts(self.client)
        return self._client_timeouts

    def slow_call_warning(self, shortest_lease_ms: int) -> str | None:
        """Why one call could block longer than ``shortest_lease_ms`` on a Redis that does not answer.

        A Redis that stops answering without closing the connection is
        noticed only by the client's ``socket_timeout``; redis-py then tries
        the call again as often as its ``retry`` says. Leases are still lost
        on time, but a worker thread acquiring or releasing would hang.

        Returns:
          str|None: A warning naming the client and what to set on it, or
          None if its timeouts bound every call below ``shortest_lease_ms``.
        """
        timeouts = self._timeouts()
        bound = timeouts.bound_s
        if timeouts.socket_timeout is None:
            how = "without end (it has no socket_timeout)"
        elif bound is None:
            how = "without end (its retry tries a timed-out call again without end)"
        elif bound * 1000 >= shortest_lease_ms:
            how = (
                f"for up to about {bound:g} s (socket_timeout={timeouts.socket_timeout:g} s, "
                f"tried again {timeouts.retries} times on a timeout)"
            )
        else:
            return None
        return (
            f"dramatiq-guard: a call to the guard's Redis through {self.client!r} can block {how} when "
            f"Redis stops answering without closing the connection (a frozen primary, a partition, a "
            f"failover), longer than the shortest lease ({shortest_lease_ms} ms): leases are still "
            f"reported lost when their time is up, but worker threads hang in the guard meanwhile. Set "
            f"socket_timeout= and socket_connect_timeout= on that client, below the lease (e.g. 5), with "
            f"few or no retries on timeouts: redis.Redis(..., socket_timeout=5, socket_connect_timeout=5), "
            f"or for a RedisBroker in its URL: RedisBroker(url='redis://host:6379/0?socket_timeout=5"
            f"&socket_connect_timeout=5') (RedisBroker(url=..., socket_timeout=5) ignores the keyword); "
            f"or give the guard a client of its own: dramatiq_guard.install(broker, redis='redis://...')."
        )

    # -- keys ---------------------------------------------------------------

    def _in_cluster(self) -> bool:
        """Whether the server is a Redis Cluster node (asked once: a plain client may talk to one)."""
        if self._cluster is None:
            with _reachable():
                try:
                    info = self.client.info("cluster")
                except redis.exceptions.ResponseError:  # INFO disabled: a managed standalone server
                    info = {}
            self._cluster = bool(info.get("cluster_enabled"))
        return self._cluster

    def _names(self, key: str) -> _KeyNames:
        check_key(key)
        return _KeyNames(*(f"{self.namespace}:{{{key}}}:{suffix}" for suffix in _KeyNames._fields))

    def _keys(self, key: str) -> list[str]:
        """The KEYS of a per-key script: the key's names, then the waiting-keys index (standalone only)."""
        keys = list(self._names(key))
        if not self._in_cluster():
            keys.append(self._index)
        return keys

    def _wake_prefix(self, key: str) -> str:
        return f"{self.namespace}:{{{key}}}:wake:"

    @staticmethod
    def _check_waiter(waiter_id: str) -> None:
        if "}" in waiter_id:
            raise ValueError(f"a waiter id must not contain '}}', got {waiter_id!r}")

    def _args(self, key: str, default_limit: int | None, *args: str | int | bytes) -> list[str | int | bytes]:
        """The ARGV of a per-key script: the values Python owns (see _prelude.lua), then its own."""
        limit: str | int = "" if default_limit is None else default_limit
        return [
            self._wake_prefix(key),
            self.handoff_ttl_ms,
            self.wake_ttl_ms,
            key,
            limit,
            self.route,
            self.stale_ttl_ms,
            *args,
        ]

    def _run(
        self,
        name: str,
        key: str,
        default_limit: int | None,
        *args: str | int | bytes,
        extra_key: str | None = None,
    ) -> Any:
        keys = self._keys(key)
        if extra_key is not None and not self._in_cluster():
            keys.append(extra_key)
        with _reachable():
            return self._scripts[name](keys=keys, args=self._args(key, default_limit, *args))

    def _pipelined(
        self, calls: Sequence[tuple[Script, list[str], list[Any]]], *, zadd_first: str | None = None
    ) -> list[Any]:
        """Run several scripts in one pipelined round trip, optionally after a ZADD to the index.

        redis-py's own pipeline script support costs an extra SCRIPT EXISTS
        round trip per execution (and does nothing for cluster pipelines), so
        a NOSCRIPT reply is handled here: load the script, re-run only the
        calls that were refused (they did nothing).
        """
        with _reachable():
            pipe = self.client.pipeline(transaction=False)
            if zadd_first is not None:
                pipe.zadd(self._index, {zadd_first: int(time.time() * 1000)})
            for script, keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            results = pipe.execute(raise_on_error=False)
            if zadd_first is not None:
                results = results[1:]
            missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if missing:
                for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
                    script.sha = self.client.script_load(script.script)
                pipe = self.client.pipeline(transaction=False)
                for i in missing:
                    script, keys, args = calls[i]
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                for i, result in zip(missing, pipe.execute(raise_on_error=False), strict=True):
                    results[i] = result
        for result in results:
            if isinstance(result, Exception):
                with _reachable():
                    raise result
        return list(results)

    def _handoffs(self, key: str, flat: list[Any]) -> tuple[Handoff, ...]:
        """Decode ``waiter, payload-or-nil, generation-or-nil`` triples (no payload: a woken waiter)."""
        return tuple(
            Handoff(
                key,
                _text(flat[i]),
                None if flat[i + 1] is None else _data(flat[i + 1]),
                None if flat[i + 2] is None else int(flat[i + 2]),
            )
            for i in range(0, len(flat), 3)
        )

    def _acquire_reply(self, key: str, reply: list[Any], sent: float) -> AcquireResult:
        """Decode acquire.lua's ``{acquired, token, limit, queued, holders, handoffs}``, sent at ``sent``."""
        acquired, token, in_force, queued, holders, handoffs = reply
        queued = _text(queued)
        return AcquireResult(
            acquired=bool(acquired),
            token=None if token is None else int(token),
            holders=tuple(_text(h) for h in holders),
            limit=int(in_force),
            parked=queued in ("queued", "standby"),
            handoffs=self._handoffs(key, handoffs),
            standby=queued == "standby",
            stale=queued == "stale",
            valid_from=sent,
        )

    def _release_reply(self, key: str, reply: list[Any]) -> ReleaseResult:
        """Decode ``{released, handoffs[, standbys]}`` (release, cancel_wait, sweep, set_limit)."""
        released, handoffs, *standbys = reply
        sent = self._handoffs(key, standbys[0]) if standbys else ()
        return ReleaseResult(bool(released), self._handoffs(key, handoffs), sent)

    def _inspect_reply(self, reply: list[Any]) -> KeyState:
        """Decode inspect.lua's ``{holders, waiters, parked flags, reserved, limit, token, info}``."""
        holders, waiters, parked, reserved, limit, token, info = reply
        meta = {_text(info[i]): _text(info[i + 1]).partition("|") for i in range(0, len(info), 2)}
        return KeyState(
            holders=tuple((_text(holders[i]), int(float(holders[i + 1]))) for i in range(0, len(holders), 2)),
            waiters=tuple(
                (_text(waiters[i]), int(float(waiters[i + 1])) // 1000, bool(parked[i // 2]))
                for i in range(0, len(waiters), 2)
            ),
            reserved=tuple(_text(r) for r in reserved),
            limit=None if limit is None else int(limit),
            token=None if token is None else int(token),
            holder_info=tuple(
                (holder, int(meta[holder][0]), meta[holder][2] or None)
                for holder in (_text(h) for h in holders[::2])
                if holder in meta
            ),
        )

    # -- operations ---------------------------------------------------------

    def acquire(
        self,
        key: str,
        holder: str,
        *,
        limit: int | None,
        ttl_ms: int,
        wait: Waiter | None = None,
        info: str | None = None,
        generation: int | None = None,
    ) -> AcquireResult:
        """Try to become a holder of ``key``; see :meth:`GuardBackend.acquire`.

        When ``wait`` is given, the key is added to the waiting-keys index
        by the script itself (on a Redis Cluster: in the same pipelined round
        trip, before the script).

        Raises:
          BackendUnavailable: If Redis cannot be reached.
          ValueError: If ``key``, a number or (with ``wait``) ``holder`` is not allowed.
          PayloadTooLarge: If ``wait.payload`` is over ``max_payload_bytes`` (nothing is written).
        """
        check_acquire(limit, ttl_ms, wait)
        self.check_payload(key, holder, wait)
        gen: str | int = "" if generation is None else generation
        sent = time.monotonic()  # the result's valid_from: Redis counts the ttl from later
        if wait is None:
            mode: list[str | int | bytes] = ["", b"", 0, info or "", gen]
            reply = self._run("acquire", key, limit, holder, ttl_ms, *mode)
        else:
            self._check_waiter(holder)
            kind = "park" if wait.payload is not None else "block"
            mode = [kind, b"" if wait.payload is None else wait.payload, wait.wait_ms, info or "", gen]
            if self._in_cluster():
                script = self._scripts["acquire"]
                [reply] = self._pipelined(
                    [(script, self._keys(key), self._args(key, limit, holder, ttl_ms, *mode))],
                    zadd_first=key,
                )
            else:
                reply = self._run("acquire", key, limit, holder, ttl_ms, *mode)
        return self._acquire_reply(key, reply, sent)

    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        """Extend ``holder``'s lease; see :meth:`GuardBackend.renew`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_ms(ttl_ms, "ttl_ms", minimum=0)
        return bool(self._run("renew", key, 0, holder, ttl_ms))

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew several leases in one pipelined round trip.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        if not leases:
            return []
        for _, _, ttl_ms in leases:
            check_ms(ttl_ms, "ttl_ms", minimum=0)
        script = self._scripts["renew"]
        calls = [(script, self._keys(key), self._args(key, 0, holder, ttl)) for key, holder, ttl in leases]
        return [bool(result) for result in self._pipelined(calls)]

    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        """Give up ``holder``'s slot; see :meth:`GuardBackend.release`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_count(limit, "limit")
        check_count(send_ahead, "send_ahead")
        return self._release_reply(key, self._run("release", key, limit, holder, send_ahead))

    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a handed-off parked message was re-enqueued; see :meth:`GuardBackend.confirm_handoff`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_ms(ttl_ms, "ttl_ms")
        gen = "" if generation is None else generation
        return bool(self._run("confirm_handoff", key, 0, waiter_id, ttl_ms, gen))

    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        """Send the oldest parked waiters ahead as standbys; see :meth:`GuardBackend.send_standbys`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_count(limit, "limit")
        check_count(count, "count")
        handoffs, sent = self._run("standby", key, limit, "send", count)  # {handoffs, standbys}
        return self._handoffs(key, handoffs), self._handoffs(key, sent)

    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        """Confirm a standby was enqueued; see :meth:`GuardBackend.confirm_standby`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_ms(ttl_ms, "ttl_ms")
        gen = "" if generation is None else generation
        return bool(self._run("standby", key, 0, "confirm", waiter_id, ttl_ms, payload, gen))

    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """Block on the waiter's wake list (BLPOP); see :meth:`GuardBackend.wait_for_handoff`.

        A BLPOP that outlasts the client's ``socket_timeout`` would fail as a
        timeout of the connection, so the wait is made of BLPOPs that each end
        safely before it (see :meth:`_blocking_chunk_s`); a push that lands
        between two of them stays in the list for the next.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        self._check_waiter(waiter_id)
        check_key(key)
        check_ms(timeout_ms, "timeout_ms", minimum=0)
        wake = self._wake_prefix(key) + waiter_id
        chunk_s = self._blocking_chunk_s()
        give_up = time.monotonic() + timeout_ms / 1000
        with _reachable():
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
        socket_timeout = self._timeouts().socket_timeout
        if socket_timeout is None:
            return None
        return max(socket_timeout - 1.0, socket_timeout / 2)

    def cancel_wait(self, key: str, waiter_id: str, *, limit: int | None) -> ReleaseResult:
        """Leave the waiters of ``key``; see :meth:`GuardBackend.cancel_wait`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        self._check_waiter(waiter_id)
        check_count(limit, "limit")
        return self._release_reply(key, self._run("cancel_wait", key, limit, waiter_id))

    def sweep(self, key: str, *, limit: int | None) -> ReleaseResult:
        """Reclaim lapsed holders and hand free slots on; see :meth:`GuardBackend.sweep`.

        Returns:
          ReleaseResult: ``released`` tells whether any lapsed holder was reclaimed.
          Holders that lapsed after the key's last deadline expired with it and are
          not counted (an unconfirmed reservation among them is: it goes back to the
          queue).

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        check_count(limit, "limit")
        return self._release_reply(key, self._run("sweep", key, limit))

    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        """Set or clear the run-time limit; see :meth:`GuardBackend.set_limit`.

        Returns:
          ReleaseResult: ``released`` is always False (nobody is evicted).

        Raises:
          BackendUnavailable: If Redis cannot be reached.
          ValueError: If ``limit`` or ``default`` is out of range (:func:`check_count`).
        """
        if limit is not None:
            check_count(limit, "limit")
        check_count(default, "default")
        value = "" if limit is None else limit
        if not self._in_cluster():
            return self._release_reply(
                key, self._run("set_limit", key, default, value, extra_key=self._limits_index)
            )
        # A cluster: the index is in another slot. The key is added before its
        # limit is set and removed after it is cleared, so a limit is never
        # left unindexed by a failure in between.
        check_key(key)
        if limit is not None:
            with _reachable():
                self.client.sadd(self._limits_index, key)
        result = self._release_reply(key, self._run("set_limit", key, default, value))
        if limit is None:
            with _reachable():
                self.client.srem(self._limits_index, key)
        return result

    def get_limit(self, key: str) -> int | None:
        """The run-time limit of ``key``, or None.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        with _reachable():
            value = self.client.get(self._names(key).limit)
        return None if value is None else int(value)

    def inspect(self, key: str) -> KeyState:
        """A snapshot of ``key``, read atomically by one script (it reclaims nothing).

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        return self._inspect_reply(self._run("inspect", key, 0))

    def waiting_keys(self) -> list[str]:
        """Keys in the waiting-keys index (see the module docstring).

        On a standalone Redis the index is exact: the keys that have a waiter
        or an unconfirmed reservation. On a Redis Cluster an entry is dropped
        here when its key has no waiter and no unconfirmed reservation and it
        was last refreshed more than ``index_grace_ms`` ago; the drop is
        conditional on the entry not being refreshed meanwhile, so a
        concurrent park never loses its entry.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        with _reachable():
            if not self._in_cluster():
                return [_text(k) for k in cast("list[bytes | str]", self.client.zrange(self._index, 0, -1))]
            raw = cast(
                "list[tuple[bytes | str, float]]", self.client.zrange(self._index, 0, -1, withscores=True)
            )
            entries = [(_text(k), score) for k, score in raw]
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
        dropped = self._pipelined([(self._unindex, [self._index], [k, cutoff]) for k in empty])
        gone = {k for k, result in zip(empty, dropped, strict=True) if result}
        return [k for k, _ in entries if k not in gone]

    def limit_keys(self) -> list[str]:
        """Keys that have a run-time limit, from the limits index kept by :meth:`set_limit`.

        Raises:
          BackendUnavailable: If Redis cannot be reached.
        """
        with _reachable():
            return sorted(_text(k) for k in self.client.smembers(self._limits_index))

    def close(self) -> None:
        """Close the client if this backend made it (:meth:`from_url`)."""
        if self._owns_client:
            self.client.close()
