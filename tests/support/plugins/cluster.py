"""Fixtures for tests of the canvas: a private redis-server and real worker processes.

No eager mode anywhere (it cannot exercise chords): every job runs on
``chkq worker`` processes started here, against a redis-server started for
the session on a free port.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from chkq.config.celery_app import close_app, get_app, make_app, use_app
from chkq.config.settings import Settings
from chkq.workers.broker import PrivateRedis
from chkq.workers.embedded import drop_result_subscriptions
from chkq.workers.runtime.launch import kill_worker, launch_worker, stop_worker, worker_environment


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    """A redis-server of the test session's own (not the machine's 6379)."""
    if shutil.which("redis-server") is None:
        pytest.fail("the cluster tests need redis-server on PATH: `apt-get install redis-server`")
    with PrivateRedis() as server:
        os.environ["CHKQ_BROKER_URL"] = server.url
        os.environ["CHKQ_RESULT_BACKEND"] = server.url
        settings = Settings.from_env()
        session_app = make_app(settings)
        use_app(session_app, settings)
        yield server
        drop_result_subscriptions()
        close_app(session_app)


class WorkerProcess:
    """A ``chkq worker`` process serving some queues; stop it or kill it."""

    def __init__(self, broker_url: str, queues: str, concurrency: int, log_dir: Path,
                 env: dict[str, str] | None = None, name: str | None = None,
                 **popen: Any) -> None:
        self.name = name or f"test-{uuid.uuid4().hex[:8]}@localhost"
        self.log_path = log_dir / f"{self.name}-{uuid.uuid4().hex[:4]}.log"
        with open(self.log_path, "wb") as log:
            self.process = launch_worker(
                self.name, log=log, env=worker_environment(broker_url, extra=env),
                concurrency=concurrency, queues=queues, peers=True, **popen)
        self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log_path.read_text()[-2000:]}")
            replies = get_app().control.ping(destination=[self.name], timeout=0.5)
            if replies:
                return
        raise RuntimeError(f"worker {self.name} did not answer ping within {timeout} s")

    def child_pids(self) -> list[int]:
        """Pids of the worker's pool processes."""
        import psutil

        return [c.pid for c in psutil.Process(self.process.pid).children()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_worker(self.process)

    def kill(self) -> None:
        """SIGKILL the worker and its pool, as when a node dies."""
        kill_worker(self.process)


@pytest.fixture(scope="session")
def worker(redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[WorkerProcess]:
    """One worker with two processes serving every queue, for the whole session."""
    process = WorkerProcess(redis_server.url, "control,copy,verify,commit", 2,
                            tmp_path_factory.mktemp("worker-logs"))
    yield process
    process.stop()


@pytest.fixture
def start_worker(redis_server: PrivateRedis, tmp_path: Path) -> Iterator[object]:
    """Factory of extra workers for one test (e.g. only some queues); all stopped after."""
    started: list[WorkerProcess] = []

    def start(queues: str, concurrency: int = 1, env: dict[str, str] | None = None
              ) -> WorkerProcess:
        process = WorkerProcess(redis_server.url, queues, concurrency, tmp_path, env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@contextmanager
def consumers_paused(worker: WorkerProcess, *queues: str) -> Iterator[None]:
    """``worker`` stops taking tasks from ``queues`` for a while (Celery remote control)."""
    for queue in queues:
        get_app().control.cancel_consumer(queue, destination=[worker.name], reply=True)
    try:
        yield
    finally:
        for queue in queues:
            get_app().control.add_consumer(queue, destination=[worker.name], reply=True)
