"""An output assembled from parts, each built or copied by range, is the consolidation of its run.

The planner plans a run as for any job; the output is then written part by
part from the plan's pieces alone (source ranges and the skeleton's bytes),
as nodes that share nothing but the plan would, and compared with what its
sources say by the independent comparator.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5f

from chkq.consolidation.output_parts import (
    MIN_PART,
    SKELETON,
    OutputPart,
    build_part,
    chunk_maps,
    cut_parts,
    eligible,
    output_pieces,
    parts_from_record,
)
from chkq.consolidation.prepare import prepare
from chkq.demo import RunShape, make_run
from chkq.errors import BadMessageError
from support.corpus_expect import compare

MiB = 1 << 20


def _assemble(plan, parts: list[OutputPart], into: Path) -> int:  # type: ignore[no-untyped-def]
    """Write every part at its offset, as the nodes would; return the bytes built (not copied)."""
    sources = {i: os.open(plan.file_path(i), os.O_RDONLY) for i in range(len(plan.files))}
    skeleton = os.open(plan.job.temp, os.O_RDONLY)
    built = 0

    def read(source: int, start: int, length: int) -> bytes:
        return os.pread(skeleton if source == SKELETON else sources[source], length, start)

    with open(into, "wb") as out:
        for part in parts:
            out.seek(part.offset)
            out.write(build_part(part, read))
            built += 0 if part.copied else part.length
    os.close(skeleton)
    for fd in sources.values():
        os.close(fd)
    return built


def _uneven_run(run: Path, scale: int = 1) -> list[Path]:
    """Single-file checkpoints of different rows, h5py's automatic chunks, three widths."""
    rng = np.random.default_rng(3)
    paths, total = [], 0
    for number, rows in enumerate((70_000 * scale, 123_457 * scale, 0, 51_001 * scale),
                                  start=1):
        path = run / f"run_chk{number:05d}.h5"
        total += rows
        with h5py.File(path, "w") as f:
            f.attrs["trials_completed"] = np.uint64(total)
            f.create_dataset("grid", data=np.linspace(0, 1, 77))
            g = f.create_group("galaxy")
            g.create_dataset("trial", data=np.arange(total - rows, total, dtype="u8"),
                             maxshape=(None,), chunks=True)
            g.create_dataset("spec", data=rng.random((rows, 9)), maxshape=(None, 9), chunks=True)
            g.create_dataset("flags", data=rng.integers(0, 255, (rows, 3)).astype("u1"),
                             maxshape=(None, 3), chunks=True)
        paths.append(path)
    return paths


@pytest.mark.parametrize("layout", ["threads", "uneven"])
def test_parts_built_and_copied_by_range_make_the_consolidation(tmp_path: Path,
                                                                 layout: str) -> None:
    run = tmp_path / "run"
    if layout == "threads":
        paths = make_run(run, "run", RunShape(checkpoints=3, writers=3, trials=3_001,
                                              spec_columns=600, chunk_rows=97))
    else:
        run.mkdir()
        paths = _uneven_run(run)
    plan = prepare(run, "run", uuid.uuid4().hex)
    assert eligible(plan) is None
    size = os.stat(plan.job.temp).st_size
    maps = chunk_maps(plan, lambda f: h5f.open(os.fsencode(plan.file_path(f)), h5f.ACC_RDONLY))
    pieces = output_pieces(plan, size, maps)
    assert [p.offset for p in pieces] == sorted(p.offset for p in pieces)
    assert sum(p.length for p in pieces) == size
    parts = cut_parts(pieces, 6 * MiB)
    assert all(p.length >= MIN_PART for p in parts[:-1])
    if layout == "threads":
        # Long runs of one source's chunks are copied by the store; h5py's automatic chunks
        # of the uneven run tile the columns, so its ranges are short and all are built.
        assert any(p.copied for p in parts), "no part is a source range the store can copy"
    assert parts_from_record([p.to_record() for p in parts], size) == parts

    output = tmp_path / "run.h5"
    built = _assemble(plan, parts, output)
    assert compare(output, paths) == []
    assert built == sum(p.length for p in parts if not p.copied)


