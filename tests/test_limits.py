"""Time limits are the worker's, never a message's.

A message's ``timelimit`` header (``(hard, soft)``) used to replace the
worker's CHKQ_TIME_LIMIT / CHKQ_SOFT_TIME_LIMIT, and every chkq client put
its own limits there. Here a real worker with a 1 s soft / 2 s hard limit
gets a message asking for 100000 s, and the task is still stopped at the
worker's limit; and chkq's client sends no limits at all.

Each test uses a Redis database of its own on the session's redis-server, so
that no other test's worker takes its messages.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from celery.worker.request import create_request_cls
from kombu import Message

from chkq.config.celery_app import get_app, make_app
from chkq.config.limits import CONF_KEY, clamp_limits
from chkq.config.routing import COMMIT_QUEUE
from chkq.config.settings import Settings
from chkq.workers.broker import PrivateRedis
from chkq.workers.runtime.request import WorkerLimitsRequest
from support.plugins.cluster import WorkerProcess

#: Redis database of these tests (the session's tests use 0).
DB = 11

#: The worker's limits here: a commit waiting for a missing parent polls for 2 s,
#: so the 1 s soft limit stops it while it waits.
WORKER_LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "1", "CHKQ_TIME_LIMIT": "2",
                 "CHKQ_VISIBILITY_TIMEOUT": "4"}
#: What a sender asks for: (hard, soft) in seconds.
ASKED = (100000, 99999)


def _db_url(server: PrivateRedis, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


class DbWorker(WorkerProcess):
    """A ``chkq worker`` on a database of its own, asked for readiness through ``client``."""

    client: Celery

    def __init__(self, client: Celery, url: str, queues: str, log_dir: Path,
                 env: dict[str, str]) -> None:
        self.client = client
        super().__init__(url, queues, 1, log_dir, env)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log()[-2000:]}")
            if self.client.control.ping(destination=[self.name], timeout=0.5):
                return
        raise RuntimeError(f"worker {self.name} did not answer ping within {timeout} s")


@pytest.fixture
def limits_db(redis_server: PrivateRedis) -> Iterator[tuple[str, Celery]]:
    """An empty Redis database and a chkq client app (default limits) bound to it."""
    url = _db_url(redis_server, DB)
    redis.Redis.from_url(url).flushdb()
    client = make_app(Settings(broker_url=url, result_backend=url))
    yield url, client
    client.close()
    redis.Redis.from_url(url).flushdb()


# ------------------------------------------------------------------ the clamp


@pytest.mark.parametrize(("asked", "expected"), [
    (None, (2.0, 1.0)),
    ([None, None], (2.0, 1.0)),
    (list(ASKED), (2.0, 1.0)),
    ([0, 0], (2.0, 1.0)),
    ([-5, -1], (2.0, 1.0)),
    ([float("inf"), float("nan")], (2.0, 1.0)),
    ([True, "9"], (2.0, 1.0)),
    ("forever", (2.0, 1.0)),
    ([1.5, None], (1.5, 1.0)),
    ([0.5, 0.25], (0.5, 0.25)),
    ([0.5, 10], (0.5, 0.5)),
    ([None, 0.25], (2.0, 0.25)),
])
def test_clamp_limits(asked: Any, expected: tuple[float, float]) -> None:
    """A message may shorten its limits, never lengthen them or switch them off."""
    assert clamp_limits(asked, (2.0, 1.0)) == expected


class _Pool:
    """Records what a request hands to the pool."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_async(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(kwargs)


