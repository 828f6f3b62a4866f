"""A private Redis for the embedded cluster and the tests.

A ``redis-server`` on PATH is preferred (NOTES: fakeredis's TCP server costs
about ten times more per task); without one, fakeredis's TCP server (with
its Lua support, which Celery's chords need) runs in a thread.

No process outlives the program that started it: redis-server (like the
embedded worker) is started with :func:`die_with_parent`, so the kernel
kills it when its parent dies, however the parent dies (SIGKILL included),
and in its own session, so that a Ctrl-C at the terminal reaches only the
parent, which then stops its children in order. A server that keeps no data
leaves no directory behind either: its working directory is removed as soon
as it answers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
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


class PrivateRedis:
    """A Redis server for the length of a ``with`` block; ``url`` addresses it.

    Parameters
    ----------
    persistent
        Keep an append-only file in ``data_dir`` (for restart tests);
        otherwise nothing is written to disk.
    data_dir
        Working directory of redis-server (default: a new temporary one,
        removed once the server answers when nothing is persisted, and when
        the server stops otherwise).
    port
        Port to listen on (default: a free one).
    prefer_fake
        Use fakeredis's TCP server even if redis-server is on PATH.
    """

    def __init__(self, *, persistent: bool = False, data_dir: Path | None = None,
                 port: int | None = None, prefer_fake: bool = False) -> None:
        self.persistent = persistent
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="chkq-redis-")
        self.data_dir = data_dir or Path(self._tmp)  # type: ignore[arg-type]
        self.prefer_fake = prefer_fake
        self.process: subprocess.Popen[bytes] | None = None
        self._fake: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def kind(self) -> str:
        return "fakeredis" if self._fake is not None else "redis-server"

    def start(self) -> PrivateRedis:
        """Start the server and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary and not self.prefer_fake:
            self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            args = [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.persistent else "no",
                "--appendfsync", "always",
                "--maxmemory-policy", "noeviction",
                "--logfile", str(self.data_dir / "redis.log") if self.persistent else "",
            ]
            self.process = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
            )
        else:
            from fakeredis import TcpFakeServer

            self._fake = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
            threading.Thread(target=self._fake.serve_forever, daemon=True).start()
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        if not self.persistent and self._tmp is not None:
            # Nothing is ever written there: remove it now, so that nothing is
            # left behind even if this process is killed.
            shutil.rmtree(self._tmp, ignore_errors=True)
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
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
                    f"no Redis answered on port {self.port} within {timeout} s")
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
        self.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
