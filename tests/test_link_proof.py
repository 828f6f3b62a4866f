"""The link publishes (and cleanup deletes) only what the job's own records prove.

Real redis-server, real worker processes. A link message is forged the way
anyone with broker access could send one: the right task name, the job's
own id as task id, the right arguments, with ``--cleanup`` on.
"""

from __future__ import annotations

import time
from pathlib import Path

import h5py
import pytest
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.routing import CONTROL_QUEUE, VERIFY_QUEUE
from chkq.demo import RunShape, make_run
from chkq.jobs.proof import verify_unit_count
from chkq.tasks.state import records
from chkq.workers.client import submit_consolidation
from support.helpers import snapshot, wait_for
from support.plugins.cluster import WorkerProcess, consumers_paused

TIMEOUT = 120


def forge_link(out_dir: Path, job: str) -> None:
    get_app().signature("chkq.link", args=(str(out_dir), "run", job)).set(task_id=job).apply_async()


def test_early_link_publishes_nothing_and_deletes_nothing(tmp_path: Path,
                                                         worker: WorkerProcess) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, trials=200))
    rows = sum(h5py.File(f)["galaxy/trial"].shape[0] for f in files)
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path, cleanup=True)
        wait_for(lambda: records().merged(job.id) is not None, what="merge")
        forge_link(tmp_path, job.id)
        wait_for(lambda: "link refused" in worker.log(), what="the refusal in the log")
        assert not (tmp_path / "run.h5").exists()
        assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(".chkq-")} \
            == before
        assert not job.ready()
    output = job.wait_for_output(timeout=TIMEOUT)
    assert output == tmp_path / "run.h5"
    with h5py.File(output) as out:
        assert out["galaxy/trial"].shape[0] == rows
    assert not any(p.name.startswith("run_chk") for p in tmp_path.iterdir())


def test_link_after_failed_verification_publishes_nothing(tmp_path: Path,
                                                         worker: WorkerProcess) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=300))
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path, cleanup=True)
        wait_for(lambda: records().merged(job.id) is not None, what="merge")
        plan = records().recorded_plan(job.id)
        assert plan is not None
        with open(plan.job.temp, "r+b") as fh:
            fh.seek(plan.datasets[0].chunk_offsets[0])
            fh.write(b"\xff" * 8)
    with pytest.raises(ValueError, match="differs"):
        job.wait_for_output(timeout=TIMEOUT)
    forge_link(tmp_path, job.id)
    time.sleep(2)
    assert snapshot(tmp_path) == before
    assert AsyncResult(job.id, app=get_app()).state == "FAILURE"


def test_link_of_an_output_changed_after_verification_fails(tmp_path: Path,
                                                           worker: WorkerProcess) -> None:
    """Every record present, but the output is no longer the one they verified."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=100))
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path, cleanup=True)
        wait_for(lambda: records().merged(job.id) is not None, what="merge")
        plan = records().recorded_plan(job.id)
        assert plan is not None
        get_app().control.cancel_consumer(CONTROL_QUEUE, destination=[worker.name], reply=True)
    try:
        wait_for(lambda: len(records().verified(job.id)) == verify_unit_count(plan),
                 what="verification")
        with open(plan.job.temp, "r+b") as fh:
            fh.seek(plan.datasets[0].chunk_offsets[0])
            fh.write(b"\x01" * 8)
    finally:
        get_app().control.add_consumer(CONTROL_QUEUE, destination=[worker.name], reply=True)
    with pytest.raises(RuntimeError, match="changed after it was merged"):
        job.wait_for_output(timeout=TIMEOUT)
    assert snapshot(tmp_path) == before
