"""CHKQ_ALLOWED_ROOTS: workers refuse task messages that point outside the run roots."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from chkq.config.celery_app import get_app
from chkq.config.routing import COMMIT_QUEUE, CONTROL_QUEUE
from chkq.demo import RunShape, make_run
from support.helpers import snapshot
from support.plugins.cluster import WorkerProcess, consumers_paused

TIMEOUT = 60


def test_tasks_outside_the_allowed_roots_touch_nothing(
    tmp_path: Path, worker: WorkerProcess, start_worker: object
) -> None:
    data = tmp_path / "data"
    allowed, outside = data / "allowed", data / "outside"
    make_run(allowed, "run", RunShape(checkpoints=2, trials=10))
    make_run(outside, "run", RunShape(checkpoints=2, trials=10))
    (outside / "secret.bin").write_bytes(b"not for the store")
    (allowed / "state.bin").write_bytes(b"a checkpoint")
    before = snapshot(data)
    with consumers_paused(worker, CONTROL_QUEUE, COMMIT_QUEUE):
        start_worker("control,commit", concurrency=1,  # type: ignore[operator]
                     env={"CHKQ_ALLOWED_ROOTS": str(allowed)})
        plan = get_app().signature("chkq.plan", args=(str(outside), "run", uuid.uuid4().hex),
                             kwargs={"cleanup": True}).apply_async()
        escape = get_app().signature("chkq.plan", args=(str(allowed / ".." / "outside"), "run",
                                                  uuid.uuid4().hex)).apply_async()
        leak = get_app().signature("chkq.commit", args=(f"file://{allowed / 'store'}", "r1",
                                                  str(outside / "secret.bin"))).apply_async()
        store = get_app().signature("chkq.commit", args=(f"file://{outside / 'store'}", "r1",
                                                   str(allowed / "state.bin"))).apply_async()
        for result in (plan, escape, leak, store):
            with pytest.raises(PermissionError, match="CHKQ_ALLOWED_ROOTS"):
                result.get(timeout=TIMEOUT)
        inside = get_app().signature("chkq.commit", args=(f"file://{allowed / 'store'}", "r1",
                                                    str(allowed / "state.bin"))).apply_async()
        assert inside.get(timeout=TIMEOUT)["full_size"] == len(b"a checkpoint")
    after = snapshot(data)
    added = set(after) - set(before)
    assert {n for n in added if not n.startswith("allowed/store")} == set()
    assert {k: v for k, v in after.items() if k in before} == before
