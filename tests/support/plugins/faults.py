"""Clusters of one test's own, and the checks of a clean failure.

A cluster is a private redis-server and workers with short time limits, for
scenarios that kill processes or Redis; a clean failure leaves the run
directory exactly as it was: no output, no temporaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from chkq.config.celery_app import close_app, get_app, get_settings, make_app, use_app
from chkq.demo import RunShape
from chkq.jobs.keys import deliveries as deliveries_key
from chkq.tasks.consolidate import task_id
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import ConsolidationJob
from support.helpers import snapshot
from support.plugins.cluster import WorkerProcess

# Limits of the clusters started here: tasks of a few seconds, a hard limit
# above the slowest of them (a 3 s verification on 2 loaded cores), and the
# visibility timeout above the hard limit, as chkq.config.settings requires.
FAULT_LIMITS = {
    "CHKQ_SOFT_TIME_LIMIT": "8",
    "CHKQ_TIME_LIMIT": "10",
    "CHKQ_VISIBILITY_TIMEOUT": "12",
}

#: Limits far above a test's own waits: only chkq's own recovery brings a task back in
#: time (the visibility timeout's sweep cannot).
LONG_LIMITS = {
    "CHKQ_SOFT_TIME_LIMIT": "500",
    "CHKQ_TIME_LIMIT": "600",
    "CHKQ_VISIBILITY_TIMEOUT": "1200",
}


# A run whose copy takes a second or more whatever the copy code's speed:
# gzip data whose file boundaries fall inside chunks must be decoded and
# encoded again, and fletcher32 keeps the encoding on HDF5's own zlib
# (chkq.consolidation.chunk_encoding encodes only [shuffle,] deflate pipelines, about 20x
# faster). ``spectra/spec`` (10 MB) is the long copy task.
SLOW = FAULT_LIMITS


SLOW_RUN = RunShape(checkpoints=2, trials=10007, spec_columns=64, compression="gzip",
                    fletcher32=True, chunk_rows=100)


def leftovers(directory: Path) -> list[str]:
    """Files a job leaves behind: temporaries (``.chkq-*``) anywhere below ``directory``."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".chkq-*"))


def checkpoints_only(before: dict[str, str], directory: Path) -> None:
    """A clean failure: the directory is exactly as it was (no output, no temporaries)."""
    assert not (directory / "run.h5").exists()
    assert leftovers(directory) == []
    assert snapshot(directory) == before


class Cluster:
    """A private redis-server and workers of one test; the client app points at it."""

    def __init__(self, log_dir: Path, *, persistent: bool = False) -> None:
        self.log_dir = log_dir
        data_dir = log_dir / "redis-data" if persistent else None
        if data_dir is not None:
            data_dir.mkdir()
        self.redis = PrivateRedis(persistent=persistent, data_dir=data_dir)
        self.workers: list[WorkerProcess] = []

    def start(self) -> Cluster:
        self.redis.start()
        assert self.redis.kind == "redis-server"
        self.app = make_app(replace(get_settings(), broker_url=self.redis.url,
                                    result_backend=self.redis.url))
        self.previous = use_app(self.app)
        return self

    def add_workers(self, count: int, queues: str = "control,copy,verify", concurrency: int = 1,
                    env: dict[str, str] | None = None, **popen: Any) -> list[WorkerProcess]:
        """Start ``count`` workers at once (each waits until it answers ping).

        ``popen`` goes to each worker's :class:`subprocess.Popen` (``user``, say), and a
        ``name`` to the worker (then ``count`` must be 1).
        """
        environment = {**FAULT_LIMITS, **(env or {})}
        with ThreadPoolExecutor(count) as pool:
            started = list(pool.map(
                lambda _: WorkerProcess(self.redis.url, queues, concurrency, self.log_dir,
                                        environment, **popen), range(count)))
        self.workers += started
        return started

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def deliveries(self, job: ConsolidationJob, step: str, unit: int | None = None) -> int:
        """How often the task of ``step`` was delivered (the counter chkq keeps)."""
        raw = self.client().get(deliveries_key(task_id(job.id, step, unit)))
        return int(raw or 0)

    def running(self, task: str) -> tuple[WorkerProcess, int] | None:
        """The worker, and the pid of its pool process, running task ``task`` now."""
        names = [w.name for w in self.workers if w.process.poll() is None]
        active = get_app().control.inspect(destination=names, timeout=1.0).active() or {}
        for worker in self.workers:
            for request in active.get(worker.name, []):
                if request.get("id") == task:
                    return worker, int(request["worker_pid"])
        return None

    def release(self) -> None:
        """Make the previous app the process's again (the session's)."""
        use_app(self.previous)

    def close(self) -> None:
        forget_results(self.app)
        for worker in self.workers:
            worker.kill()
        close_app(self.app)
        self.redis.close()


def forget_results(app: Celery) -> None:
    """Drop ``app``'s result subscriptions without a word to its Redis (maybe killed by now).

    Celery unsubscribes from a task's result when its AsyncResult is collected, which
    may be long after the cluster is gone (a reference cycle waits for the collector):
    an unsubscription then retries its dead Redis for 20 s, in whichever test the
    collector happens to run. Forgotten here, the handles have nothing left to undo.
    """
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is None:
        return
    consumer.subscribed_to.clear()
    consumer._pending_unsubscribe.clear()
    pubsub, consumer._pubsub = consumer._pubsub, None
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()


@pytest.fixture
def make_cluster(redis_server: PrivateRedis, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Clusters of this test's own; afterwards the client app is back on the session's."""
    clusters: list[Cluster] = []

    def make(persistent: bool = False) -> Cluster:
        log_dir = tmp_path / f"cluster-{len(clusters)}"
        log_dir.mkdir()
        cluster = Cluster(log_dir, persistent=persistent)
        clusters.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in reversed(clusters):
            cluster.release()
        for cluster in clusters:
            cluster.close()

