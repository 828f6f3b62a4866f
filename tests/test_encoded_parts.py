"""A filtered run's chunks laid out in a sparse skeleton, for an output assembled from parts.

The skeleton is planned on metadata mirrors (every chunk a hole); the
chunks the store will copy unchanged are written into it as placeholders
of their stored size and filter mask, freed from the disk as soon as they
are written, and the few chunks encoded again are real bytes. The skeleton
must stay small on disk while its chunk index places every chunk; its
pieces, with the sources' bytes, must make the consolidation; and a source
chunk encoded again that cannot be decoded is a clear error.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5f
from test_mirror import new_file, upload
from test_skeleton_space import _holes_supported

from chkq.consolidation import encoded_parts
from chkq.consolidation.checkpoint_files import stored_chunks
from chkq.consolidation.encoded_parts import write_chunks
from chkq.consolidation.mirror import sealed_mirror
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.output_parts import (
    SKELETON,
    build_part,
    chunk_maps,
    cut_parts,
    output_pieces,
)
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.errors import BadCheckpointError, BadMessageError, CheckpointCorruptionError
from chkq.stores.base import CheckpointStore
from chkq.stores.local import LocalDirectoryStore
from support.corpus_expect import compare

#: Rows of each writer of each checkpoint: multiples of the wide dataset's 64 rows per chunk
#: (its chunks move unchanged) but for the run's last file; never of the narrow ones' 1,024
#: (every chunk of theirs is encoded again); a writer of no rows in two checkpoints.
ROWS = [[64 * 37, 64 * 41, 0], [64 * 50, 64 * 29, 0], [64 * 44, 64 * 33 + 17]]


def gzip_run(run: Path, rows: list[list[int]] = ROWS, width: int = 1000) -> list[Path]:
    """Thread directories of gzip files, h5py's automatic chunks, rows that differ per file.

    Each file's datasets are created empty and grown, as a writer that
    appends does: h5py then guesses the same chunks in every file.
    """
    rng = np.random.default_rng(5)
    total, paths = 0, []
    for number, writers in enumerate(rows, start=1):
        folder = run / f"sim_chk{number:05d}"
        folder.mkdir(parents=True)
        for writer, count in enumerate(writers):
            path = folder / f"thread_{writer:04d}.h5"
            with h5py.File(path, "w") as f:
                f.attrs["trials_completed"] = np.uint64(total + count)
                f.create_dataset("grid", data=np.linspace(0, 1, 77))
                g = f.create_group("galaxy")
                for name, shape, dtype in (("trial", (), "u8"), ("spec", (width,), "f8"),
                                           ("flags", (3,), "u1")):
                    g.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape),
                                     dtype=dtype, chunks=True, compression="gzip",
                                     shuffle=True).resize(count, axis=0)
                if count:
                    g["trial"][:] = np.arange(total, total + count)
                    g["spec"][:] = np.round(rng.random((count, width)), 3)
                    g["flags"][:] = rng.integers(0, 4, (count, 3))
            total += count
            paths.append(path)
    return paths


def _mirrored(run: Path, tmp_path: Path) -> tuple[CheckpointStore, Plan, list[str]]:
    """The run in a local store, planned on its spread mirrors; the store and each file's key."""
    store = LocalDirectoryStore(tmp_path / "store")
    keys = upload(store, run)
    mirrors = tmp_path / "mirrors"
    for key in keys:
        fd = new_file(mirrors / key)
        try:
            sealed_mirror(store, key, store.version(key), fd)
        finally:
            os.close(fd)
    plan = prepare(mirrors, "sim", uuid.uuid4().hex, digest=False, reserve=False)
    return store, plan, [str(Path(f[0]).relative_to(mirrors)) for f in plan.files]


