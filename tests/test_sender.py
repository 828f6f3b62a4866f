"""The job's first message sent straight to Redis is the one Celery sends, and workers run it.

Celery's message is captured by publishing it through a Celery app to a
redis-server of the test's own (nothing consumes it there) and reading what
Celery wrote; the direct sender's entry, built with the values Celery picked at
random (the delivery tag, the reply queue, the event's time), must be the same
bytes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from chkq.config.celery_app import close_app, get_app, get_settings, make_app, use_app
from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.jobs import first_messages
from chkq.tasks.canvas import consolidation_signature
from chkq.tasks.from_store import stage_signature
from chkq.workers import client, sender
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import consolidate_checkpoints, submit_consolidation
from support.helpers import assert_consolidated
from support.plugins.cluster import WorkerProcess

pytestmark = pytest.mark.cluster

TIMEOUT = 120
QUEUE = "chkq.control"
EVENTS = "/0.celeryev/task.sent"

PARTY = {"user": "ann", "issued": 1796595762.5,
         "claim": {"task": "chkq.plan", "dirs": ["/runs/a"], "cleanup": False},
         "mac": "9f" * 32}



def _plan(out_dir: str, model: str, job: str, cleanup: bool = False, allow_gaps: bool = False,
          party: dict[str, Any] | None = None, through: int | None = None) -> Case:
    args = [out_dir, model, job]
    return Case(consolidation_signature(out_dir, model, job, cleanup, allow_gaps, party=party,
                                        through=through),
                sender.PLAN_TASK, args,
                first_messages.plan_kwargs(cleanup, allow_gaps, party, through), args)


def _stage(source: str, model: str, job: str, run: str | None = None, to: str | None = None,
           cleanup: bool = False, allow_gaps: bool = False,
           party: dict[str, Any] | None = None, verify_data: bool = False) -> Case:
    return Case(stage_signature(source, model, job, run=run, to=to, cleanup=cleanup,
                                allow_gaps=allow_gaps, party=party, verify_data=verify_data),
                sender.STAGE_TASK, [source, model, job],
                first_messages.stage_kwargs(run, to, cleanup, allow_gaps, party, verify_data),
                ["", model, job])


@dataclass
class Case:
    """One job's first message: Celery's signature of it, and the direct sender's arguments."""

    signature: Any
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    fail_args: list[Any]


#: A job's first message: plain, a path needing quotes, every option set; for a run
#: directory and for a run in a store.
CASES: list[Callable[[str], Case]] = [
    lambda job: _plan("/runs/plain", "run", job),
    lambda job: _plan("/runs/it's \"quoted\"\\é ünïcode", "m-1", job, cleanup=True),
    lambda job: _plan("/runs/a", "run", job, allow_gaps=True, party=PARTY, through=7),
    lambda job: _stage("s3://bucket/runs/", "run", job),
    lambda job: _stage("gs://b/p/", "run", job, run="r1", to="gs://b/out.h5", cleanup=True,
                       allow_gaps=True, party=PARTY, verify_data=True),
]


