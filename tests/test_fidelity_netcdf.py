"""netCDF-4 record variables of different lengths, written with the netCDF4 package.

In a netCDF-4 file the unlimited dimension's length is its longest
variable's; a variable written to fewer records reads as its fill value
past its end. Concatenating each dataset's rows on its own would shift the
shorter variable's records against the coordinate in every later file; chkq
gives such a file's missing records the fill value instead, as ``ncrcat``
does, so the output reads (through netCDF4) as the files' records one after
the other. What cannot be padded exactly is refused before anything is
written, naming the file, the dimension and the variables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import netCDF4
import numpy as np
import pytest

from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.merge import merge_parts
from chkq.consolidation.output_check import check_output
from chkq.consolidation.prepare import prepare
from chkq.consolidation.verify_rows import digests_by_dataset, verify_files
from chkq.errors import BadCheckpointError, OutputMismatchError
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare
from support.h5runs import TIMEOUT, refused
from support.helpers import assert_consolidated, snapshot
from support.plugins.cluster import WorkerProcess

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


def netcdf_view(path: Path) -> dict[str, tuple[list[object], list[bool]]]:
    """Every record variable as a netCDF reader sees it: values and which are missing."""
    with netCDF4.Dataset(path) as nc:
        found = {}
        for name in ("time", "x", "flag", "z", "w"):
            values = nc[name][:]
            mask = np.ma.getmaskarray(values)
            found[name] = (np.ma.filled(values, 0).tolist(), mask.tolist())
        return found


def concatenated_views(files: list[Path]) -> dict[str, tuple[list[object], list[bool]]]:
    """What ``ncrcat`` gives for ``files``: each file's records, as read, one after the other."""
    views = [netcdf_view(path) for path in files]
    return {name: ([v for view in views for v in view[name][0]],
                   [m for view in views for m in view[name][1]]) for name in views[0]}


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


@pytest.mark.parametrize("lengths", [
    lambda n: {"x": 7} if n == 2 else {},
    lambda n: {"time": 6, "flag": 6} if n == 1 else {"x": 4} if n == 3 else {},
    lambda n: {"w": 2, "x": 0} if n == 1 else {"z": 1} if n == 2 else {},
], ids=["variable-short-in-a-middle-file", "coordinate-short-in-the-first-file",
        "dimension-without-coordinate"])
def test_records_of_different_lengths_are_aligned_with_fill_values_as_ncrcat_does(
        tmp_path: Path, worker: WorkerProcess, lengths: Lengths) -> None:
    run = tmp_path / "run"
    files = write_run(run, lengths)
    expected = concatenated_views(files)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert netcdf_view(output) == expected
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as ref:
        assert sorted(out) == sorted(ref)
        for name in ("time", "x", "flag"):
            assert out[name].shape[0] == 2 * RECORDS + ref[name].shape[0]
        assert out["x"].fillvalue == -999.0


def test_fill_value_records_in_the_output_are_checked_independently(tmp_path: Path) -> None:
    """A padded row that is not the fill value fails the whole-output check."""
    run = tmp_path / "run"
    files = write_run(run, lambda n: {"x": 7} if n == 1 else {})
    output = consolidate_here(run, "run")
    with h5py.File(output, "r") as out:
        assert out["x"][7:10].tolist() == [[-999.0] * 3] * 3
        rows = {name: int(out[name].shape[0]) for name in ("time", "x", "flag", "z", "w")}
    check_output(output, files[-1], rows, set(), padding={"x": [(7, 3)]})
    with h5py.File(output, "r+") as out:
        out["x"][8] = [1.0, 2.0, 3.0]
    with pytest.raises(OutputMismatchError, match=r"'x': rows 7 to 9, records its file "
                                                  r"lacked, are not its fill value"):
        check_output(output, files[-1], rows, set(), padding={"x": [(7, 3)]})


def write_strings(run: Path, stored: Callable[[int], int], checkpoints: int = 3) -> list[Path]:
    """netCDF4 checkpoints of 4 ``time`` records; ``label`` and ``mark`` (strings) hold
    ``stored(n)`` of them, ``mark`` with the fill value "NA", ``label`` with netCDF's ""."""
    run.mkdir()
    files = []
    for n in range(1, checkpoints + 1):
        path = run / f"run_chk{n:05d}.h5"
        with netCDF4.Dataset(path, "w") as nc:
            nc.createDimension("time", None)
            nc.createVariable("time", "f8", ("time",))[0:4] = np.arange(4) + 4 * n
            label = nc.createVariable("label", str, ("time",))
            mark = nc.createVariable("mark", str, ("time",), fill_value="NA")
            for i in range(stored(n)):
                label[i] = f"step {4 * n + i} \u00e9"
                mark[i] = "" if i == 1 else f"m{i}"
            nc.trials_completed = np.uint64(1)
        files.append(path)
    return files


def string_view(path: Path) -> dict[str, list[object]]:
    with netCDF4.Dataset(path) as nc:
        return {name: list(nc[name][:]) for name in ("time", "label", "mark")}


def concatenated_strings(files: list[Path]) -> dict[str, list[object]]:
    views = [string_view(path) for path in files]
    return {name: [v for view in views for v in view[name]] for name in views[0]}


