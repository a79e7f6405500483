"""Replicated Redis topologies on loopback ports, started by the tests themselves, for failover.

* :class:`ReplicatedRedis`: a primary and one replica (the replica may run under a
  :class:`~harness.FakeClock`, e.g. one behind the primary's), promoted by hand
  (:meth:`ReplicatedRedis.promote`: ``REPLICAOF NO ONE``, what a failover does).
* :class:`SentinelRedis`: the same pair watched by one Sentinel (quorum 1), which fails over
  when the primary dies (:meth:`SentinelRedis.kill_primary`).
* :class:`RedisCluster3x1`: a Redis Cluster of 3 primaries with 1 replica each, whose primary
  of a slot is killed and its replica promoted (:meth:`RedisCluster3x1.fail_over`).
* :func:`start_cluster_node`: a one-node Redis Cluster owning every slot, on a
  :class:`~harness.FakeClock` (the model tests run it beside a standalone server).

Every server is a :class:`~harness.RedisServer` (no persistence, keyspace notifications on),
with ``repl-diskless-sync-delay 0`` so a replica syncs at once. Start-up, the replication link and
a promotion have no event to wait on: they are polled with :func:`harness.wait_until`'s back-off.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import redis
import redis.cluster
import redis.sentinel

from .fake_clock import FakeClock
from .proxy import SilentProxy
from .redis_server import RedisServer, free_port
from .waiting import wait_until

#: What every server of a topology is started with, on top of RedisServer's defaults.
REPLICATION_ARGS = ("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1")


def command(client: redis.Redis, *args: Any) -> Any:
    """``client.execute_command(*args)`` (untyped in redis-py)."""
    return cast(Any, client).execute_command(*args)


def linked(replica: redis.Redis) -> bool:
    """Whether a replica's link to its primary is up (it has synced)."""
    info = replica.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def replicate_all(primary: redis.Redis, replicas: int = 1, timeout_ms: int = 5_000) -> None:
    """Wait until ``replicas`` replicas acknowledged every write made so far (``WAIT``).

    Raises:
      AssertionError: If fewer acknowledged within ``timeout_ms``.
    """
    acked = int(primary.wait(replicas, timeout_ms))
    assert acked >= replicas, f"only {acked} of {replicas} replicas acknowledged the writes"


