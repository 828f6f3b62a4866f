"""A slow slug-like simulation: each checkpoint file stays open for writing a while.

Usage: ``python tests/support/fake_simulation.py OUT_DIR MODEL CHECKPOINTS WRITERS PAUSE
[--trials N] [--compression gzip] [--chunk-rows N] [--done PATH] [--upload STORE_URL]``, or
:func:`start` from a test. Each file is created, filled, flushed, left open for ``PAUSE``
seconds, and only then gets ``trials_completed`` and is closed, as slug does. ``WRITERS`` 0 writes
each checkpoint as one file, more a directory of ``thread_NNNN.h5`` (the last of which
ran no trial in checkpoint 2). Checkpoint ``n`` holds ``trials + 3 n`` trials a writer,
so that checkpoints end off the chunk grid. ``--done`` is created once the run ends.
``--upload``: each file, once closed, is also put into the store at its name in the run
directory (a simulation that writes locally and copies each finished file to a bucket).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import h5py

from chkq.demo import RunShape, fill_checkpoint, mark_complete


def checkpoint_trials(trials: int, number: int, writer: int, writers: int) -> int:
    """Trials writer ``writer`` of checkpoint ``number`` runs (its last writer: none in 2)."""
    if writers > 1 and writer == writers - 1 and number == 2:
        return 0
    return trials + 3 * number


def main(out_dir: Path, model: str, checkpoints: int, writers: int, pause: float,
         shape: RunShape | None = None, done: Path | None = None,
         upload: str | None = None) -> None:
    shape = shape or RunShape(trials=40, spec_columns=8)
    store = None
    if upload is not None:
        from chkq.stores import open_store

        store = open_store(upload)
    trial = 0
    for number in range(1, checkpoints + 1):
        if writers:
            folder = out_dir / f"{model}_chk{number:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            paths = [folder / f"thread_{w:04d}.h5" for w in range(writers)]
        else:
            paths = [out_dir / f"{model}_chk{number:05d}.h5"]
        for writer, path in enumerate(paths):
            trials = checkpoint_trials(shape.trials, number, writer, writers)
            with h5py.File(path, "w") as f:
                fill_checkpoint(f, shape, trial, trials, number)
                f.flush()
                time.sleep(pause)
                trial += trials
                mark_complete(f, trial)
            if store is not None:
                store.put(str(path.relative_to(out_dir)), path.read_bytes())
        time.sleep(pause / 2)
    if done is not None:
        done.touch()


def start(out_dir: Path, model: str, checkpoints: int, writers: int, pause: float,
          *options: str) -> subprocess.Popen[bytes]:
    """Run :func:`main` in a process of its own (the simulation a watcher follows)."""
    return subprocess.Popen([sys.executable, __file__, str(out_dir), model, str(checkpoints),
                             str(writers), str(pause), *options])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("out_dir", "model", "checkpoints", "writers", "pause"):
        parser.add_argument(name)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--compression", default=None)
    parser.add_argument("--chunk-rows", type=int, default=256)
    parser.add_argument("--done", type=Path, default=None)
    parser.add_argument("--upload", default=None)
    args = parser.parse_args()
    main(Path(args.out_dir), args.model, int(args.checkpoints), int(args.writers),
         float(args.pause),
         RunShape(trials=args.trials, spec_columns=8, compression=args.compression,
                  chunk_rows=args.chunk_rows),
         args.done, args.upload)
