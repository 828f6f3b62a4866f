"""The merge's cost through the undo journal, against the merge of an older revision.

One run is built (gzip rows whose file boundaries fall inside chunks, so
that their chunks go through part files; variable-length strings and
object references, copied row by row), then, alternately for the two
merges, planned and copied afresh (not timed) and merged in pieces of
``--task-bytes`` (timed: every piece, as the workers run them, fsyncs
included). The older merge is loaded from ``git show REV:chkq/consolidation/merge.py``.
Prints each merge's median seconds and the ratio new/old.

Usage::

    .venv/bin/python bench/merge_journal.py [--old-rev main] [--repeat 3] [--rows 400000]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

import h5py
import numpy as np

from chkq.consolidation import merge as new_merge
from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.prepare import prepare

ROOT = Path(__file__).resolve().parent.parent


def old_merge(rev: str, where: Path) -> types.ModuleType:
    """The merge module of revision ``rev``, loaded under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:chkq/consolidation/merge.py"],
                            check=True, capture_output=True, text=True).stdout
    path = where / "old_merge.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_merge", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_merge"] = module
    spec.loader.exec_module(module)
    return module


def make_run(run: Path, rows: int, names: int, files: int) -> None:
    run.mkdir()
    for n in range(1, files + 1):
        with h5py.File(run / f"run_chk{n:05d}.h5", "w", libver=("latest", "latest")) as f:
            data = np.random.default_rng(n).integers(0, 50, size=(rows + 7 * n, 4)).astype("f4")
            f.create_dataset("x", data=data, maxshape=(None, 4), chunks=(256, 4),
                             compression="gzip")
            f.create_dataset("names", data=[f"file{n}-row{i}" * (1 + i % 5) for i in range(names)],
                             maxshape=(None,), chunks=(256,), dtype=h5py.string_dtype())
            f["grid"] = np.arange(5)
            f.create_dataset("refs", data=[f["grid"].ref, f["x"].ref] * (names // 2),
                             maxshape=(None,), chunks=(256,), dtype=h5py.ref_dtype)
            f.attrs["trials_completed"] = np.uint64(1)


def timed_merge(module: types.ModuleType, source: Path, work: Path, task_bytes: int) -> float:
    run = work / uuid.uuid4().hex
    shutil.copytree(source, run)
    plan = prepare(run, "run", uuid.uuid4().hex, task_bytes=task_bytes)
    for unit in range(len(plan.copy_units)):
        copy_unit(plan, unit)
    items = module.merge_items(plan)
    done: set[int] = set()
    started = time.perf_counter()
    while len(done) < len(items):
        piece = module.next_piece(items, done, task_bytes)
        module.merge_piece(plan, items, piece)
        done |= set(piece)
    seconds = time.perf_counter() - started
    check_plan_output(plan)
    shutil.rmtree(run)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-rev", default="main")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=400_000, help="gzip rows a file")
    parser.add_argument("--names", type=int, default=40_000, help="strings and references a file")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--task-bytes", type=int, default=4 * 1024 * 1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / ".venv") as tmp:
        work = Path(tmp)
        old = old_merge(args.old_rev, work)
        source = work / "source"
        make_run(source, args.rows, args.names, args.files)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeat):
            for name, module in (("old", old), ("new", new_merge)):
                times[name].append(timed_merge(module, source, work, args.task_bytes))
        old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"run: {args.files} files, {args.rows:,} gzip rows and {args.names:,} strings and "
              f"references each; pieces of {args.task_bytes:,} bytes; {args.repeat} rounds")
        for name in ("old", "new"):
            print(f"{name}: median {statistics.median(times[name]):.3f} s "
                  f"(runs {', '.join(f'{t:.3f}' for t in times[name])})")
        print(f"ratio new/old: {new_s / old_s:.2f}")


if __name__ == "__main__":
    main()
