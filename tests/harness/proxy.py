"""A TCP proxy that can go silent: it keeps every connection open but stops answering.

What a client sees of a frozen primary, a partition or a stalled failover: the
connection stays open (no reset, no FIN), requests are accepted by the
kernel, and no reply ever comes. A plain stop of the server (a closed port, a
reset connection) is not that: redis-py fails fast on it.

::

    with SilentProxy("127.0.0.1", redis_port) as proxy:
        client = redis.Redis(host=proxy.host, port=proxy.port, socket_timeout=1)
        proxy.freeze()   # from now on nothing is forwarded, either way; sockets stay open
        proxy.thaw()     # what was sent meanwhile is forwarded, as after a healed partition
        proxy.freeze(replies_only=True)  # requests reach the server, its replies are held
        proxy.drop_connections()  # while frozen: what they hold is never forwarded

New connections made while frozen are accepted (as the kernel of a frozen
server would) and paired with the server, but carry nothing until thawed.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import cast

__all__ = ["SilentProxy"]


class SilentProxy:
    """Forward TCP bytes between a listening port on 127.0.0.1 and ``(host, port)``, one thread.

    Parameters:
      host(str): The server's host.
      port(int): The server's port.

    Attributes:
      host(str): Where clients connect (``127.0.0.1``).
      port(int): The proxy's port (a free one).
    """

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.host = "127.0.0.1"
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # Held while bytes are forwarded: once freeze() returns, nothing more goes through.
        self._lock = threading.Lock()
        self._frozen = False
        self._replies_only = False
        self._closed = False
        self._peers: dict[socket.socket, socket.socket] = {}
        self._servers: set[socket.socket] = set()  # the server's ends of the pairs
        self._thread = threading.Thread(target=self._run, name="silent-proxy", daemon=True)
        self._thread.start()

    @property
    def frozen(self) -> bool:
        """Whether the proxy is silent."""
        return self._frozen

    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        with self._lock:
            return len(self._peers) // 2

    def freeze(self, *, replies_only: bool = False) -> None:
        """Stop forwarding in both directions (``replies_only``: the server's replies only, so
        requests still reach it, as when a connection drops after a request); every socket stays
        open. Returns once it holds."""
        with self._lock:
            self._frozen, self._replies_only = True, replies_only
        self._wake()

    def thaw(self) -> None:
        """Forward again, starting with what was sent while frozen."""
        with self._lock:
            self._frozen = False
        self._wake()

    def drop_connections(self) -> None:
        """Close every connection open now without forwarding what it holds (call it while frozen: what
        was sent meanwhile never arrives, as across a partition that reset them); new connections are
        accepted as before."""
        with self._lock:
            assert self._frozen, "drop the connections of a frozen proxy"
            for sock in self._peers:
                with contextlib.suppress(OSError):
                    sock.close()
            self._peers.clear()
            self._servers.clear()
        self._wake()

    def close(self) -> None:
        """Close every connection and the listening socket, and stop the thread."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(10)
        for sock in [self._listener, self._wake_r, self._wake_w, *self._peers]:
            with contextlib.suppress(OSError):
                sock.close()
        self._peers.clear()
        self._servers.clear()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    watched = [self._listener, self._wake_r]
                    if not self._frozen:
                        watched += list(self._peers)
                    elif self._replies_only:
                        watched += [sock for sock in self._peers if sock not in self._servers]
                for sock in watched:
                    selector.register(sock, selectors.EVENT_READ)
                try:
                    ready = [cast(socket.socket, key.fileobj) for key, _ in selector.select()]
                finally:
                    for sock in watched:
                        selector.unregister(sock)
                for sock in ready:
                    if sock is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    elif sock is self._listener:
                        self._accept()
                    else:
                        assert isinstance(sock, socket.socket)
                        self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(True)
            sock.settimeout(None)
        with self._lock:
            self._peers[client] = server
            self._peers[server] = client
            self._servers.add(server)

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            held = self._frozen and (not self._replies_only or sock in self._servers)
            if held or sock not in self._peers:
                return
            peer = self._peers[sock]
            try:
                data = sock.recv(65536)
                if data:
                    peer.sendall(data)
                    return
            except OSError:
                pass
            # One side closed (or failed): close both, as a proxy that goes away would.
            for end in (sock, peer):
                self._peers.pop(end, None)
                self._servers.discard(end)
                with contextlib.suppress(OSError):
                    end.close()

    def __enter__(self) -> SilentProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