def test_short_string_records_are_padded_with_their_fill_value_as_netcdf_reads_them(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """Strings short in the first two files: the output reads as ncrcat gives the files."""
    run = tmp_path / "run"
    files = write_strings(run, lambda n: {1: 2, 2: 0}.get(n, 4))
    expected = concatenated_strings(files)
    assert expected["label"][2:8] == ["", "", "", "", "", ""]
    assert expected["mark"][2:8] == ["NA"] * 6
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert string_view(output) == expected
    with h5py.File(output, "r") as out:
        assert out["label"].shape == out["mark"].shape == (12,)


def test_short_string_records_in_many_small_units_and_the_check_of_their_fill(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = write_strings(run, lambda n: 1 if n < 4 else 4, checkpoints=4)
    output = consolidate_here(run, "run", task_bytes=40, task_files=1)
    assert string_view(output) == concatenated_strings(files)
    padding = {"label": [(1, 3), (5, 3), (9, 3)], "mark": [(1, 3), (5, 3), (9, 3)]}
    rows = {"time": 16, "label": 16, "mark": 16}
    check_output(output, files[-1], rows, set(), padding=padding)
    with h5py.File(output, "r+") as out:
        out["mark"][6] = "forged"
    with pytest.raises(OutputMismatchError, match=r"'mark': rows 5 to 7, records its file "
                                                  r"lacked, are not its fill value"):
        check_output(output, files[-1], rows, set(), padding=padding)


def test_records_that_cannot_be_padded_exactly_are_refused_before_writing(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """Variable-length sequences (netCDF VLEN types) have no fill value chkq can give
    records: refused, named."""
    run = tmp_path / "run"
    run.mkdir()
    for n in (1, 2, 3):
        with netCDF4.Dataset(run / f"run_chk{n:05d}.h5", "w") as nc:
            nc.createDimension("time", None)
            nc.createVariable("time", "f8", ("time",))[0:4] = np.arange(4) + 4 * n
            ragged = nc.createVariable("ragged", nc.createVLType(np.int32, "ints"), ("time",))
            for i in range(2 if n == 2 else 4):
                ragged[i] = np.arange(i + 1, dtype="i4")
            nc.trials_completed = np.uint64(1)
    message = refused(run, r"run_chk00002\.h5' holds records of dimension '/time' in datasets "
                           r"of different lengths \('/time' 4, '/ragged' 2 rows\): '/ragged' "
                           r"holds variable-length data other than strings")
    assert "aligned" in message


def test_a_file_whose_fill_value_is_not_the_templates_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = write_run(run, lambda n: {"x": 7} if n == 1 else {})
    with h5py.File(files[0], "r") as f:
        assert f["x"].fillvalue == -999.0
    rewritten = run / "first.nc"
    with netCDF4.Dataset(files[0]) as old, netCDF4.Dataset(rewritten, "w") as nc:
        nc.createDimension("time", None)
        nc.createDimension("rec", None)
        nc.createDimension("y", 3)
        for name, var in old.variables.items():
            fill = -1.0 if name == "x" else None
            new = nc.createVariable(name, var.dtype, var.dimensions, fill_value=fill)
            count = 7 if name == "x" else len(var)
            new[0:count] = var[:count]
        nc.trials_completed = np.uint64(1)
    rewritten.replace(files[0])
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"'/x' of checkpoint file '.*run_chk00001\.h5' "
                                                 r"lacks 3 records .* its fill value is not "
                                                 r"the template's"):
        consolidate_here(run, "run")
    assert snapshot(run) == before


def test_plain_hdf5_dimension_scales_are_records_too(tmp_path: Path) -> None:
    """Scales attached with h5py's ``dims``: a shorter dataset gets its (default) fill value."""
    run = tmp_path / "run"
    run.mkdir()
    for n, short in ((1, 3), (2, 5)):
        with h5py.File(run / f"run_chk{n:05d}.h5", "w") as f:
            f.create_dataset("t", data=np.arange(5.0) + 5 * n, maxshape=(None,), chunks=(4,))
            f["t"].make_scale("t")
            f.create_dataset("v", data=np.arange(short * 2.0).reshape(short, 2) + n,
                             maxshape=(None, 2), chunks=(4, 2), fillvalue=-1.0)
            f["v"].dims[0].attach_scale(f["t"])
            f.attrs["trials_completed"] = np.uint64(1)
    output = consolidate_here(run, "run")
    with h5py.File(output, "r") as out:
        assert out["t"][:].tolist() == [5.0, 6, 7, 8, 9, 10, 11, 12, 13, 14]
        assert out["v"][:, 0].tolist() == [1.0, 3, 5, -1, -1, 2, 4, 6, 8, 10]


def test_row_verification_checks_fill_value_records_against_the_source(tmp_path: Path) -> None:
    """A padded row changed after the copy is named by the row check, like any other row."""
    run = tmp_path / "run"
    write_run(run, lambda n: {"x": 7} if n == 1 else {})
    plan = prepare(run, "run", "0123456789abcdef")
    copies = {unit: copy_unit(plan, unit).digests for unit in range(len(plan.copy_units))}
    merge_parts(plan)
    with h5py.File(plan.job.temp, "r+") as out:
        assert out["x"][7:10].tolist() == [[-999.0] * 3] * 3
        out["x"][8] = [0.0, 0.0, 0.0]
    with pytest.raises(OutputMismatchError, match=r"row 8 of dataset 'x' in the output differs "
                                                  r"from row 8 of checkpoint file '.*"
                                                  r"run_chk00001\.h5'"):
        for first, stop in plan.verify_units:
            verify_files(plan, first, stop, digests_by_dataset(copies, plan))
