"""Real faults in a store job spread over two nodes (moto's S3 server over HTTP).

A node killed outright while it sends a part; the staging node lost for good
once the parts are sent; the upload aborted under the job by ``chkq gc``; a
source object replaced after it was pinned. Each ends in the whole verified
output, or in a clear failure with nothing at the output's key and no
unfinished upload left in the store.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from test_from_store import fetched, reference_output, upload_run
from test_node_loss_steps import job_lines, step_lines

from chkq.demo import RunShape, make_run
from chkq.stores import CheckpointStore, open_store
from chkq.stores.publish import sweep_uploads
from chkq.tasks.state import records
from chkq.workers.client import ConsolidationJob, submit_store_consolidation
from support.helpers import assert_same_hdf5, wait_for
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import FAULT_LIMITS, Cluster
from support.plugins.object_stores import BUCKET

pytestmark = [pytest.mark.integration, pytest.mark.fault]

JOB_SECONDS = 150


def _two_nodes(make_cluster: Callable[..., Cluster], tmp_path: Path) -> list[WorkerProcess]:
    cluster = make_cluster()
    reference = tmp_path / "reference"
    reference.mkdir()
    workers = []
    for node in ("node0", "node1"):
        scratch = tmp_path / node
        scratch.mkdir(mode=0o700)
        workers += cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
            **FAULT_LIMITS, "CHKQ_SCRATCH_DIR": str(scratch / "work"),
            "CHKQ_SPREAD_BYTES": "0", "CHKQ_UPLOAD_PART_BYTES": str(5 << 20),
            "CHKQ_ALLOWED_ROOTS": f"{scratch}:{reference}"})
    return workers


def _run_in_s3(tmp_path: Path, s3_endpoint: str) -> tuple[list[Path], Path, str, CheckpointStore]:
    del s3_endpoint
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=3, writers=2, trials=2_000,
                                              spec_columns=1_000, chunk_rows=89))
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/"
    store = open_store(url)
    upload_run(files, run_dir, store)
    return files, run_dir, url, store


def _staging_queue(job: ConsolidationJob) -> str:
    recorded = records().store_job_record(job.id)
    assert recorded is not None
    return str(recorded["queue"])


def _parts_sent(job: ConsolidationJob) -> int:
    return len(records().parts(job.id))


def _failed_cleanly(job: ConsolidationJob, store: CheckpointStore, *words: str) -> str:
    with pytest.raises(Exception) as failed:
        job.wait_for_output(timeout=JOB_SECONDS)
    message = str(failed.value)
    for word in words:
        assert word in message, message
    assert not store.exists("sim.h5")
    wait_for(lambda: store.stray_uploads() == [], 30, "the job's upload to be aborted")
    return message


def test_a_node_killed_while_it_sends_a_part_is_survived(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    workers = _two_nodes(make_cluster, tmp_path)
    files, run_dir, url, store = _run_in_s3(tmp_path, s3_endpoint)
    job = submit_store_consolidation("sim", url)
    staging = wait_for(lambda: records().store_job_record(job.id), 60, "the job to be staged")
    helper = next(w for w in workers if not str(staging["queue"]).endswith(w.name))

    def killed() -> bool:
        started, ended = step_lines(helper, "part", job.id)
        if started > ended and helper.process.poll() is None:
            helper.kill()
            return True
        return False

    wait_for(killed, JOB_SECONDS, "the other node to send a part", interval=0.003)
    try:
        job.wait_for_output(timeout=JOB_SECONDS)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{job_lines(workers, job.id)}") from exc
    output = fetched(store, "sim.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files, run_dir, {"reference": tmp_path /
                                                               "reference"}, "sim"))
    assert store.stray_uploads() == []


def test_the_staging_node_lost_for_good_once_the_parts_are_sent_is_survived(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    workers = _two_nodes(make_cluster, tmp_path)
    files, run_dir, url, store = _run_in_s3(tmp_path, s3_endpoint)
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: _parts_sent(job) >= 1, JOB_SECONDS, "a part to be sent", interval=0.01)
    staging = next(w for w in workers if _staging_queue(job).endswith(w.name))
    staging.kill()
    others = [w for w in workers if w is not staging]
    try:
        job.wait_for_output(timeout=JOB_SECONDS)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{job_lines(others, job.id)}") from exc
    assert staging.process.poll() is not None, "the staging node was not lost"
    output = fetched(store, "sim.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files, run_dir, {"reference": tmp_path /
                                                               "reference"}, "sim"))
    assert store.stray_uploads() == []


def test_the_upload_aborted_by_gc_fails_the_job_clearly(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    _two_nodes(make_cluster, tmp_path)
    _, _, url, store = _run_in_s3(tmp_path, s3_endpoint)
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: _parts_sent(job) >= 1, JOB_SECONDS, "a part to be sent", interval=0.01)
    # What `chkq gc URL --older-than 0` does, without a process's start-up: the job is quick.
    swept = sweep_uploads(open_store(url), "", older_than=0)
    assert [s.key for s in swept] == ["sim.h5"], swept
    message = _failed_cleanly(job, store, "aborted")
    assert "sim.h5" in message, message


def test_a_source_replaced_after_it_was_pinned_fails_the_job_naming_it(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    _two_nodes(make_cluster, tmp_path)
    files, run_dir, url, store = _run_in_s3(tmp_path, s3_endpoint)
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: _parts_sent(job) >= 1, JOB_SECONDS, "a part to be sent", interval=0.01)
    victim = str(files[-1].relative_to(run_dir))
    store.put(victim, files[0].read_bytes())
    try:
        job.wait_for_output(timeout=JOB_SECONDS)
    except Exception as exc:  # noqa: BLE001 - the failure is what is checked
        assert "changed" in str(exc) and victim in str(exc), exc
        assert not store.exists("sim.h5")
        wait_for(lambda: store.stray_uploads() == [], 30, "the job's upload to be aborted")
        return
    # Every part from it was copied before it was replaced: the output holds the pinned bytes.
    output = fetched(store, "sim.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files[:-1] + [files[-1]], run_dir, {
        "reference": tmp_path / "reference"}, "sim"))
