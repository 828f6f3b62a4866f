"""A TCP proxy in front of a redis-server that cuts every connection at a chosen instant.

A server that dies between doing a command and answering it leaves its client
with the command done and no answer; one that dies just before leaves it
undone. Killing the real server cannot choose the instant: this proxy can. It
forwards bytes both ways until a chunk carrying a marker passes, in one
direction or the other; then it drops that chunk, cuts every connection and
refuses new ones for a while, as a server that went down would, and forwards
again afterwards.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class RedisCut:
    """A proxy to the Redis at ``url``; :attr:`url` is the same URL through the proxy."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        netloc = parts.netloc.rsplit(":", 1)[0] + f":{port}" if parts.port else (
            f"{parts.netloc}:{port}")
        self.url = urlunsplit(parts._replace(netloc=netloc))
        self._lock = threading.Lock()
        self._markers: dict[str, tuple[bytes, float] | None] = {"request": None, "reply": None}
        self._down_until = 0.0
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at_request(self, marker: bytes, down_for: float) -> None:
        """Cut when a command carrying ``marker`` is sent (the server never gets it)."""
        with self._lock:
            self._markers["request"] = (marker, down_for)

    def cut_at_reply(self, marker: bytes, down_for: float) -> None:
        """Cut when an answer carrying ``marker`` comes back (the server did the command,
        its client never hears of it)."""
        with self._lock:
            self._markers["reply"] = (marker, down_for)

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = time.monotonic() < self._down_until
            if down:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for source, sink, direction in ((client, upstream, "request"),
                                            (upstream, client, "reply")):
                threading.Thread(target=self._pump, args=(source, sink, direction),
                                 daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while True:
                chunk = source.recv(1 << 16)
                if not chunk:
                    break
                with self._lock:
                    armed = self._markers[direction]
                    hit = armed is not None and armed[0] in chunk
                    if hit:
                        assert armed is not None
                        self._markers[direction] = None
                        self._down_until = time.monotonic() + armed[1]
                        sockets = list(self._sockets)
                if hit:
                    self.cuts += 1
                    for sock in sockets:
                        _shut(sock)
                    return
                sink.sendall(chunk)
        except OSError:
            return
        finally:
            with self._lock:
                self._sockets.discard(source)
                self._sockets.discard(sink)
            _shut(source)
            _shut(sink)
