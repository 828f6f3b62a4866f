"""How far a running simulation's checkpoints are complete, when a checkpoint is a directory.

Each writer of a checkpoint directory creates its own file, one after another
or at once: until the last is there, the directory looks complete with the
files it has. A follow must not publish a version without the missing ones.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from chkq.consolidation.versions import run_progress
from chkq.demo import RunShape, fill_checkpoint, mark_complete

SHAPE = RunShape(trials=40, spec_columns=8)


def _write(run: Path, number: int, writer: int, trial: int) -> int:
    folder = run / f"sim_chk{number:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / f"thread_{writer:04d}.h5", "w") as f:
        fill_checkpoint(f, SHAPE, trial, 40, number)
        mark_complete(f, trial + 40)
    return trial + 40


def test_a_checkpoint_directory_counts_once_it_can_gain_no_more_files(tmp_path: Path) -> None:
    trial = _write(tmp_path, 1, 0, 0)
    trial = _write(tmp_path, 1, 1, trial)
    assert run_progress(tmp_path, "sim").through is None, "the first, with no later one begun"
    trial = _write(tmp_path, 2, 0, trial)
    assert run_progress(tmp_path, "sim").through == 1
    assert run_progress(tmp_path, "sim", ended=True).through == 2
    _write(tmp_path, 2, 1, trial)
    assert run_progress(tmp_path, "sim").through == 2, "as many files as the one before"
