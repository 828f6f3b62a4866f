"""Consolidation against a run directory whose owner is hostile (real workers, real files).

The worker has ``CHKQ_ALLOWED_ROOTS`` set; the attacker owns a run directory
inside it and tries to make the worker read, publish or delete files outside.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.routing import CONTROL_QUEUE, COPY_QUEUE
from chkq.demo import RunShape, make_run
from chkq.errors import CheckpointChangedError
from chkq.tasks.consolidate import consolidation_signature
from chkq.tasks.state import records
from support.helpers import snapshot
from support.plugins.cluster import WorkerProcess, consumers_paused

TIMEOUT = 60


def submit(run: Path, cleanup: bool = True) -> str:
    job = uuid.uuid4().hex
    consolidation_signature(str(run), "run", job, cleanup).apply_async()
    return job


def outcome(job: str) -> BaseException | str:
    try:
        return str(AsyncResult(job, app=get_app()).get(timeout=TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return exc


@pytest.fixture
def roots(tmp_path: Path, worker: WorkerProcess,
          start_worker: Callable[..., WorkerProcess]) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    return allowed, outside


def test_checkpoint_directory_linked_out_of_the_roots(
        roots: tuple[Path, Path], worker: WorkerProcess,
        start_worker: Callable[..., WorkerProcess]) -> None:
    allowed, outside = roots
    make_run(outside, "run", RunShape(checkpoints=2, writers=2, trials=20))
    make_run(allowed / "run", "run", RunShape(checkpoints=1, trials=20))
    (allowed / "run" / "run_chk00002").symlink_to(outside / "run_chk00002")
    before = snapshot(outside)
    with consumers_paused(worker, CONTROL_QUEUE):
        start_worker("control", concurrency=1, env={"CHKQ_ALLOWED_ROOTS": str(allowed)})
        result = outcome(submit(allowed / "run"))
    assert isinstance(result, ValueError) and "symbolic link" in str(result)
    assert snapshot(outside) == before
    assert not (allowed / "run" / "run.h5").exists()


def test_checkpoint_file_linked_out_of_the_roots(
        roots: tuple[Path, Path], worker: WorkerProcess,
        start_worker: Callable[..., WorkerProcess]) -> None:
    allowed, outside = roots
    make_run(outside, "run", RunShape(checkpoints=2, trials=20))
    (allowed / "run").mkdir()
    (allowed / "run" / "run_chk00001.h5").symlink_to(outside / "run_chk00001.h5")
    before = snapshot(outside)
    with consumers_paused(worker, CONTROL_QUEUE):
        start_worker("control", concurrency=1, env={"CHKQ_ALLOWED_ROOTS": str(allowed)})
        result = outcome(submit(allowed / "run"))
    assert isinstance(result, ValueError) and "symbolic link" in str(result)
    assert snapshot(outside) == before


def test_run_directory_linked_out_of_the_roots_fails_promptly(
        roots: tuple[Path, Path], worker: WorkerProcess,
        start_worker: Callable[..., WorkerProcess]) -> None:
    """The failure handler records the failure even though the message itself is at fault."""
    allowed, outside = roots
    make_run(outside, "run", RunShape(checkpoints=2, trials=20))
    (allowed / "run").symlink_to(outside)
    before = snapshot(outside)
    with consumers_paused(worker, CONTROL_QUEUE):
        start_worker("control", concurrency=1, env={"CHKQ_ALLOWED_ROOTS": str(allowed)})
        started = time.monotonic()
        job = submit(allowed / "run")
        result = outcome(job)
    assert isinstance(result, PermissionError), result
    assert time.monotonic() - started < 30
    assert records().failure(job) is not None
    assert snapshot(outside) == before


def test_checkpoint_rewritten_in_place_with_its_mtime_restored(
        tmp_path: Path, worker: WorkerProcess) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, trials=300))
    with consumers_paused(worker, COPY_QUEUE):
        job = submit(tmp_path, cleanup=True)
        deadline = time.monotonic() + TIMEOUT
        while records().recorded_plan(job) is None:
            assert time.monotonic() < deadline, "no plan"
            time.sleep(0.05)
        st = os.stat(files[0])
        with open(files[0], "r+b") as fh:
            fh.seek(st.st_size - 16)
            fh.write(b"\x00" * 16)
        os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(files[0]).st_size, os.stat(files[0]).st_ino) == (st.st_size, st.st_ino)
    result = outcome(job)
    assert isinstance(result, CheckpointChangedError), result
    assert str(files[0]) in str(result)
    assert files[0].exists() and files[1].exists()
    assert not (tmp_path / "run.h5").exists()


def test_no_job_state_lives_in_the_run_directory(tmp_path: Path, worker: WorkerProcess) -> None:
    """Plan, markers and digests are kept where only workers write: editing the directory
    cannot change what a job does."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=50, compression="gzip"))
    with consumers_paused(worker, COPY_QUEUE):
        job = submit(tmp_path, cleanup=False)
        deadline = time.monotonic() + TIMEOUT
        while records().recorded_plan(job) is None:
            assert time.monotonic() < deadline, "no plan"
            time.sleep(0.05)
        own = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".chkq-"))
        assert own == [f".chkq-{job}.run.h5.tmp"]
    assert isinstance(outcome(job), str)
    assert (tmp_path / "run.h5").exists()
