"""Filters whose "set local" step rewrites their parameters (bitshuffle, SZ, SZ3).

Such a filter stores, at dataset creation, parameters derived from the
caller's (library versions, element size, chunk shape) in front of them. A
dataset created again from the stored parameters would get that step a
second time: chunks written under the doubled parameters do not decode
under the template's. The runs here are written the way producers write
them (h5py's low-level API with an explicit creation property list and
``hdf5plugin``'s filter options, rows that do not fill whole chunks, several
checkpoints) and consolidated on real workers and through the in-process
driver with many small copy units.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import pytest
from h5py import h5d, h5p, h5s, h5t, h5z

from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.filter_pipelines import create_extensible, stored_filters
from chkq.consolidation.output_check import check_output
from chkq.errors import BadCheckpointError, OutputMismatchError
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare
from support.h5runs import TIMEOUT, chunk_infos, make_run, refused
from support.helpers import assert_consolidated, snapshot
from support.plugins.cluster import WorkerProcess

#: Each dataset's filter as a producer sets it: (filter id, options from hdf5plugin).
FILTERS: dict[str, hdf5plugin.Bitshuffle | hdf5plugin.SZ3 | hdf5plugin.SZ] = {
    "bitshuffle_lz4": hdf5plugin.Bitshuffle(cname="lz4"),
    "bitshuffle_zstd": hdf5plugin.Bitshuffle(cname="zstd", clevel=5),
    "bitshuffle_plain": hdf5plugin.Bitshuffle(nelems=256, cname="none"),
    "sz3": hdf5plugin.SZ3(absolute=0),
    "sz": hdf5plugin.SZ(absolute=0),
}


def low_level(where: h5py.Group, name: str, data: np.ndarray, chunk: tuple[int, ...],
              filters: list[tuple[int, tuple[int, ...]]]) -> h5d.DatasetID:
    """An extensible dataset created with ``H5Dcreate`` and an explicit property list."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_chunk(chunk)
    for code, options in filters:
        dcpl.set_filter(code, h5z.FLAG_MANDATORY, options)
    tid = h5t.py_create(data.dtype)
    space = h5s.create_simple(data.shape, (h5s.UNLIMITED, *data.shape[1:]))
    dsid = h5d.create(where.id, name.encode(), tid, space, dcpl=dcpl)
    dsid.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(data))
    return dsid


def producer(f: h5py.File, n: int) -> None:
    """Every set-local filter, in 2-D and 3-D, rows (13 n + 3) filling no whole chunk."""
    rows = 13 * n + 3
    rng = np.random.default_rng(n)
    for name, fltr in FILTERS.items():
        data = rng.normal(size=(rows, 16)).astype("<f4")
        low_level(f, name, data, (8, 16), [(fltr.filter_id, tuple(fltr.filter_options))])
    cube = (np.arange(rows * 20, dtype="<f8").reshape(rows, 4, 5) * 0.25) + n
    bitshuffle = FILTERS["bitshuffle_lz4"]
    low_level(f, "cube", cube, (5, 2, 3), [(bitshuffle.filter_id,
                                            tuple(bitshuffle.filter_options))])
    plain = FILTERS["bitshuffle_plain"]
    low_level(f, "both", rng.normal(size=(rows, 6)).astype("<f4"), (4, 6),
              [(h5z.FILTER_SHUFFLE, ()), (plain.filter_id, tuple(plain.filter_options)),
               (h5z.FILTER_DEFLATE, (4,))])
    f.create_dataset("steps", data=np.arange(rows, dtype="<i8") + 100 * n, maxshape=(None,),
                     chunks=(7,), compression="gzip", shuffle=True)


def assert_filters_kept(output: Path, template: Path) -> None:
    """Every dataset of ``output`` stores its template's filters, parameters and flags."""
    with h5py.File(output, "r") as out, h5py.File(template, "r") as ref:
        for name in [*FILTERS, "cube", "both", "steps"]:
            want = stored_filters(ref[name].id.get_create_plist())
            assert stored_filters(out[name].id.get_create_plist()) == want, name