@pytest.fixture(params=["tcp", "unix"])
def private_app(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """A Celery app on a redis-server of this test's own (over TCP, or a Unix socket as
    the embedded cluster's), made this process's app; and a client of that server."""
    with PrivateRedis(unix_socket=request.param == "unix") as server:
        settings = replace(Settings.from_env(), broker_url=server.url,
                           result_backend=server.url)
        app = make_app(settings)
        previous = use_app(app)
        try:
            yield app, server.client()
        finally:
            use_app(previous)
            close_app(app)


def _sends(redis: Any, send: Callable[[], Any]) -> tuple[str, str, dict[str, Any]]:
    """What ``send()`` writes for a job's first message: the list entry, the sent event
    and the queue's other keys."""
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(EVENTS)
    events.get_message(timeout=1.0)
    send()
    entry = redis.rpop(QUEUE).decode()
    assert redis.llen(QUEUE) == 0
    deadline = time.monotonic() + 5
    event = None
    while event is None and time.monotonic() < deadline:
        event = events.get_message(timeout=1.0)
    events.close()
    assert event is not None, "no task-sent event published"
    return entry, event["data"].decode(), _queue_keys(redis)


def _queue_keys(redis: Any) -> dict[str, Any]:
    """Everything but the message that a send leaves in Redis for the queue."""
    return {"keys": sorted(redis.keys("*")),
            "binding": redis.smembers(f"_kombu.binding.{QUEUE}"),
            "permanent": redis.smembers(f"_kombu.binding_permanent.{QUEUE}"),
            "ring": redis.lrange(f"chkq:ring:{QUEUE}", 0, -1),
            "ring expires": 0 < redis.ttl(f"chkq:ring:{QUEUE}") <= sender.RING_SECONDS}


def _body(raw: str) -> Any:
    import base64

    return json.loads(base64.b64decode(json.loads(raw)["body"]))


@pytest.mark.parametrize("make", CASES)
def test_the_direct_message_is_celerys_byte_for_byte(
        private_app: tuple[Any, Any], make: Callable[[str], Case]) -> None:
    """Entry on the queue's list, sent event, binding and ring: what Celery writes."""
    app, redis = private_app
    job = os.urandom(16).hex()
    case = make(job)
    entry, event, state = _sends(redis, case.signature.apply_async)
    celery = json.loads(entry)
    built = sender.job_message(case.task, job, case.args, case.kwargs, case.fail_args,
                               sender=celery["headers"]["origin"],
                               reply_to=celery["properties"]["reply_to"],
                               delivery_tag=celery["properties"]["delivery_tag"],
                               ignored=sender.ignore_result(app, case.task))
    assert built is not None
    assert built[0] == entry
    celery_event, shown = json.loads(event), _body(event)
    assert sender.sent_event(built[1], sender=shown["hostname"], clock=shown["clock"],
                             timestamp=shown["timestamp"],
                             delivery_tag=celery_event["properties"]["delivery_tag"]) == event

    redis.flushdb()
    sent: list[bool] = []
    direct_entry, direct_event, direct_state = _sends(redis, lambda: sent.append(
        sender.send_job(app, case.task, job, case.args, case.kwargs, case.fail_args)))
    assert sent == [True]
    direct = json.loads(direct_entry)
    assert sender.origin() == celery["headers"]["origin"]
    for message in (direct, celery):
        message["properties"]["delivery_tag"] = message["properties"]["reply_to"] = "-"
    assert direct == celery
    assert direct_state == state
    events = [json.loads(direct_event), celery_event]
    bodies = [_body(direct_event), shown]
    for outer, body in zip(events, bodies, strict=True):
        outer["properties"]["delivery_tag"] = outer["body"] = "-"
        body["timestamp"] = body["clock"] = 0
    assert events[0] == events[1] and bodies[0] == bodies[1]


def test_signed_or_unusual_messages_go_through_celery(private_app: tuple[Any, Any]) -> None:
    """Anything the direct message does not reproduce is left to Celery: nothing sent."""
    app, redis = private_app
    assert sender.direct_broker(app) is not None
    app.conf.task_serializer = "auth"
    assert sender.direct_broker(app) is None
    assert not sender.send_job(app, sender.PLAN_TASK, "a" * 32, ["/runs/a", "run", "a" * 32],
                               {"cleanup": False}, ["/runs/a", "run", "a" * 32])
    app.conf.task_serializer = "json"
    app.conf.task_default_priority = 5
    assert sender.direct_broker(app) is None
    app.conf.task_default_priority = None
    app.conf.broker_transport_options = {"global_keyprefix": "x:"}
    assert sender.direct_broker(app) is None
    for url in ("amqp://guest@localhost//", "rediss://localhost:6380/0?ssl_cert_reqs=required"):
        app.conf.broker_url = url
        assert sender.direct_broker(app) is None
    for args, kwargs in (([f"/runs/{'x' * 2000}", "run"], {"cleanup": False}),
                         (["/runs/a", "run"], {"cleanup": False, "at": object()})):
        assert sender.job_message(sender.PLAN_TASK, "a" * 32, args, kwargs, args, sender="s",
                                  reply_to="r", delivery_tag="t") is None
    assert redis.llen(QUEUE) == 0


@pytest.fixture
def direct_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Submissions must take the direct path: sending through Celery fails the test."""
    def through_celery(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the job was sent through Celery, not directly")

    monkeypatch.setattr(client, "consolidation_signature", through_celery)


def test_a_worker_runs_a_job_sent_directly(worker: WorkerProcess, tmp_path: Path,
                                          direct_only: None) -> None:
    """The output of a directly sent job holds every checkpoint's rows."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=20))
    assert sender.direct_broker(get_app()) is not None
    job = submit_consolidation("run", tmp_path)
    output = job.wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)


def test_a_bad_run_sent_directly_fails_through_its_errback(
        worker: WorkerProcess, tmp_path: Path, direct_only: None) -> None:
    """A checkpoint that is not HDF5: the plan fails, ``chkq.fail`` ends the job, the client
    hears the cause; no output, no temporaries."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=10))
    (tmp_path / "run_chk00002" / "thread_0001.h5").write_bytes(b"not hdf5 at all" * 100)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    job = submit_consolidation("run", tmp_path)
    with pytest.raises(ValueError, match=r"thread_0001.h5.*not HDF5"):
        job.wait_for_output(timeout=TIMEOUT)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.fixture
def no_broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process has no broker configured (as a user without ``CHKQ_BROKER_URL``)."""
    for name in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    settings = get_settings()
    previous = use_app(None, replace(settings, broker_url=None, result_backend=None))
    try:
        yield
    finally:
        use_app(previous, settings)


def test_an_embedded_cluster_runs_a_job_sent_directly(tmp_path: Path, direct_only: None,
                                                       no_broker: None) -> None:
    """No broker configured: the embedded cluster's Unix-socket Redis gets the message
    directly, and its workers consolidate the run."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=20))
    output = consolidate_checkpoints("run", tmp_path, workers=1)
    assert_consolidated(Path(output), files)