class ReplicatedRedis:
    """A primary and one replica of it, each a private ``redis-server``.

    The replica replicates through a :class:`~harness.SilentProxy`, so a test can cut the link
    (:meth:`partition`): what the primary writes then never reaches the replica, as in a
    partition or a crash before the replication stream went out.

    Parameters:
      replica_env: More environment for the replica (e.g. :meth:`harness.FakeClock.server_env`).
      args: More ``redis-server`` options for both.
    """

    def __init__(self, *, replica_env: Mapping[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.primary = RedisServer(args=(*REPLICATION_ARGS, *args))
        self._replica_env = dict(replica_env or {})
        self._args = args
        self.replica: RedisServer | None = None
        self.link: SilentProxy | None = None

    def start(self) -> ReplicatedRedis:
        """Start both and wait until the replica has synced."""
        self.primary.start()
        self.link = SilentProxy(self.primary.host, self.primary.port)
        self.replica = RedisServer(
            args=(*REPLICATION_ARGS, *self._args, "--replicaof", self.link.host, str(self.link.port)),
            env=self._replica_env,
        ).start()
        with self.replica.client() as client:
            wait_until(lambda: linked(client), what="the replica to sync")
        return self

    def partition(self) -> None:
        """Cut the replication link: from now on nothing the primary writes reaches the replica."""
        assert self.link is not None
        self.link.freeze()

    def promote(self) -> RedisServer:
        """Make the replica a primary (``REPLICAOF NO ONE``, what a failover does) and kill the old one.

        Returns:
          RedisServer: The new primary.
        """
        assert self.replica is not None
        with self.replica.client() as client:
            client.replicaof("NO", "ONE")
            wait_until(lambda: client.info("replication").get("role") == "master", what="the promotion")
        self.primary.stop()
        if self.link is not None:
            self.link.close()
        return self.replica

    def close(self) -> None:
        if self.replica is not None:
            self.replica.close()
        if self.link is not None:
            self.link.close()
        self.primary.close()

    def __enter__(self) -> ReplicatedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SentinelRedis(ReplicatedRedis):
    """A :class:`ReplicatedRedis` watched by one Sentinel (quorum 1) as ``name``.

    The Sentinel finds the primary down ``down_after_ms`` after it stops answering and promotes
    the replica (:meth:`kill_primary`, then :meth:`wait_promoted`). Clients come from
    :meth:`sentinel` (``redis.sentinel.Sentinel``), as an application would make them.
    """

    def __init__(self, *, name: str = "guard", down_after_ms: int = 500, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.down_after_ms = down_after_ms
        self.sentinel_port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="dramatiq-guard-sentinel-"))
        self._sentinel: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelRedis:
        super().start()
        config = self._dir / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self._dir}\n"
            f"sentinel monitor {self.name} {self.primary.host} {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.name} 10000\n"
        )
        self._sentinel = subprocess.Popen(
            [self.primary.executable, str(config), "--sentinel", "--loglevel", "warning"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with redis.Redis(port=self.sentinel_port, socket_connect_timeout=1) as client:

            def knows_the_replica() -> bool:
                try:
                    return bool(client.sentinel_slaves(self.name))
                except redis.ConnectionError:
                    return False

            wait_until(knows_the_replica, what="the Sentinel to find the primary and its replica")
        return self

    def sentinel(self, **connection_kwargs: Any) -> Any:
        """A ``redis.sentinel.Sentinel`` of this Sentinel (``master_for(self.name)``: the primary)."""
        return cast(Any, redis.sentinel).Sentinel([("127.0.0.1", self.sentinel_port)], **connection_kwargs)

    def primary_address(self) -> tuple[str, int]:
        with redis.Redis(port=self.sentinel_port) as client:
            host, port = client.sentinel_get_master_addr_by_name(self.name)
        return str(host), int(port)

    def kill_primary(self) -> RedisServer:
        """Kill the primary (SIGKILL) and wait until the Sentinel promoted the replica.

        Returns:
          RedisServer: The new primary.
        """
        assert self.replica is not None
        self.primary.stop()
        replica = self.replica
        wait_until(
            lambda: self.primary_address()[1] == replica.port, timeout=30, what="the Sentinel's failover"
        )
        with replica.client() as client:
            wait_until(lambda: client.info("replication").get("role") == "master", what="the promotion")
        return replica

    def __enter__(self) -> SentinelRedis:
        return self.start()

    def restore_old_primary(self, new_primary: RedisServer) -> None:
        """Start the killed primary again (empty), as a replica of ``new_primary``; wait until it synced."""
        old = self.primary
        old.args = (*old.args, "--replicaof", new_primary.host, str(new_primary.port))
        with old.start().client() as client:
            wait_until(lambda: linked(client), what="the old primary to sync as a replica")

    def close(self) -> None:
        if self._sentinel is not None and self._sentinel.poll() is None:
            self._sentinel.kill()
            self._sentinel.wait(10)
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)


def start_cluster_node(clock: FakeClock) -> RedisServer:
    """A one-node Redis Cluster owning every slot, on ``clock``, started.

    The clock is moved on 5 s: a node waits 2 s (of its clock) before it declares its state ok.
    """
    node = RedisServer(
        args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
              "--cluster-port", str(free_port())),
        env=clock.server_env(),
    ).start()  # fmt: skip
    try:
        with node.client() as client:
            client.cluster("addslotsrange", 0, 16383)
            clock.advance(5_000)
            wait_until(lambda: client.cluster("info").get("cluster_state") == "ok", timeout=20)
    except BaseException:
        node.close()
        raise
    return node


@contextlib.contextmanager
def model_client(clock: FakeClock, *, cluster: bool) -> Iterator[Any]:
    """A client of a private ``redis-server`` on ``clock``: a standalone one, or (``cluster``) a
    one-node Cluster owning every slot (:func:`start_cluster_node`), closed at the end.

    Raises:
      AssertionError: If the server ignores the fake clock.
    """
    server = start_cluster_node(clock) if cluster else RedisServer(env=clock.server_env()).start()
    client: Any = (redis.cluster.RedisCluster if cluster else redis.Redis)(host=server.host, port=server.port)
    try:
        seconds, micros = client.time()
        assert int(seconds) * 1000 + int(micros) // 1000 == clock.now_ms, "Redis ignores the fake clock"
        yield client
    finally:
        client.close()
        server.close()


