"""The output's byte layout fixed by the planner: metadata by libhdf5, chunks copied by range.

A run whose checkpoints end on the chunk grid is laid out (every chunk a
placeholder of its stored size), assembled with ``copy_file_range`` from the
sources' stored chunk bytes, and checked by the corpus comparator against what
its sources say; the layout's chunk map is proven from the output's metadata.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.consolidation.layout import (
    ChunkExtent,
    LayoutImage,
    assemble,
    check_chunk_map,
    plan_layout,
)
from chkq.errors import BadCheckpointError
from support.corpus_expect import compare
from support.h5runs import chunk_infos

ROWS = (512, 1024, 256)


def _write_run(run: Path) -> list[Path]:
    """Three checkpoints as h5py writes them: 256-row chunks, gzip, h5py's automatic chunks."""
    rng = np.random.default_rng(7)
    paths = []
    for number, rows in enumerate(ROWS, start=1):
        path = run / f"run_chk{number:05d}.h5"
        with h5py.File(path, "w") as f:
            f.attrs["trials_completed"] = sum(ROWS[:number])
            f.create_dataset("grid", data=np.linspace(0, 1, 300))
            trials = f.create_group("galaxy")
            trials.create_dataset("trial", data=rng.random((rows, 6)), maxshape=(None, 6),
                                  chunks=(256, 6))
            trials.create_dataset("mass", data=rng.integers(0, 9, (rows,)).astype("f4"),
                                  maxshape=(None,), chunks=(256,), compression="gzip")
            auto = f.create_dataset("auto", shape=(rows, 3), maxshape=(None, 3), dtype="f8",
                                    chunks=(256, 3), compression="gzip", shuffle=True)
            auto[...] = rng.normal(size=(rows, 3)).round(2)
        paths.append(path)
    return paths


EXTENSIBLE = ("galaxy/trial", "galaxy/mass", "auto")


def _source_chunks(paths: list[Path]) -> dict[str, list[tuple[int, int, int, int, int]]]:
    """Per dataset: ``(file, row, offset, size, mask)`` of every stored chunk, in output order."""
    found: dict[str, list[tuple[int, int, int, int, int]]] = {name: [] for name in EXTENSIBLE}
    base = 0
    for index, path in enumerate(paths):
        with h5py.File(path, "r") as f:
            for name in EXTENSIBLE:
                dsid = f[name].id
                for info in chunk_infos(dsid):
                    found[name].append((index, base + info.chunk_offset[0], info.byte_offset,
                                        info.size, info.filter_mask))
            base += f["auto"].shape[0]
    return found


def _build(template: Path, chunks: dict[str, list[tuple[int, int, int, int, int]]],
           extents: dict[int, tuple[int, int]]) -> object:
    total = sum(ROWS)

    def build(out: h5py.File, image: LayoutImage) -> None:
        with h5py.File(template, "r") as t:
            out.attrs["trials_completed"] = t.attrs["trials_completed"]
            t.copy("grid", out)
            out.create_group("galaxy")
            for name in EXTENSIBLE:
                source = t[name]
                space = h5py.h5s.create_simple((total,) + source.shape[1:],
                                               (h5py.h5s.UNLIMITED,) + source.shape[1:])
                dsid = h5py.h5d.create(out.id, name.encode(), source.id.get_type(), space,
                                       dcpl=source.id.get_create_plist())
                for file_index, row, offset, size, mask in chunks[name]:
                    tag = len(extents)
                    extents[tag] = (file_index, offset)
                    dsid.write_direct_chunk((row,) + (0,) * (len(source.shape) - 1),
                                            image.placeholder(tag, size), mask)
    return build


def test_a_run_assembled_from_ranges_is_the_consolidation_of_its_checkpoints(
        tmp_path: Path) -> None:
    paths = _write_run(tmp_path)
    chunks = _source_chunks(paths)
    extents: dict[int, tuple[int, int]] = {}
    layout = plan_layout(_build(paths[-1], chunks, extents))
    assert len(layout.chunks) == sum(len(c) for c in chunks.values())
    stored = sum(size for c in chunks.values() for *_, size, _ in c)
    assert sum(c.length for c in layout.chunks) == stored

    output = tmp_path / "run.h5"
    sources = [os.open(p, os.O_RDONLY) for p in paths]
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        copied = assemble(layout, fd, lambda c: (sources[extents[c.tag][0]], extents[c.tag][1]))
    finally:
        os.close(fd)
        for s in sources:
            os.close(s)
    assert copied == stored
    assert compare(output, paths) == []

    # The proof from metadata: the output's own chunk index places every chunk as planned.
    by_tag = {c.tag: c for c in layout.chunks}
    tag = 0
    with h5py.File(output, "r") as out:
        for name in EXTENSIBLE:
            planned, masks = {}, {}
            for _, row, _, _, mask in chunks[name]:
                where = (row,) + (0,) * (out[name].ndim - 1)
                planned[where], masks[where] = by_tag[tag], mask
                tag += 1
            assert check_chunk_map(out[name], planned, masks) == []


def test_a_chunk_placed_wrongly_is_named_from_metadata_alone(tmp_path: Path) -> None:
    paths = _write_run(tmp_path)
    chunks = _source_chunks(paths)
    extents: dict[int, tuple[int, int]] = {}
    layout = plan_layout(_build(paths[-1], chunks, extents))
    image = tmp_path / "image.h5"
    with open(image, "wb") as f:
        f.truncate(layout.size)
        for offset, data in layout.metadata:
            f.seek(offset)
            f.write(data)
    wrong = {(0, 0): ChunkExtent(layout.chunks[0].offset + 1, layout.chunks[0].length, 0)}
    with h5py.File(image, "r") as out:
        problems = check_chunk_map(out["galaxy/trial"], wrong, {})
    assert any("planned at" in p for p in problems), problems
    assert any("not planned" in p for p in problems), problems


def test_a_metadata_write_holding_a_placeholder_is_refused() -> None:
    image = LayoutImage()
    with pytest.raises(BadCheckpointError, match="layout cannot be fixed"):
        image.write(b"header" + image.placeholder(3, 64))
