"""Filter parameters the installed plugin would not write, from netCDF-C's own plugins.

netCDF-C ships its own HDF5 Blosc filter; the parameters it stores
(``[0, 0, type size, chunk bytes, level, shuffle, compressor]``) are not
what ``hdf5plugin``'s set-local step writes for any input (it puts its own
filter and Blosc versions first), so no dataset created anew stores them.
chkq builds the datasets it encodes chunks in from an empty copy of the
template's dataset (``H5Ocopy``: the stored pipeline byte for byte). The
runs here are written with the netCDF4 package and its bundled netCDF-C
plugins, with rows off the chunk grid so that chunks are encoded again,
consolidated on real workers and in the in-process driver, checked by the
independent comparator and read back through netCDF4.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (decodes Blosc in this process)
import netCDF4
import numpy as np
import pytest

from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.filter_pipelines import recreation_plist, stored_filters
from chkq.errors import BadCheckpointError
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare
from support.h5runs import TIMEOUT, mark_complete
from support.plugins.cluster import WorkerProcess

#: Records per checkpoint: 13 is no multiple of the 8-record chunks.
RECORDS = 13
#: netCDF4's name of each Blosc compressor, and the variable's type.
BLOSC = {"blosc_lz": "f8", "blosc_lz4": "i4", "blosc_zstd": "f4", "blosc_zlib": "i8"}

pytestmark = pytest.mark.skipif(not netCDF4.__has_blosc_support__,
                                reason="this netCDF4 has no Blosc plugin")


def values(name: str, first: int, count: int) -> np.ndarray:
    """Records ``first...`` of variable ``name``: compressible, and distinct per record."""
    rows = np.arange(first, first + count)[:, None] * 10 + np.arange(5)[None, :]
    return (rows * (1 + len(name) % 3)).astype(BLOSC.get(name, "f8"))


def write_run(run: Path, checkpoints: int = 3) -> list[Path]:
    """Checkpoints ``run_chkNNNNN.h5`` written by netCDF4, Blosc variables of ``time``."""
    run.mkdir()
    files = []
    for n in range(1, checkpoints + 1):
        path = run / f"run_chk{n:05d}.h5"
        first = (n - 1) * RECORDS
        with netCDF4.Dataset(path, "w") as nc:
            nc.createDimension("time", None)
            nc.createDimension("x", 5)
            time = nc.createVariable("time", "f8", ("time",))
            time[:] = np.arange(first, first + RECORDS, dtype="f8")
            for name, kind in BLOSC.items():
                var = nc.createVariable(name, kind, ("time", "x"), compression=name,
                                        complevel=4, shuffle=True, chunksizes=(8, 5))
                var[0:RECORDS] = values(name, first, RECORDS)
        mark_complete(path)
        files.append(path)
    return files


def assert_reads_as_concatenation(output: Path, checkpoints: int) -> None:
    """Read through netCDF4, every variable is its checkpoints' records in order."""
    with netCDF4.Dataset(output) as nc:
        assert len(nc.dimensions["time"]) == checkpoints * RECORDS
        for name in BLOSC:
            got = nc[name][:]
            assert np.array_equal(got, values(name, 0, checkpoints * RECORDS)), name


def test_netcdf_c_blosc_parameters_are_not_what_a_new_dataset_gets(tmp_path: Path) -> None:
    """The case is real: the installed plugin's set-local step cannot give these parameters."""
    files = write_run(tmp_path / "run", checkpoints=1)
    with h5py.File(files[0], "r") as f:
        for name in BLOSC:
            (code, _flags, stored), = stored_filters(f[name].id.get_create_plist())
            assert code == hdf5plugin.BLOSC_ID and stored[:2] == (0, 0), stored
            with pytest.raises(BadCheckpointError, match="set-local step does not produce"):
                recreation_plist(f[name].id, name)


def test_netcdf_c_blosc_run_consolidates_exactly_on_workers(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    files = write_run(run)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert compare(output, files) == []
    assert_reads_as_concatenation(output, len(files))
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as template:
        for name in BLOSC:
            assert (stored_filters(out[name].id.get_create_plist())
                    == stored_filters(template[name].id.get_create_plist()))
    assert sorted(os.listdir(run)) == sorted([*(f.name for f in files), "run.h5"])


@pytest.mark.cluster
def test_netcdf_c_blosc_run_consolidates_exactly_in_many_small_units(tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = write_run(run, checkpoints=4)
    output = consolidate_here(run, "run", task_bytes=300, task_files=1)
    assert compare(output, files) == []
    assert_reads_as_concatenation(output, len(files))
    assert sorted(os.listdir(run)) == sorted([*(f.name for f in files), "run.h5"])
