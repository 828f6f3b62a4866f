"""Metadata mirrors of store objects (chkq.consolidation.mirror): planning on them equals planning
on the full copy, and a mirror is refused rather than wrong.

A run is put into a store (a ``file://`` directory, and moto's S3 over HTTP), each object
mirrored into a second run directory, and both directories planned
(``prepare(digest=False, reserve=False)``). The plans must be equal but for what names the
directory (paths, stamps, inodes, the directory's id), and the skeletons equal byte for
byte outside the raw chunk ranges of the output, which the copy writes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from chkq.consolidation.mirror import MirrorStats, mirror_object, raw_chunk_ranges, raw_chunk_rows
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.temporaries import JobFiles
from chkq.demo import RunShape
from chkq.demo import make_run as make_demo_run
from chkq.errors import BadCheckpointError, CheckpointChangedError, CheckpointCorruptionError
from chkq.stores.base import CheckpointStore
from chkq.stores.local import LocalDirectoryStore
from support import corpus

MODEL = "run"
JOB = "0123456789abcdef"
MIRROR_STORES = ["file", "s3"]


# --------------------------------------------------------------------------- runs


def _auto_chunked(f: h5py.File, rows: int, number: int, cut_rows: bool = True) -> None:
    """Datasets as a writer that appends makes them: created empty, h5py's own chunks."""
    rng = np.random.default_rng(number)
    f.attrs["code"] = "sim 1.2"
    f.attrs["checkpoint"] = np.uint32(number)
    f.create_dataset("grid", data=np.linspace(0.0, 1.0, 33))  # fixed
    f.create_dataset("params/matrix", data=np.arange(12.0).reshape(3, 4), chunks=(2, 2))
    f["params"].attrs["seed"] = np.int64(1234)
    specs = {"trial": ("<u8", ()), "pos": ("<f4", (3,)), "flags": ("<i4", (5,))}
    if cut_rows:
        specs["spec"] = ("<f8", (8,))  # h5py's chunks cut its rows: kept in a mirror
    for name, (dtype, trailing) in specs.items():
        ds = f.create_dataset(f"g/{name}", shape=(0, *trailing), maxshape=(None, *trailing),
                              dtype=dtype, chunks=True)
        ds.attrs["units"] = name
        ds.resize(rows, axis=0)
        if rows:
            ds[...] = rng.random((rows, *trailing)) * 100
    f.attrs["trials_completed"] = np.uint64(number * 1000)


def auto_chunked_run(run: Path, rows: list[int], cut_rows: bool = True) -> None:
    """Single-file checkpoints of ``rows`` rows each (off the chunk grid)."""
    run.mkdir(parents=True)
    for number, count in enumerate(rows, 1):
        with h5py.File(run / f"{MODEL}_chk{number:05d}.h5", "w") as f:
            _auto_chunked(f, count, number, cut_rows)


def slug_run(run: Path, trials: int = 77) -> None:
    """Checkpoint directories of thread files, the last writer of each with no trial."""
    make_demo_run(run, MODEL, RunShape(checkpoints=3, writers=3, trials=trials,
                                       chunk_rows=50, spec_columns=6, nans=False))


def corpus_run(run: Path, name: str) -> None:
    """A corpus file other software wrote, checkpointed as tests/test_corpus.py does."""
    corpus.make_run(corpus.CORPUS_DIR / name, run, MODEL, directory=True)


# --------------------------------------------------------------------------- helpers


def local_store(tmp_path: Path) -> CheckpointStore:
    return LocalDirectoryStore(tmp_path / "store")


def upload(store: CheckpointStore, run: Path) -> list[str]:
    """Every file of ``run`` as an object keyed by its relative name."""
    keys = []
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        key = path.relative_to(run).as_posix()
        store.put(key, path.read_bytes())
        keys.append(key)
    return keys


