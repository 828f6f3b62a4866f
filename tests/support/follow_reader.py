"""A reader of a followed output: opens MODEL.h5 in a loop and checks every version it sees.

Usage: ``python tests/support/follow_reader.py OUT_DIR MODEL STOP_FILE RESULT_JSON``, or
:func:`start` from a test.
Until ``STOP_FILE`` exists it opens ``OUT_DIR/MODEL.h5`` again and again, as a user
looking at the rows so far would. Each version must open cleanly and be whole: every
extensible dataset holds exactly the rows of checkpoints 1..k for one k, equal to those
checkpoints' rows. It writes what it saw (the k of each version, any error) to
``RESULT_JSON``. Written for tests, independently of chkq's own code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np


def checkpoint_files(out_dir: Path, model: str, count: int) -> list[list[Path]]:
    """The files of checkpoints 1..count, each checkpoint's in name order."""
    found = []
    for number in range(1, count + 1):
        single = out_dir / f"{model}_chk{number:05d}.h5"
        found.append([single] if single.exists()
                     else sorted((out_dir / f"{model}_chk{number:05d}").glob("*.h5")))
    return found


def extensible(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset)
                 and obj.maxshape and obj.maxshape[0] is None else None)
    return names


def expected_rows(files: list[Path], name: str) -> bytes:
    parts = []
    for path in files:
        with h5py.File(path, "r") as f:
            parts.append(np.ascontiguousarray(f[name][()]).tobytes())
    return b"".join(parts)


def check_version(out_dir: Path, model: str, output: h5py.File) -> int:
    """The k of the version ``output`` is; AssertionError if it is not one whole version."""
    trials = output["galaxy/trial"].shape[0]
    k, total = 0, 0
    while total < trials:
        k += 1
        files = checkpoint_files(out_dir, model, k)[-1]
        if not files:
            raise AssertionError(f"{trials} trials: more than the checkpoints hold")
        for path in files:
            with h5py.File(path, "r") as f:
                total += f["galaxy/trial"].shape[0]
    if total != trials:
        raise AssertionError(f"{trials} trials: not the rows of whole checkpoints")
    files = [p for group in checkpoint_files(out_dir, model, k) for p in group]
    for name in extensible(output):
        want = expected_rows(files, name)
        got = np.ascontiguousarray(output[name][()]).tobytes()
        if got != want:
            raise AssertionError(f"/{name}: rows differ from checkpoints 1..{k}")
    return k


def main(out_dir: Path, model: str, stop: Path, result: Path) -> None:
    seen: list[int] = []
    errors: list[str] = []
    opens = 0
    output = out_dir / f"{model}.h5"
    last = False
    while not last:
        last = stop.exists()  # one look after the stop, at the version published last
        if not output.exists():
            time.sleep(0.02)
            continue
        try:
            with h5py.File(output, "r") as f:
                opens += 1
                k = check_version(out_dir, model, f)
            if not seen or seen[-1] != k:
                seen.append(k)
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
            errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.01)
    result.write_text(json.dumps({"seen": seen, "errors": errors[:20], "opens": opens}))


def start(out_dir: Path, model: str, stop: Path, result: Path) -> subprocess.Popen[bytes]:
    """Run :func:`main` in a process of its own, beside the follow it looks at."""
    return subprocess.Popen([sys.executable, __file__, str(out_dir), model, str(stop),
                             str(result)])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
