"""The row check of an output and sources kept as store objects (``verify_opened``).

A run of checkpoint files is consolidated here (planned, copied, merged: the
output the verify step would read), then the output and every checkpoint file
are put into a store, and the output's rows are verified against the sources
read through :class:`chkq.stores.fileobj.ObjectFile`, as a job whose run and
output live in a store verifies them. A byte changed in one row of the output
object must fail the check naming the dataset, the output row and the source
object.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5f

from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.merge import merge_parts
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.verify_rows import VerifyStats, verify_files, verify_opened
from chkq.errors import OutputMismatchError
from chkq.stores.base import CheckpointStore
from chkq.stores.fileobj import ObjectFile
from chkq.stores.local import LocalDirectoryStore
from chkq.stores.memory import MemoryStore
from support.h5runs import make_run

#: Rows of each checkpoint file: each file a different count, none on a chunk boundary.
ROWS = [1500, 37, 2900, 811]
OUTPUT_KEY = "out/run.h5"


def plain_rows(f: h5py.File, n: int) -> None:
    """Datasets appended to as a simulation does: created empty, h5py's own chunks."""
    rng = np.random.default_rng(n)
    rows = ROWS[n - 1]
    specs = {"trial": ("<u8", ()), "pos": ("<f4", (3,)), "spec": ("<f8", (7,))}
    for name, (dtype, trailing) in specs.items():
        ds = f.create_dataset(f"g/{name}", shape=(0, *trailing), maxshape=(None, *trailing),
                              dtype=dtype, chunks=True)
        ds.resize(rows, axis=0)
        ds[...] = rng.random((rows, *trailing)) * 1000
    f["g/trial"][...] = np.arange(rows) + 10_000 * n


def string_rows(f: h5py.File, n: int) -> None:
    """A fixed-size dataset and one of variable-length strings."""
    rows = ROWS[n - 1]
    f.create_dataset("trial", data=np.arange(rows, dtype="<u8"), maxshape=(None,), chunks=True)
    f.create_dataset("log", data=[f"file {n} row {i}" for i in range(rows)],
                     dtype=h5py.string_dtype(), maxshape=(None,), chunks=True)


def consolidated(tmp_path: Path, build: Callable[[h5py.File, int], None]) -> Plan:
    """A planned job whose copy and merge are done: its output is ``plan.job.temp``."""
    run = tmp_path / "run"
    make_run(run, build, checkpoints=len(ROWS))
    plan = prepare(run, "run", uuid.uuid4().hex, task_bytes=64 * 1024)
    for unit in range(len(plan.copy_units)):
        copy_unit(plan, unit)
    merge_parts(plan)
    return plan


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "memory":
        return MemoryStore()
    return LocalDirectoryStore(tmp_path / "bucket")


def put_run(store: CheckpointStore, plan: Plan, output: bytes) -> list[str]:
    """Put ``output`` and every checkpoint file of ``plan`` into ``store``; the files' keys."""
    store.put(OUTPUT_KEY, output)
    keys = []
    for index in range(len(plan.files)):
        key = f"run/{plan.file_path(index).name}"
        store.put(key, plan.file_path(index).read_bytes())
        keys.append(key)
    return keys


@contextmanager
def opened(store: CheckpointStore, key: str) -> Iterator[h5f.FileID]:
    """The HDF5 id of the object under ``key``, read through a pinned ObjectFile."""
    with h5py.File(ObjectFile(store, key, pinned=store.version(key)), "r") as f:
        yield f.id


def verify_objects(store: CheckpointStore, plan: Plan, keys: list[str]) -> VerifyStats:
    """Every verify unit of ``plan`` run on the store's objects; the stats added up."""
    total = VerifyStats()

    def source(index: int) -> h5f.FileID:
        return h5py.File(ObjectFile(store, keys[index], pinned=store.version(keys[index])),
                         "r").id

    with opened(store, OUTPUT_KEY) as output:
        for first, stop in plan.verify_units:
            stats = verify_opened(plan, first, stop, output, source,
                                  source_name=lambda i: f"{store.url}/{keys[i]}")
            total.rows += stats.rows
            total.bytes += stats.bytes
            total.files += stats.files
    return total


def row_offset(output: Path, name: str, row: int) -> int:
    """The byte offset in ``output`` of the first element of ``row`` of dataset ``name``.

    Through the dataset's chunk index (``get_chunk_info``): the chunk that
    holds the row, and the row's place in that (unfiltered) chunk.
    """
    with h5py.File(output, "r") as f:
        ds = f[name]
        chunk = ds.chunks
        dsid = ds.id
        first_row = row // chunk[0] * chunk[0]
        infos = [dsid.get_chunk_info(i) for i in range(dsid.get_num_chunks())]
        info = next(i for i in infos
                    if i.chunk_offset == (first_row, *([0] * (len(chunk) - 1))))
        assert info.filter_mask == 0 and ds.compression is None
        return int(info.byte_offset) + (row - first_row) * int(np.prod(chunk[1:])) \
            * ds.dtype.itemsize


