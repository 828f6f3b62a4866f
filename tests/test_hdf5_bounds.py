"""Crafted HDF5 that costs more than it stores, nests deeper than chkq walks, or uses newer formats.

Every case runs on real ``chkq worker`` processes against the session's
redis-server. Memory claims are measured on the worker's own pool
processes (their peak resident set, ``VmHWM``), on a worker started for
the test with a small ``CHKQ_BLOCK_BYTES`` while the session's worker
takes no task, and the pool processes are checked to be the same before
and after, so that no peak escapes the measurement.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from chkq.config.routing import QUEUES
from chkq.consolidation.checkpoint_files import MAX_DEPTH, UNWRITTEN_CHUNKS, UNWRITTEN_SLACK
from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.output_check import check_output
from chkq.errors import BadCheckpointError, OutputMismatchError
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare
from support.h5runs import TIMEOUT, Builder, make_run, refused
from support.helpers import assert_consolidated, snapshot
from support.plugins.cluster import WorkerProcess, consumers_paused
from support.plugins.users import LocalUser

MiB = 1024 * 1024
#: The block the measured workers run with, and what a pool process may grow by during a
#: job beyond its peak after a small warm-up job: a few blocks (the kept verify windows,
#: one transient window, one slab a side in the whole-output check) and HDF5's caches.
BLOCK = 16 * MiB
GROWTH = 4 * BLOCK







def rows(f: h5py.File, n: int) -> None:
    """An ordinary extensible dataset, so that every run has rows to consolidate."""
    f.create_dataset("rows", data=np.arange(100 * n, dtype="<f8").reshape(-1, 4),
                     maxshape=(None, 4), chunks=(8, 4))


def peak_rss(pid: int) -> int:
    """Peak resident set of process ``pid`` so far, in bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.fixture
def measured(worker: WorkerProcess, start_worker: Callable[..., WorkerProcess],
             tmp_path: Path) -> Iterator[WorkerProcess]:
    """A worker of its own (CHKQ_BLOCK_BYTES=16 MiB, one pool process), warmed up by a small job.

    The session's worker takes no task meanwhile, so every task runs here.
    """
    with consumers_paused(worker, *QUEUES):
        mine = start_worker(",".join(QUEUES), 1, {"CHKQ_BLOCK_BYTES": str(BLOCK)})
        warm = tmp_path / "warm"
        files = make_run(warm, rows)
        output = submit_consolidation("run", warm).wait_for_output(timeout=TIMEOUT)
        assert_consolidated(output, files)
        yield mine


@contextmanager
def growth_at_most(worker: WorkerProcess, limit: int) -> Iterator[None]:
    """Fail unless no pool process of ``worker`` grew its peak RSS by more than ``limit``."""
    pids = sorted(worker.child_pids())
    before = {pid: peak_rss(pid) for pid in pids}
    yield
    assert sorted(worker.child_pids()) == pids, "a pool process was replaced: peak unmeasured"
    grown = {pid: peak_rss(pid) - before[pid] for pid in pids}
    assert max(grown.values()) <= limit, (
        f"a pool process grew by {max(grown.values()) / MiB:.0f} MiB (limit {limit / MiB:.0f}"
        f" MiB; peaks {[peak_rss(p) // MiB for p in pids]} MiB)")




# --------------------------------------------------------------------------- memory


def test_fixed_datasets_declaring_gigabytes_they_do_not_store_cost_no_memory(
        tmp_path: Path, measured: WorkerProcess) -> None:
    """A 1 GiB row and 3e8 empty strings, nothing stored: the job succeeds within a few blocks."""
    def build(f: h5py.File, n: int) -> None:
        rows(f, n)
        f.create_dataset("one_row", shape=(1, 2**27), dtype="<f8", chunks=(1, 2**27))
        f.create_dataset("names", shape=(3 * 10**8,), dtype=h5py.string_dtype(),
                         chunks=(10**6,))

    run = tmp_path / "run"
    files = make_run(run, build)
    assert all(p.stat().st_size < 64 * 1024 for p in files)
    with growth_at_most(measured, GROWTH):
        output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as ref:
        expected = np.concatenate([h5py.File(p, "r")["rows"][()] for p in files])
        assert out["rows"][()].tobytes() == expected.tobytes()
        for name in ("one_row", "names"):
            assert out[name].shape == ref[name].shape
            assert out[name].id.get_storage_size() == 0
        assert out["one_row"][0, 2**27 - 3:].tolist() == [0.0, 0.0, 0.0]


