"""Rows of variable-length strings are verified exactly, null strings apart from empty ones.

The row check compares a vlen string dataset's rows by their bytes, read
through h5py's compiled conversion, and where both sides read empty, whether
each is a null string (a null pointer, which HDF5 stores apart from "").
Each test changes one row of the merged output through HDF5 and expects the
row check to name it; the unchanged output passes.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5s, h5t

from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.merge import merge_parts
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.verify_rows import digests_by_dataset, verify_files
from chkq.errors import OutputMismatchError
from support.h5runs import make_run

ROWS = 700


def producer(f: h5py.File, n: int) -> None:
    """``log``: strings, every seventh empty; ``grid``: rows of two strings."""
    values = np.array([b"" if i % 7 == 0 else f"row {i} of {n} \u00e9".encode()
                       for i in range(ROWS)], dtype=object)
    f.create_dataset("log", data=values, dtype=h5py.string_dtype(), maxshape=(None,),
                     chunks=(64,))
    f.create_dataset("grid", data=values.reshape(-1, 2), dtype=h5py.string_dtype("ascii"),
                     maxshape=(None, 2), chunks=(32, 2))


def merged(tmp_path: Path) -> tuple[Plan, dict[int, list[list[int | str]]]]:
    run = tmp_path / "run"
    make_run(run, producer, checkpoints=3)
    plan = prepare(run, "run", "0123456789abcdef", task_bytes=4096)
    copies = {unit: copy_unit(plan, unit).digests for unit in range(len(plan.copy_units))}
    merge_parts(plan)
    return plan, copies


def verify(plan: Plan, copies: dict[int, list[list[int | str]]]) -> None:
    for first, stop in plan.verify_units:
        verify_files(plan, first, stop, digests_by_dataset(copies, plan))


def write_null(path: Path, name: str, row: int) -> None:
    """Store a null string (a null pointer, not "") at ``row`` of dataset ``name``."""
    with h5py.File(path, "r+") as out:
        dsid = out[name].id
        tid = dsid.get_type()
        fspace = dsid.get_space()
        fspace.select_hyperslab((row, *([0] * (len(dsid.shape) - 1))),
                                (1, *([1] * (len(dsid.shape) - 1))))
        dsid.write(h5s.create_simple((1,)), fspace, np.zeros(1, dtype=f"V{tid.get_size()}"),
                   mtype=tid)
        assert tid.get_class() == h5t.STRING


def test_unchanged_string_rows_pass(tmp_path: Path) -> None:
    plan, copies = merged(tmp_path)
    verify(plan, copies)


@pytest.mark.parametrize("name, row, value, source_row", [
    ("log", 1000, b"row 300 of 2 \xc3\xa9!", 300),
    ("log", 703, b"row 3 of 2", 3),
    ("grid", 360, b"x", 10),
])
def test_a_changed_string_is_named(tmp_path: Path, name: str, row: int, value: bytes,
                                   source_row: int) -> None:
    plan, copies = merged(tmp_path)
    with h5py.File(plan.job.temp, "r+") as out:
        ds = out[name]
        if ds.ndim == 1:
            ds[row] = value
        else:
            ds[row, 1] = value
    with pytest.raises(OutputMismatchError, match=rf"row {row} of dataset '{name}' in the "
                                                  r"output differs from row "
                                                  rf"{source_row} of "
                                                  r"checkpoint file '.*run_chk0000[12]\.h5'"):
        verify(plan, copies)


def test_a_null_string_where_the_source_has_an_empty_one_is_named(tmp_path: Path) -> None:
    plan, copies = merged(tmp_path)
    with h5py.File(plan.job.temp, "r") as out:
        assert out["log"][707] == b""
    write_null(plan.job.temp, "log", 707)
    with pytest.raises(OutputMismatchError, match=r"row 707 of dataset 'log' in the output "
                                                  r"differs from row 7 of checkpoint file "
                                                  r"'.*run_chk00002\.h5'"):
        verify(plan, copies)


@pytest.mark.cluster
def test_a_string_merge_leaves_another_copy_of_hdf5_in_the_process_working(
        tmp_path: Path) -> None:
    """netCDF4 runs on a copy of HDF5 of its own: freeing what h5py's copy read must not
    put h5py's copy's symbols where netCDF4's plugins would find them."""
    netCDF4 = pytest.importorskip("netCDF4")
    subprocess_code = f"""
import numpy as np, netCDF4, h5py
from pathlib import Path
from chkq.consolidation.driver import consolidate_here
run = Path({str(tmp_path)!r})
for n in (1, 2):
    with h5py.File(run / f"run_chk{{n:05d}}.h5", "w") as f:
        f.attrs["trials_completed"] = n
        f.create_dataset("names", data=[f"row{{n}}-{{i}}" for i in range(3)], maxshape=(None,),
                         chunks=(2,), dtype=h5py.string_dtype())
consolidate_here(run, "run")
with netCDF4.Dataset(run / "after.nc", "w") as nc:
    nc.createDimension("t", None)
    nc.createVariable("x", "f8", ("t",), compression="blosc_lz")[0:4] = np.arange(4.0)
print("ok")
"""
    import subprocess
    import sys

    assert netCDF4 is not None
    done = subprocess.run([sys.executable, "-c", subprocess_code], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
