"""Runs of more than SCAN_FILES files are scanned by parallel scan units (real workers)."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest

from chkq.consolidation.run_scan import SCAN_FILES, scan_units
from chkq.demo import RunShape, make_run, write_checkpoint_file
from chkq.jobs.keys import deliveries as deliveries_key
from chkq.tasks.consolidate import task_id
from chkq.tasks.state import job_status
from chkq.workers.client import submit_consolidation
from support.helpers import assert_consolidated, snapshot

TIMEOUT = 180
FILES = SCAN_FILES + 40
SHAPE = RunShape(checkpoints=FILES, trials=1, spec_columns=4)


@pytest.fixture(autouse=True)
def _cluster(worker: object) -> None:
    """Every test here runs against the session's worker processes."""


@pytest.fixture(scope="module")
def run_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """One run of FILES one-trial files, copied by each test that changes it."""
    directory = tmp_path_factory.mktemp("many")
    return directory, make_run(directory, "run", SHAPE)


def fresh_run(run_files: tuple[Path, list[Path]], tmp_path: Path) -> list[Path]:
    source, files = run_files
    copies = []
    for path in files:
        target = tmp_path / path.relative_to(source)
        target.write_bytes(path.read_bytes())
        copies.append(target)
    return copies


def test_a_run_scanned_by_several_units_is_consolidated_whole(
        run_files: tuple[Path, list[Path]], tmp_path: Path) -> None:
    files = fresh_run(run_files, tmp_path)
    job = submit_consolidation("run", tmp_path)
    output = job.wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    with h5py.File(output) as out:
        assert out["galaxy/trial"].shape == (FILES,)
    units = len(scan_units(FILES))
    assert units >= 2
    metas = job.app.backend.client.mget(
        [job.app.backend.get_key_for_task(task_id(job.id, "scan", i)) for i in range(units)])
    assert all(meta is not None and b'"SUCCESS"' in meta for meta in metas)
    client = job.app.backend.client
    plan_id = task_id(job.id, "plan")
    assert int(client.get(deliveries_key(plan_id)) or 0) == 1
    assert int(client.get(deliveries_key(plan_id, replaced=1)) or 0) == 1, \
        "the planning step's second run (the scans' callback) is counted apart"
    status = job_status(job.id)
    assert status.plan is not None and status.plan["files"] == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f.name for f in files]
                                                                + ["run.h5"])


@pytest.mark.parametrize("fault", ["incomplete", "structure"])
def test_a_bad_file_in_a_later_scan_unit_fails_the_job_naming_it(
        run_files: tuple[Path, list[Path]], tmp_path: Path, fault: str) -> None:
    files = fresh_run(run_files, tmp_path)
    bad = files[SCAN_FILES + 7]
    if fault == "incomplete":
        with h5py.File(bad, "r+") as f:
            del f.attrs["trials_completed"]
        match = "incomplete"
    else:
        write_checkpoint_file(bad, RunShape(trials=1, spec_columns=5), 0, 1, SCAN_FILES + 8)
        match = "differs in structure"
    before = snapshot(tmp_path)
    job = submit_consolidation("run", tmp_path, cleanup=True)
    with pytest.raises(ValueError, match=match) as caught:
        job.wait_for_output(timeout=TIMEOUT)
    assert bad.name in str(caught.value)
    assert snapshot(tmp_path) == before