def test_stored_fixed_data_larger_than_the_block_is_checked_in_slabs(
        tmp_path: Path, measured: WorkerProcess) -> None:
    """48 MiB of fixed rows of 24 MiB each and 200,000 strings: checked within a few blocks."""
    values = np.random.default_rng(7).random((2, 3 * 2**20))
    strings = np.array([f"s{i}" for i in range(200_000)], dtype=object)

    def build(f: h5py.File, n: int) -> None:
        rows(f, n)
        f.create_dataset("field", data=values * n)
        f.create_dataset("labels", data=strings, dtype=h5py.string_dtype())

    run = tmp_path / "run"
    files = make_run(run, build)
    with growth_at_most(measured, GROWTH):
        output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)


def test_a_fixed_dataset_changed_in_its_last_slab_is_found(tmp_path: Path) -> None:
    """The slab-wise check is a check: a value at the end of a 24 MiB row, a stored chunk."""
    template, output = tmp_path / "t.h5", tmp_path / "o.h5"
    for path, last in ((template, 1.0), (output, 2.0)):
        with h5py.File(path, "w") as f:
            data = np.zeros((2, 3 * 2**20))
            data[1, -1] = last
            f.create_dataset("field", data=data)
            sparse = f.create_dataset("sparse", shape=(10**6,), chunks=(1000,), dtype="<i4")
            if last == 1.0:
                sparse[5000] = 0
    with pytest.raises(OutputMismatchError) as caught:
        check_output(output, template, rows={}, raw_datasets=set(), block_bytes=BLOCK)
    assert re.search(r"dataset '/field' holds other values from element \(1, \d+\)",
                     str(caught.value))
    assert "dataset '/sparse': its stored chunks are not those of the template" in str(
        caught.value)


def test_rows_or_filtered_chunks_larger_than_the_block_are_refused_before_work(
        tmp_path: Path, measured: WorkerProcess) -> None:
    def big_row(f: h5py.File, n: int) -> None:
        rows(f, n)
        f.create_dataset("wide", data=np.zeros((1, 3 * 2**20)), maxshape=(None, 3 * 2**20),
                         chunks=(1, 3 * 2**20))

    def big_chunk(f: h5py.File, n: int) -> None:
        rows(f, n)
        f.create_dataset("packed", data=np.zeros((64, 65536)), maxshape=(None, 65536),
                         chunks=(64, 65536), compression="gzip")

    with growth_at_most(measured, GROWTH):
        run = tmp_path / "row"
        make_run(run, big_row)
        refused(run, r"dataset '/wide' of checkpoint file .* needs 25165824 bytes in memory "
                     rf"at once .*CHKQ_BLOCK_BYTES={BLOCK}")
        run = tmp_path / "chunk"
        make_run(run, big_chunk)
        refused(run, r"dataset '/packed' of checkpoint file .* needs 33554432 bytes")


# --------------------------------------------------------------------------- declared sizes


def test_an_unstored_gigabyte_chunk_is_refused_and_output_size_is_bounded_by_sources(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """One unstored 1 GiB chunk is refused; an unwritten tail within the slack is consolidated."""
    def forged(f: h5py.File, n: int) -> None:
        rows(f, n)
        ds = f.create_dataset("x", shape=(0,), maxshape=(None,), chunks=(2**27,), dtype="<f8")
        ds.resize((2**27 - 1,))

    run = tmp_path / "forged"
    files = make_run(run, forged)
    assert all(p.stat().st_size < 64 * 1024 for p in files)
    refused(run, r"dataset '/x' of checkpoint file .*run_chk00001.h5' declares 134217727 rows, "
                 r"1073741816 bytes of them in chunks the file does not store")

    tail = 2**20 // 8  # 1 MiB of rows declared ahead of their data, in each file

    def ahead(f: h5py.File, n: int) -> None:
        rows(f, n)
        ds = f.create_dataset("y", data=np.arange(4096.0 * n), maxshape=(None,), chunks=(4096,))
        ds.resize((4096 * n + tail,))

    run = tmp_path / "ahead"
    files = make_run(run, ahead)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    sources = sum(p.stat().st_size for p in files)
    assert output.stat().st_size <= sources + len(files) * UNWRITTEN_SLACK
    assert os.stat(output).st_blocks * 512 <= sources + len(files) * UNWRITTEN_SLACK


def test_sixteen_million_unstored_one_byte_chunks_are_refused_a_few_thousand_are_not(
        tmp_path: Path) -> None:
    """16 MiB of unwritten one-byte rows is within the byte slack, but 16 Mi chunks each cost
    the output a chunk: refused by their count, naming the dataset; 4,000 are consolidated."""
    def declared(count: int) -> Builder:
        def build(f: h5py.File, n: int) -> None:
            rows(f, n)
            ds = f.create_dataset("flags", shape=(count,), maxshape=(None,), chunks=(1,),
                                  dtype="u1")
            ds[:10] = n
        return build

    run = tmp_path / "forged"
    files = make_run(run, declared(16 * MiB))
    assert all(p.stat().st_size < 64 * 1024 for p in files)
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"dataset '/flags' of checkpoint file .*"
                       r"run_chk00001.h5' declares 16777206 chunks the file does not store "
                       rf"\(at most {UNWRITTEN_CHUNKS} chunks"):
        consolidate_here(run, "run")
    assert snapshot(run) == before
    run = tmp_path / "ahead"
    files = make_run(run, declared(4010))
    output = consolidate_here(run, "run")
    assert compare(output, files) == []
    with h5py.File(output, "r") as out:
        assert out["flags"].shape == (8020,)
        assert out["flags"][4005:4012].tolist() == [0] * 5 + [2] * 2


