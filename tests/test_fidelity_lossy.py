"""Lossy codecs (ZFP, SZ3, scale-offset on floats): every row decodes as in its source.

A lossy filter approximates each chunk's values as a whole, so rows decoded
and encoded again at other chunk boundaries come back with other values.
Chunks that land whole on the output's grid reach it as they are stored;
every other chunk (where two files meet, in a file that starts off the
grid, or stored under other parameters) holds the sources' decoded rows,
stored with the lossy filter skipped in its filter mask, so readers decode
exactly the sources' rows and the dataset keeps its pipeline. Files are
written with h5py and hdf5plugin, as producers write them; jobs run on real
workers and in the in-process driver, checked by the independent comparator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import pytest

from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.filter_pipelines import stored_filters
from chkq.workers.client import submit_consolidation
from support.corpus_expect import compare

TIMEOUT = 120
CHUNK = 100


@pytest.fixture(autouse=True)
def _cluster(worker: object) -> None:
    """Every test here runs against the session's worker processes."""


def write_run(directory: Path, rows: list[int], datasets: dict[str, dict[str, Any]],
              overrides: dict[int, dict[str, dict[str, Any]]] | None = None) -> list[Path]:
    """One checkpoint file per entry of ``rows``, each holding ``datasets`` (name: filter
    options) with that many rows of smooth floats, chunked ``CHUNK`` rows along the first
    axis and 3 columns; ``overrides`` gives other options for some files' datasets."""
    files, done = [], 0
    for number, count in enumerate(rows, start=1):
        path = directory / f"run_chk{number:05d}.h5"
        with h5py.File(path, "w") as f:
            for name, options in datasets.items():
                options = (overrides or {}).get(number, {}).get(name, options)
                t = np.arange(done, done + count, dtype="f8")[:, None]
                values = np.sin(t / 37.0 + np.arange(3) / 5.0) * 100.0 + t / 1000.0
                f.create_dataset(name, data=values, maxshape=(None, 3), chunks=(CHUNK, 3),
                                 **options)
            done += count
            f.attrs["trials_completed"] = np.uint64(done)
        files.append(path)
    return files


ZFP_RATE = dict(hdf5plugin.Zfp(rate=10))
SCALEOFFSET = {"scaleoffset": 2}
SZ3 = dict(hdf5plugin.SZ3(absolute=1e-3))
GZIP = {"compression": "gzip", "shuffle": True}


def stored_chunks(path: Path, name: str) -> list[tuple[int, bytes]]:
    """Filter mask and stored bytes of every chunk of a dataset, in row order."""
    with h5py.File(path, "r") as f:
        ds = f[name]
        return [ds.id.read_direct_chunk((row, 0)) for row in range(0, ds.shape[0], CHUNK)]


def consolidate(directory: Path) -> Path:
    return submit_consolidation("run", directory).wait_for_output(timeout=TIMEOUT)


@pytest.mark.parametrize("codec", [ZFP_RATE, SCALEOFFSET, SZ3], ids=["zfp-rate", "scaleoffset",
                                                                     "sz3"])
def test_lossy_chunks_on_the_grid_move_unchanged(tmp_path: Path, codec: dict[str, Any]) -> None:
    """Every file but the last holds whole chunks: the output stores each source chunk as it
    was (bytes and filter mask), and reads back exactly the values each file reads back,
    the last file's partial chunk included."""
    files = write_run(tmp_path, [300, 500, 200, 250], {"lossy": codec, "plain": GZIP})
    output = consolidate(tmp_path)
    with h5py.File(output, "r") as out:
        for name in ("lossy", "plain"):
            expected = np.concatenate([h5py.File(p, "r")[name][()] for p in files])
            assert out[name][()].tobytes() == expected.tobytes(), name
        pipeline = out["lossy"].id.get_create_plist().get_filter(0)[:3]
    with h5py.File(files[-1], "r") as last:
        assert last["lossy"].id.get_create_plist().get_filter(0)[:3] == pipeline
    assert stored_chunks(output, "lossy") == [
        chunk for p in files for chunk in stored_chunks(p, "lossy")]


def masks(path: Path, name: str) -> list[int]:
    """The filter mask of every chunk of a dataset, in row order."""
    with h5py.File(path, "r") as f:
        return [mask for mask, _ in (f[name].id.read_direct_chunk((row, 0))
                                     for row in range(0, f[name].shape[0], CHUNK))]


def decoded(files: list[Path], name: str) -> np.ndarray:
    """The sources' rows of ``name`` as a reader decodes them, one file after the other."""
    return np.concatenate([h5py.File(p, "r")[name][()] for p in files])


