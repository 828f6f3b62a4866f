"""netCDF-4 record variables of different lengths, written with the netCDF4 package.

In a netCDF-4 file the unlimited dimension's length is its longest
variable's; a variable written to fewer records reads as its fill value
past its end. chkq concatenates each dataset's rows, so such a file
anywhere but at the end of a run would shift the shorter variable's
records against the coordinate in every later file: that is refused before
anything is written, naming the file, the dimension and the variables.
Where only the run's last file has them differ, every record stays with
its coordinate, as ``ncrcat`` gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import netCDF4
import numpy as np
import pytest

from chkq.consolidation.driver import consolidate_here
from chkq.errors import BadCheckpointError
from chkq.workers.client import submit_consolidation
from tests.corpus_expect import compare
from tests.helpers import assert_consolidated, snapshot
from tests.plugins.cluster import WorkerProcess
from tests.test_hdf5_bounds import TIMEOUT, refused

#: Records of each checkpoint's time coordinate.
RECORDS = 10

Lengths = Callable[[int], dict[str, int]]


def write_run(run: Path, lengths: Lengths, checkpoints: int = 3) -> list[Path]:
    """Checkpoints ``run_chkNNNNN.h5`` written by netCDF4, each variable to ``lengths(n)``.

    ``time`` (the unlimited dimension's coordinate), ``x(time, y)`` and
    ``flag(time)`` are records of ``time``; ``z(rec)`` and ``w(rec)`` of
    ``rec``, an unlimited dimension with no coordinate variable. Each
    record's values derive from its global index, so aligned records agree.
    """
    run.mkdir()
    files, first = [], 0
    for n in range(1, checkpoints + 1):
        path = run / f"run_chk{n:05d}.h5"
        want = {"time": RECORDS, "x": RECORDS, "flag": RECORDS, "z": 4, "w": 4, **lengths(n)}
        with netCDF4.Dataset(path, "w") as nc:
            nc.createDimension("time", None)
            nc.createDimension("rec", None)
            nc.createDimension("y", 3)
            time = nc.createVariable("time", "f8", ("time",))
            time.units = "days since 2000-01-01"
            x = nc.createVariable("x", "f4", ("time", "y"), fill_value=-999.0)
            flag = nc.createVariable("flag", "i2", ("time",), zlib=True)
            z = nc.createVariable("z", "i4", ("rec",))
            w = nc.createVariable("w", "f8", ("rec",))
            index = np.arange(first, first + RECORDS)
            time[0:want["time"]] = index[:want["time"]] * 0.5
            x[0:want["x"]] = np.repeat(index[:want["x"], None], 3, axis=1).astype("f4")
            flag[0:want["flag"]] = (index[:want["flag"]] % 7).astype("i2")
            z[0:want["z"]] = np.arange(want["z"]) + 10 * n
            w[0:want["w"]] = np.arange(want["w"]) * 1.5 + n
            nc.trials_completed = np.uint64(1)
        first += RECORDS
        files.append(path)
    return files


def test_aligned_records_consolidate_exactly_and_read_as_ncrcat_gives_them(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """Every file full, but the last file's ``x`` short: each record keeps its time."""
    run = tmp_path / "run"
    files = write_run(run, lambda n: {"x": 7} if n == 3 else {})
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    with netCDF4.Dataset(output) as nc:
        assert len(nc.dimensions["time"]) == 3 * RECORDS
        time, x = nc["time"][:], nc["x"][:]
        assert not np.ma.is_masked(time)
        assert x.mask[:, 0].tolist() == [False] * (3 * RECORDS - 3) + [True] * 3
        np.testing.assert_array_equal(x[:3 * RECORDS - 3, 0], time[:3 * RECORDS - 3] * 2)
        assert nc["z"][:].tolist() == [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]


@pytest.mark.parametrize("lengths, bad, shown", [
    (lambda n: {"x": 7} if n == 2 else {}, 1, r"'/time' 10, '/flag' 10, '/x' 7"),
    (lambda n: {"time": 6, "flag": 6} if n == 1 else {}, 0, r"'/time' 6, '/flag' 6, '/x' 10"),
], ids=["variable-short-in-a-middle-file", "coordinate-short-in-the-first-file"])
def test_records_of_different_lengths_before_the_last_file_are_refused(
        tmp_path: Path, worker: WorkerProcess, lengths: Lengths, bad: int, shown: str) -> None:
    run = tmp_path / "run"
    files = write_run(run, lengths)
    message = refused(run, r"holds records of dimension '/time' in datasets of different "
                           r"lengths \(" + shown)
    assert str(files[bad]) in message
    assert "shifted" in message


def test_a_dimension_with_no_coordinate_variable_is_checked_through_its_variables(
        tmp_path: Path) -> None:
    """``rec`` is a stand-in scale of length 0: its variables ``z`` and ``w`` are compared."""
    run = tmp_path / "run"
    files = write_run(run, lambda n: {"w": 2} if n == 1 else {})
    with h5py.File(files[0], "r") as f:
        assert f["rec"].shape == (0,) and f["z"].shape == (4,) and f["w"].shape == (2,)
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"dimension '/rec' in datasets of different "
                                                 r"lengths \('/w' 2, '/z' 4 rows\)"):
        consolidate_here(run, "run")
    assert snapshot(run) == before


def test_plain_hdf5_dimension_scales_are_records_too(tmp_path: Path) -> None:
    """Scales attached with h5py's ``dims``: a shorter dataset in the first file is refused."""
    run = tmp_path / "run"
    run.mkdir()
    for n, short in ((1, 3), (2, 5)):
        with h5py.File(run / f"run_chk{n:05d}.h5", "w") as f:
            f.create_dataset("t", data=np.arange(5.0) + 5 * n, maxshape=(None,), chunks=(4,))
            f["t"].make_scale("t")
            f.create_dataset("v", data=np.arange(short * 2.0).reshape(short, 2),
                             maxshape=(None, 2), chunks=(4, 2))
            f["v"].dims[0].attach_scale(f["t"])
            f.attrs["trials_completed"] = np.uint64(1)
    with pytest.raises(BadCheckpointError, match=r"run_chk00001\.h5'.*dimension '/t'.*"
                                                 r"'/t' 5, '/v' 3 rows"):
        consolidate_here(run, "run")