def test_a_variable_length_attribute_is_bounded_by_the_objects_built_from_it(
        tmp_path: Path) -> None:
    """200,000 one-integer sequences: 3.2 MB in the file, within a 16 MiB hold, but some 35 MB
    of Python objects when the whole-output check reads it; refused naming it. 2,000 are not."""
    def attributed(count: int) -> Builder:
        def build(f: h5py.File, n: int) -> None:
            rows(f, n)
            values = np.empty(count, dtype=object)
            for i in range(count):
                values[i] = np.arange(i % 2 + 1, dtype="<i4")
            f["rows"].attrs.create("ragged", data=values, dtype=h5py.vlen_dtype("<i4"))
        return build

    run = tmp_path / "large"
    make_run(run, attributed(200_000), libver="latest")
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"attribute 'ragged' of '/rows' in checkpoint "
                       r"file .*run_chk00002.h5' holds 200000 variable-length elements, "
                       r"80000000 bytes as the Python objects"):
        consolidate_here(run, "run", block_bytes=1 * MiB)
    assert snapshot(run) == before
    run = tmp_path / "small"
    files = make_run(run, attributed(2_000), libver="latest")
    output = consolidate_here(run, "run", block_bytes=1 * MiB)
    assert compare(output, files) == []


# --------------------------------------------------------------------------- compression ratio


#: Filters that store a 512 KiB chunk of zeros in a few hundred bytes or less (ratios of 1,800 to
#: 15,000, far past deflate's 1,032), as producers set them through hdf5plugin.
COMPRESSIBLE = {
    "zstd": hdf5plugin.Zstd(clevel=3),
    "bzip2": hdf5plugin.BZip2(blocksize=9),
    "blosc2": hdf5plugin.Blosc2(cname="zstd"),
    "blosc_zstd": hdf5plugin.Blosc(cname="zstd", clevel=5),
}


def zeros_and_masks(f: h5py.File, n: int) -> None:
    """Simulation output of mostly zeros (unused bins, masked cells), in 512 KiB chunks."""
    rows(f, n)
    count = 65536 * (n + 1) + 1000 * n
    for name, options in COMPRESSIBLE.items():
        values = np.zeros(count, dtype="<f8")
        values[::100_003] = n
        f.create_dataset(name, data=values, maxshape=(None,), chunks=(65536,), **options)


def test_highly_compressible_data_is_consolidated_exactly(tmp_path: Path,
                                                          worker: WorkerProcess) -> None:
    run = tmp_path / "zeros"
    files = make_run(run, zeros_and_masks, checkpoints=3)
    with h5py.File(files[0], "r") as f:
        for name in COMPRESSIBLE:
            info = f[name].id.get_chunk_info(1)
            assert info.size * 1100 < 65536 * 8, (name, info.size)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []


@pytest.fixture
def decode_allowance(worker: WorkerProcess, start_worker: Callable[..., WorkerProcess]
                     ) -> Iterator[int]:
    """A worker of its own allowing jobs 64 MiB of decoded rows; the session's takes nothing."""
    allowance = 64 * MiB
    with consumers_paused(worker, *QUEUES):
        start_worker(",".join(QUEUES), 1, {"CHKQ_MAX_DECODED_BYTES": str(allowance)})
        yield allowance


