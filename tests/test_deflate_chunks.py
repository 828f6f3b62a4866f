"""Chunks encoded with ISA-L are read back by HDF5 (and by plain zlib) as the rows written."""

from __future__ import annotations

import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.consolidation.chunk_encoding import ChunkEncoder
from chkq.consolidation.driver import consolidate_here
from support.h5runs import make_run

ROW = np.dtype([("id", "<u8"), ("x", ">f4"), ("flag", "u1")])


@pytest.mark.parametrize("dtype", ["<f8", ">i2", "u1", ROW])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("level", [1, 4, 9])
def test_hdf5_reads_encoded_chunks_as_the_rows(tmp_path: Path, dtype: object, shuffle: bool,
                                               level: int) -> None:
    rng = np.random.default_rng(level)
    rows = rng.integers(0, 200, size=(3 * 64, 5)).astype(dtype) if dtype != ROW else \
        np.array([(i, i / 3, i % 7) for i in range(3 * 64 * 5)], dtype=ROW).reshape(-1, 5)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("x", shape=rows.shape, maxshape=(None, 5), chunks=(64, 5),
                              dtype=rows.dtype, compression="gzip", compression_opts=level,
                              shuffle=shuffle)
        encoder = ChunkEncoder.for_dataset(ds.id)
        assert encoder is not None
        for first in range(0, len(rows), 64):
            ds.id.write_direct_chunk((first, 0), encoder.encode(rows[first:first + 64]))
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["x"][:].tobytes() == rows.tobytes()
        _, stored = f["x"].id.read_direct_chunk((64, 0))
    plain = np.frombuffer(zlib.decompress(stored), dtype=np.uint8)
    size = rows.dtype.itemsize
    if shuffle and size > 1:
        plain = plain.reshape(size, -1).T.reshape(-1)
    assert plain.tobytes() == rows[64:128].tobytes()


@pytest.mark.parametrize("shuffle", [True, False])
def test_chunks_tiling_the_trailing_axes_are_encoded_tile_by_tile(tmp_path: Path,
                                                                  shuffle: bool) -> None:
    rows = np.random.default_rng(3).random((3 * 64, 5))
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("x", shape=rows.shape, maxshape=(None, 5), chunks=(64, 2),
                              dtype=rows.dtype, compression="gzip", shuffle=shuffle)
        encoder = ChunkEncoder.for_dataset(ds.id)
        assert encoder is not None
        for first in range(0, len(rows), 64):
            tiles = list(encoder.encode_rows(rows[first:first + 64]))
            assert [where for where, _ in tiles] == [(0,), (2,), (4,)]
            for where, chunk in tiles:
                ds.id.write_direct_chunk((first, *where), chunk)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["x"][:].tobytes() == rows.tobytes()


@pytest.mark.parametrize("options", [
    {"compression": "gzip", "fletcher32": True},
    {"compression": "gzip", "compression_opts": 0},
    {"compression": "lzf"},
    {"chunks": (64, 5)},
])
def test_other_pipelines_are_left_to_hdf5(tmp_path: Path, options: dict) -> None:
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("x", shape=(128, 5), maxshape=(None, 5), dtype="<f8",
                              **{"chunks": (64, 5), **options})
        assert ChunkEncoder.for_dataset(ds.id) is None


@pytest.mark.parametrize("options", [
    {"compression": "gzip", "compression_opts": 4, "shuffle": True},
    {"compression": "gzip", "compression_opts": 9},
    {"compression": "gzip", "shuffle": True, "fletcher32": True},
])
def test_consolidated_gzip_output_has_the_template_pipeline_and_every_row(
        tmp_path: Path, options: dict) -> None:
    """Files of 1,000 rows on 256-row chunks: no file boundary falls on the chunk grid."""

    def build(f: h5py.File, n: int) -> None:
        rows = np.arange(1000 * 6, dtype="<f8").reshape(1000, 6) + 1e6 * n
        f.create_dataset("spec", data=rows, maxshape=(None, 6), chunks=(256, 6), **options)

    make_run(tmp_path, build, checkpoints=3)
    out = consolidate_here(tmp_path, "run", block_bytes=256 * 48 * 3, task_bytes=256 * 48 * 4)
    expected = np.concatenate([np.arange(6000.0).reshape(1000, 6) + 1e6 * n for n in (1, 2, 3)])
    with h5py.File(out) as o, h5py.File(tmp_path / "run_chk00003.h5") as t:
        got, template = o["spec"], t["spec"]
        assert got[:].tobytes() == expected.tobytes()
        out_plist, template_plist = got.id.get_create_plist(), template.id.get_create_plist()
        assert [out_plist.get_filter(i) for i in range(out_plist.get_nfilters())] == \
            [template_plist.get_filter(i) for i in range(template_plist.get_nfilters())]
        assert got.chunks == template.chunks and got.maxshape == template.maxshape


def test_plain_chunks_written_out_of_order_unallocated_or_of_other_shape(tmp_path: Path) -> None:
    """Rows copied from the chunk offsets the scan found land in row order, whatever the
    order HDF5 stored the chunks in; a file with an unstored chunk or another chunk shape
    is read through HDF5 instead."""
    expected = []

    def build(f: h5py.File, n: int) -> None:
        rows = np.arange(300 * 3, dtype="<i8").reshape(300, 3) + 10_000 * n
        chunks = (100, 3) if n != 2 else (64, 3)
        ds = f.create_dataset("x", shape=(300, 3), maxshape=(None, 3), chunks=chunks, dtype="<i8",
                              fillvalue=-1)
        if n == 3:
            ds[200:300], ds[0:100] = rows[200:300], rows[0:100]  # chunk 1 never written
            rows = rows.copy()
            rows[100:200] = -1
        else:
            for first in reversed(range(0, 300, chunks[0])):
                ds[first:first + chunks[0]] = rows[first:first + chunks[0]]
        expected.append(rows)

    make_run(tmp_path, build, checkpoints=4)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert o["x"][:].tobytes() == np.concatenate(expected).tobytes()
