"""Measure the planning step (the output's skeleton) of uncompressed runs against ``cp``.

Planning an uncompressed run writes the output's skeleton: the template's
bytes, then every chunk of the run's rows allocated for the copy tasks.
This script times, in this one process, ``chkq.consolidation.prepare.prepare``
of each run (the skeleton is removed after each round), alternating with
``cp -r`` of the same checkpoint files + ``sync`` (the baseline, measured in
the same run), and prints medians, seconds per GB, the ratio plan / cp,
the skeleton's size against the run's bytes, and the load average.

Usage::

    .venv/bin/python bench/plan_cost.py [--runs big,big4] [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from cli import MODEL, RUNS, prepare_run  # noqa: E402
from consolidate import bench_dirs  # noqa: E402

from chkq.consolidation.prepare import prepare  # noqa: E402
from chkq.consolidation.temporaries import JobFiles  # noqa: E402


def plan_once(run_dir: Path) -> tuple[float, int]:
    """Seconds of one planning step of ``run_dir``, and its skeleton's size (then removed)."""
    job = uuid.uuid4().hex
    t0 = time.perf_counter()
    prepare(run_dir, MODEL, job)
    elapsed = time.perf_counter() - t0
    files = JobFiles(run_dir, MODEL, job)
    size = files.temp.stat().st_size
    for path in files.temporaries():
        path.unlink(missing_ok=True)
    return elapsed, size


def cp_once(files: list[Path], scratch: Path) -> float:
    """Seconds of ``cp -r`` of ``files`` into a new directory, then ``sync``."""
    target = scratch / "cp"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", *map(str, files), str(target)], check=True)
    subprocess.run(["sync"], check=True)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(target)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="big,big4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args(argv)
    tmp, root, scratch = bench_dirs(args.keep, "chkq-bench-plan-")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    rows = []
    loads: list[float] = []
    try:
        for name in args.runs.split(","):
            if name not in RUNS:
                parser.error(f"unknown run {name!r}")
            run_dir, files = prepare_run(root, name)
            size = sum(p.stat().st_size for p in files)
            plan_once(run_dir)  # untimed warm-up (page cache)
            plans, cps, skeleton = [], [], 0
            for rep in range(args.repeat):
                for label in (("plan", "cp") if rep % 2 == 0 else ("cp", "plan")):
                    loads.append(os.getloadavg()[0])
                    if label == "plan":
                        seconds, skeleton = plan_once(run_dir)
                        plans.append(seconds)
                    else:
                        cps.append(cp_once(files, scratch))
                    print(f"#   {name:6s} {label:4s} round {rep + 1}: "
                          f"{(plans if label == 'plan' else cps)[-1]:7.3f} s "
                          f"(load {loads[-1]:.2f})", flush=True)
            rows.append((name, size, statistics.median(plans), statistics.median(cps),
                         skeleton))
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"# load average before the timed calls: median {statistics.median(loads):.2f}, "
          f"min {min(loads):.2f}, max {max(loads):.2f} on {os.cpu_count()} CPUs")
    print(f"{'run':6s} {'GB':>6s} {'plan s':>7s} {'cp s':>7s} {'plan s/GB':>9s} "
          f"{'cp s/GB':>8s} {'plan/cp':>7s} {'skeleton/run':>12s}")
    for name, size, plan, cp, skeleton in rows:
        gb = size / 1e9
        print(f"{name:6s} {gb:6.2f} {plan:7.3f} {cp:7.3f} {plan / gb:9.3f} {cp / gb:8.3f} "
              f"{plan / cp:7.3f} {skeleton / size:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
