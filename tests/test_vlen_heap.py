"""Variable-length rows moved as heap IDs and whole heap collections, then proven.

The merge copies the heap collections a block of source rows points into
and writes the rows' heap IDs, their addresses moved
(``chkq.consolidation.heap_collections.HeapWriter``); verification proves such rows
from the stored bytes of both files (``same_heap_rows``) and compares
anything else through HDF5. With the merge's blocks and items cut small, a
block boundary falls inside files and inside heap collections. Each test
reads the output as a user would: every value, null strings apart from
empty ones, and verification passes or names the row at fault.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5s

from chkq.consolidation import heap_collections, merge, vlen
from chkq.consolidation.merge import merge_items, merge_parts, merge_piece
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.verify_rows import verify_files
from chkq.errors import OutputMismatchError
from support.h5runs import make_run

ROWS = 150
CHECKPOINTS = 3
NULL_EVERY = 11


def text(n: int, i: int) -> bytes:
    """Row ``i`` of checkpoint ``n``: empty every seventh row, long (own collection) every 50th."""
    if i % 7 == 0:
        return b""
    return f"{n}:{i} ".encode() * (700 if i % 50 == 1 else 1 + i % 9)


def write_nulls(dsid: h5py.h5d.DatasetID, rows: list[int]) -> None:
    """Store null strings (null pointers, not "") at ``rows`` of a 1-D vlen string dataset."""
    tid = dsid.get_type()
    for row in rows:
        fspace = dsid.get_space()
        fspace.select_hyperslab((row,), (1,))
        dsid.write(h5s.create_simple((1,)), fspace, np.zeros(1, dtype=f"V{tid.get_size()}"),
                   mtype=tid)


def producer(f: h5py.File, n: int, compression: str | None = None) -> None:
    """``log`` (strings, some empty, some null), ``grid`` (3 strings a row, chunks one column
    wide), ``seq`` (big-endian int32 sequences, some empty)."""
    values = np.array([text(n, i) for i in range(ROWS)], dtype=object)
    log = f.create_dataset("log", data=values, dtype=h5py.string_dtype(), maxshape=(None,),
                           chunks=(16,), compression=compression)
    write_nulls(log.id, list(range(3, ROWS, NULL_EVERY)))
    f.create_dataset("grid", data=np.array([text(n + 10, i) for i in range(ROWS * 3)],
                                           dtype=object).reshape(ROWS, 3),
                     dtype=h5py.string_dtype("ascii"), maxshape=(None, 3), chunks=(16, 1))
    seq = f.create_dataset("seq", shape=(ROWS,), maxshape=(None,), chunks=(16,),
                           dtype=h5py.vlen_dtype(np.dtype(">i4")))
    for i in range(ROWS):
        seq[i] = np.arange(n * 1000 + i, n * 1000 + i + i % 5, dtype=">i4")


def sources(run: Path, name: str) -> list[object]:
    """Every checkpoint's values of ``name``, in order, as h5py reads them."""
    values: list[object] = []
    for n in range(1, CHECKPOINTS + 1):
        with h5py.File(run / f"run_chk{n:05d}.h5", "r") as f:
            values += list(f[name][...])
    return values


