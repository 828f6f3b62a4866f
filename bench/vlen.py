"""Time each step of consolidating a run with a variable-length string dataset, in-process.

The run: ``--files`` single-file checkpoints, each with ``--rows`` rows of a
chunked (1,024-row chunks), extensible dataset of variable-length strings
(``log``, 20 to 380 ASCII bytes each, 200 on average) and a small float64
dataset (``t``) of as many rows. The baseline, measured in the same run: a
run of fixed-size rows of about the same size on disk (``spec``, 30
uncompressed float64 columns, 1,024-row chunks, and ``t``), consolidated
the same way. The steps are those of
:func:`chkq.consolidation.driver.consolidate_here` (plan, copy, merge,
verify, the whole-output check, link), timed one by one in this process,
warm cache (the files were just written), best of ``--repeat`` rounds (the
two runs alternate), with the CPU seconds of this process per step
(steadier than wall time on a machine shared with other users). The
figures to compare: ``rate`` (megabytes of file a second of the whole job)
and the ratio of the string run's time to the baseline's.

Usage::

    .venv/bin/python bench/vlen.py [--files 8] [--rows 300000] [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chkq.consolidation.copy_rows import copy_unit  # noqa: E402
from chkq.consolidation.link import discard_job_files, link_output  # noqa: E402
from chkq.consolidation.merge import merge_parts, remove_parts  # noqa: E402
from chkq.consolidation.output_check import check_plan_output  # noqa: E402
from chkq.consolidation.prepare import prepare  # noqa: E402
from chkq.consolidation.verify_rows import digests_by_dataset, verify_files  # noqa: E402

CHUNK = 1024
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789 ,.;:=", dtype="u1")


def write_run(directory: Path, files: int, rows: int) -> int:
    """Write the run; return the bytes of string data it holds."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(1)
    text = ALPHABET[rng.integers(0, len(ALPHABET), 400 * CHUNK)].tobytes()
    total, done = 0, 0
    for number in range(1, files + 1):
        lengths = rng.integers(20, 381, rows)
        starts = rng.integers(0, len(text) - 400, rows)
        values = np.array([text[s:s + n] for s, n in zip(starts, lengths, strict=True)],
                          dtype=object)
        total += int(lengths.sum())
        with h5py.File(directory / f"run_chk{number:05d}.h5", "w") as f:
            f.create_dataset("log", data=values, dtype=h5py.string_dtype("ascii"),
                             maxshape=(None,), chunks=(CHUNK,))
            f.create_dataset("t", data=np.arange(done, done + rows, dtype="f8"),
                             maxshape=(None,), chunks=(CHUNK * 8,))
            done += rows
            f.attrs["trials_completed"] = np.uint64(done)
    return total


def write_fixed_run(directory: Path, files: int, rows: int) -> None:
    """Write the baseline run: fixed-size rows, about the string run's size on disk."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(2)
    done = 0
    for number in range(1, files + 1):
        with h5py.File(directory / f"run_chk{number:05d}.h5", "w") as f:
            f.create_dataset("spec", data=rng.random((rows, 30)), maxshape=(None, 30),
                             chunks=(CHUNK, 30))
            f.create_dataset("t", data=np.arange(done, done + rows, dtype="f8"),
                             maxshape=(None,), chunks=(CHUNK * 8,))
            done += rows
            f.attrs["trials_completed"] = np.uint64(done)


def timed(steps: dict[str, float], name: str, call: Callable[[], object]) -> object:
    """Run ``call``; add its wall and CPU seconds (this process) to ``steps``."""
    started, cpu = time.perf_counter(), time.process_time()
    result = call()
    steps[name] = steps.get(name, 0.0) + time.perf_counter() - started
    steps[name + " cpu"] = steps.get(name + " cpu", 0.0) + time.process_time() - cpu
    return result


def one_job(directory: Path) -> dict[str, float]:
    """Consolidate the run in ``directory`` once, step by step; remove the output after."""
    steps: dict[str, float] = {}
    plan = timed(steps, "plan", lambda: prepare(directory, "run", uuid.uuid4().hex))
    try:
        copies = timed(steps, "copy", lambda: {
            unit: copy_unit(plan, unit).digests for unit in range(len(plan.copy_units))})
        timed(steps, "merge", lambda: merge_parts(plan))
        remove_parts(plan)
        digests = digests_by_dataset(copies, plan)
        timed(steps, "verify", lambda: [verify_files(plan, first, stop, digests)
                                        for first, stop in plan.verify_units])
        timed(steps, "check", lambda: check_plan_output(plan))
        output = timed(steps, "link", lambda: link_output(plan))
    finally:
        discard_job_files(plan.job)
    Path(str(output)).unlink()
    steps["total"] = sum(v for k, v in steps.items() if not k.endswith(" cpu"))
    steps["total cpu"] = sum(v for k, v in steps.items() if k.endswith(" cpu"))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="chkq-bench-vlen-", dir=args.keep))
    try:
        started = time.perf_counter()
        strings = write_run(root / "run", args.files, args.rows)
        size = sum(p.stat().st_size for p in (root / "run").glob("*.h5"))
        print(f"# generated {args.files} files, {args.rows} rows each: {size / 1e6:.1f} MB on "
              f"disk, {strings / 1e6:.1f} MB of strings, in {time.perf_counter() - started:.1f} s"
              "; warm cache, in-process")
        write_fixed_run(root / "fixed", args.files, args.rows)
        fixed_size = sum(p.stat().st_size for p in (root / "fixed").glob("*.h5"))
        print(f"# baseline: {args.files} files of {args.rows} rows of 30 float64 columns: "
              f"{fixed_size / 1e6:.1f} MB on disk")
        runs, fixed = [], []
        for _ in range(args.repeat):
            runs.append(one_job(root / "run"))
            fixed.append(one_job(root / "fixed"))
        best = min(runs, key=lambda r: r["total"])
        base = min(fixed, key=lambda r: r["total"])
        print("| step | strings: wall s | CPU s | fixed-size: wall s | CPU s |\n"
              "|---|---|---|---|---|")
        for name, seconds in best.items():
            if not name.endswith(" cpu"):
                print(f"| {name} | {seconds:.2f} | {best[name + ' cpu']:.2f} | "
                      f"{base[name]:.2f} | {base[name + ' cpu']:.2f} |")
        print(f"\nrate: strings {size / 1e6 / best['total']:.0f} MB of file a second "
              f"({strings / 1e6 / best['total']:.0f} MB of strings), fixed-size "
              f"{fixed_size / 1e6 / base['total']:.0f} MB a second; totals "
              + ", ".join(f"{r['total']:.2f}" for r in runs) + " s against "
              + ", ".join(f"{r['total']:.2f}" for r in fixed) + " s")
        print(f"strings / fixed-size, per MB of file: wall "
              f"{best['total'] / size / (base['total'] / fixed_size):.2f}x, CPU "
              f"{best['total cpu'] / size / (base['total cpu'] / fixed_size):.2f}x")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