def bomb(count: int, chunk: int = 65536) -> Builder:
    """Checkpoints whose ``bins`` are ``count`` Blosc2 chunks of zeros, one chunk stored again."""
    def build(f: h5py.File, n: int) -> None:
        rows(f, n)
        ds = f.create_dataset("bins", data=np.zeros(chunk), maxshape=(None,),
                              chunks=(chunk,), **COMPRESSIBLE["blosc2"])
        mask, stored = ds.id.read_direct_chunk((0,))
        ds.resize((count * chunk,))
        for k in range(1, count):
            ds.id.write_direct_chunk((k * chunk,), stored, mask)
    return build


def test_a_decompression_bomb_is_refused_at_the_users_allowance(
        tmp_path: Path, decode_allowance: int) -> None:
    """A 300 KB file whose Blosc2 chunks decode to 256 MiB: refused before work, naming it.

    The chunks are one stored chunk of zeros written again at every offset
    (``write_direct_chunk``), so the file costs nothing to make; the same
    run within the allowance is consolidated exactly.
    """
    run = tmp_path / "bomb"
    files = make_run(run, bomb(512))
    assert all(p.stat().st_size < 400_000 for p in files)
    refused(run, r"the run's filtered datasets decode to 536870912 bytes, more than a job may "
                 rf"decode \(CHKQ_MAX_DECODED_BYTES={decode_allowance}\); most of them in "
                 r"dataset '/bins' .*checkpoint file .*run_chk0000[12].h5' declares 268435456")
    run = tmp_path / "within"
    files = make_run(run, bomb(32))
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []


def test_the_in_process_driver_bounds_decoding_by_its_allowance(tmp_path: Path) -> None:
    run = tmp_path / "bomb"
    make_run(run, bomb(512))
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"decode to 536870912 bytes, more than a job "
                       r"may decode \(CHKQ_MAX_DECODED_BYTES=67108864\)"):
        consolidate_here(run, "run", max_decoded_bytes=64 * MiB)
    assert snapshot(run) == before
    run = tmp_path / "within"
    files = make_run(run, bomb(32))
    output = consolidate_here(run, "run", max_decoded_bytes=64 * MiB)
    assert compare(output, files) == []


# --------------------------------------------------------------------------- depth


def nested(depth: int) -> Builder:
    def build(f: h5py.File, n: int) -> None:
        rows(f, n)
        group = f.create_group("/".join(["g"] * depth))
        group.attrs["depth"] = depth
    return build