class RedisCluster3x1:
    """A Redis Cluster of 3 primaries with 1 replica each, on loopback ports.

    Made by hand (``CLUSTER MEET``, ``ADDSLOTSRANGE``, ``CLUSTER REPLICATE``), not by
    ``redis-cli --cluster create``. ``node_timeout_ms`` is how soon a dead primary is failed
    over by its replica.
    """

    SLOTS = ((0, 5460), (5461, 10922), (10923, 16383))

    def __init__(self, *, node_timeout_ms: int = 1_000) -> None:
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        self.bus_ports: list[int] = []
        self._failed: RedisServer | None = None

    def _node(self) -> RedisServer:
        bus = free_port()
        self.bus_ports.append(bus)
        return RedisServer(
            args=(
                *REPLICATION_ARGS,
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(bus),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-replica-validity-factor", "0",
            )
        )  # fmt: skip

    def start(self) -> RedisCluster3x1:
        """Start six nodes, give the three primaries a third of the slots each, and pair the replicas."""
        self.nodes = [self._node().start() for _ in range(6)]
        clients = [node.client() for node in self.nodes]
        try:
            ids = [bytes(command(c, "CLUSTER", "MYID")).decode() for c in clients]
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                command(clients[0], "CLUSTER", "MEET", node.host, node.port, bus)
            for client, (low, high) in zip(clients[:3], self.SLOTS, strict=True):
                command(client, "CLUSTER", "ADDSLOTSRANGE", low, high)

            def everyone_knows_everyone() -> bool:
                return all(len(command(c, "CLUSTER", "NODES").splitlines()) == 6 for c in clients)

            wait_until(everyone_knows_everyone, timeout=30, what="the nodes to meet")
            for client, primary in zip(clients[3:], ids[:3], strict=True):
                command(client, "CLUSTER", "REPLICATE", primary)

            def ready() -> bool:
                """Every node ok and seeing a replica for every slot range, every replica synced."""
                return (
                    all(c.cluster("info").get("cluster_state") == "ok" for c in clients)
                    and all(len(r) >= 4 for c in clients for r in command(c, "CLUSTER", "SLOTS"))
                    and all(linked(c) for c in clients[3:])
                )

            wait_until(ready, timeout=30, what="the cluster to be ok and its replicas synced")
        finally:
            for client in clients:
                client.close()
        return self

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A RedisCluster client that knows every node (so it finds the cluster after a failover)."""
        startup = [cast(Any, redis.cluster).ClusterNode(node.host, node.port) for node in self.nodes]
        return redis.cluster.RedisCluster(startup_nodes=startup, **kwargs)

    def owner_of(self, key: str) -> RedisServer:
        """The running node that a live node says is the primary of ``key``'s slot."""
        alive = next(node for node in self.nodes if node.proc is not None)
        with alive.client() as client:
            slot = int(command(client, "CLUSTER", "KEYSLOT", key))
            for low, high, primary, *_ in command(client, "CLUSTER", "SLOTS"):
                if int(low) <= slot <= int(high):
                    port = int(primary[1])
        return next(node for node in self.nodes if node.port == port)

    def replica_of(self, key: str) -> RedisServer:
        """The replica of ``key``'s slot, as its primary reports it (``INFO replication``)."""
        with self.owner_of(key).client() as client:
            port = int(client.info("replication")["slave0"]["port"])
        return next(node for node in self.nodes if node.port == port)

    def switch_over(self, key: str) -> RedisServer:
        """A manual failover of ``key``'s slot (``CLUSTER FAILOVER`` on its replica): nothing is lost,
        the old primary becomes its replica. Returns the new primary once every node agrees."""
        new = self.replica_of(key)
        with new.client() as client:
            command(client, "CLUSTER", "FAILOVER")

        def switched() -> bool:
            return all(self._owner_seen_by(node, key) == new.port for node in self.nodes)

        wait_until(switched, timeout=30, what="the manual failover")
        return new

    def _owner_seen_by(self, node: RedisServer, key: str) -> int:
        with node.client() as client:
            slot = int(command(client, "CLUSTER", "KEYSLOT", key))
            for low, high, primary, *_ in command(client, "CLUSTER", "SLOTS"):
                if int(low) <= slot <= int(high):
                    return int(primary[1])
        return 0

    def fail_over(self, key: str) -> RedisServer:
        """Kill the primary of ``key``'s slot (SIGKILL) and wait until its replica took the slot over.

        Returns:
          RedisServer: The new primary of the slot.
        """
        old = self.owner_of(key)
        old.stop()

        def promoted() -> RedisServer | None:
            try:
                new = self.owner_of(key)
            except redis.ConnectionError:
                return None
            if new is old:
                return None
            with new.client() as client:
                return new if client.cluster("info").get("cluster_state") == "ok" else None

        self._failed = old
        return wait_until(promoted, timeout=30, what="the replica to take the slot over")

    def restore_failed(self) -> None:
        """Start the node killed by :meth:`fail_over` again: it rejoins as a replica of its successor.

        Waits until it synced (its cluster config file is kept, so it knows its place).
        """
        old = self._failed
        assert old is not None
        self._failed = None
        with old.start().client() as client:
            wait_until(lambda: linked(client), timeout=30, what="the old primary to sync as a replica")

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster3x1:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