def new_file(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def mirror_run(store: CheckpointStore, keys: list[str], into: Path) -> dict[str, MirrorStats]:
    stats = {}
    for key in keys:
        fd = new_file(into / key)
        try:
            stats[key] = mirror_object(store, key, store.version(key), fd)
        finally:
            os.close(fd)
    return stats


def comparable(plan: Plan, run: Path) -> dict[str, Any]:
    """The plan's fields but those that name its directory: paths made relative, stamps
    (mtime, ctime, inode, device: each file's identity here), the temporary output's inode
    and the directory's id left out. The sizes in the stamps are kept."""
    fields = json.loads(plan.to_json())
    prefix = str(run.resolve()) + "/"

    def rel(path: str) -> str:
        assert path.startswith(prefix), path
        return path[len(prefix):]

    fields["checkpoints"] = [[n, rel(p), d] for n, p, d in fields["checkpoints"]]
    fields["files"] = [[rel(f[0]), f[1]] for f in fields["files"]]
    fields["reference_file"] = rel(fields["reference_file"])
    for name in ("out_dir", "temp_inode", "out_dir_id"):
        del fields[name]
    return fields


def raw_ranges(plan: Plan) -> list[tuple[int, int]]:
    """The output's raw chunks: what the copy writes over the skeleton."""
    ranges = []
    for d in plan.datasets:
        size = d.element_size * int(np.prod(d.chunk))
        ranges += [(offset, offset + size) for offset in d.chunk_offsets]
    return sorted(ranges)


def masked(data: bytes, ranges: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for start, stop in ranges:
        out[start:stop] = bytes(stop - start)
    return bytes(out)


def modification_times(path: Path, plan: Plan) -> list[tuple[int, int]]:
    """Where the skeleton's extensible datasets keep their modification time (the seconds
    of a version 1 header's message 0x12): the time of the planning, which differs between
    any two plannings of one run a second apart."""
    found = []
    data = path.read_bytes()
    with h5py.File(path, "r") as f:
        base = f.userblock_size
        for d in plan.datasets:
            info = h5py.h5o.get_info(f[d.name].id)
            start = base + info.addr
            stop = start + info.hdr.space.total
            at = data.find(b"\x12\x00\x08\x00", start, stop)
            while at >= 0:
                if data[at + 8] == 1:
                    found.append((at + 12, at + 16))
                at = data.find(b"\x12\x00\x08\x00", at + 1, stop)
    return found


def holed_but_read_through_hdf5(plan: Plan, chunk_rows: dict[str, int] | None = None
                                ) -> list[tuple[str, str]]:
    """(file, dataset) whose chunks a mirror leaves out but the plan copies through HDF5
    (no ``source_chunks``): a copy from the mirror would read zeros there."""
    found = []
    for index, entry in enumerate(plan.files):
        holes = raw_chunk_ranges(entry[0], chunk_rows)
        with h5py.File(entry[0], "r") as f:
            for d in plan.datasets:
                dsid = f[d.name].id
                if d.source_chunks[index] or not dsid.get_num_chunks():
                    continue
                first = dsid.get_chunk_info(0).byte_offset
                if any(a <= first < b for a, b in holes):
                    found.append((entry[0], d.name))
    return found


def plan_both(full: Path, mirror: Path, through_hdf5: frozenset[tuple[str, str]] = frozenset(),
              chunk_rows: dict[str, int] | None = None) -> tuple[Plan, Plan]:
    """Plan both directories as a mirror's planner does; check the plans and skeletons agree."""
    plan_full = prepare(full, MODEL, JOB, digest=False, reserve=False)
    plan_mirror = prepare(mirror, MODEL, JOB, digest=False, reserve=False)
    assert comparable(plan_mirror, mirror) == comparable(plan_full, full)
    path_full = JobFiles(full.resolve(), MODEL, JOB).temp
    path_mirror = JobFiles(mirror.resolve(), MODEL, JOB).temp
    skeleton_full, skeleton_mirror = path_full.read_bytes(), path_mirror.read_bytes()
    assert len(skeleton_full) == len(skeleton_mirror)
    times = modification_times(path_full, plan_full)
    assert times == modification_times(path_mirror, plan_mirror)
    ranges = raw_ranges(plan_full) + times
    assert masked(skeleton_mirror, ranges) == masked(skeleton_full, ranges)
    prefix = str(full.resolve()) + "/"
    assert {(path.removeprefix(prefix), name)
            for path, name in holed_but_read_through_hdf5(plan_full, chunk_rows)} == through_hdf5
    return plan_full, plan_mirror


def check_mirrors(run: Path, mirror: Path, stats: dict[str, MirrorStats],
                  chunk_rows: dict[str, int] | None = None) -> None:
    """Each mirror: the object's bytes outside its raw chunks, zeros (holes) inside them."""
    for key, stat in stats.items():
        original, copy = (run / key).read_bytes(), (mirror / key).read_bytes()
        holes = raw_chunk_ranges(run / key, chunk_rows)
        assert stat == MirrorStats(len(original), len(original) - stat.skipped,
                                   sum(b - a for a, b in holes), stat.sha256)
        assert masked(original, holes) == copy


# --------------------------------------------------------------------------- the equality


@pytest.mark.parametrize("store", MIRROR_STORES, indirect=True)
def test_auto_chunked_run_plans_alike(store: CheckpointStore, tmp_path: Path) -> None:
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    auto_chunked_run(full, [1300, 2051, 777, 3001])
    stats = mirror_run(store, upload(store, full), mirror)
    check_mirrors(full, mirror, stats)
    assert all(s.skipped > 0 for s in stats.values())
    plan, _ = plan_both(full, mirror)
    modes = {d.name: (d.mode, bool(all(d.source_chunks))) for d in plan.datasets}
    # h5py's chunks of g/spec cut its rows: raw, but copied through HDF5 (its bytes kept).
    assert modes == {"g/trial": ("raw", True), "g/pos": ("raw", True),
                     "g/flags": ("raw", True), "g/spec": ("raw", False)}


def poison(run: Path, keys: list[str], holes: dict[str, list[tuple[int, int]]]) -> None:
    """Fill the holes of each mirror with 0xA5: a planner that read them would plan otherwise."""
    for key in keys:
        with open(run / key, "r+b") as f:
            for start, stop in holes[key]:
                f.seek(start)
                f.write(b"\xa5" * (stop - start))


def test_planning_reads_no_byte_of_the_holes(tmp_path: Path) -> None:
    """Not only zeros: whatever the raw chunks hold, the plan and skeleton are the same."""
    store = local_store(tmp_path)
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    auto_chunked_run(full, [1300, 2051, 777])
    keys = upload(store, full)
    mirror_run(store, keys, mirror)
    poison(mirror, keys, {key: raw_chunk_ranges(full / key) for key in keys})
    plan_both(full, mirror)


def _linked_twice(f: h5py.File, rows: int, number: int) -> None:
    """Extensible datasets with a second hard link: resized in place, not recreated (one
    allocated late, so allocated by writing zeros, one early, its chunks kept)."""
    _auto_chunked(f, rows, number, cut_rows=False)
    f["alias"] = f["g/pos"]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk((300,))
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    space = h5py.h5s.create_simple((rows,), (h5py.h5s.UNLIMITED,))
    early = h5py.Dataset(h5py.h5d.create(f["g"].id, b"early", h5py.h5t.STD_I16LE, space,
                                         dcpl=dcpl))
    early[...] = np.arange(rows, dtype="<i2")
    f["alias_early"] = early


def test_datasets_resized_in_place_plan_alike(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    full.mkdir()
    for number, rows in enumerate([900, 1201, 350], 1):
        with h5py.File(full / f"{MODEL}_chk{number:05d}.h5", "w") as f:
            _linked_twice(f, rows, number)
    keys = upload(store, full)
    stats = mirror_run(store, keys, mirror)
    check_mirrors(full, mirror, stats)
    poison(mirror, keys, {key: raw_chunk_ranges(full / key) for key in keys})
    plan, _ = plan_both(full, mirror)
    assert {d.name: d.mode for d in plan.datasets} == dict.fromkeys(
        ["alias", "alias_early", "g/flags", "g/trial"], "raw")
    assert all(all(d.source_chunks) for d in plan.datasets)


@pytest.mark.parametrize("store", MIRROR_STORES, indirect=True)
def test_slug_run_with_an_empty_writer_plans_alike(store: CheckpointStore,
                                                   tmp_path: Path) -> None:
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    slug_run(full)
    keys = upload(store, full)
    assert any("thread_0002" in k for k in keys)
    stats = mirror_run(store, keys, mirror)
    check_mirrors(full, mirror, stats)
    assert stats[f"{MODEL}_chk00001/thread_0002.h5"].skipped == 0  # no row, no chunk
    assert stats[f"{MODEL}_chk00001/thread_0000.h5"].skipped > 0
    plan, _ = plan_both(full, mirror)
    assert {d.mode for d in plan.datasets} == {"raw"}


@pytest.mark.parametrize("name", [
    "hdf5ex-SDSextendible.h5", "netcdfc-cf_timeseries.nc", "netcdfc-usertypes.nc",
    "pytables-attr-u16.h5", "pytables-idx-std-1.x.h5", "pytables-indexes_2_1.h5",
    "pytables-out_of_order_types.h5", "pytables-python3.h5", "pytables-smpl_SDSextendible.h5",
    "pytables-test_filenode_v1.h5", "pytables-times-nested-be.h5",
])  # every corpus file a mirror leaves holes in
def test_corpus_file_plans_alike(name: str, tmp_path: Path) -> None:
    store = local_store(tmp_path)
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    corpus_run(full, name)
    stats = mirror_run(store, upload(store, full), mirror)
    check_mirrors(full, mirror, stats)
    assert sum(s.skipped for s in stats.values()) > 0
    try:
        prepare(full, MODEL, "f" * 16, digest=False, reserve=False)
    except (ValueError, TypeError, NotImplementedError) as exc:
        pytest.skip(f"chkq refuses this run: {exc}")
    plan_both(full, mirror)


def test_chunks_of_other_rows_than_the_templates_are_kept_when_told(tmp_path: Path) -> None:
    """h5py guesses chunks from each file's shape, so files' chunk rows differ from the
    template's: planning copies those files through HDF5. Told the template's chunk rows
    (``chunk_rows``, from the template's mirror, made first), a mirror keeps their bytes."""
    store = local_store(tmp_path)
    full, told, untold = tmp_path / "full", tmp_path / "told", tmp_path / "untold"
    full.mkdir()
    for number, rows in enumerate([3000, 9001, 2500], 1):
        with h5py.File(full / f"{MODEL}_chk{number:05d}.h5", "w") as f:
            f.create_dataset("a", data=np.arange(rows, dtype="<f8"), maxshape=(None,))
            f.create_dataset("b", data=np.ones((rows, 2), dtype="<i2"), maxshape=(None, 2))
            f.attrs["trials_completed"] = np.uint64(number)
    keys = upload(store, full)
    template = f"{MODEL}_chk00003.h5"
    mirror_run(store, keys, untold)
    rows = raw_chunk_rows(untold / template)
    assert set(rows) == {"a", "b"}
    stats = {}
    for key in keys:
        fd = new_file(told / key)
        try:
            stats[key] = mirror_object(store, key, store.version(key), fd, chunk_rows=rows)
        finally:
            os.close(fd)
    check_mirrors(full, told, stats, rows)
    assert stats[keys[0]].skipped == 0 and stats[keys[2]].skipped > 0
    # b's chunks in the second file cut its rows: kept in any case.
    differing = {(keys[0], "a"), (keys[1], "a"), (keys[0], "b")}
    plan, _ = plan_both(full, untold, frozenset(differing))
    assert {d.name: [bool(c) for c in d.source_chunks] for d in plan.datasets} == {
        "a": [False, False, True], "b": [False, False, True]}
    plan_both(full, told, chunk_rows=rows)  # the same job's temporary output made again


def test_padded_records_are_read_through_hdf5(tmp_path: Path) -> None:
    """netCDF records of a dimension shorter than the others in a file but the last: the plan
    pads them with the fill value and copies that file's rows of them through HDF5, not from
    ``source_chunks``. A mirror leaves those chunks out all the same (it cannot tell from one
    object): the copy must read them from the object. Planning itself is alike."""
    from test_fidelity_netcdf import write_run

    store = local_store(tmp_path)
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    write_run(full, lambda n: {"x": 7} if n == 1 else {})
    stats = mirror_run(store, upload(store, full), mirror)
    check_mirrors(full, mirror, stats)
    plan, _ = plan_both(full, mirror, frozenset({(f"{MODEL}_chk00001.h5", "x")}))
    assert {d.name: d.padding for d in plan.datasets if d.padding} == {"x": [[0, 3]]}


def test_digest_is_the_only_field_that_reads_rows(tmp_path: Path) -> None:
    """Planned with digests (the default), a plan differs from one without only in them."""
    run = tmp_path / "run"
    auto_chunked_run(run, [300, 211])
    with_digests = json.loads(prepare(run, MODEL, "a" * 16).to_json())
    without = json.loads(prepare(run, MODEL, "b" * 16, digest=False, reserve=False).to_json())
    assert all(with_digests["file_digests"]) and not any(without["file_digests"])
    for fields in (with_digests, without):
        for name in ("file_digests", "job_id", "temp_inode"):
            del fields[name]
    assert with_digests == without


def test_sparse_skeleton_of_a_large_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """About 200 MB of checkpoints: the mirrors and the skeleton stay small on disk."""
    store = local_store(tmp_path)
    full, mirror = tmp_path / "full", tmp_path / "mirror"
    auto_chunked_run(full, [1_200_000, 1_300_001, 1_150_003, 1_350_007], cut_rows=False)
    keys = upload(store, full)
    stats = mirror_run(store, keys, mirror)
    source = sum(s.size for s in stats.values())
    assert source > 150e6
    mirrored = sum(os.stat(mirror / k).st_blocks * 512 for k in keys)
    plan_full, _ = plan_both(full, mirror)
    skeleton = JobFiles(mirror.resolve(), MODEL, JOB).temp
    size, held = os.path.getsize(skeleton), os.stat(skeleton).st_blocks * 512
    with capsys.disabled():
        print(f"\nsources {source:,} B; mirrors fetched {sum(s.fetched for s in stats.values()):,}"
              f" B, hold {mirrored:,} B on disk; skeleton {size:,} B, holds {held:,} B")
    assert mirrored < source / 50
    assert held < size / 20


# --------------------------------------------------------------------------- refusals


def test_filtered_chunks_are_kept(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("z", data=np.arange(5000.0), maxshape=(None,), chunks=(1000,),
                         compression="gzip")
        f.create_dataset("raw", data=np.arange(5000.0), maxshape=(None,), chunks=(1000,))
    store.put("gz.h5", path.read_bytes())
    fd = new_file(tmp_path / "m.h5")
    try:
        stats = mirror_object(store, "gz.h5", store.version("gz.h5"), fd)
    finally:
        os.close(fd)
    assert stats.skipped == 5 * 8000
    with h5py.File(tmp_path / "m.h5") as f:
        assert (f["z"][...] == np.arange(5000.0)).all()
        assert not f["raw"][...].any()


def _chunk_offset_forged(path: Path, new_offset: int) -> None:
    """Point the first chunk of /x at ``new_offset`` in its (v1 B-tree) index."""
    with h5py.File(path) as f:
        old = f["x"].id.get_chunk_info(0).byte_offset
    data = bytearray(path.read_bytes())
    packed = struct.pack("<Q", old)
    at = data.find(packed)
    assert at >= 0 and data.find(packed, at + 1) < 0
    data[at:at + 8] = struct.pack("<Q", new_offset)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("where", "said"), [("past the end", "lies outside"),
                                             ("over another chunk", "overlaps another"),
                                             ("over metadata", "covers an object header")])
def test_hostile_chunk_index_is_refused_by_name(where: str, said: str, tmp_path: Path) -> None:
    store = local_store(tmp_path)
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.full(4000, -1, dtype="<i8"), maxshape=(None,),
                         chunks=(1000,))
        f.attrs["trials_completed"] = 1
    with h5py.File(path) as f:
        second = f["x"].id.get_chunk_info(1).byte_offset
        header = h5py.h5o.get_info(f["x"].id).addr
    target = {"past the end": os.path.getsize(path) + 4096, "over another chunk": second + 8,
              "over metadata": header}[where]
    _chunk_offset_forged(path, target)
    store.put("bad.h5", path.read_bytes())
    fd = new_file(tmp_path / "m.h5")
    try:
        with pytest.raises(CheckpointCorruptionError, match=f"bad.h5.*{said}"):
            mirror_object(store, "bad.h5", store.version("bad.h5"), fd)
    finally:
        os.close(fd)


def test_not_hdf5_is_refused_by_name(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    store.put("junk.h5", b"\x89HDF\r\n\x1a\n" + b"\xff" * 5000)
    fd = new_file(tmp_path / "m.h5")
    try:
        with pytest.raises(BadCheckpointError, match="junk.h5"):
            mirror_object(store, "junk.h5", store.version("junk.h5"), fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("store", MIRROR_STORES, indirect=True)
def test_object_replaced_after_pinning_is_refused(store: CheckpointStore,
                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    auto_chunked_run(run, [500, 600])
    key = f"{MODEL}_chk00001.h5"
    store.put(key, (run / key).read_bytes())
    pinned = store.version(key)
    store.put(key, (run / f"{MODEL}_chk00002.h5").read_bytes())
    fd = new_file(tmp_path / "m.h5")
    try:
        with pytest.raises(CheckpointChangedError, match=key):
            mirror_object(store, key, pinned, fd)
    finally:
        os.close(fd)


def test_mirror_needs_an_empty_file(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    run = tmp_path / "run"
    auto_chunked_run(run, [10])
    key = f"{MODEL}_chk00001.h5"
    store.put(key, (run / key).read_bytes())
    fd = new_file(tmp_path / "m.h5")
    try:
        os.write(fd, b"x")
        with pytest.raises(ValueError, match="empty"):
            mirror_object(store, key, store.version(key), fd)
    finally:
        os.close(fd)