def test_pool_gets_the_worker_limits() -> None:
    """What Celery's worker passes to billiard for a message asking for 100000 s."""
    worker_app = make_app(Settings(soft_time_limit=1, time_limit=2, visibility_timeout=4))
    worker_app.loader.import_default_modules()
    worker_app.finalize()
    task = worker_app.tasks["chkq.commit"]
    pool = _Pool()
    request_cls = create_request_cls(WorkerLimitsRequest, task, pool, "test@host", None,
                                     app=worker_app)
    task_id = uuid.uuid4().hex
    headers = {"lang": "py", "task": "chkq.commit", "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "timelimit": list(ASKED)}
    message = Message(body=json.dumps([[], {}, {}]), headers=headers,
                      content_type="application/json", content_encoding="utf-8",
                      delivery_info={"routing_key": COMMIT_QUEUE})
    request = request_cls(message, app=worker_app, task=task)
    request.execute_using_pool(pool)
    assert [(c["timeout"], c["soft_timeout"]) for c in pool.calls] == [(2.0, 1.0)]
    # The task's own context (and so its retries) carries no limits of the sender's.
    assert request.request_dict["timelimit"] is None
    worker_app.close()


def test_every_task_has_the_clamping_request() -> None:
    """chkq's tasks, chkq.fail and Celery's built-in tasks all cap a message's limits."""
    get_app().loader.import_default_modules()
    get_app().finalize()
    assert get_app().conf[CONF_KEY] == (Settings().time_limit, Settings().soft_time_limit)
    for name, task in get_app().tasks.items():
        assert task.Request == "chkq.workers.runtime.request:WorkerLimitsRequest", name


# ------------------------------------------------------------ real processes


def test_client_sends_no_limits(limits_db: tuple[str, Celery]) -> None:
    """chkq's client puts no ``timelimit`` of its own in a task message (read from Redis).

    Sent as ``chkq.workers.commit_client`` does, through the app that registers the
    tasks (a task's class attributes become the message's options).
    """
    import chkq.tasks.commit  # noqa: F401 - registers chkq.commit with the process's app

    url, _ = limits_db
    with get_app().connection_for_write(url) as connection:
        get_app().signature("chkq.commit", args=("memory://", "run", "/nowhere")).apply_async(
            connection=connection)
    raw = redis.Redis.from_url(url).lpop(COMMIT_QUEUE)
    assert isinstance(raw, bytes)
    headers = json.loads(raw)["headers"]
    assert headers["task"] == "chkq.commit"
    assert headers["timelimit"] in ([None, None], None)


def test_message_limits_do_not_outlast_the_worker(limits_db: tuple[str, Celery],
                                                  tmp_path: Path) -> None:
    """A commit sent with ``timelimit=(100000, 99999)`` is stopped at the worker's 1 s.

    The commit names a parent that is not in the log: the task polls for it
    for 2 s before handing the wait to a retry. Under the worker's soft limit
    it fails with SoftTimeLimitExceeded after about 1 s; under the message's,
    it would poll, retry, poll... for about ten minutes.
    """
    url, client = limits_db
    store = tmp_path / "store"
    store.mkdir()
    checkpoint = tmp_path / "run_chk00001.h5"
    checkpoint.write_bytes(b"checkpoint bytes")
    worker = DbWorker(client, url, "commit", tmp_path,
                      {**WORKER_LIMITS, "CHKQ_ALLOWED_ROOTS": str(tmp_path)})
    try:
        started = time.monotonic()
        result = client.send_task(
            "chkq.commit", args=[f"file://{store}", "run", str(checkpoint)],
            kwargs={"parent": "f" * 64}, time_limit=ASKED[0], soft_time_limit=ASKED[1])
        while result.state not in ("FAILURE", "SUCCESS") and time.monotonic() - started < 20:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        state = AsyncResult(result.id, app=client).state
        assert state == "FAILURE", f"{state} after {elapsed:.1f} s: {worker.log()[-3000:]}"
        assert type(result.result).__name__ == "SoftTimeLimitExceeded", result.result
        assert elapsed < 10
        assert "Soft time limit (1.0s) exceeded" in worker.log()
        # The worker is still there, and nothing was committed.
        assert client.control.ping(destination=[worker.name], timeout=5)
        assert not any(p.is_file() for p in store.rglob("*"))
    finally:
        worker.stop()
