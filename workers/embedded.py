"""The embedded local cluster: a private broker and local worker processes.

With no ``CHKQ_BROKER_URL``, ``chkq consolidate`` (and ``chkq log commit``)
run inside one of these: the same canvas and the same worker code as a real
cluster, against a broker started for the length of the command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery.result import AsyncResult

from chkq.config.celery_app import app, use_broker
from chkq.config.routing import QUEUES
from chkq.workers.broker import PrivateRedis


def worker_command(concurrency: int, queues: list[str], name: str,
                   loglevel: str = "INFO") -> list[str]:
    """The command line of a chkq worker process."""
    return [
        sys.executable, "-m", "celery", "-A", "chkq.config.celery_app:app", "worker",
        "-c", str(concurrency), "-Q", ",".join(queues), "-n", name,
        "--loglevel", loglevel, "-P", "prefork",
        "--without-gossip", "--without-mingle",
    ]


def drop_result_subscriptions() -> None:
    """Close the client's result subscriptions while its broker still answers.

    Celery subscribes to a task's result when it sends it and unsubscribes
    when the AsyncResult is collected, which may be after the broker is
    gone: the unsubscription would then fail noisily at exit.
    """
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.subscribed_to.clear()
        consumer.stop()


class EmbeddedCluster:
    """A private Redis and one worker with ``workers`` processes, for a ``with`` block."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.broker = PrivateRedis()
        self._logdir = tempfile.TemporaryDirectory(prefix="chkq-embedded-")
        self.log_path = Path(self._logdir.name) / "worker.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EmbeddedCluster:
        self.broker.start()
        use_broker(app, self.broker.url)
        env = {**os.environ, "CHKQ_BROKER_URL": self.broker.url,
               "CHKQ_RESULT_BACKEND": self.broker.url}
        name = f"embedded-{uuid.uuid4().hex[:8]}@%h"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                worker_command(self.workers, list(QUEUES), name), env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def check_alive(self) -> None:
        """Raise RuntimeError, with the worker's last log lines, if the worker died."""
        if self.process is not None and self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-10:]
            raise RuntimeError(
                f"the embedded worker exited with status {self.process.returncode}: "
                + " | ".join(tail)
            )

    def wait(self, result: AsyncResult, timeout: float | None = None) -> Any:
        """``result.get()``, but raising at once if the worker dies meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not result.ready():
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"task {result.id} did not finish within {timeout} s")
            time.sleep(0.05)
        return result.get()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        drop_result_subscriptions()
        self.broker.close()
        self._logdir.cleanup()
