"""Lossy codecs (ZFP, SZ3, scale-offset on floats): chunks move unchanged, or the run is refused.

A lossy filter approximates each chunk's values as a whole, so rows decoded
and encoded again at other chunk boundaries come back with other values.
Such chunks must reach the output as they are stored; a run whose rows do
not fall on the chunk grid is refused before anything is written, naming
the dataset and saying the filter is lossy. Files are written with h5py and
hdf5plugin, as producers write them; jobs run on real workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import pytest

from chkq.workers.client import submit_consolidation
from support.helpers import snapshot

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


@pytest.mark.parametrize("codec, named", [
    (ZFP_RATE, r"lossy filter \(ZFP"),
    (SCALEOFFSET, r"lossy filter \(scale-offset on floating-point values\)"),
    (SZ3, r"lossy filter \(SZ3\)"),
], ids=["zfp-rate", "scaleoffset", "sz3"])
def test_lossy_rows_off_the_grid_are_refused_before_anything_is_written(
        tmp_path: Path, codec: dict[str, Any], named: str) -> None:
    """550 rows a file, chunks of 100: the second file starts inside a chunk. The job is
    refused naming the dataset, the file and the lossy filter, never a row that differs,
    and the run directory is left exactly as it was."""
    write_run(tmp_path, [550, 550, 550], {"plain": GZIP, "lossy": codec})
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"dataset '/lossy' is stored with a " + named) as err:
        consolidate(tmp_path)
    assert "run_chk00001.h5" in str(err.value) and "differs" not in str(err.value)
    assert snapshot(tmp_path) == before


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


def test_a_file_stored_with_other_lossy_parameters_fails_naming_the_filter(
        tmp_path: Path) -> None:
    """Rows on the grid, but the first file's ZFP rate is not the final checkpoint's: its
    chunks cannot move unchanged into the output's pipeline. The job fails naming the
    dataset, the file and the lossy filter, not a row, and leaves nothing behind."""
    write_run(tmp_path, [300, 300, 200], {"lossy": ZFP_RATE},
              overrides={1: {"lossy": dict(hdf5plugin.Zfp(rate=16))}})
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"dataset '/lossy' of checkpoint file "
                                         r"'[^']*run_chk00001\.h5' is stored with a lossy "
                                         r"filter \(ZFP") as err:
        consolidate(tmp_path)
    assert "differs" not in str(err.value)
    assert snapshot(tmp_path) == before
