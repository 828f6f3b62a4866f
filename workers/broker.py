"""A private Redis for the embedded cluster and the tests.

A ``redis-server`` on PATH is preferred (NOTES: fakeredis's TCP server costs
about ten times more per task); without one, fakeredis's TCP server (with
its Lua support, which Celery's chords need) runs in a thread.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis


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
        Working directory of redis-server (default: a new temporary one).
    port
        Port to listen on (default: a free one).
    """

    def __init__(self, *, persistent: bool = False, data_dir: Path | None = None,
                 port: int | None = None, prefer_fake: bool = False) -> None:
        self.persistent = persistent
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="chkq-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
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
            args = [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.persistent else "no",
                "--appendfsync", "always",
                "--maxmemory-policy", "noeviction",
                "--logfile", str(self.data_dir / "redis.log"),
            ]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
        else:
            from fakeredis import TcpFakeServer

            self._fake = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
            threading.Thread(target=self._fake.serve_forever, daemon=True).start()
        self._wait_ready()
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
                raise RuntimeError(f"redis-server exited with status {self.process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Redis answered on port {self.port} within {timeout} s")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (``kill``: SIGKILL, as a crash would)."""
        if self.process is not None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(10)
            self.process = None
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()
            self._fake = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
