"""The output's skeleton: allocated without writing rows, no larger than rows plus metadata.

Uncompressed datasets that are recreated with every chunk allocated must
not have their chunks written twice (once with the fill value, once with
the rows), must leave no room for the template's own rows, and must show a
reader the template's fill time and fill value, also in the rows a user
adds by growing the output.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d

from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.prepare import prepare
from chkq.consolidation.temporaries import JobFiles
from support.h5runs import make_run

ROWS, COLUMNS, CHUNK = 1000, 64, 256
LAYOUTS = [pytest.param({"libver": ("earliest", "latest")}, id="header-v1"),
           pytest.param({"libver": ("v108", "latest"), "userblock_size": 512},
                        id="header-v2-userblock")]


def _build(f: h5py.File, n: int) -> None:
    f.create_dataset("grid", data=np.linspace(0.0, 1.0, 50))
    spec = f.create_dataset("trials/spec", data=np.full((ROWS, COLUMNS), float(n)),
                            maxshape=(None, COLUMNS), chunks=(CHUNK, COLUMNS))
    spec.attrs["units"] = "erg"
    f.create_dataset("trials/tile", data=np.full((ROWS, 5), n, dtype="i4"),
                     maxshape=(None, 5), chunks=(7, 2))


def _holes_supported(path: Path) -> bool:
    probe = path / "probe"
    with open(probe, "wb") as fh:
        fh.truncate(1 << 20)
        fh.seek(1 << 19)
        fh.write(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_DATA) > 0
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def _holds_data(fd: int, start: int, stop: int) -> bool:
    try:
        return os.lseek(fd, start, os.SEEK_DATA) < stop
    except OSError:
        return False


@pytest.mark.parametrize("options", LAYOUTS)
def test_planning_writes_no_rows_of_a_recreated_dataset(tmp_path: Path, options: dict) -> None:
    if not _holes_supported(tmp_path):
        pytest.skip("the filesystem of the test's directory reports no holes")
    make_run(tmp_path, _build, checkpoints=4, **options)
    job = uuid.uuid4().hex
    plan = prepare(tmp_path, "run", job)
    skeleton = JobFiles(tmp_path, "run", job).temp
    offsets = next(d.chunk_offsets for d in plan.datasets if d.name == "trials/spec")
    assert len(offsets) == -(-4 * ROWS // CHUNK)
    fd = os.open(skeleton, os.O_RDONLY)
    try:
        # A chunk's first and last blocks may share a block with the template's metadata.
        written = [o for o in offsets if _holds_data(fd, o + 4096, o + CHUNK * COLUMNS * 8 - 4096)]
    finally:
        os.close(fd)
    assert written == [], f"{len(written)} of {len(offsets)} chunks written before the copy"


@pytest.mark.parametrize("options", LAYOUTS)
def test_the_output_holds_its_rows_and_the_metadata_only(tmp_path: Path, options: dict) -> None:
    files = make_run(tmp_path, _build, checkpoints=4, **options)
    def chunked(rows: int) -> int:
        """Bytes of the chunks that hold ``rows`` rows of both datasets."""
        return (-(-rows // CHUNK) * CHUNK * COLUMNS * 8) + -(-rows // 7) * 3 * 7 * 2 * 4

    metadata = files[-1].stat().st_size - chunked(ROWS)
    out = consolidate_here(tmp_path, "run")
    # Chunk indexes grow with the rows (at most 64 bytes a chunk); the template's own rows
    # must not stay behind.
    index = 64 * (-(-4 * ROWS // CHUNK) + -(-4 * ROWS // 7) * 3)
    assert out.stat().st_size <= chunked(4 * ROWS) + metadata + index, (
        f"output {out.stat().st_size} bytes for {chunked(4 * ROWS)} bytes of chunks and "
        f"{metadata} bytes of the template's metadata")
    with h5py.File(out) as o:
        assert o["trials/spec"].shape == (4 * ROWS, COLUMNS)
        for n in range(1, 5):
            assert (o["trials/spec"][(n - 1) * ROWS:n * ROWS] == float(n)).all()
            assert (o["trials/tile"][(n - 1) * ROWS:n * ROWS] == n).all()


@pytest.mark.parametrize("options", LAYOUTS)
def test_a_grown_output_shows_the_templates_fill(tmp_path: Path, options: dict) -> None:
    files = make_run(tmp_path, _build, checkpoints=3, **options)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(files[-1]) as t, h5py.File(out) as o:
        for name in ("trials/spec", "trials/tile"):
            want, got = t[name].id.get_create_plist(), o[name].id.get_create_plist()
            assert got.get_fill_time() == want.get_fill_time() == h5d.FILL_TIME_IFSET
            assert got.fill_value_defined() == want.fill_value_defined()
            assert o[name].fillvalue == t[name].fillvalue
            assert o[name].attrs.keys() == t[name].attrs.keys()
    with h5py.File(out, "r+") as o:
        # 3,000 rows end inside a 256-row chunk and inside 7 x 2 chunks.
        o["trials/spec"].resize(3 * ROWS + CHUNK, axis=0)
        o["trials/tile"].resize(3 * ROWS + 9, axis=0)
        assert (o["trials/spec"][3 * ROWS:] == 0).all()
        assert (o["trials/tile"][3 * ROWS:] == 0).all()
        assert (o["trials/spec"][2 * ROWS:3 * ROWS] == 3.0).all()


def test_a_demo_run_consolidated_by_the_workers_matches_its_checkpoints(
        tmp_path: Path, worker: object) -> None:
    from chkq.demo import RunShape
    from chkq.demo import make_run as make_demo_run
    from chkq.workers.client import submit_consolidation
    from support.corpus_expect import compare_full

    files = make_demo_run(tmp_path, "run", RunShape(checkpoints=4, trials=200))
    out = submit_consolidation("run", tmp_path).wait_for_output(timeout=120)
    result = compare_full(out, files)
    assert result.differences == []


def test_a_header_chkq_cannot_rewrite_gets_the_fill_written(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from chkq.consolidation import fill_restore

    def unknown(*_args: object) -> list[fill_restore.Block]:
        raise fill_restore.Unpatchable("object header version 9")

    monkeypatch.setattr(fill_restore, "_header_blocks", unknown)
    files = make_run(tmp_path, _build, checkpoints=3)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(files[-1]) as t, h5py.File(out) as o:
        for name in ("trials/spec", "trials/tile"):
            assert (o[name].id.get_create_plist().get_fill_time()
                    == t[name].id.get_create_plist().get_fill_time())
            assert o[name].shape[0] == 3 * ROWS
        assert (o["trials/spec"][2 * ROWS:] == 3.0).all()
        assert (o["trials/tile"][:ROWS] == 1).all()
