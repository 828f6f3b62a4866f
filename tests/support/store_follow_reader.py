"""A reader of a followed output in a store: opens the latest version in a loop, checks each.

Usage: ``python tests/support/store_follow_reader.py STORE_URL DEST_KEY RUN_DIR MODEL
STOP_FILE RESULT_JSON``, or :func:`start` from a test. Until ``STOP_FILE`` exists it finds
the latest version as a user would (the highest pointer under ``DEST_KEY.versions/``,
:func:`chkq.staging.follow_versions.latest_pointer`), reads the object it names (checked
against the pointer's size and SHA-256) and opens it. Each version must open cleanly and
be whole: every extensible dataset holds exactly the rows of checkpoints 1..k of the
writer's own files in ``RUN_DIR`` for one k (:func:`follow_reader.check_version`, which
shares nothing with chkq). It writes the k of each version seen, and any error, to
``RESULT_JSON``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.follow_reader import check_version  # noqa: E402


def main(url: str, destination: str, run_dir: Path, model: str, stop: Path,
         result: Path) -> None:
    from chkq.staging.follow_versions import fetch_version, latest_pointer
    from chkq.stores import open_store

    store = open_store(url)
    seen: list[int] = []
    numbers: list[int] = []
    errors: list[str] = []
    opens = 0
    last = False
    with tempfile.TemporaryDirectory() as scratch:
        while not last:
            last = stop.exists()  # one look after the stop, at the version published last
            try:
                pointer = latest_pointer(store, destination)
            except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                errors.append(f"pointer: {type(exc).__name__}: {exc}")
                continue
            if pointer is None:
                time.sleep(0.05)
                continue
            local = Path(scratch) / f"v{opens}.h5"
            try:
                fetch_version(store, destination, pointer, local)
            except KeyError:
                continue  # the interim versions are deleted after the final one: look again
            except Exception as exc:  # noqa: BLE001
                errors.append(f"fetch {pointer.key(destination)}: {type(exc).__name__}: {exc}")
                continue
            try:
                with h5py.File(local, "r") as f:
                    opens += 1
                    k = check_version(run_dir, model, f)
                if k != pointer.through:
                    errors.append(f"{pointer.key(destination)} holds checkpoints 1..{k}, its "
                                  f"pointer says 1..{pointer.through}")
                if not seen or seen[-1] != k:
                    seen.append(k)
                if not numbers or numbers[-1] != pointer.number:
                    numbers.append(pointer.number)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{pointer.key(destination)}: {type(exc).__name__}: {exc}")
            finally:
                local.unlink()
            time.sleep(0.05)
    result.write_text(json.dumps({"seen": seen, "numbers": numbers, "errors": errors[:20],
                                  "opens": opens}))


def start(url: str, destination: str, run_dir: Path, model: str, stop: Path,
          result: Path) -> subprocess.Popen[bytes]:
    """Run :func:`main` in a process of its own, beside the follow it looks at."""
    return subprocess.Popen([sys.executable, __file__, url, destination, str(run_dir), model,
                             str(stop), str(result)])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5]),
         Path(sys.argv[6]))
