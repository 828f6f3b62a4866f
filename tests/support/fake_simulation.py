"""A slow slug-like simulation: each checkpoint file stays open for writing a while.

Usage: ``python tests/support/fake_simulation.py OUT_DIR MODEL CHECKPOINTS WRITERS PAUSE``,
or :func:`start` from a test.
Each file is created, filled, flushed, left open for ``PAUSE`` seconds, and
only then gets ``trials_completed`` and is closed, as slug does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import h5py

from chkq.demo import RunShape, fill_checkpoint, mark_complete


def main(out_dir: Path, model: str, checkpoints: int, writers: int, pause: float) -> None:
    shape = RunShape(trials=40, spec_columns=8)
    trial = 0
    for number in range(1, checkpoints + 1):
        folder = out_dir / f"{model}_chk{number:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        for writer in range(writers):
            with h5py.File(folder / f"thread_{writer:04d}.h5", "w") as f:
                fill_checkpoint(f, shape, trial, shape.trials, number)
                f.flush()
                time.sleep(pause)
                trial += shape.trials
                mark_complete(f, trial)
        time.sleep(pause / 2)


def start(out_dir: Path, model: str, checkpoints: int, writers: int,
          pause: float) -> subprocess.Popen[bytes]:
    """Run :func:`main` in a process of its own (the simulation a watcher follows)."""
    return subprocess.Popen([sys.executable, __file__, str(out_dir), model, str(checkpoints),
                             str(writers), str(pause)])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
         float(sys.argv[5]))
