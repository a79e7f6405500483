"""The redis-py side of the Redis backend: what it may raise, how long one call can block
(``docs/failure-model.md``, "A silent Redis"), running and pipelining the scripts (``docs/redis.md``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias, cast

import redis
import redis.cluster

from dramatiq_guard.backends.redis_scripts import LuaScript, ScriptLibrary
from dramatiq_guard.errors import BackendRefused, BackendUnavailable, ReplicasBehind

#: A redis-py client the backend accepts.
RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster

#: ``socket_timeout`` and ``socket_connect_timeout`` (seconds) of a client made by
#: :meth:`RedisBackend.from_url` whose URL does not set them: well below a lease.
DEFAULT_SOCKET_TIMEOUT_S = 5.0


class Timeouts(NamedTuple):
    """How long one call of a client can wait for a Redis that does not answer."""

    socket_timeout: float | None
    connect_timeout: float | None
    retries: int  # how many times a timed-out call is tried again (-1: without end)
    backoff_cap: float  # the longest pause between two tries (seconds)


def timeouts_of(client: RedisClient) -> Timeouts:
    """The timeouts of ``client``'s connections (redis-py's defaults included: read from a connection
    made, not connected), and its retries of a timed-out call."""
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
        socket_timeout, connect_timeout = probe.socket_timeout, probe.socket_connect_timeout
        retry = retry or getattr(probe, "retry", None)
    except Exception:  # an exotic connection class: what the kwargs say
        socket_timeout, connect_timeout = kwargs.get("socket_timeout"), kwargs.get("socket_connect_timeout")
        retry = retry or kwargs.get("retry")
    retries, cap = 0, 0.0
    if retry is not None and any(
        issubclass(redis.exceptions.TimeoutError, error) for error in getattr(retry, "_supported_errors", ())
    ):
        retries = int(getattr(retry, "_retries", 0))
        cap = float(getattr(getattr(retry, "_backoff", None), "_cap", 0.0) or 0.0)
    socket_s, connect_s = (None if t is None else float(t) for t in (socket_timeout, connect_timeout))
    return Timeouts(socket_s, connect_s, retries, cap)


UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,  # a full noeviction Redis refuses writes: fail closed
)


def text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def data(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


class reachable(contextlib.AbstractContextManager[None]):
    """``with reachable(): ...`` turns redis-py's connection-level errors into :class:`BackendUnavailable`,
    and a call the ACL user may not make (``NOPERM``) into :class:`BackendRefused` (it fails closed too)."""

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        reachable.raise_for(exc)

    @staticmethod
    def raise_for(exc: BaseException | None) -> None:
        """Raise what ``exc`` is turned into, if anything (the body of ``except`` where no ``with`` is)."""
        if isinstance(exc, UNAVAILABLE):
            raise BackendUnavailable(f"the guard's Redis backend is unavailable: {exc}") from exc
        if isinstance(exc, redis.exceptions.NoPermissionError):
            raise BackendRefused(str(exc)) from exc


def slow_call_warning(
    client: RedisClient, timeouts: Timeouts, shortest_lease_ms: int, replicas: ReplicaWaits | None
) -> str | None:
    """Why one call could block longer than ``shortest_lease_ms`` on a Redis that does not answer, or
    a replica wait could outlast the ``socket_timeout``, naming what to set; None if neither."""
    found, socket_timeout, retries = [], timeouts.socket_timeout, timeouts.retries
    per_try = max(socket_timeout or 0.0, timeouts.connect_timeout or 0.0)
    bound = (1 + retries) * per_try + retries * timeouts.backoff_cap
    how = None
    if socket_timeout is None:
        how = "without end (it has no socket_timeout)"
    elif retries < 0:
        how = "without end (its retry tries a timed-out call again without end)"
    elif bound * 1000 >= shortest_lease_ms:
        how = f"for up to about {bound:g} s (socket_timeout={socket_timeout:g} s, tried again {retries} times"
        how += " on a timeout)"
    if how is not None:
        found.append(
            f"dramatiq-guard: a call to the guard's Redis through {client!r} can block {how} when "
            f"Redis stops answering without closing the connection (a frozen primary, a partition, a "
            f"failover), longer than the shortest lease ({shortest_lease_ms} ms): leases are still "
            f"reported lost when their time is up, but worker threads hang in the guard meanwhile. Set "
            f"socket_timeout= and socket_connect_timeout= on that client, below the lease (e.g. 5), with "
            f"few or no retries on timeouts: redis.Redis(..., socket_timeout=5, socket_connect_timeout=5), "
            f"or for a RedisBroker in its URL: RedisBroker(url='redis://host:6379/0?socket_timeout=5"
            f"&socket_connect_timeout=5') (RedisBroker(url=..., socket_timeout=5) ignores the keyword); "
            f"or give the guard a client of its own: dramatiq_guard.install(broker, redis='redis://...')."
        )
    if replicas is not None and socket_timeout is not None and socket_timeout * 1000 <= replicas.timeout_ms:
        found.append(
            f"dramatiq-guard: replica_wait_timeout_ms={replicas.timeout_ms} is not below the guard "
            f"client's socket_timeout ({socket_timeout:g} s): a decision whose replicas are slow "
            f"fails as a connection timeout. Set replica_wait_timeout_ms below it."
        )
    return " ".join(found) or None


#: A thread's own connection is checked before a call (:meth:`ThreadClients.here`) only if the thread
#: made no call in this many seconds, as redis-py's ``health_check_interval`` checks an idle one.
CHECK_IDLE_S = 0.1


class ThreadClients:
    """A client per thread for the script calls of a backend on ``client``, each on one connection of
    ``client``'s pool, held while its thread lives (given back to the pool when the thread ends): no
    pool lock per call (docs/redis.md, "Connections: one per thread", says why and what it measured).

    At most half the pool's ``max_connections`` are held so; a thread beyond them, and every thread
    of a Redis Cluster client, use ``client`` itself. Each thread's client is made on its first call
    (BackendUnavailable if Redis cannot be reached then: made again on the next call), and again on
    the first call of a forked child. A connection is checked before a call only after
    :data:`CHECK_IDLE_S` idle; a call that fails with a ConnectionError on an unchecked one runs once
    more on a new connection (:class:`_OwnClient`).
    """

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held = 0
        self._pid = os.getpid()

    def here(self) -> RedisClient:
        """The client of the calling thread; after :data:`CHECK_IDLE_S` without a call, its connection
        checked as the pool checks one it lends: one that Redis closed is closed here and opened
        again by the next command."""
        local = self._local
        if local.__dict__.get("pid") != os.getpid():
            made = local.client = self._make()
            local.connection = (
                made.connection if made is not self.client and isinstance(made, redis.Redis) else None
            )
            local.pid, local.called = os.getpid(), 0.0
        connection, last = local.connection, local.called
        local.called = now = time.monotonic()
        if connection is not None:  # the thread's own (a shared client is used as it is)
            # (redis-py's `_sock`: only a connected one is asked; asking one that is not would connect it)
            connected = getattr(connection, "_sock", None) is not None
            local.client.unchecked = connected and now - last < CHECK_IDLE_S
            if connected and not local.client.unchecked:
                try:
                    stale = connection.can_read()  # a reply nobody asked for, or the end of the stream
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    stale = True
                if stale:
                    connection.disconnect()  # and its next command connects again
        client: RedisClient = local.client
        return client

    def _make(self) -> RedisClient:
        shared = self.client
        if not isinstance(shared, redis.Redis):  # a Cluster client keeps a pool per node
            return shared
        pool = shared.connection_pool
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's connections are not its own
                self._pid, self._held = os.getpid(), 0
            if self._held >= pool.max_connections // 2:
                return shared
            self._held += 1
        try:
            with reachable():
                own = _OwnClient(connection_pool=pool, single_connection_client=True)
        except BaseException:
            self._given_back(os.getpid())
            raise
        # Its connection goes back to the pool when the thread's client is collected, with the thread.
        weakref.finalize(own, self._given_back, os.getpid())
        return own

    def _given_back(self, pid: int) -> None:
        with self._lock:
            if self._pid == pid:
                self._held -= 1


class _OwnClient(redis.Redis):
    """A thread's client (:class:`ThreadClients`), on one connection of its own: a call made on it
    unchecked that fails with a ConnectionError (redis-py closed the connection) runs once more, on a
    new connection, as it would have after the check found the connection closed. A timeout is not
    tried again (Redis may have run the call), and neither is the second try's failure."""

    #: Whether the next call uses the connection unchecked (set by :meth:`ThreadClients.here`).
    unchecked = False

    def execute_command(self, *args: Any, **options: Any) -> Any:
        execute: Callable[..., Any] = super().execute_command  # untyped in redis-py
        if not self.unchecked:
            return execute(*args, **options)
        self.unchecked = False
        try:
            return execute(*args, **options)
        except redis.ConnectionError:
            return execute(*args, **options)


