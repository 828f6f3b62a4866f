"""A private Redis for the embedded cluster and the tests.

A ``redis-server`` on PATH is preferred (fakeredis's server costs about ten
times more per task); without one, fakeredis (with its Lua support, which
Celery's chords need) serves in a thread.

Reachable by its owner only (``unix_socket=True``, the embedded cluster's
mode): the server listens on a Unix socket, mode 0700, in a fresh directory
of mode 0700, and on no TCP port at all (``port 0``), so another local user
can neither find a port nor connect (the kernel checks the directory's and
the socket's permissions on ``connect``). It also requires a random
password, given to redis-server on its standard input (never on its
command line, which ``ps`` shows) and to clients in the URL, which the
embedded cluster passes to its workers in their environment (readable by
the owner only). fakeredis, when it serves, listens on a Unix socket in the
same kind of directory; it does not enforce the password, so there the
directory's permissions alone keep other users out. The TCP mode (on
127.0.0.1, a password too) is for tests that need a redis-py ``redis://``
URL.

No process outlives the program that started it: redis-server (like the
embedded worker) is started with :func:`die_with_parent`, so the kernel
kills it when its parent dies, however the parent dies (SIGKILL included),
and in its own session, so that a Ctrl-C at the terminal reaches only the
parent, which then stops its children in order. A TCP server that keeps no
data removes its directory as soon as it answers; a Unix-socket server's
directory holds its socket and goes when it stops (after a SIGKILL of the
embedded cluster's command, the reaper removes it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import os
import secrets
import shutil
import signal
import socket
import socketserver
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from chkq.errors import EmbeddedClusterError

#: ``prctl`` option: the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG = 1

#: Longest path a Unix socket address holds on Linux (``sun_path``, NUL included).
SOCKET_PATH_MAX = 107

#: Name of the server's socket in its private directory.
SOCKET_NAME = "redis.sock"


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when its parent dies.

    Why: a child of a process killed by SIGKILL (or crashing) would otherwise
    be re-parented to PID 1 and run on for ever. ``PR_SET_PDEATHSIG`` fires
    when the *thread* that forked the child exits, so start children from a
    thread that lives as long as they should (the main thread). If the
    parent died before the child could ask, the child kills itself at once.
    Returns None where ``prctl`` does not exist (not Linux).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def private_directory(prefix: str = "chkq-redis-") -> Path:
    """A new directory of mode 0700 whose socket path fits a Unix socket address.

    ``TMPDIR`` may be too deep for a socket path (107 bytes on Linux): then
    ``/tmp`` is used. ``mkdtemp`` creates the directory 0700, owned by the
    caller, under a name nobody could have taken before.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if len(os.fsencode(path / SOCKET_NAME)) > SOCKET_PATH_MAX:
        path.rmdir()
        path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o700)
    return path


