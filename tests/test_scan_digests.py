"""Small files are verified against the digest their planning scan took (Celery-free)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.consolidation.checkpoint_files import DIGEST_FILE_BYTES, scan_file
from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.merge import merge_parts
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.verify_rows import verify_files
from chkq.demo import RunShape, make_run
from chkq.errors import OutputMismatchError


def copied(run: Path, model: str = "run") -> Plan:
    """A planned job whose copy and merge are done, not yet verified."""
    plan = prepare(run, model, uuid.uuid4().hex)
    for unit in range(len(plan.copy_units)):
        copy_unit(plan, unit)
    merge_parts(plan)
    return plan


def test_the_scan_digests_what_hdf5_reads_in_name_order(tmp_path: Path) -> None:
    (path,) = make_run(tmp_path, "run", RunShape(checkpoints=1, trials=3))
    expected = hashlib.sha256()
    with h5py.File(path) as f:
        names = sorted(n for n in _extensible(f))
        for name in names:
            data = f[name][()]
            expected.update(f"{name}\0{len(data)}\0".encode())
            expected.update(np.ascontiguousarray(data).tobytes())
    assert scan_file(path).digest == expected.hexdigest()


def _extensible(f: h5py.File) -> list[str]:
    found: list[str] = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset)
                 and obj.maxshape and obj.maxshape[0] is None else None)
    return found


def test_no_digest_for_big_files_or_variable_length_rows(tmp_path: Path) -> None:
    big = tmp_path / "big.h5"
    with h5py.File(big, "w") as f:
        f.attrs["trials_completed"] = 1
        f.create_dataset("x", data=np.zeros(DIGEST_FILE_BYTES // 8 + 1), maxshape=(None,))
    small = tmp_path / "vlen.h5"
    with h5py.File(small, "w") as f:
        f.attrs["trials_completed"] = 1
        f.create_dataset("s", data=["a", "bc"], maxshape=(None,), dtype=h5py.string_dtype())
    assert scan_file(big).digest == "" and scan_file(small).digest == ""


@pytest.mark.parametrize("block_bytes", [64 * 1024 * 1024, 4096])
def test_a_row_damaged_after_the_copy_is_named(tmp_path: Path, block_bytes: int) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=5, trials=40))
    plan = copied(tmp_path)
    plan.block_bytes = block_bytes
    try:
        assert all(plan.file_digests), "small files are digested when planned"
        trial = next(d for d in plan.datasets if d.name == "galaxy/trial")
        for first, stop in plan.verify_units:
            verify_files(plan, first, stop)
        with open(plan.job.temp, "r+b") as fh:
            fh.seek(trial.chunk_offsets[0] + 123 * trial.row_bytes)
            fh.write(np.uint64(999999).tobytes())
        with pytest.raises(OutputMismatchError,
                           match=r"row 123 of dataset 'galaxy/trial'.*run_chk00004.h5"):
            for first, stop in plan.verify_units:
                verify_files(plan, first, stop)
    finally:
        plan.job.temp.unlink()


def test_a_digest_that_does_not_match_the_file_fails_the_job(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    plan = copied(tmp_path)
    try:
        plan.file_digests[1] = hashlib.sha256(b"another version").hexdigest()
        with pytest.raises(OutputMismatchError, match=r"run_chk00002.h5.*digest"):
            for first, stop in plan.verify_units:
                verify_files(plan, first, stop)
    finally:
        plan.job.temp.unlink()


def test_a_damaged_small_file_is_refused_when_planned(tmp_path: Path) -> None:
    """Its scan reads every row (fletcher32 checked): nothing is written at all."""
    from support.helpers import corrupt_chunk, snapshot

    make_run(tmp_path, "run", RunShape(checkpoints=3, trials=50, fletcher32=True,
                                       chunk_rows=16))
    corrupt_chunk(tmp_path / "run_chk00002.h5", "spectra/spec")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"cannot read checkpoint file .*run_chk00002.h5"):
        prepare(tmp_path, "run", uuid.uuid4().hex)
    assert snapshot(tmp_path) == before


def test_a_reused_scan_is_of_the_file_as_it_is_now(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A followed run scans a file again only once it changed (its stamp, as every check)."""
    from chkq.consolidation import run_scan

    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=40))
    paths = sorted(tmp_path.glob("run_chk*.h5"))
    opened: list[Path] = []
    real = run_scan.scan_file
    monkeypatch.setattr(run_scan, "scan_file",
                        lambda path, fd: opened.append(path) or real(path, fd=fd))
    first = run_scan.scan_files(paths, tmp_path, reuse=True)
    again = run_scan.scan_files(paths, tmp_path, reuse=True)
    assert opened == paths, "the second look scanned files that had not changed"
    assert [s.stamp for s in again] == [s.stamp for s in first]
    with h5py.File(paths[1], "r+") as f:
        f.attrs["trials_completed"] = 41
    changed = run_scan.scan_files(paths, tmp_path, reuse=True)
    assert opened == [*paths, paths[1]]
    assert changed[1].stamp != first[1].stamp
    run_scan.scan_files(paths, tmp_path)
    assert opened == [*paths, paths[1], *paths], "without reuse every file is scanned"


@pytest.mark.parametrize("collector_on", [True, False])
def test_planning_leaves_the_collector_as_it_found_it(tmp_path: Path, collector_on: bool) -> None:
    """Planning pauses the cyclic collector; a refused run does not leave it off in the worker."""
    import gc

    files = make_run(tmp_path, "run", RunShape(checkpoints=3, trials=4))
    was = gc.isenabled()
    try:
        (gc.enable if collector_on else gc.disable)()
        plan = copied(tmp_path)
        plan.job.temp.unlink()
        assert gc.isenabled() is collector_on
        with h5py.File(files[1], "r+") as f:
            del f.attrs["trials_completed"]
        with pytest.raises(ValueError, match=r"run_chk00002.h5.*incomplete"):
            prepare(tmp_path, "run", uuid.uuid4().hex)
        assert gc.isenabled() is collector_on
    finally:
        (gc.enable if was else gc.disable)()