def test_a_filtered_dataset_whose_chunks_were_not_laid_out_is_not_assembled(
        tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, compression="gzip"))
    plan = prepare(tmp_path, "run", uuid.uuid4().hex)
    assert eligible(plan) is None
    with pytest.raises(BadMessageError, match="chunks were not laid out"):
        output_pieces(plan, 1 << 20, [[] for _ in plan.datasets])


def test_a_parts_record_that_does_not_cover_the_output_is_refused() -> None:
    good = [[[0, 10, SKELETON, 0]], [[10, 5, 0, 100]]]
    assert [p.length for p in parts_from_record(good, 15)] == [10, 5]
    for bad, size in (([[[0, 10, SKELETON, 0]], [[11, 4, 0, 100]]], 15),
                      (good, 16), ([[[0, 15, -7, 0]]], 15), ([[[0, 15, 0, True]]], 15),
                      ("parts", 15), ([[]], 0)):
        with pytest.raises(BadMessageError):
            parts_from_record(bad, size)


def test_every_part_but_the_last_is_at_least_the_store_minimum() -> None:
    from chkq.consolidation.output_parts import Piece

    pieces = [Piece(0, 1000, SKELETON, 0), Piece(1000, 12 * MiB, 0, 0),
              Piece(1000 + 12 * MiB, 3 * MiB, 1, 0), Piece(1000 + 15 * MiB, 40, SKELETON, 0),
              Piece(1040 + 15 * MiB, 30 * MiB, 2, 7)]
    parts = cut_parts(pieces, 5 * MiB, copy_part_bytes=16 * MiB)
    assert all(p.length >= MIN_PART for p in parts[:-1])
    assert sum(p.length for p in parts) == sum(p.length for p in pieces)
    copied = [p for p in parts if p.copied]
    assert copied and all(p.length <= 16 * MiB for p in copied)
    # The first built part took the head of the copied range to reach the minimum.
    assert parts[0].length == MIN_PART and parts[0].pieces[1].source == 0


def test_a_wide_output_planned_for_parts_is_nearly_all_copied_by_the_store(
        tmp_path: Path) -> None:
    """Datasets of 64 MiB a checkpoint: the chunk index does not break the runs of chunks.

    What passes through a node is the built parts; the rest the store copies.
    Planned for parts (a sparse skeleton), the output keeps its new chunk
    index out of the runs of chunks, so what is built is two minimum parts:
    the head (the superblock and the template's metadata) and the new
    metadata, where the template ended; the same run planned for one node,
    its index among the chunks, builds more.
    """
    run = tmp_path / "run"
    run.mkdir()
    rng = np.random.default_rng(5)
    paths = []
    for number in range(1, 5):
        path = run / f"run_chk{number:05d}.h5"
        with h5py.File(path, "w") as f:
            f.attrs["trials_completed"] = np.uint64(number * 8192)
            f.create_dataset("spec", data=rng.random((8192, 1024)), maxshape=(None, 1024),
                             chunks=(256, 1024))
        paths.append(path)

    def built_share(reserve: bool) -> float:
        plan = prepare(run, "run", uuid.uuid4().hex, reserve=reserve, digest=reserve)
        size = os.stat(plan.job.temp).st_size
        maps = chunk_maps(plan, lambda f: h5f.open(os.fsencode(plan.file_path(f)),
                                                   h5f.ACC_RDONLY))
        parts = cut_parts(output_pieces(plan, size, maps), 16 * MiB)
        output = tmp_path / f"run-{reserve}.h5"
        built = _assemble(plan, parts, output)
        assert compare(output, paths) == []
        os.unlink(plan.job.temp)
        output.unlink()
        return built / size

    for_parts, for_one_node = built_share(False), built_share(True)
    assert for_parts <= 0.05, f"{for_parts:.1%} of the output is built"
    assert for_parts < for_one_node
