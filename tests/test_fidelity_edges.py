"""Datasets that store their partial edge chunks unfiltered (``H5Pset_chunk_opts``).

Writers set ``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS`` to avoid compressing
the ragged edges of a dataset: HDF5 then stores every chunk that reaches
past the extent, on any axis, as its plain elements, and reads such a chunk
without its filters whatever its filter mask says. Which chunks those are
depends on the dataset's extent, so a checkpoint's edge chunks are no
longer edges in the output and the output's own edges must be stored
plain. The runs here are written with h5py's low-level API and an explicit
creation property list (h5py does not wrap ``H5Pset_chunk_opts``: it is
called through ctypes on h5py's own HDF5), consolidated on real workers and
through the in-process driver in many small units, and checked by the
independent comparator, which also compares each dataset's chunk options.
"""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest
from h5py import h5d, h5p, h5s, h5t, h5z

from chkq.consolidation.driver import consolidate_here
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare
from support.h5runs import TIMEOUT, chunk_infos, make_run
from support.helpers import assert_consolidated
from support.plugins.cluster import WorkerProcess

DONT_FILTER_PARTIAL_CHUNKS = 0x2


def _libhdf5() -> ctypes.CDLL:
    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs",
                                  "libhdf5-*.so*"))
    return ctypes.CDLL(libs[0] if libs else "libhdf5.so")


def chunk_opts(dcpl: h5p.PropDCID) -> int:
    value = ctypes.c_uint(0)
    assert _libhdf5().H5Pget_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.byref(value)) >= 0
    return int(value.value)


def edges_unfiltered(where: h5py.Group, name: str, data: np.ndarray, chunk: tuple[int, ...],
                     filters: list[tuple[int, tuple[int, ...]]]) -> None:
    """An extensible dataset created the way such a writer creates it."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_chunk(chunk)
    for code, options in filters:
        dcpl.set_filter(code, h5z.FLAG_MANDATORY, options)
    assert _libhdf5().H5Pset_chunk_opts(ctypes.c_int64(dcpl.id),
                                        ctypes.c_uint(DONT_FILTER_PARTIAL_CHUNKS)) >= 0
    space = h5s.create_simple(data.shape, (h5s.UNLIMITED, *data.shape[1:]))
    dsid = h5d.create(where.id, name.encode(), h5t.py_create(data.dtype), space, dcpl=dcpl)
    dsid.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(data))


ZSTD = hdf5plugin.Zstd(clevel=3)


def producer(f: h5py.File, n: int) -> None:
    """Rows (13 n + 3) that fill no whole chunk; edge tiles along the second axis too."""
    rows = 13 * n + 3
    rng = np.random.default_rng(n)
    values = (np.arange(rows * 7, dtype="<f8").reshape(rows, 7) + n) * 0.5
    edges_unfiltered(f, "gzip", values, (8, 5), [(h5z.FILTER_DEFLATE, (4,))])
    edges_unfiltered(f, "rows_gzip", rng.integers(0, 9, (rows, 6)).astype("<i4"), (4, 6),
                     [(h5z.FILTER_SHUFFLE, ()), (h5z.FILTER_DEFLATE, (6,))])
    edges_unfiltered(f, "zstd", rng.normal(size=(rows, 3, 4)).astype("<f4"), (5, 2, 3),
                     [(ZSTD.filter_id, tuple(ZSTD.filter_options))])
    edges_unfiltered(f, "checked", np.arange(rows, dtype="<i8") * n, (6,),
                     [(h5z.FILTER_FLETCHER32, ())])


def assert_edges_plain(output: Path) -> None:
    """The output keeps the option, and its edge chunks are stored as HDF5 stores them."""
    with h5py.File(output, "r") as f:
        for name in ("gzip", "rows_gzip", "zstd", "checked"):
            dsid = f[name].id
            assert chunk_opts(dsid.get_create_plist()) == DONT_FILTER_PARTIAL_CHUNKS, name
            chunk, shape = dsid.get_create_plist().get_chunk(), dsid.shape
            size = int(np.prod(chunk)) * dsid.get_type().get_size()
            for info in chunk_infos(dsid):
                if any(o + c > s for o, c, s in zip(info.chunk_offset, chunk, shape,
                                                    strict=True)):
                    assert info.size == size, (name, info.chunk_offset)


def test_edge_chunks_stored_unfiltered_consolidate_exactly_on_workers(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    files = make_run(run, producer, checkpoints=3)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    assert_edges_plain(output)


def test_edge_chunks_stored_unfiltered_consolidate_exactly_in_many_small_units(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = make_run(run, producer, checkpoints=4)
    output = consolidate_here(run, "run", task_bytes=300, task_files=1)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    assert_edges_plain(output)


def test_a_checkpoint_that_filters_its_edges_joins_a_run_whose_template_does_not(
        tmp_path: Path) -> None:
    """Chunks of a file stored under other chunk options are encoded again, not moved."""
    def build(f: h5py.File, n: int) -> None:
        values = np.arange(16 * n + 5, dtype="<f8") + n
        if n == 1:
            f.create_dataset("gzip", data=values, maxshape=(None,), chunks=(8,),
                             compression="gzip")
        else:
            edges_unfiltered(f, "gzip", values, (8,), [(h5z.FILTER_DEFLATE, (4,))])

    run = tmp_path / "run"
    files = make_run(run, build, checkpoints=2)
    output = consolidate_here(run, "run")
    assert compare(output, files) == []


def test_the_library_h5py_runs_on_is_found_beside_another_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """netCDF4 loads a copy of HDF5 of its own, which knows identifiers of the same numbers."""
    import netCDF4

    from chkq.consolidation import h5types

    with netCDF4.Dataset(tmp_path / "other.nc", "w") as nc:
        nc.createDimension("t", None)
        nc.createVariable("x", "f8", ("t",), zlib=True)[0:4] = np.arange(4.0)
        copies = h5types._loaded_hdf5.__wrapped__()
        assert len(copies) == 2, copies
        h5py_first = sorted(copies, key=lambda p: "h5py" not in p)
        for order in (h5py_first, h5py_first[::-1]):
            monkeypatch.setattr(h5types, "_loaded_hdf5", lambda order=order: tuple(order))
            h5types.hdf5_library.cache_clear()
            assert "h5py" in h5types.hdf5_library()._name, order
    h5types.hdf5_library.cache_clear()