class ReplicaWaits(NamedTuple):
    """How many replicas must acknowledge each decision (Redis ``WAIT``), and for how long to wait."""

    replicas: int
    timeout_ms: int


#: A script call: the script, its KEYS and its ARGV.
ScriptCall: TypeAlias = tuple[LuaScript, list[str], list[Any]]


def run_script(
    client: RedisClient, library: ScriptLibrary, script: LuaScript, keys: list[str], args: list[Any]
) -> Any:
    """Run one script (no replica waits); a call refused for want of its code loads it and runs again."""
    execute: Callable[..., Any] = client.execute_command  # untyped in redis-py
    try:  # as `with reachable():`, without its two calls on every send
        try:
            return execute(*library.command(script, keys, args))
        except redis.exceptions.RedisError as exc:
            if not library.missing(exc):
                raise
            library.load(client, [script])
            return execute(*library.command(script, keys, args))
    except Exception as exc:
        reachable.raise_for(exc)
        raise


def run_scripts(
    client: RedisClient,
    library: ScriptLibrary,
    calls: Sequence[ScriptCall],
    *,
    zadd_first: tuple[str, str] | None = None,
    replicas: ReplicaWaits | None = None,
    own: ThreadClients | None = None,
) -> list[Any]:
    """Run several scripts in one pipelined round trip, optionally after a ZADD ``(index, member)``.

    Calls refused for want of their code did nothing: it is loaded and they run again. With
    ``replicas``, each pipeline ends with a ``WAIT`` (:class:`ReplicasBehind`, after every call
    ran): on a Redis Cluster one pipeline per node, and a call refused with MOVED or ASK (a
    failover moved its slot) runs once more on the new owner. ``own``: the clients of ``client``'s
    threads; a lone call runs on the calling thread's (a pipeline takes a pool connection anyway).
    """
    if replicas is None or replicas.replicas <= 0:
        if len(calls) == 1 and zadd_first is None:  # a call costs less CPU than a pipeline of one
            return [run_script(client if own is None else own.here(), library, *calls[0])]
        return _run_pipelined(client, library, client, calls, zadd_first, None)
    if not isinstance(client, redis.cluster.RedisCluster):
        return _run_pipelined(client, library, client, calls, zadd_first, replicas)
    if zadd_first is not None:
        _run_on_nodes(client, library, [], zadd_first, replicas)
    return _run_on_nodes(client, library, list(calls), None, replicas)