def test_ten_thousand_nested_groups_are_refused_without_a_crash(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """In the template and in an earlier file: a clear refusal, the pool process alive."""
    pids = sorted(worker.child_pids())
    for first in (True, False):
        run = tmp_path / f"deep-{first}"
        make_run(run, lambda f, n, first=first: nested(10_000 if (n == 1) == first else 3)(f, n))
        message = refused(run, rf"checkpoint file .*run_chk0000{1 if first else 2}.h5' nests "
                               rf"groups more than {MAX_DEPTH} levels deep")
        assert len(message) < 600, "the refusal should not spell out 10,000 levels"
    assert worker.process.poll() is None
    assert sorted(worker.child_pids()) == pids, "a pool process died"


def test_depth_at_the_limit_is_consolidated_and_one_more_is_refused(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "at"
    files = make_run(run, nested(MAX_DEPTH))
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    with h5py.File(output, "r") as out:
        assert out["/".join(["g"] * MAX_DEPTH)].attrs["depth"] == MAX_DEPTH
    run = tmp_path / "over"
    make_run(run, nested(MAX_DEPTH + 1))
    refused(run, rf"nests groups more than {MAX_DEPTH} levels deep")


def test_the_whole_output_check_refuses_a_deep_file_without_recursion(tmp_path: Path) -> None:
    deep = tmp_path / "deep.h5"
    with h5py.File(deep, "w") as f:
        f.create_group("/".join(["g"] * 10_000))
    with pytest.raises(Exception, match=rf"nests groups more than {MAX_DEPTH} levels deep"):
        check_output(deep, deep, rows={}, raw_datasets=set())


# --------------------------------------------------------------------------- output mode


@pytest.mark.parametrize("directory_owner", ["victim", "attacker"])
def test_a_private_run_gives_a_private_output_owned_by_the_checkpoints_owner(
        worker: WorkerProcess, local_users: tuple[LocalUser, LocalUser],
        directory_owner: str) -> None:
    """Root workers consolidate a victim's 0600 checkpoints: the attacker cannot read the output.

    Also when the run directory is the attacker's, holding hard links to the victim's
    files (what a system without ``protected_hardlinks`` lets any user make): the output
    goes to the checkpoints' owner, not the directory's.
    """
    victim, attacker = local_users
    with shared_directory() as shared:
        run = shared / "run"
        files = make_run(run, rows, checkpoints=3)
        for path in files:
            path.chmod(0o600)
        run.chmod(0o755)
        victim.chown_tree(run)
        if directory_owner == "attacker":
            os.chown(run, attacker.uid, attacker.gid)
        assert attacker.run(["ls", str(run)]).returncode == 0, "the run must be listable"
        for path in files:
            assert attacker.run(["cat", str(path)]).returncode != 0
        output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
        st = output.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert (st.st_uid, st.st_gid) == (victim.uid, victim.gid)
        stolen = attacker.run(["cat", str(output)])
        assert stolen.returncode != 0 and not stolen.stdout
        assert b"Permission denied" in stolen.stderr
        mine = victim.run(["cat", str(output)])
        assert mine.returncode == 0 and mine.stdout == output.read_bytes()
        assert_consolidated(output, files)


@contextmanager
def shared_directory() -> Iterator[Path]:
    """A directory every user can list (runs of a shared scratch space), removed after."""
    path = Path(tempfile.mkdtemp(prefix="chkq-shared-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_output_mode_is_what_every_checkpoint_allows(tmp_path: Path,
                                                     worker: WorkerProcess) -> None:
    """0644, 0640 and 0664 checkpoints: the output gets 0640, never execute or special bits."""
    run = tmp_path / "run"
    files = make_run(run, rows, checkpoints=3)
    for path, mode in zip(files, (0o644, 0o640, 0o6775), strict=True):
        path.chmod(mode)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert stat.S_IMODE(output.stat().st_mode) == 0o640
    assert_consolidated(output, files)


# --------------------------------------------------------------------------- newer formats


def _swmr(f: h5py.File, n: int) -> None:
    ds = f.create_dataset("rows", shape=(0, 4), maxshape=(None, 4), chunks=(8, 4), dtype="<f8")
    f.create_dataset("fixed", data=np.arange(12.0))
    f.swmr_mode = True
    for step in range(5 * n):
        ds.resize((step + 1, 4))
        ds[step] = np.arange(4.0) + step
        ds.flush()


def _big_attribute(f: h5py.File, n: int) -> None:
    rows(f, n)
    f["rows"].attrs["history"] = np.arange(20_000, dtype="<f8")  # 160 KB: dense storage
    f.attrs["notes"] = np.zeros(30_000, dtype="<i4")


def _plain(f: h5py.File, n: int) -> None:
    rows(f, n)
    f.create_dataset("fixed", data=np.arange(6.0))
    f.create_group("g").create_dataset("u", data=np.arange(30 * n, dtype="<i2"),
                                       maxshape=(None,), chunks=(16,))


@pytest.mark.parametrize("build, options", [
    (_plain, {"libver": "latest"}),
    (_plain, {"libver": ("v110", "latest")}),
    (_big_attribute, {"libver": "latest"}),
    (_swmr, {"libver": "latest"}),
    (_plain, {"libver": "latest", "fs_strategy": "page", "fs_page_size": 4096}),
    (_plain, {"libver": ("v108", "latest"), "fs_strategy": "fsm", "fs_persist": True}),
], ids=["latest", "v110", "attribute-over-64k", "swmr", "paged", "v108-persistent-fsm"])
def test_newer_format_versions_consolidate_exactly(tmp_path: Path, worker: WorkerProcess,
                                                   build: Builder,
                                                   options: dict[str, object]) -> None:
    run = tmp_path / "run"
    files = make_run(run, build, checkpoints=3, **options)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as ref:
        assert (out.id.get_create_plist().get_version()
                == ref.id.get_create_plist().get_version())
        assert (out.id.get_create_plist().get_file_space_strategy()
                == ref.id.get_create_plist().get_file_space_strategy())
        for name in ("rows", "g/u"):
            if name in ref:
                assert (h5py.h5o.get_info(out[name].id).hdr.version
                        == h5py.h5o.get_info(ref[name].id).hdr.version)
                assert (out[name].id.get_create_plist().get_obj_track_times()
                        == ref[name].id.get_create_plist().get_obj_track_times())
