"""The Python client on a cluster: progress and summary of a finished job, early refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from chkq.workers.client import Progress, submit_consolidation
from support.helpers import modules_loaded_by
from support.plugins.cluster import WorkerProcess

TIMEOUT = 120


def test_a_finished_job_reads_all_rows_done_and_its_summary(
        worker: WorkerProcess, tmp_path: Path) -> None:
    """``job.progress`` after the end reads every row copied and verified, not zeros."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=100))
    (tmp_path / "run_chk00001" / "notes.txt").write_text("keep")
    job = submit_consolidation("run", tmp_path, cleanup=True)
    output = job.wait_for_output(timeout=TIMEOUT)
    summary = job.summary()
    assert summary.output == output and summary.files == 4 and summary.rows > 0
    assert summary.bytes == output.stat().st_size
    assert summary.seconds is not None and summary.seconds > 0
    assert len(summary.warnings) == 1 and "run_chk00001" in summary.warnings[0]
    assert job.progress == Progress("done", summary.rows, summary.rows, summary.rows,
                                    summary.records)


def test_refusals_happen_before_anything_is_sent(worker: WorkerProcess, tmp_path: Path) -> None:
    """A missing directory, an existing output, no checkpoints: refused at submission."""
    with pytest.raises(FileNotFoundError, match="nowhere"):
        submit_consolidation("run", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no checkpoints of model 'run'"):
        submit_consolidation("run", tmp_path)
    make_run(tmp_path, "run", RunShape(checkpoints=1, trials=5))
    (tmp_path / "run.h5").write_bytes(b"")
    with pytest.raises(FileExistsError, match="run.h5"):
        submit_consolidation("run", tmp_path)


@pytest.mark.cluster
def test_the_client_loads_no_hdf5_array_or_plan_modules() -> None:
    """Submitting and waiting needs Redis and a message: h5py, numpy and the plan stay unloaded."""
    assert modules_loaded_by(["chkq.workers.cli", "chkq.workers.client"],
                             ["h5py", "numpy", "chkq.consolidation.plan",
                              "chkq.consolidation.stamps"]) == []