def _reader(store: CheckpointStore, keys: list[str]):  # type: ignore[no-untyped-def]
    def read(file_index: int, start: int, length: int) -> bytes:
        key = keys[file_index]
        data = store.get_range_pinned(key, store.version(key), start, length)
        assert data is not None
        return data
    return read


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_placeholders_leave_the_skeleton_sparse_with_every_chunk_placed(
        tmp_path: Path) -> None:
    if not _holes_supported(tmp_path):
        pytest.skip("this filesystem keeps no holes")
    run = tmp_path / "run"
    files = gzip_run(run)
    store, plan, keys = _mirrored(run, tmp_path)

    encoded = write_chunks(plan, _reader(store, keys))

    size = os.stat(plan.job.temp).st_size
    run_bytes = sum(f.stat().st_size for f in files)
    assert size > 0.9 * run_bytes
    # The metadata, the chunks encoded again (the narrow datasets') and a block at each end
    # of each run of placeholders: a few hundred KiB of a 90 MiB output.
    assert _allocated(plan.job.temp) < 2 << 20, _allocated(plan.job.temp)
    assert 0 < encoded < 1 << 20
    with h5py.File(plan.job.temp, "r") as out:
        for d in plan.datasets:
            dsid = out[d.name].id
            found = [info for _, info in stored_chunks(dsid, tuple(d.chunk), dsid.shape)]
            assert all(i is not None for i in found), d.name
            assert [int(i.byte_offset) for i in found] == d.chunk_offsets
            assert [int(i.size) for i in found] == d.chunk_sizes
    spec = next(d for d in plan.datasets if d.name == "galaxy/spec")
    assert all(f >= 0 for f in spec.chunk_files), "a wide chunk was encoded again"
    trial = next(d for d in plan.datasets if d.name == "galaxy/trial")
    # Its files' first rows are mostly off its 1,024-row grid: those chunks are encoded again.
    assert trial.chunk_files.count(-1) > len(trial.chunk_files) // 2

    check_plan_output(plan)
    maps = chunk_maps(plan, lambda f: h5f.open(os.fsencode(plan.file_path(f)), h5f.ACC_RDONLY))
    parts = cut_parts(output_pieces(plan, size, maps), 5 << 20)
    skeleton = os.open(plan.job.temp, os.O_RDONLY)
    sources = {i: os.open(store.root / key, os.O_RDONLY) for i, key in enumerate(keys)}
    output = tmp_path / "sim.h5"
    try:
        with open(output, "wb") as out_file:
            for part in parts:
                out_file.seek(part.offset)
                out_file.write(build_part(part, lambda s, at, n: os.pread(
                    skeleton if s == SKELETON else sources[s], n, at)))
    finally:
        for fd in (skeleton, *sources.values()):
            os.close(fd)
    assert compare(output, sorted(files)) == []


def test_a_damaged_source_chunk_encoded_again_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = gzip_run(run, rows=[[3000, 2000], [2500]], width=8)
    victim = files[1]
    with h5py.File(victim, "r") as f:
        info = f["galaxy/trial"].id.get_chunk_info(0)
    with open(victim, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xff" * 16)
    store, plan, keys = _mirrored(run, tmp_path)

    with pytest.raises(CheckpointCorruptionError) as failed:
        write_chunks(plan, _reader(store, keys))

    assert "dataset /galaxy/trial of" in str(failed.value)
    assert "sim_chk00001/thread_0001.h5" in str(failed.value), failed.value
    assert "nothing was published" in str(failed.value)
    assert not any(p.name.endswith(".filled") for p in (tmp_path / "mirrors").rglob("*"))


@pytest.mark.parametrize("wrong", ["start", "size", "file"])
def test_a_moved_chunk_planned_from_the_wrong_place_is_refused(tmp_path: Path,
                                                              wrong: str) -> None:
    run = tmp_path / "run"
    gzip_run(run, rows=[[2048, 1024], [1500]], width=8)
    store, plan, keys = _mirrored(run, tmp_path)
    write_chunks(plan, _reader(store, keys))
    d = plan.datasets[0]
    n = d.chunk_files.index(1)
    if wrong == "start":
        d.chunk_starts[n] += 8
    elif wrong == "size":
        d.chunk_sizes[n] -= 1
    else:
        d.chunk_files[n] = 0

    with pytest.raises((CheckpointCorruptionError, BadMessageError),
                       match=f"dataset /{d.name}"):
        chunk_maps(plan, lambda f: h5f.open(os.fsencode(plan.file_path(f)), h5f.ACC_RDONLY))


def test_more_chunks_to_encode_again_than_the_bound_refuse_the_spread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    gzip_run(run, rows=[[3000, 2000], [2500]], width=8)
    store, plan, keys = _mirrored(run, tmp_path)
    monkeypatch.setattr(encoded_parts, "MAX_ENCODED_BYTES", 4096)

    with pytest.raises(BadCheckpointError, match="cannot be spread over the nodes: more than "
                       "4,096 bytes of its filtered chunks would be encoded again"):
        write_chunks(plan, _reader(store, keys))
    assert not any(p.name.endswith(".filled") for p in (tmp_path / "mirrors").rglob("*"))
