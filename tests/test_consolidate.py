"""Consolidation end to end: real redis-server, real worker processes, real files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.config.routing import VERIFY_QUEUE
from chkq.demo import RunShape, make_run, write_checkpoint_file
from chkq.tasks.consolidate import task_id
from chkq.tasks.state import records
from chkq.workers.client import ConsolidationJob, submit_consolidation
from support.helpers import assert_consolidated, corrupt_chunk, snapshot, wait_for
from support.plugins.cluster import WorkerProcess, consumers_paused

SLUG = Path(__file__).resolve().parent / "data" / "QHIFUVstats.h5"
TIMEOUT = 120


def consolidate(out_dir: Path, model: str = "run", cleanup: bool = False) -> Path:
    job = submit_consolidation(model, out_dir, cleanup)
    return job.wait_for_output(timeout=TIMEOUT)


def refused(out_dir: Path, exc: type[BaseException], match: str, model: str = "run") -> None:
    """The job fails with ``exc`` and leaves the directory exactly as it was."""
    before = snapshot(out_dir)
    with pytest.raises(exc, match=match):
        consolidate(out_dir, model)
    assert snapshot(out_dir) == before


@pytest.fixture(autouse=True)
def _cluster(worker: object) -> None:
    """Every test here runs against the session's worker processes."""


def test_single_file_checkpoints(tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, trials=300))
    output = consolidate(tmp_path)
    assert output == tmp_path / "run.h5"
    assert_consolidated(output, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.h5", "run_chk00001.h5", "run_chk00002.h5", "run_chk00003.h5"]


def test_directories_of_thread_files_with_empty_writers(tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, writers=3, trials=200))
    with h5py.File(files[2], "r") as f:
        assert f["galaxy/trial"].shape == (0,)
    output = consolidate(tmp_path)
    assert_consolidated(output, files)
    with h5py.File(output, "r") as out:
        assert out["galaxy/trial"].shape == (3 * 2 * 200,)
        assert np.array_equal(out["galaxy/trial"][()], np.arange(1200, dtype=np.uint64))
        assert np.isnan(out["galaxy/actual_mass"][()]).sum() > 0


def test_nullterm_strings_and_variable_length_strings_are_kept_exactly(tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, trials=50))
    output = consolidate(tmp_path)
    assert_consolidated(output, files)
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as last:
        rng = out["clusters/rng"].id.get_type()
        assert rng.get_strpad() == h5py.h5t.STR_NULLTERM and rng.get_size() == 128
        assert out["input_deck/toml"][()] == last["input_deck/toml"][()]
        assert out["input_deck/toml"].id.get_type().is_variable_str()
        assert list(out["galaxy_phot"].attrs["filters"]) == ["GALEX.GALEX.FUV", "Q(HI)"]
        assert out.attrs.get_id("date").get_type().is_variable_str()
        assert out.attrs["trials_completed"] == last.attrs["trials_completed"]


def test_gzip_shuffle_fletcher32_and_fill_value_are_kept(tmp_path: Path) -> None:
    shape = RunShape(checkpoints=3, writers=2, trials=700, compression="gzip", shuffle=True,
                     fletcher32=True, spec_columns=24, chunk_rows=100)
    files = make_run(tmp_path, "run", shape)
    output = consolidate(tmp_path)
    assert_consolidated(output, files)
    with h5py.File(output, "r") as out:
        spec = out["spectra/spec"]
        assert (spec.compression, spec.shuffle, spec.fletcher32, spec.chunks) == (
            "gzip", True, True, (100, 24))


def test_chunks_tiling_columns_and_user_fill_values(tmp_path: Path) -> None:
    files = []
    for n, rows in enumerate((300, 0, 517), start=1):
        path = tmp_path / f"run_chk{n:05d}.h5"
        with h5py.File(path, "w") as f:
            d = f.create_dataset("grid", shape=(rows, 10, 3), maxshape=(None, 10, 3),
                                 chunks=(64, 4, 2), dtype=">i4", fillvalue=-7)
            d[:] = np.arange(rows * 30, dtype=">i4").reshape(rows, 10, 3) + n * 100000
            e = f.create_dataset("e", shape=(rows,), maxshape=(None,), chunks=(50,),
                                 dtype=np.float32, fillvalue=np.nan)
            e[:] = np.linspace(0, 1, rows, dtype=np.float32)
            f.attrs["trials_completed"] = np.uint64(rows)
        files.append(path)
    output = consolidate(tmp_path)
    assert_consolidated(output, files)


