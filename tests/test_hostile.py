"""Hostile and broken messages on every queue a worker consumes.

A message is untrusted input: whoever can write to the broker can
publish anything. Here raw messages are published with kombu, bypassing
chkq's client, to the four task queues, the worker's remote-control
(pidbox) exchange and the event exchange its gossip listens on. After
them, the worker must still be alive and answer ping, no pickle must have
been unpickled (the payload would create a file), no file outside a job's
own temporaries may have changed, and a real consolidation must succeed.
"""

from __future__ import annotations

import json
import pickle
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.result import AsyncResult
from kombu import Connection, Exchange, Producer

from chkq.config.celery_app import get_app
from chkq.config.routing import QUEUES
from chkq.consolidation.prepare import prepare
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.demo import RunShape, make_run
from chkq.tasks.state import records
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import submit_consolidation
from support.helpers import assert_consolidated, snapshot
from support.plugins.cluster import WorkerProcess

TIMEOUT = 60


class _CreatesFile:
    """Unpickling this object opens (creates) ``path`` for writing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _headers(task: str, task_id: str | None = None) -> dict[str, Any]:
    """Protocol 2 headers of a task message."""
    tid = task_id or uuid.uuid4().hex
    return {"lang": "py", "task": task, "id": tid, "root_id": tid, "parent_id": None,
            "group": None, "retries": 0, "eta": None, "expires": None,
            "argsrepr": "", "kwargsrepr": "", "origin": "hostile@test"}


def _body(*args: Any, **kwargs: Any) -> str:
    return json.dumps([list(args), kwargs,
                       {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])


class Publisher:
    """Publishes raw messages (any body, content type and headers) with kombu."""

    def __init__(self, url: str) -> None:
        self.connection = Connection(url)
        self.producer = Producer(self.connection.channel())
        self.task_ids: list[str] = []

    def to_queue(self, queue: str, body: bytes | str, *, headers: dict[str, Any] | None,
                 content_type: str = "application/json",
                 content_encoding: str = "utf-8") -> None:
        declared = get_app().amqp.queues[queue]
        self.producer.publish(
            body, exchange=declared.exchange, routing_key=declared.routing_key,
            declare=[declared], serializer=None, content_type=content_type,
            content_encoding=content_encoding, headers=headers or {}, retry=True,
        )

    def task(self, queue: str, name: str, *args: Any, **kwargs: Any) -> str:
        """A well-formed JSON task message with the given arguments; returns its id."""
        headers = _headers(name)
        self.to_queue(queue, _body(*args, **kwargs), headers=headers)
        self.task_ids.append(headers["id"])
        return str(headers["id"])

    def to_exchange(self, exchange: Exchange, routing_key: str, body: bytes | str,
                    content_type: str, content_encoding: str = "utf-8") -> None:
        self.producer.publish(body, exchange=exchange, routing_key=routing_key,
                              declare=[exchange], serializer=None, content_type=content_type,
                              content_encoding=content_encoding, retry=True)

    def close(self) -> None:
        self.connection.release()


@pytest.fixture
def publisher(redis_server: PrivateRedis) -> Iterator[Publisher]:
    pub = Publisher(redis_server.url)
    yield pub
    pub.close()


def _wait_drained(url: str, timeout: float = TIMEOUT) -> None:
    """Wait until every task queue is empty and no message is unacknowledged."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = sum(int(client.llen(q)) for q in QUEUES)
        unacked = int(client.zcard("unacked_index"))
        if pending == 0 and unacked == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"queues not drained within {timeout} s")


def _broken_messages(pub: Publisher, queue: str, marker: Path) -> None:
    """Messages no worker may act on: pickle, unknown task, broken JSON, wrong shapes."""
    evil = pickle.dumps(((_CreatesFile(marker),), {}, {}), protocol=2)
    for task in ("chkq.plan", "chkq.copy", "celery.chord_unlock"):
        pub.to_queue(queue, evil, headers=_headers(task),
                     content_type="application/x-python-serialize", content_encoding="binary")
    # A pickle whose content type lies, and one sent as protocol 1 (no headers).
    pub.to_queue(queue, evil, headers=_headers("chkq.plan"),
                 content_type="application/json", content_encoding="binary")
    pub.to_queue(queue, pickle.dumps({"task": "chkq.plan", "id": uuid.uuid4().hex,
                                      "args": [_CreatesFile(marker)], "kwargs": {}}),
                 headers=None, content_type="application/x-python-serialize",
                 content_encoding="binary")
    # Content types kombu passes through undecoded, and ones it has no decoder for.
    for content_type in ("application/data", "application/text", "application/x-yaml",
                         "application/x-msgpack", ""):
        pub.to_queue(queue, evil, headers=_headers("chkq.plan"),
                     content_type=content_type, content_encoding="binary")
    pub.to_queue(queue, _body(), headers=_headers("chkq.no_such_task"))
    pub.to_queue(queue, _body(), headers={**_headers("os.system"), "id": None})
    for broken in ('{"not json', "[[], {}, {]", "\xff\xfe", "", "null"):
        pub.to_queue(queue, broken, headers=_headers("chkq.plan"))
    # Well-formed JSON, wrong structure.
    for body in ({"args": []}, [1, 2], [[], [], []], ["x", {}, {}], [[], {}, "embed"],
                 [[], {}, {"callbacks": "chkq.fail", "chord": 5}], 42, "text"):
        pub.to_queue(queue, json.dumps(body), headers=_headers("chkq.verify"))
    # Headers of the wrong type or missing.
    for headers in ({"task": ["chkq.plan"], "id": "x"}, {"task": {"a": 1}, "id": "y"},
                    {"task": None, "id": "z"}, {"task": "chkq.plan"},
                    {**_headers("chkq.plan"), "eta": "yesterday"},
                    {**_headers("chkq.plan"), "expires": "never"},
                    {**_headers("chkq.plan"), "timelimit": "forever"},
                    {**_headers("chkq.plan"), "retries": "many"},
                    {"id": uuid.uuid4().hex}):
        pub.to_queue(queue, _body(), headers=headers)  # type: ignore[arg-type]
    # Protocol 1 with a JSON body that is not a task at all.
    pub.to_queue(queue, json.dumps(["not", "a", "task"]), headers=None)
    pub.to_queue(queue, json.dumps({"task": ["x"], "id": 1}), headers=None)


