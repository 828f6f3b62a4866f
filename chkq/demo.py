"""Slug-like checkpointed runs, for the demo, the tests and the benchmarks.

The layout follows real slug output (``shared/data/QHIFUVstats.h5``):
extensible datasets chunked 256 rows (or 256 x k), uint64 ``trial``/``uid``
columns, float64 values, a fixed-length 128-byte NULLTERM string column,
``units`` attributes as scalar strings or string arrays, a scalar
variable-length string ``input_deck/toml``, variable-length string and
uint64 root attributes, and a ``trials_completed`` root attribute written
last, when the file is complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5p, h5s, h5t

from chkq.consolidation.discovery import check_model_name, checkpoint_pattern
from chkq.errors import OutputExistsError

STR = h5py.string_dtype()


@dataclass(frozen=True)
class RunShape:
    """The shape of a generated run.

    Attributes
    ----------
    checkpoints
        Number of checkpoints.
    writers
        Files per checkpoint; 0 writes each checkpoint as a single file
        ``MODEL_chkNNNNN.h5``, otherwise as a directory of ``thread_NNNN.h5``.
    trials
        Trials (rows of ``galaxy/*``) per file; the last writer of every
        directory checkpoint ran none when ``empty_writer`` is set (of
        checkpoint ``empty_in`` only, when that is given).
    spec_columns
        Width of the ``spectra/spec`` dataset (float64).
    clusters_per_trial
        Rows of ``clusters/*`` per trial.
    compression, shuffle, fletcher32
        Filters of every extensible dataset (``"gzip"`` or None).
    chunk_rows
        Rows per chunk.
    """

    checkpoints: int = 3
    writers: int = 0
    trials: int = 100
    spec_columns: int = 16
    clusters_per_trial: int = 2
    compression: str | None = None
    shuffle: bool = False
    fletcher32: bool = False
    chunk_rows: int = 256
    empty_writer: bool = True
    empty_in: int | None = None
    nans: bool = True
    seed: int = 0


def nullterm_string_type(size: int) -> h5t.TypeID:
    """A fixed-length NULLTERM ASCII string type, as C codes such as slug write."""
    tid = h5t.C_S1.copy()
    tid.set_size(size)
    tid.set_strpad(h5t.STR_NULLTERM)
    return tid


def _create(group: h5py.Group, name: str, tid: h5t.TypeID, trailing: tuple[int, ...],
            shape: RunShape, rows: int) -> h5py.Dataset:
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_chunk((shape.chunk_rows, *trailing))
    if shape.shuffle:
        dcpl.set_shuffle()
    if shape.compression == "gzip":
        dcpl.set_deflate(4)
    if shape.fletcher32:
        dcpl.set_fletcher32()
    space = h5s.create_simple((rows, *trailing), (h5s.UNLIMITED, *trailing))
    return h5py.Dataset(h5d.create(group.id, name.encode(), tid, space, dcpl=dcpl))


def write_checkpoint_file(path: Path, shape: RunShape, first_trial: int, trials: int,
                          checkpoint: int, complete: bool = True) -> None:
    """Write one checkpoint file holding trials ``[first_trial, first_trial + trials)``."""
    with h5py.File(path, "w") as f:
        fill_checkpoint(f, shape, first_trial, trials, checkpoint)
        if complete:
            mark_complete(f, first_trial + trials)


def mark_complete(f: h5py.File, trials_completed: int) -> None:
    """Write ``trials_completed``, as a simulation does when it closes a checkpoint."""
    f.attrs["trials_completed"] = np.uint64(trials_completed)


def fill_checkpoint(f: h5py.File, shape: RunShape, first_trial: int, trials: int,
                    checkpoint: int) -> None:
    """Write a checkpoint's content (all but ``trials_completed``) into open file ``f``."""
    rng = np.random.default_rng([shape.seed, checkpoint, first_trial])
    n_clusters = trials * shape.clusters_per_trial
    f.attrs["date"] = "2026-08-18"
    f.attrs["slug-hash"] = "b8dec92c3c199b293ffb436530ee46befce15fa6"
    f.attrs["checkpoint"] = np.uint64(checkpoint)
    deck = f.create_group("input_deck")
    deck.create_dataset("toml", data=f"model = 'demo'\ncheckpoint = {checkpoint}\n",
                        dtype=STR)
    galaxy = f.create_group("galaxy")
    trial = _create(galaxy, "trial", h5t.STD_U64LE, (), shape, trials)
    trial[:] = np.arange(first_trial, first_trial + trials, dtype=np.uint64)
    trial.attrs["units"] = ""
    mass = _create(galaxy, "actual_mass", h5t.IEEE_F64LE, (), shape, trials)
    values = rng.lognormal(8.0, 1.0, trials)
    if shape.nans and trials:
        values[:: 7] = np.nan
    mass[:] = values
    mass.attrs["units"] = "Msun"
    phot_group = f.create_group("galaxy_phot")
    phot_group.attrs["filters"] = np.array(["GALEX.GALEX.FUV", "Q(HI)"], dtype=STR)
    phot = _create(phot_group, "phot", h5t.IEEE_F64LE, (2,), shape, trials)
    phot[:] = rng.random((trials, 2)) * 1e38
    phot.attrs["units"] = np.array(["erg/(s Angstrom)", "photon/s"], dtype=STR)
    spectra = f.create_group("spectra")
    spectra.create_dataset("wl", data=np.linspace(912.0, 10000.0, shape.spec_columns))
    spec = _create(spectra, "spec", h5t.IEEE_F64LE, (shape.spec_columns,), shape, trials)
    if trials:
        spec[:] = rng.random((trials, shape.spec_columns))
    spec.attrs["units"] = "erg/s/A"
    clusters = f.create_group("clusters")
    uid = _create(clusters, "uid", h5t.STD_U64LE, (), shape, n_clusters)
    uid[:] = np.arange(n_clusters, dtype=np.uint64) + first_trial * shape.clusters_per_trial
    cmass = _create(clusters, "mass", h5t.IEEE_F64LE, (), shape, n_clusters)
    cmass[:] = rng.random(n_clusters) * 100.0
    rng_col = _create(clusters, "rng", nullterm_string_type(128), (), shape, n_clusters)
    if n_clusters:
        states = [f"{rng.integers(1 << 62)} {rng.integers(1 << 62)}".encode()
                  for _ in range(n_clusters)]
        rng_col[:] = np.array(states, dtype="S128")


def make_run(out_dir: str | Path, model: str, shape: RunShape | None = None) -> list[Path]:
    """Write a slug-like checkpointed run of ``model`` into ``out_dir``; return its files."""
    shape = shape or RunShape()
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    trial = 0
    for number in range(1, shape.checkpoints + 1):
        if shape.writers == 0:
            path = directory / f"{model}_chk{number:05d}.h5"
            write_checkpoint_file(path, shape, trial, shape.trials, number)
            trial += shape.trials
            written.append(path)
            continue
        folder = directory / f"{model}_chk{number:05d}"
        folder.mkdir(exist_ok=True)
        for writer in range(shape.writers):
            empty = (shape.empty_writer and writer == shape.writers - 1 and shape.writers > 1
                     and shape.empty_in in (None, number))
            trials = 0 if empty else shape.trials
            path = folder / f"thread_{writer:04d}.h5"
            write_checkpoint_file(path, shape, trial, trials, number)
            trial += trials
            written.append(path)
    return written


def write_demo(out_dir: str | Path, model: str = "demo", checkpoints: int = 4,
               writers: int = 2, trials: int = 500) -> list[Path]:
    """The run ``chkq demo`` writes: ``make_run`` into a directory that holds no such run.

    Every thread file has trials, so that consolidating merges threads,
    except the last thread of the first checkpoint, which ran none (a
    thread with no work, as slug leaves when a run has more threads than
    trials to give them).

    Raises
    ------
    OutputExistsError
        If ``out_dir`` already holds checkpoints of ``model`` or ``MODEL.h5``:
        a demo never overwrites files.
    BadNameError
        If ``model`` cannot name files.
    """
    directory = Path(out_dir)
    check_model_name(model)
    if directory.is_dir():
        pattern = checkpoint_pattern(model)
        taken = sorted(e.name for e in directory.iterdir()
                       if pattern.fullmatch(e.name) or e.name == f"{model}.h5")
        if taken:
            shown = ", ".join(taken[:3]) + (", ..." if len(taken) > 3 else "")
            raise OutputExistsError(
                f"{str(directory)!r} already holds a run of model {model!r} ({shown}); "
                "chkq demo never overwrites files: choose another directory or --model")
    shape = RunShape(checkpoints=checkpoints, writers=writers, trials=trials,
                     empty_in=1 if checkpoints > 1 else None)
    return make_run(directory, model, shape)