def test_slug_output_cut_into_checkpoints_comes_back_the_same(tmp_path: Path) -> None:
    """tests/data/QHIFUVstats.h5 (real slug output) cut into 4 checkpoints, consolidated back."""
    with h5py.File(SLUG, "r") as src:
        n = src["galaxy/trial"].shape[0]
        cuts = [0, 1000, 1000, 6543, n]
        for k in range(4):
            path = tmp_path / f"QHIFUV_chk{k + 1:05d}.h5"
            with h5py.File(path, "w") as out:
                for name, value in src.attrs.items():
                    out.attrs[name] = value
                def cut(name: str, obj: object, out: h5py.File = out, k: int = k) -> None:
                    if isinstance(obj, h5py.Group):
                        group = out.require_group(name)
                        for key, value in obj.attrs.items():
                            group.attrs[key] = value
                    elif isinstance(obj, h5py.Dataset) and obj.maxshape and None in obj.maxshape:
                        data = obj[cuts[k]:cuts[k + 1]]
                        d = out.create_dataset(name, data=data, maxshape=obj.maxshape,
                                               chunks=obj.chunks, dtype=obj.dtype)
                        for key, value in obj.attrs.items():
                            d.attrs[key] = value
                    elif isinstance(obj, h5py.Dataset):
                        out.copy(obj, name)
                src.visititems(cut)
                out.attrs["trials_completed"] = np.uint64(cuts[k + 1])
    output = consolidate(tmp_path, "QHIFUV")
    with h5py.File(SLUG, "r") as src, h5py.File(output, "r") as out:
        names: list[str] = []
        src.visit(names.append)
        for name in names:
            if isinstance(src[name], h5py.Dataset):
                assert np.asarray(out[name][()]).tobytes() == np.asarray(src[name][()]).tobytes()
                assert dict(out[name].attrs).keys() == dict(src[name].attrs).keys()
        assert out["galaxy_phot/phot"].chunks == src["galaxy_phot/phot"].chunks
        assert {k: v for k, v in out.attrs.items() if k != "trials_completed"} == dict(src.attrs)


def test_no_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "run_chk1.h5").write_bytes(b"decoy")
    refused(tmp_path, FileNotFoundError, "no checkpoints of model 'run'")


def test_existing_output_is_never_overwritten(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    (tmp_path / "run.h5").write_bytes(b"precious")
    refused(tmp_path, FileExistsError, "run.h5")
    assert (tmp_path / "run.h5").read_bytes() == b"precious"


def test_incomplete_file_is_named(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=10))
    write_checkpoint_file(tmp_path / "run_chk00003.h5", RunShape(), 40, 10, 3, complete=False)
    refused(tmp_path, ValueError, r"run_chk00003.h5.*incomplete.*trials_completed")


def test_file_that_is_not_hdf5_is_named(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=1, writers=2, trials=10))
    (tmp_path / "run_chk00001" / "thread_0005.h5").write_bytes(b"not hdf5 at all" * 100)
    refused(tmp_path, ValueError, r"thread_0005.h5.*not HDF5")


def test_structure_mismatch_names_file_and_differences(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    with h5py.File(tmp_path / "run_chk00002.h5", "a") as f:
        del f["galaxy/actual_mass"]
        f.create_group("extra")
        f.attrs["trials_completed"] = np.uint64(20)
    refused(tmp_path, ValueError,
            r"run_chk00002.h5.*differs in structure.*missing extensible dataset "
            r"'galaxy/actual_mass'.*unexpected group 'extra'")


def test_extensible_dataset_with_another_dtype_or_width(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=1, trials=10))
    make_run(tmp_path / "other", "run", RunShape(checkpoints=1, trials=10, spec_columns=17))
    shutil.move(tmp_path / "other" / "run_chk00001.h5", tmp_path / "run_chk00002.h5")
    shutil.rmtree(tmp_path / "other")
    refused(tmp_path, ValueError, r"run_chk00002.h5.*'spectra/spec' has type and row shape "
            r"float64 \(17,\), expected float64 \(16,\)$")


def test_fixed_datasets_may_differ_and_the_final_one_is_kept(tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    with h5py.File(files[0], "a") as f:
        del f["spectra/wl"]
        f["spectra/wl"] = np.arange(3, dtype=np.int16)
    output = consolidate(tmp_path)
    with h5py.File(output, "r") as out, h5py.File(files[1], "r") as last:
        assert np.array_equal(out["spectra/wl"][()], last["spectra/wl"][()])


def test_cleanup_removes_checkpoints_and_keeps_foreign_files(tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=20))
    copies = tmp_path / "copies"
    copies.mkdir()
    for f in files:
        shutil.copy(f, copies / f"{f.parent.name}-{f.name}")
    (tmp_path / "run_chk00002" / "notes.txt").write_text("mine")
    (tmp_path / "unrelated.h5").write_bytes(b"x")
    output = consolidate(tmp_path, cleanup=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "copies", "run.h5", "run_chk00002", "unrelated.h5"]
    assert [p.name for p in (tmp_path / "run_chk00002").iterdir()] == ["notes.txt"]
    assert_consolidated(output, sorted(copies.iterdir(), key=lambda p: p.name))