def _hostile_tasks(pub: Publisher, queue: str, run: Path, outside: Path, job: str) -> list[str]:
    """chkq tasks whose arguments try to reach outside the run; returns their ids."""
    a_file = outside / "victim_chk00001.h5"
    hex_job = uuid.uuid4().hex
    sent = []
    for task in ("chkq.plan", "chkq.copy", "chkq.merge", "chkq.verify", "chkq.link"):
        unit = (0,) if task in ("chkq.copy", "chkq.verify") else ()
        for out_dir, model, job_id in (
            (str(run), "../outside/victim", hex_job),
            (str(run), "a/b", hex_job),
            (str(run), "..", hex_job),
            (str(run), "", hex_job),
            (str(run), ".chkq-x", hex_job),
            (str(run), "run\x00", hex_job),
            (str(run), ["run"], hex_job),
            (str(a_file), "victim", hex_job),
            (str(run / "missing"), "run", hex_job),
            (".", "run", hex_job),
            ("../" * 8 + "tmp", "run", hex_job),
            (str(run), "run", "../" + hex_job),
            (str(run), "run", "../../outside/x"),
            (str(run), "run", hex_job + "/.."),
            (str(run), "run", 12345678),
            (str(run), "run", "DEADBEEF"),
            (None, "run", hex_job),
        ):
            sent.append(pub.task(queue, task, out_dir, model, job_id, *unit))
    # A unit number out of range, negative, of the wrong type, against a real plan.
    for task in ("chkq.copy", "chkq.verify"):
        for unit in (10**6, -1, -(10**18), "0", 0.5, True, None, [0], {"unit": 0}):
            sent.append(pub.task(queue, task, str(run), "run", job, unit))
    # Keyword arguments a task does not take, or of the wrong type.
    sent.append(pub.task(queue, "chkq.plan", str(run), "run", hex_job, cleanup="false"))
    sent.append(pub.task(queue, "chkq.plan", str(run), "run", hex_job, evil=1))
    sent.append(pub.task(queue, "chkq.copy", str(run), "run", job, 0, datasets=7))
    # The errback, asked to clean up another directory or with garbage.
    sent.append(pub.task(queue, "chkq.fail", None, {"exc_type": "X"}, None,
                         str(outside), "victim", "../x"))
    sent.append(pub.task(queue, "chkq.fail", "a", "b"))
    return sent


def test_hostile_messages_on_every_queue_leave_worker_and_files_alone(
    tmp_path: Path, worker: WorkerProcess, publisher: Publisher, redis_server: PrivateRedis,
) -> None:
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    outside = tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    files = make_run(run, "run", RunShape(checkpoints=3, writers=2, trials=300))
    make_run(outside, "victim", RunShape(checkpoints=1, trials=10))
    # A real plan on disk, so that unit-number checks are reached.
    planned = uuid.uuid4().hex
    records().store_plan(prepare(run, "run", planned))
    before_run, before_outside = snapshot(run), snapshot(outside)

    for queue in QUEUES:
        _broken_messages(publisher, queue, marker)
        _hostile_tasks(publisher, queue, run, outside, planned)
    # The fanout exchanges a worker also consumes: remote control and events (gossip).
    evil = pickle.dumps(_CreatesFile(marker))
    for exchange, key in ((Exchange("celery.pidbox", type="fanout"), ""),
                          (Exchange("celeryev", type="topic"), "worker.heartbeat")):
        publisher.to_exchange(exchange, key, evil, "application/x-python-serialize", "binary")
        publisher.to_exchange(exchange, key, '{"broken', "application/json")
        publisher.to_exchange(exchange, key, json.dumps([1, 2]), "application/json")
        publisher.to_exchange(exchange, key, evil, "application/data", "binary")
    _wait_drained(redis_server.url)

    assert not marker.exists(), "a pickle was unpickled"
    assert worker.process.poll() is None, f"worker died:\n{worker.log()[-3000:]}"
    assert get_app().control.ping(destination=[worker.name], timeout=5), "no answer to ping"
    assert snapshot(outside) == before_outside
    assert snapshot(run) == before_run, "a hostile task changed the run directory"
    # Every hostile chkq task failed on its arguments, before touching a file.
    for task_id in publisher.task_ids:
        result = AsyncResult(task_id, app=get_app())
        assert result.state == "FAILURE", (task_id, result.state, result.result)
        assert isinstance(result.result, TypeError | ValueError | OSError), result.result
    log = worker.log()
    assert "Unrecoverable error" not in log
    assert "Connection to broker lost" not in log, "a message made the worker reconnect"
    assert "Refusing to deserialize untrusted content" in log or "refusing task message" in log

    # The worker still does real work, correctly.
    discard_job_files(JobFiles(run, "run", planned))
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert output == run / "run.h5"
    assert_consolidated(output, files)
    assert not marker.exists()
    assert snapshot(outside) == before_outside
    assert worker.process.poll() is None