def test_a_correct_output_passes_with_every_row_counted(tmp_path: Path,
                                                        store: CheckpointStore) -> None:
    plan = consolidated(tmp_path, plain_rows)
    try:
        assert {d.mode for d in plan.datasets} == {"raw"}
        assert any(d.trailing for d in plan.datasets), "a dataset of 2-D rows"
        keys = put_run(store, plan, plan.job.temp.read_bytes())
        seen: list[int] = []
        stats = verify_objects(store, plan, keys)
        assert stats.files == len(ROWS)
        assert stats.rows == 3 * sum(ROWS) == plan.total_rows
        assert stats.bytes == sum(ROWS) * (8 + 3 * 4 + 7 * 8)
        with opened(store, OUTPUT_KEY) as output:
            verify_opened(plan, 0, len(plan.files), output,
                          lambda i: h5py.File(ObjectFile(store, keys[i]), "r").id, seen.append)
        assert seen == sorted(seen) and seen[-1] == plan.total_rows
    finally:
        plan.job.temp.unlink()


@pytest.mark.parametrize("block_bytes", [64 * 1024 * 1024, 4096])
@pytest.mark.parametrize(("name", "file_index", "within"), [
    ("g/pos", 2, 1234), ("g/trial", 0, 0), ("g/spec", 3, ROWS[3] - 1)])
def test_a_flipped_byte_in_the_output_object_names_its_row(
        tmp_path: Path, store: CheckpointStore, name: str, file_index: int, within: int,
        block_bytes: int) -> None:
    plan = consolidated(tmp_path, plain_rows)
    plan.block_bytes = block_bytes
    try:
        d = next(d for d in plan.datasets if d.name == name)
        row = d.offsets[file_index] + within
        output = bytearray(plan.job.temp.read_bytes())
        output[row_offset(plan.job.temp, name, row) + 1] ^= 0xFF
        keys = put_run(store, plan, bytes(output))
        source = f"{store.url}/{keys[file_index]}"
        with pytest.raises(OutputMismatchError) as caught:
            verify_objects(store, plan, keys)
        assert str(caught.value) == (
            f"row {row} of dataset {name!r} in the output differs from row {within} of "
            f"checkpoint file {source!r}")
        for first, stop in plan.verify_units:
            verify_files(plan, first, stop)  # the local output was not changed
    finally:
        plan.job.temp.unlink()


def test_without_a_name_the_plan_s_path_names_the_source(tmp_path: Path) -> None:
    store = MemoryStore()
    plan = consolidated(tmp_path, plain_rows)
    try:
        d = next(d for d in plan.datasets if d.name == "g/trial")
        row = d.offsets[1] + 5
        output = bytearray(plan.job.temp.read_bytes())
        output[row_offset(plan.job.temp, d.name, row)] ^= 0x01
        keys = put_run(store, plan, bytes(output))
        with opened(store, OUTPUT_KEY) as out, pytest.raises(
                OutputMismatchError,
                match=rf"row {row} of dataset 'g/trial' .* row 5 of checkpoint file "
                      rf"'{plan.file_path(1)}'"):
            verify_opened(plan, 0, len(plan.files), out,
                          lambda i: h5py.File(ObjectFile(store, keys[i]), "r").id)
    finally:
        plan.job.temp.unlink()


def test_string_rows_compare_by_value_through_the_objects(tmp_path: Path) -> None:
    store = MemoryStore()
    plan = consolidated(tmp_path, string_rows)
    try:
        assert {d.name: d.mode for d in plan.datasets}["log"] == "whole"
        keys = put_run(store, plan, plan.job.temp.read_bytes())
        assert verify_objects(store, plan, keys).rows == 2 * sum(ROWS)
        log = next(d for d in plan.datasets if d.name == "log")
        row = log.offsets[2] + 99
        with h5py.File(plan.job.temp, "r+") as f:
            f["log"][row] = "file 3 row 100"
        put_run(store, plan, plan.job.temp.read_bytes())
        with pytest.raises(OutputMismatchError) as caught:
            verify_objects(store, plan, keys)
        assert str(caught.value) == (
            f"row {row} of dataset 'log' in the output differs from row 99 of checkpoint file "
            f"'{store.url}/{keys[2]}'")
    finally:
        plan.job.temp.unlink()