def nulls(dsid: h5py.h5d.DatasetID) -> np.ndarray:
    """Which rows of a 1-D vlen string dataset are null strings."""
    with vlen.read_rows(dsid, 0, dsid.shape[0]) as rows:
        return np.asarray(~rows.view(np.uint8).reshape(len(rows), -1)[:, :8].any(axis=1))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 40 rows, items of 96: boundaries inside files and inside collections."""
    monkeypatch.setattr(merge, "WHOLE_BLOCK_ROWS", 40)
    monkeypatch.setattr(merge, "WHOLE_ITEM_ROWS", 96)


def merged(tmp_path: Path, compression: str | None = None, **options: object) -> Plan:
    run = tmp_path / "run"
    make_run(run, lambda f, n: producer(f, n, compression), checkpoints=CHECKPOINTS, **options)
    plan = prepare(run, "run", "0123456789abcdef")
    assert [d.mode for d in plan.datasets] == ["whole"] * 3
    merge_parts(plan)
    return plan


def verify(plan: Plan) -> None:
    for first, stop in plan.verify_units:
        verify_files(plan, first, stop)


def assert_output_is_the_run(plan: Plan) -> None:
    run = Path(plan.out_dir)
    with h5py.File(plan.job.temp, "r") as out:
        assert list(out["log"][...]) == sources(run, "log")
        assert out["grid"][...].tolist() == np.concatenate(
            [np.asarray(h5py.File(p, "r")["grid"][...]) for p in sorted(run.glob("run_chk*.h5"))]
        ).tolist()
        assert [list(x) for x in out["seq"][...]] == [list(x) for x in sources(run, "seq")]
        expected = np.concatenate([nulls(h5py.File(p, "r")["log"].id)
                                   for p in sorted(run.glob("run_chk*.h5"))])
        assert expected.sum() == CHECKPOINTS * len(range(3, ROWS, NULL_EVERY))
        assert np.array_equal(nulls(out["log"].id), expected)


def test_rows_cut_into_small_blocks_arrive_whole_nulls_and_empties_apart(
        tmp_path: Path, small_blocks: None) -> None:
    plan = merged(tmp_path)
    assert_output_is_the_run(plan)
    verify(plan)


def test_the_rows_moved_as_stored_are_proven_from_the_stored_bytes(
        tmp_path: Path, small_blocks: None) -> None:
    plan = merged(tmp_path)
    run = Path(plan.out_dir)
    out_fd = os.open(plan.job.temp, os.O_RDONLY)
    try:
        with h5py.File(plan.job.temp, "r") as out:
            for name in ("log", "grid", "seq"):
                d = next(d for d in plan.datasets if d.name == name)
                for index in range(CHECKPOINTS):
                    path = run / f"run_chk{index + 1:05d}.h5"
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        with h5py.File(path, "r") as src:
                            start, stop = d.rows_of(index)
                            assert heap_collections.same_heap_rows(
                                src.id, src[name].id, fd, 0, out.id, out[name].id, out_fd,
                                start, stop - start), (name, index)
                    finally:
                        os.close(fd)
    finally:
        os.close(out_fd)


def test_a_string_changed_inside_its_heap_collection_is_named(
        tmp_path: Path, small_blocks: None) -> None:
    """The proof covers the heap bytes, not only the heap IDs: a byte of one string changed in
    the output's collection (its ID left alone) fails it, and the row is named."""
    plan = merged(tmp_path)
    row = ROWS + 20  # the second file's row 20
    with h5py.File(plan.job.temp, "r") as out:
        heap_id = heap_collections.stored_ids(out["log"].id, row, 1).reshape(-1)[0]
        base = out.userblock_size
        wanted = out["log"][row]
    fd = os.open(plan.job.temp, os.O_RDWR)
    try:
        address = base + int(heap_id["address"])
        size = int.from_bytes(os.pread(fd, 8, address + 8), "little")
        collection = os.pread(fd, size, address)
        at = 16
        while at + 16 <= size:
            index = int.from_bytes(collection[at:at + 2], "little")
            length = int.from_bytes(collection[at + 8:at + 16], "little")
            if index == int(heap_id["index"]):
                break
            at += 16 + length + (-length % 8) if index else size
        assert collection[at + 16:at + 16 + len(wanted)] == wanted
        os.pwrite(fd, b"#", address + at + 16)
    finally:
        os.close(fd)
    with pytest.raises(OutputMismatchError, match=rf"row {row} of dataset 'log' in the output "
                                                  r"differs from row 20 of checkpoint file "
                                                  r"'.*run_chk00002\.h5'"):
        verify(plan)


def test_a_merge_piece_done_twice_leaves_the_same_rows(tmp_path: Path,
                                                        small_blocks: None) -> None:
    """A piece delivered again after it finished writes the rows again, the template's too."""
    plan = merged(tmp_path)
    items = merge_items(plan)
    merge_piece(plan, items, list(range(len(items))))
    assert_output_is_the_run(plan)
    verify(plan)


def test_files_with_a_userblock_keep_their_heap_addresses_relative_to_it(
        tmp_path: Path, small_blocks: None) -> None:
    """Heap IDs count from the superblock, which a userblock moves: the copies land right."""
    plan = merged(tmp_path, userblock_size=1024)
    with h5py.File(plan.job.temp, "r") as out:
        assert out.userblock_size == 1024
    assert_output_is_the_run(plan)
    verify(plan)


def test_compressed_strings_go_through_hdf5(tmp_path: Path, small_blocks: None) -> None:
    plan = merged(tmp_path, compression="gzip")
    assert_output_is_the_run(plan)
    verify(plan)


def test_the_output_holds_each_string_once(tmp_path: Path) -> None:
    """The template's strings stay where the skeleton copied them; the other files' are copied
    once: the output is not larger than the run's files together."""
    plan = merged(tmp_path)
    run = Path(plan.out_dir)
    size = sum(p.stat().st_size for p in run.glob("run_chk*.h5"))
    assert os.path.getsize(plan.job.temp) <= size


def test_blocks_cut_to_a_few_heap_collections_still_move_every_row(
        tmp_path: Path, small_blocks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks whose collections would hold more than the bound are halved, down to a row."""
    monkeypatch.setattr(merge, "WHOLE_HEAP_BYTES", 3 * heap_collections.COLLECTION_MIN)
    run = tmp_path / "run"
    make_run(run, producer, checkpoints=CHECKPOINTS)
    plan = prepare(run, "run", "0123456789abcdef", block_bytes=4 * heap_collections.COLLECTION_MIN)
    fd = os.open(run / "run_chk00001.h5", os.O_RDONLY)
    try:
        with h5py.File(run / "run_chk00001.h5", "r") as f:
            limit = 3 * heap_collections.COLLECTION_MIN
            assert heap_collections.heap_rows(f.id, f["log"].id, fd, 0, 40, limit) < 40
    finally:
        os.close(fd)
    merge_parts(plan)
    assert_output_is_the_run(plan)
    verify(plan)