def test_set_local_filters_consolidate_exactly_on_workers(tmp_path: Path,
                                                          worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    files = make_run(run, producer, checkpoints=3)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    assert_filters_kept(output, files[-1])


def test_set_local_filters_consolidate_exactly_in_many_small_units(tmp_path: Path) -> None:
    run = tmp_path / "run"
    files = make_run(run, producer, checkpoints=4)
    output = consolidate_here(run, "run", task_bytes=600, task_files=1)
    assert_consolidated(output, files)
    assert compare(output, files) == []
    assert_filters_kept(output, files[-1])


@pytest.mark.parametrize("name", [*FILTERS, "cube", "both"])
def test_a_part_dataset_stores_its_templates_filter_parameters(tmp_path: Path,
                                                               name: str) -> None:
    """What a copy task creates encodes chunks the template's dataset decodes."""
    template = make_run(tmp_path / "run", producer, checkpoints=1)[0]
    with h5py.File(template, "r") as ref, h5py.File(tmp_path / "part.h5", "w") as part:
        source = ref[name]
        made = create_extensible(part, "data", source, source.shape[0])
        assert (stored_filters(made.id.get_create_plist())
                == stored_filters(source.id.get_create_plist()))
        made[...] = source[()]
        with h5py.File(tmp_path / "moved.h5", "w") as moved:
            # The template's own object, its chunks replaced by the part's as stored.
            ref.copy(source, moved, "data")
            for offset in [tuple(int(o) for o in info.chunk_offset)
                           for info in chunk_infos(made.id)]:
                mask, chunk = made.id.read_direct_chunk(offset)
                moved["data"].id.write_direct_chunk(offset, chunk, mask)
            np.testing.assert_array_equal(moved["data"][()], source[()])


def unreachable_parameters(path: Path) -> None:
    """A file whose bitshuffle parameters say another bitshuffle version (0.3) wrote them.

    Written in a process with no filter plugin, so that HDF5 stores the
    parameters as given (the filter is optional there, and skipped).
    """
    script = f"""
import h5py, numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t, h5z
with h5py.File({str(path)!r}, "w") as f:
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_chunk((8, 4))
    dcpl.set_filter(32008, h5z.FLAG_OPTIONAL, (0, 3, 8, 0, 2))
    space = h5s.create_simple((20, 4), (h5s.UNLIMITED, 4))
    dsid = h5d.create(f.id, b"old", h5t.IEEE_F64LE, space, dcpl=dcpl)
    dsid.write(h5s.ALL, h5s.ALL, np.arange(80.0).reshape(20, 4))
    f.create_dataset("rows", data=np.arange(12.0), maxshape=(None,), chunks=(5,))
    f.attrs["trials_completed"] = np.uint64(1)
"""
    env = {"HDF5_PLUGIN_PATH": str(path.parent / "no-plugins"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env)


def test_filter_parameters_the_installed_plugin_cannot_encode_are_refused_before_writing(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """bitshuffle 0.3's parameters crash the installed plugin's encoder: refused, the worker lives.

    (Parameters the plugin can encode with are kept, see
    ``tests/test_fidelity_foreign_filters.py``.)
    """
    run = tmp_path / "run"
    run.mkdir()
    for n in (1, 2):
        unreachable_parameters(run / f"run_chk{n:05d}.h5")
    with h5py.File(run / "run_chk00002.h5", "r") as f:
        assert stored_filters(f["old"].id.get_create_plist())[0][2] == (0, 3, 8, 0, 2)
    message = refused(run, r"'/old' .*filter 32008 \(.*\) with parameters \[0, 3, 8, 0, 2\]")
    assert "cannot encode" in message
    assert worker.process.poll() is None


@pytest.mark.cluster
def test_the_driver_refuses_them_too_and_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for n in (1, 2):
        unreachable_parameters(run / f"run_chk{n:05d}.h5")
    before = snapshot(run)
    with pytest.raises(BadCheckpointError, match=r"'/old' .*filter 32008"):
        consolidate_here(run, "run")
    assert snapshot(run) == before


def test_the_whole_output_check_compares_each_filters_parameters_and_flags(
        tmp_path: Path) -> None:
    """An output whose dataset got the filter's set-local step twice is caught; so are flags."""
    bitshuffle = FILTERS["bitshuffle_lz4"]

    def write(path: Path, twice: bool, flags: int) -> None:
        with h5py.File(path, "w") as f:
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_chunk((4, 4))
            dcpl.set_filter(bitshuffle.filter_id, flags, tuple(bitshuffle.filter_options))
            space = h5s.create_simple((0, 4), (h5s.UNLIMITED, 4))
            if twice:
                dcpl = h5d.create(f.id, None, h5t.IEEE_F32LE, space, dcpl=dcpl
                                  ).get_create_plist()
            h5d.create(f.id, b"x", h5t.IEEE_F32LE, space, dcpl=dcpl)

    template, doubled, optional = (tmp_path / name for name in ("t.h5", "d.h5", "o.h5"))
    write(template, False, h5z.FLAG_MANDATORY)
    write(doubled, True, h5z.FLAG_MANDATORY)
    write(optional, False, h5z.FLAG_OPTIONAL)
    check_output(template, template, {}, set())
    for output in (doubled, optional):
        with pytest.raises(OutputMismatchError, match=r"dataset '/x' has other creation "
                                                      r"properties: filters"):
            check_output(output, template, {}, set())


@pytest.mark.parametrize("options, dtype, chunk", [
    (hdf5plugin.Sperr(rate=8), "<f4", (16, 16)),
    (hdf5plugin.Sperr(peak_signal_to_noise_ratio=60, missing_value_mode=1), "<f8", (10, 12)),
    (hdf5plugin.Sperr(absolute=1e-3, missing_value_mode=2, swap=True), "<f4", (9, 10, 11)),
    (hdf5plugin.FciDecomp(), "<u2", (8, 16)),
    (hdf5plugin.SZ(absolute=1e-2), "<f4", (2, 3, 4, 5)),
    (hdf5plugin.SZ3(relative=1e-4), "<f8", (8,)),
    (hdf5plugin.Bitshuffle(cname="zstd", clevel=9), "i1", (8, 3)),
    (hdf5plugin.Zfp(precision=10), "<f4", (4, 4, 4)),
    (hdf5plugin.Blosc2(cname="lz4", filters=hdf5plugin.Blosc2.BITSHUFFLE), "<f8", (5, 7)),
], ids=["sperr-rate", "sperr-psnr-missing", "sperr-3d-swap", "fcidecomp", "sz-4d", "sz3-1d",
        "bitshuffle-int8", "zfp-3d", "blosc2"])
def test_a_part_dataset_stores_the_parameters_of_every_plugin_filter(
        tmp_path: Path, options: Mapping[str, Any], dtype: str, chunk: tuple[int, ...]) -> None:
    with h5py.File(tmp_path / "t.h5", "w") as f, h5py.File(tmp_path / "p.h5", "w") as part:
        shape = (0, *chunk[1:])
        source = f.create_dataset("x", shape=shape, maxshape=(None, *chunk[1:]), chunks=chunk,
                                  dtype=dtype, **options)
        made = create_extensible(part, "data", source, 2 * chunk[0] + 1)
        assert (stored_filters(made.id.get_create_plist())
                == stored_filters(source.id.get_create_plist()))