def test_cleanup_of_single_file_checkpoints(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=20))
    consolidate(tmp_path, cleanup=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


def state_of(job: ConsolidationJob, step: str, unit: int | None = None) -> str:
    from celery.result import AsyncResult

    return AsyncResult(task_id(job.id, step, unit), app=job.app).state


def test_output_created_while_the_job_runs(tmp_path: Path, worker: WorkerProcess) -> None:
    """The output appears between copy and link: FileExistsError, nothing else touched."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=50))
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: state_of(job, "merge") == "SUCCESS", what="merge")
        (tmp_path / "run.h5").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="run.h5"):
        job.wait_for_output(timeout=TIMEOUT)
    assert (tmp_path / "run.h5").read_bytes() == b"someone else's"
    after = snapshot(tmp_path)
    after.pop("run.h5")
    assert after == before


def test_copy_task_failing_midway_fails_the_job_cleanly(tmp_path: Path) -> None:
    """A checksummed chunk of the last file is corrupt: the copy fails after others."""
    # Files above the scan's digest size: the damage is found by the copy, not the plan.
    shape = RunShape(checkpoints=4, trials=600, fletcher32=True, chunk_rows=64,
                     spec_columns=256)
    make_run(tmp_path, "run", shape)
    corrupt_chunk(tmp_path / "run_chk00004.h5", "spectra/spec")
    before = snapshot(tmp_path)
    with pytest.raises(Exception, match=r"(?i)checksum|fletcher|filter|read"):
        consolidate(tmp_path)
    assert snapshot(tmp_path) == before


def test_verify_finds_a_corrupted_row(tmp_path: Path, worker: WorkerProcess) -> None:
    """The output is damaged between copy and verify: the job fails naming the row."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=400))
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: state_of(job, "merge") == "SUCCESS", what="merge")
        plan = records().recorded_plan(job.id)
        trial = next(d for d in plan.datasets if d.name == "galaxy/trial")
        with open(plan.job.temp, "r+b") as fh:
            fh.seek(trial.chunk_offsets[0] + 123 * trial.row_bytes)
            fh.write(np.uint64(999999).tobytes())
    with pytest.raises(ValueError, match=r"row 123 of dataset 'galaxy/trial'.*run_chk00001.h5"):
        job.wait_for_output(timeout=TIMEOUT)
    assert snapshot(tmp_path) == before


def test_job_files_never_match_the_checkpoint_pattern(tmp_path: Path) -> None:
    from chkq.consolidation.discovery import checkpoint_pattern
    from chkq.consolidation.temporaries import JobFiles

    job = JobFiles(tmp_path, "run", "0123456789abcdef")
    pattern = checkpoint_pattern("run")
    for path in (job.temp, job.part(3)):
        assert not pattern.fullmatch(path.name)
        assert path.name != "run.h5"
    assert os.path.dirname(job.temp) == str(tmp_path)


def test_verify_finds_a_changed_row_in_compressed_data(tmp_path: Path,
                                                       worker: WorkerProcess) -> None:
    """gzip data is verified against digests taken while copying, or (chunks moved
    unchanged) against the checkpoint's stored chunks; a row changed in the output
    between copy and verify fails the job naming the row and the file."""
    make_run(tmp_path, "run", RunShape(checkpoints=3, trials=550, compression="gzip",
                                       shuffle=True, chunk_rows=100))
    before = snapshot(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: state_of(job, "merge") == "SUCCESS", what="merge")
        plan = records().recorded_plan(job.id)
        digests = [entry for unit in records().copied(job.id).values() for entry in unit]
        # Files 1 and 3 start on the chunk grid: their whole chunks moved unchanged.
        assert {entry[4] if len(entry) > 4 else len(entry[3]) for entry in digests} == {
            "stored", 64}
        with h5py.File(plan.job.temp, "r+") as out:
            out["galaxy/trial"][1234] = 7
    with pytest.raises(ValueError, match=r"row 1234 of dataset 'galaxy/trial'.*run_chk00003.h5"):
        job.wait_for_output(timeout=TIMEOUT)
    assert snapshot(tmp_path) == before