SCALEOFFSET_GZIP = {"scaleoffset": 2, "compression": "gzip"}


@pytest.mark.parametrize("codec", [ZFP_RATE, SCALEOFFSET, SZ3, SCALEOFFSET_GZIP],
                         ids=["zfp-rate", "scaleoffset", "sz3", "scaleoffset-gzip"])
def test_lossy_rows_off_the_grid_decode_exactly_as_their_sources(
        tmp_path: Path, codec: dict[str, Any]) -> None:
    """550 rows a file, chunks of 100: the second file starts inside a chunk, the third on
    the grid again. The first file's five whole chunks and the third file's six move as
    stored; the six between hold decoded rows with the lossy filter (the first) skipped and
    any lossless one after it applied."""
    files = write_run(tmp_path, [550, 550, 550], {"plain": GZIP, "lossy": codec})
    output = consolidate(tmp_path)
    assert compare(output, files) == []
    with h5py.File(output, "r") as out:
        for name in ("lossy", "plain"):
            assert out[name][()].tobytes() == decoded(files, name).tobytes(), name
        with h5py.File(files[-1], "r") as last:
            assert (stored_filters(out["lossy"].id.get_create_plist())
                    == stored_filters(last["lossy"].id.get_create_plist()))
    moved = stored_chunks(output, "lossy")
    assert moved[:5] == stored_chunks(files[0], "lossy")[:5]
    assert moved[11:] == stored_chunks(files[2], "lossy")
    assert masks(output, "lossy") == [0] * 5 + [1] * 6 + [0] * 6
    if codec is SCALEOFFSET_GZIP:
        sizes = [info.size for info in (h5py.File(output, "r")["lossy"].id.get_chunk_info(i)
                                        for i in range(5, 11))]
        assert max(sizes) < CHUNK * 3 * 8, "the lossless filter after the skipped one applies"


def test_lossy_rows_off_the_grid_decode_exactly_in_many_small_units(tmp_path: Path) -> None:
    files = write_run(tmp_path, [130, 275, 42, 300], {"zfp": ZFP_RATE, "so": SCALEOFFSET})
    output = consolidate_here(tmp_path, "run", task_bytes=2000, task_files=1)
    assert compare(output, files) == []
    for name in ("zfp", "so"):
        with h5py.File(output, "r") as out:
            assert out[name][()].tobytes() == decoded(files, name).tobytes(), name
        assert masks(output, name)[0] == 0 and 1 in masks(output, name)


def test_lossless_zfp_and_integer_scaleoffset_are_encoded_again_off_the_grid(
        tmp_path: Path) -> None:
    """ZFP's reversible mode and scale-offset on integers (bit count chosen by the
    filter) restore values exactly: rows off the grid are decoded and encoded again,
    and the output holds every row."""
    files, done = [], 0
    for number, count in enumerate([550, 430, 275], start=1):
        path = tmp_path / f"run_chk{number:05d}.h5"
        with h5py.File(path, "w") as f:
            t = np.arange(done, done + count)
            f.create_dataset("zfp", data=np.sin(t / 9.0), maxshape=(None,), chunks=(CHUNK,),
                             **hdf5plugin.Zfp(reversible=True))
            f.create_dataset("counts", data=(t * 7 % 1000).astype("i4"), maxshape=(None,),
                             chunks=(CHUNK,), scaleoffset=0)
            done += count
            f.attrs["trials_completed"] = np.uint64(done)
        files.append(path)
    output = consolidate(tmp_path)
    with h5py.File(output, "r") as out:
        for name in ("zfp", "counts"):
            expected = np.concatenate([h5py.File(p, "r")[name][()] for p in files])
            assert out[name][()].tobytes() == expected.tobytes(), name


def test_a_file_stored_with_other_lossy_parameters_decodes_exactly_as_it_did(
        tmp_path: Path) -> None:
    """Rows on the grid, but the first file's ZFP rate is not the final checkpoint's: its
    chunks cannot move into the output's pipeline as they are, so they hold its decoded
    rows with ZFP skipped; the other files' chunks move unchanged."""
    files = write_run(tmp_path, [300, 300, 200], {"lossy": ZFP_RATE},
                      overrides={1: {"lossy": dict(hdf5plugin.Zfp(rate=16))}})
    output = consolidate(tmp_path)
    assert compare(output, files) == []
    with h5py.File(output, "r") as out:
        assert out["lossy"][()].tobytes() == decoded(files, "lossy").tobytes()
    assert masks(output, "lossy") == [1, 1, 1, 0, 0, 0, 0, 0]
    assert stored_chunks(output, "lossy")[3:] == [
        chunk for p in files[1:] for chunk in stored_chunks(p, "lossy")]
