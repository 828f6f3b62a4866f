"""A TCP proxy in front of a redis-server that cuts every connection at a chosen instant.

A server that dies between doing a command and answering it leaves its client
with the command done and no answer; one that dies just before leaves it
undone. Killing the real server cannot choose the instant: this proxy can. It
forwards bytes both ways until a chunk carrying a marker passes, in one
direction or the other; then it drops that chunk, cuts every connection and
refuses new ones for a while (:meth:`FaultProxy.go_down`), as a server that
went down would, and forwards again afterwards.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit, urlunsplit

from support.plugins.object_stores import FaultProxy


class RedisCut(FaultProxy):
    """A proxy to the Redis at ``url``; :attr:`redis_url` is the same URL through it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        super().__init__(f"http://{parts.hostname}:{parts.port}")
        port = urlsplit(self.url).port
        credentials = parts.netloc.rpartition("@")[0]
        self.redis_url = urlunsplit(parts._replace(
            netloc=f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"))
        self._markers: dict[str, tuple[bytes, float] | None] = {"request": None, "reply": None}
        self._marker_lock = threading.Lock()
        self.cuts = 0

    def cut_at_request(self, marker: bytes, down_for: float) -> None:
        """Cut when a command carrying ``marker`` is sent (the server never gets it)."""
        with self._marker_lock:
            self._markers["request"] = (marker, down_for)

    def cut_at_reply(self, marker: bytes, down_for: float) -> None:
        """Cut when an answer carrying ``marker`` comes back (the server did the command,
        its client never hears of it)."""
        with self._marker_lock:
            self._markers["reply"] = (marker, down_for)

    def _client_to_server(self, client: socket.socket, upstream: socket.socket,
                          state: dict[str, bool]) -> None:
        self._pump(client, upstream, "request")

    def _server_to_client(self, client: socket.socket, upstream: socket.socket,
                          state: dict[str, bool]) -> None:
        self._pump(upstream, client, "reply")

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while True:
                chunk = source.recv(1 << 16)
                if not chunk:
                    break
                with self._marker_lock:
                    armed = self._markers[direction]
                    hit = armed is not None and armed[0] in chunk
                    if hit:
                        self._markers[direction] = None
                if hit and armed is not None:
                    self.cuts += 1
                    self.go_down(armed[1])
                    return
                sink.sendall(chunk)
        except OSError:
            return
        finally:
            self._forget(source, sink)