def _run_on_nodes(
    client: redis.cluster.RedisCluster,
    library: ScriptLibrary,
    calls: list[ScriptCall],
    zadd: tuple[str, str] | None,
    replicas: ReplicaWaits,
) -> list[Any]:
    """Run ``calls`` (or only ``zadd``) on the nodes owning their keys, each pipeline with its WAIT."""
    results: list[Any] = [None] * len(calls)
    pending = list(range(len(calls)))
    for attempt in range(2):
        moved: list[int] = []
        failed: BackendUnavailable | None = None
        for target, indices in _by_node(client, calls, pending, zadd).values():
            # Every node's calls run even if another node failed (a renewal batch must not leave the
            # leases of healthy nodes to lapse because one node is failing over); then it raises.
            try:
                mine = [calls[i] for i in indices]
                replies = _run_pipelined(client, library, target, mine, zadd, replicas, moved_ok=attempt == 0)
            except BackendUnavailable as exc:
                if not isinstance(exc, ReplicasBehind):  # the node is gone: ask the cluster again
                    with contextlib.suppress(*UNAVAILABLE):
                        client.nodes_manager.initialize()
                failed = failed or exc
                continue
            for i, reply in zip(indices, replies, strict=True):
                if isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError)):
                    moved.append(i)
                results[i] = reply
        if failed is not None:
            raise failed
        if not moved:
            break
        with reachable():
            client.nodes_manager.initialize()
        pending, zadd = moved, None
    return results  # a second MOVED was raised by _run_pipelined (moved_ok=False)