def config_value(value: str) -> str:
    """``value`` quoted for a redis.conf line (spaces, quotes and backslashes kept)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _fake_server_classes() -> tuple[type, type]:
    """fakeredis's TCP server and request handler, made to serve a Unix socket.

    A Unix peer has no address (``''`` for all), and fakeredis keys its
    connections by address: each connection is named by a counter instead.
    """
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler, TcpFakeServer

    class UnixFakeRequestHandler(TCPFakeRequestHandler):
        def setup(self) -> None:
            self.client_address = ("unix", next(self.server.client_ids))
            super().setup()

    class UnixFakeServer(socketserver.ThreadingUnixStreamServer):
        def __init__(self, path: str) -> None:
            from fakeredis._core import FakeServer

            self.daemon_threads = False
            self._shutdown_event = threading.Event()
            super().__init__(path, UnixFakeRequestHandler)
            self.fake_server = FakeServer(server_type="redis", version=(8, 0))
            self.client_ids = itertools.count(0)
            self.clients: dict[Any, Any] = {}

        def shutdown(self) -> None:
            self._shutdown_event.set()
            super().shutdown()

    return TcpFakeServer, UnixFakeServer


class PrivateRedis:
    """A Redis server for the length of a ``with`` block; ``url`` addresses it.

    Parameters
    ----------
    persistent
        Keep an append-only file in ``data_dir`` (for restart tests);
        otherwise nothing is written to disk.
    data_dir
        Working directory of redis-server (default: the server's private
        directory, removed when the server stops).
    port
        TCP mode: the port to listen on (default: a free one).
    prefer_fake
        Use fakeredis even if redis-server is on PATH.
    unix_socket
        Listen only on a Unix socket in a private 0700 directory, no TCP
        (what the embedded cluster uses); otherwise on 127.0.0.1.
    """

    def __init__(self, *, persistent: bool = False, data_dir: Path | None = None,
                 port: int | None = None, prefer_fake: bool = False,
                 unix_socket: bool = False) -> None:
        self.persistent = persistent
        self.unix_socket = unix_socket
        self.private_dir = private_directory()
        self.socket_path = self.private_dir / SOCKET_NAME
        self.port = 0 if unix_socket else (port or free_port())
        self.data_dir = data_dir or self.private_dir
        self.prefer_fake = prefer_fake
        self.password = secrets.token_hex(32)
        self.process: subprocess.Popen[bytes] | None = None
        self._fake: Any = None

    @property
    def url(self) -> str:
        """Broker and result-backend URL for Celery, password included.

        Unix mode: ``redis+socket://:PASSWORD@/DIR/redis.sock?virtual_host=0``,
        a form kombu's Redis transport and Celery's Redis result backend both
        read (not redis-py's ``from_url``).
        """
        if self.unix_socket:
            return f"redis+socket://:{self.password}@{self.socket_path}?virtual_host=0"
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def kind(self) -> str:
        return "fakeredis" if self._fake is not None else "redis-server"

    def client(self, **options: Any) -> redis.Redis:
        """A redis-py client of this server, authenticated."""
        if self.unix_socket:
            return redis.Redis(unix_socket_path=str(self.socket_path), password=self.password,
                               **options)
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **options)

    def server_config(self) -> str:
        """redis.conf text for redis-server, fed on its standard input."""
        lines = [
            f"requirepass {self.password}",
            f"dir {config_value(str(self.data_dir))}",
            'save ""',
            f"appendonly {'yes' if self.persistent else 'no'}",
            "appendfsync always",
            "maxmemory-policy noeviction",
            "logfile " + (config_value(str(self.data_dir / "redis.log"))
                          if self.persistent else '""'),
        ]
        if self.unix_socket:
            lines += ["port 0", f"unixsocket {config_value(str(self.socket_path))}",
                      "unixsocketperm 700"]
        else:
            lines += [f"port {self.port}", "bind 127.0.0.1"]
        return "\n".join(lines) + "\n"

    def start(self) -> PrivateRedis:
        """Start the server and wait until it answers PING."""
        binary = shutil.which("redis-server")
        try:
            if binary and not self.prefer_fake:
                self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                # "-": the configuration, password included, comes on stdin.
                self.process = subprocess.Popen(
                    [binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=die_with_parent(signal.SIGKILL),
                )
                assert self.process.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    self.process.stdin.write(self.server_config().encode())
                self.process.stdin.close()
            else:
                tcp_server, unix_server = _fake_server_classes()
                if self.unix_socket:
                    self._fake = unix_server(str(self.socket_path))
                    os.chmod(self.socket_path, 0o700)
                else:
                    self._fake = tcp_server(("127.0.0.1", self.port), server_type="redis")
                threading.Thread(target=self._fake.serve_forever, daemon=True).start()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        if not (self.unix_socket or self.persistent) and self.data_dir == self.private_dir:
            # Nothing is ever written there: remove it now, so that nothing is
            # left behind even if this process is killed.
            shutil.rmtree(self.private_dir, ignore_errors=True)
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(socket_connect_timeout=0.5)
        where = self.socket_path if self.unix_socket else f"port {self.port}"
        while True:
            try:
                if client.ping():
                    return
            except redis.exceptions.RedisError:
                pass
            if self.process is not None and self.process.poll() is not None:
                raise EmbeddedClusterError(
                    f"redis-server exited with status {self.process.returncode}")
            if time.monotonic() > deadline:
                raise EmbeddedClusterError(
                    f"no Redis answered on {where} within {timeout} s")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (``kill``: SIGKILL, as a crash would)."""
        if self.process is not None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()
            self._fake = None

    def close(self) -> None:
        """Stop the server and remove its private directory (and what it kept there)."""
        self.stop()
        shutil.rmtree(self.private_dir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