def _by_node(
    client: redis.cluster.RedisCluster,
    calls: list[ScriptCall],
    pending: list[int],
    zadd: tuple[str, str] | None,
) -> dict[str, tuple[redis.Redis, list[int]]]:
    """The ``pending`` calls (indices), and the ZADD's node, grouped by the node owning their first key."""
    groups: dict[str, tuple[redis.Redis, list[int]]] = {}
    with reachable():
        if zadd is not None:
            node = cast(Any, client).get_node_from_key(zadd[0])
            groups[node.name] = (client.get_redis_connection(node), [])
        for i in pending:
            node = cast(Any, client).get_node_from_key(calls[i][1][0])
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(i)
    return groups


def _run_pipelined(
    client: RedisClient,
    library: ScriptLibrary,
    target: RedisClient,
    calls: Sequence[ScriptCall],
    zadd_first: tuple[str, str] | None,
    replicas: ReplicaWaits | None,
    *,
    moved_ok: bool = False,
) -> list[Any]:
    """One pipeline on ``target`` (then a second for calls missing their code); ``client`` loads it."""
    with reachable():
        results = _pipeline(library, target, calls, zadd_first, replicas)
        missing = [i for i, r in enumerate(results) if isinstance(r, redis.RedisError) and library.missing(r)]
        if missing:
            library.load(client, [calls[i][0] for i in missing])
            again = _pipeline(library, target, [calls[i] for i in missing], None, replicas)
            for i, result in zip(missing, again, strict=True):
                results[i] = result
    for result in results:
        if moved_ok and isinstance(result, (redis.exceptions.MovedError, redis.exceptions.AskError)):
            continue
        if isinstance(result, Exception):
            with reachable():
                raise result
    return results


def _pipeline(
    library: ScriptLibrary,
    target: RedisClient,
    calls: Sequence[ScriptCall],
    zadd_first: tuple[str, str] | None,
    replicas: ReplicaWaits | None,
) -> list[Any]:
    """The replies of one pipeline (errors as values), the ZADD's and the WAIT's left out."""
    pipe = target.pipeline(transaction=False)
    if zadd_first is not None:
        pipe.zadd(zadd_first[0], {zadd_first[1]: int(time.time() * 1000)})
    for script, keys, args in calls:
        pipe.execute_command(*library.command(script, keys, args))
    if replicas is not None:
        pipe.execute_command("WAIT", replicas.replicas, replicas.timeout_ms)
    results = list(pipe.execute(raise_on_error=False))
    if zadd_first is not None:
        results.pop(0)
    if replicas is not None:
        acked = results.pop()
        if isinstance(acked, Exception):
            if any(isinstance(result, Exception) for result in results):
                return results  # the calls' errors say more
            # A node that refuses WAIT is a replica (a failover demoted it): nothing stands.
            raise BackendUnavailable(f"the guard's Redis backend could not wait for replicas: {acked}")
        if int(acked) < replicas.replicas:
            raise ReplicasBehind(int(acked), replicas.replicas, replicas.timeout_ms)
    return results
