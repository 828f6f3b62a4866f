"""Following a running simulation against one one-shot consolidation of the finished run.

A writer process (:func:`simulate`, a separate interpreter) writes a
slug-like run as slug does: each checkpoint file is created, filled with
``chkq.demo.fill_checkpoint``, flushed, left open ``--open-seconds``, and
only then gets ``trials_completed`` and is closed; the next checkpoint
starts ``--interval`` seconds later, and the done file is created as soon
as the last checkpoint is closed (a simulation that exits). Checkpoint
``n`` holds ``--trials + 3 n`` trials, so that checkpoints end off the
chunk grid, as a simulation's do.

Before any timing a private redis-server and one ``chkq worker -c 2``
(``bench/consolidate.py``'s ``Cluster``) start. The bench process runs
:func:`chkq.workers.follow.follow_run` (``--done-file``) beside the writer
on that cluster, then, with the followed ``MODEL.h5`` moved aside,
``--repeat`` one-shot consolidations of the same completed run
(``submit_consolidation(...).wait_for_output()``), the baseline, and checks
that the follow's final version holds the same datasets, row for row, as
the one-shot output.

What is counted, for the follow (every version) and for each one-shot job:

- **bytes written**: ``write_bytes`` of ``/proc/PID/io`` summed over the
  worker's process tree (the worker and its pool processes, which do every
  write of a job: temporaries, clones, outputs). It counts the bytes a
  process caused to be written to storage (page-cache pages it dirtied,
  which the kernel writes back), whichever file they went to; a clone by
  ``FICLONE`` dirties nothing, one by ``copy_file_range`` on ext4 dirties
  every page it copies. ``cancelled_write_bytes`` (dirty pages of files
  deleted or truncated before writeback) is printed beside it. The writer
  and the bench process are not counted.
- **CPU seconds**: user + system of the same process tree (the client's
  own CPU printed apart).
- **latency**: from the done file's creation (the writer's clock, the same
  host) to the final version's publication (its ``on_version`` call) and to
  ``follow_run``'s return, against the one-shot job's submit-to-output time.
- **per version**: each version's seconds (its job's, as recorded by the
  worker), bytes written between two versions, the new checkpoints' own
  size on disk, and the output's size.

Usage::

    .venv/bin/python bench/follow.py [--checkpoints 24] [--trials 2000] \
        [--spec-columns 512] [--compression gzip] [--writers 0] [--interval 2] \
        [--open-seconds 0.5] [--repeat 3] [--root DIR] [--workers 2]

``--root`` puts the run on another filesystem (an XFS loop mount, where
clones are reflinks); its type (``stat -f -c %T``) is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

MODEL = "run"
MB = 1e6
#: Goals: the whole follow's bytes and CPU against one one-shot job, and the latency
#: from the run's end to the final version against the one-shot job's time.
BYTES_GOAL = 1.5
LATENCY_GOAL = 0.3


# --------------------------------------------------------------------------- the simulation

def simulate(out_dir: Path, checkpoints: int, trials: int, spec_columns: int,
             compression: str | None, writers: int, interval: float, open_seconds: float,
             done: Path, timeline: Path) -> None:
    """Write the run as slug does; record when each checkpoint and the done file appeared."""
    import h5py

    from chkq.demo import RunShape, fill_checkpoint, mark_complete

    shape = RunShape(trials=trials, spec_columns=spec_columns, compression=compression,
                     shuffle=compression is not None)
    trial = 0
    completed: list[float] = []
    for number in range(1, checkpoints + 1):
        if writers:
            folder = out_dir / f"{MODEL}_chk{number:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            paths = [folder / f"thread_{w:04d}.h5" for w in range(writers)]
        else:
            paths = [out_dir / f"{MODEL}_chk{number:05d}.h5"]
        for path in paths:
            count = trials + 3 * number
            with h5py.File(path, "w") as f:
                fill_checkpoint(f, shape, trial, count, number)
                f.flush()
                time.sleep(open_seconds)
                trial += count
                mark_complete(f, trial)
        completed.append(time.time())
        if number < checkpoints:
            time.sleep(interval)
    done.touch()
    timeline.write_text(json.dumps({"completed": completed, "done": time.time()}))


# --------------------------------------------------------------------------- counting

@dataclass
class Counters:
    """Bytes written and CPU seconds of a process tree so far."""

    write_bytes: int = 0
    cancelled: int = 0
    cpu: float = 0.0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.write_bytes - other.write_bytes, self.cancelled - other.cancelled,
                        self.cpu - other.cpu)


class Tree:
    """The worker's process tree, whose pool processes must stay the same through the bench."""

    def __init__(self, root: int) -> None:
        import psutil

        self.root = psutil.Process(root)
        self.pids = sorted([self.root.pid, *(c.pid for c in self.root.children(recursive=True))])

    def counters(self) -> Counters:
        import psutil

        now = Counters()
        found = []
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                with proc.oneshot():
                    io = Path(f"/proc/{proc.pid}/io").read_text().split("\n")
                    fields = dict(line.split(": ") for line in io if line)
                    times = proc.cpu_times()
            except (psutil.NoSuchProcess, OSError):
                continue
            found.append(proc.pid)
            now.write_bytes += int(fields["write_bytes"])
            now.cancelled += int(fields["cancelled_write_bytes"])
            now.cpu += times.user + times.system
        if sorted(found) != self.pids:
            raise RuntimeError(f"the worker's processes changed ({self.pids} -> {sorted(found)}): "
                               "a replaced process's counts are lost; the figures would be short")
        return now


def disk_size(paths: list[Path]) -> int:
    """Bytes of the files at ``paths`` (a directory checkpoint: its files)."""
    total = 0
    for path in paths:
        files = sorted(path.glob("*.h5")) if path.is_dir() else [path]
        total += sum(f.stat().st_size for f in files)
    return total


def checkpoint_paths(run_dir: Path, first: int, last: int) -> list[Path]:
    """The checkpoints numbered ``first..last`` (file or directory)."""
    found = []
    for number in range(first, last + 1):
        stem = run_dir / f"{MODEL}_chk{number:05d}"
        found.append(stem if stem.is_dir() else stem.with_suffix(".h5"))
    return found


def same_datasets(a: Path, b: Path) -> None:
    """``a`` and ``b`` hold the same datasets with equal contents (else AssertionError)."""
    import h5py
    import numpy as np

    def names(f: h5py.File) -> list[str]:
        found: list[str] = []
        f.visititems(lambda n, o: found.append(n) if isinstance(o, h5py.Dataset) else None)
        return sorted(found)

    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        if names(fa) != names(fb):
            raise AssertionError(f"datasets differ: {names(fa)} != {names(fb)}")
        for name in names(fa):
            x, y = np.asarray(fa[name][()]), np.asarray(fb[name][()])
            if x.shape != y.shape or not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                raise AssertionError(f"{name} differs between the follow and the one-shot")


# --------------------------------------------------------------------------- the contenders

@dataclass
class VersionRow:
    number: int
    through: int
    seconds: float
    published_at: float
    written: int
    new_bytes: int
    output_bytes: int
    clone: str


def run_follow(args: argparse.Namespace, run_dir: Path, tree: Tree) -> dict[str, Any]:
    """Follow the writer's run to its end; return what it cost."""
    from chkq.workers.follow import Version, follow_run

    done, timeline = run_dir.parent / "done", run_dir.parent / "timeline.json"
    done.unlink(missing_ok=True)
    writer = subprocess.Popen(
        [sys.executable, __file__, "--simulate", str(run_dir), str(args.checkpoints),
         str(args.trials), str(args.spec_columns), args.compression or "none",
         str(args.writers), str(args.interval), str(args.open_seconds), str(done),
         str(timeline)])
    rows: list[VersionRow] = []
    start = last = tree.counters()
    client_cpu = time.process_time()

    def published(version: Version) -> None:
        nonlocal last
        now = tree.counters()
        previous = rows[-1].through if rows else 0
        rows.append(VersionRow(
            version.number, version.through, version.seconds, time.time(),
            (now - last).write_bytes,
            disk_size(checkpoint_paths(run_dir, previous + 1, version.through)),
            (run_dir / f"{MODEL}.h5").stat().st_size, version.clone or "one-shot"))
        last = now
        print(f"#   version {version.number:3d}: through {version.through:3d}, "
              f"{version.seconds:6.2f} s (job), wrote {rows[-1].written / MB:8.1f} MB, "
              f"clone {rows[-1].clone}", flush=True)

    try:
        follow_run(MODEL, run_dir, done_file=done, on_version=published, poll=args.poll)
        returned = time.time()
    finally:
        if writer.wait(600) != 0:
            raise RuntimeError("the writer failed")
    spent = tree.counters() - start
    times = json.loads(timeline.read_text())
    return {"versions": rows, "cost": spent, "client_cpu": time.process_time() - client_cpu,
            "done_at": times["done"], "last_completed": times["completed"][-1],
            "returned": returned}


def run_one_shot(run_dir: Path, tree: Tree) -> tuple[float, Counters]:
    from chkq.workers.client import submit_consolidation

    (run_dir / f"{MODEL}.h5").unlink(missing_ok=True)
    before = tree.counters()
    start = time.perf_counter()
    output = submit_consolidation(MODEL, run_dir).wait_for_output(timeout=1800)
    elapsed = time.perf_counter() - start
    spent = tree.counters() - before
    if output != run_dir / f"{MODEL}.h5":
        raise RuntimeError(f"one-shot output at {output}")
    return elapsed, spent


# --------------------------------------------------------------------------- main

def fs_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoints", type=int, default=24)
    parser.add_argument("--trials", type=int, default=2000,
                        help="trials of each checkpoint (checkpoint n: TRIALS + 3 n)")
    parser.add_argument("--spec-columns", type=int, default=512,
                        help="float64 columns of spectra/spec (most of a checkpoint's bytes)")
    parser.add_argument("--compression", choices=("gzip",), default=None,
                        help="gzip 4 + shuffle on every extensible dataset")
    parser.add_argument("--writers", type=int, default=0,
                        help="files per checkpoint (0: one file MODEL_chkNNNNN.h5)")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="seconds between a checkpoint's close and the next one's start")
    parser.add_argument("--open-seconds", type=float, default=0.5,
                        help="seconds each file stays open, filled, before trials_completed")
    parser.add_argument("--poll", type=float, default=None,
                        help="seconds between the follower's looks at the run (default: "
                             "the shipped chkq.workers.follow.POLL_SECONDS)")
    parser.add_argument("--repeat", type=int, default=3, help="one-shot jobs (median taken)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--root", type=Path, default=None,
                        help="directory to write the run in (default: a temporary one in /tmp)")
    args = parser.parse_args(argv)
    if not 12 <= args.checkpoints <= 50:
        print(f"warning: {args.checkpoints} checkpoints: the goals are set for 12 to 50",
              file=sys.stderr)
    from consolidate import Cluster

    import chkq.workers.follow

    args.poll = chkq.workers.follow.POLL_SECONDS if args.poll is None else args.poll
    tmp = tempfile.TemporaryDirectory(prefix="chkq-follow-", dir=args.root)
    base = Path(tmp.name)
    run_dir = base / "run"
    run_dir.mkdir()
    print(f"# command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"# filesystem of {base}: {fs_type(base)}; {os.cpu_count()} CPUs; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# run: {args.checkpoints} checkpoints of {args.trials}+3n trials, "
          f"{args.spec_columns} spec columns, compression {args.compression or 'none'}, "
          f"writers {args.writers}; every {args.interval} s, each file open "
          f"{args.open_seconds} s; follower polls every {args.poll} s", flush=True)
    try:
        with Cluster(args.workers, base) as cluster:
            assert cluster.process is not None
            tree = Tree(cluster.process.pid)
            followed = run_follow(args, run_dir, tree)
            kept = base / "followed.h5"
            os.rename(run_dir / f"{MODEL}.h5", kept)
            shots = []
            for rep in range(args.repeat):
                load = os.getloadavg()[0]
                elapsed, spent = run_one_shot(run_dir, tree)
                shots.append((elapsed, spent))
                print(f"#   one-shot round {rep + 1}: {elapsed:6.2f} s, wrote "
                      f"{spent.write_bytes / MB:8.1f} MB, cpu {spent.cpu:6.2f} s "
                      f"(load avg before {load:.2f})", flush=True)
            same_datasets(kept, run_dir / f"{MODEL}.h5")
            run_bytes = disk_size(checkpoint_paths(run_dir, 1, args.checkpoints))
            output_bytes = kept.stat().st_size
    finally:
        tmp.cleanup()
    report(followed, shots, run_bytes, output_bytes)
    return 0


def report(followed: dict[str, Any], shots: list[tuple[float, Counters]], run_bytes: int,
           output_bytes: int) -> None:
    """Print the follow against the one-shot median, the goals, and the versions."""
    rows: list[VersionRow] = followed["versions"]
    cost: Counters = followed["cost"]
    shot_time = statistics.median(s[0] for s in shots)
    shot_bytes = statistics.median(s[1].write_bytes for s in shots)
    shot_cpu = statistics.median(s[1].cpu for s in shots)
    final = rows[-1].published_at - followed["done_at"]
    returned = followed["returned"] - followed["done_at"]
    print()
    print(f"run: {run_bytes / MB:.1f} MB of checkpoints; output {output_bytes / MB:.1f} MB; "
          f"{len(rows)} versions (the final one equal, dataset for dataset, to the one-shot's)")
    print(f"{'':34s} {'follow':>10s} {'one-shot':>10s} {'ratio':>7s} {'goal':>6s}")
    ratio = cost.write_bytes / shot_bytes
    print(f"{'bytes written (worker tree), MB':34s} {cost.write_bytes / MB:10.1f} "
          f"{shot_bytes / MB:10.1f} {ratio:7.2f} {BYTES_GOAL:6.2f}  "
          f"{'met' if ratio <= BYTES_GOAL else 'NOT MET'}")
    ratio = cost.cpu / shot_cpu
    print(f"{'CPU seconds (worker tree)':34s} {cost.cpu:10.2f} {shot_cpu:10.2f} {ratio:7.2f} "
          f"{BYTES_GOAL:6.2f}  {'met' if ratio <= BYTES_GOAL else 'NOT MET'}")
    ratio = final / shot_time
    print(f"{'done file -> final version, s':34s} {final:10.2f} {shot_time:10.2f} {ratio:7.2f} "
          f"{LATENCY_GOAL:6.2f}  {'met' if ratio <= LATENCY_GOAL else 'NOT MET'}")
    print(f"{'done file -> follow returns, s':34s} {returned:10.2f} {shot_time:10.2f} "
          f"{returned / shot_time:7.2f}")
    job = rows[-1].seconds
    print(f"  of the latency: the final version's job {job:.2f} s ({job / shot_time:.2f}x the "
          f"one-shot); the rest ({final - job:.2f} s) is "
          "the follower's next look at the run (every --poll s), submission, dispatch, wake-up")
    print(f"cancelled_write_bytes: follow {cost.cancelled / MB:.1f} MB; client CPU of the "
          f"follow {followed['client_cpu']:.2f} s; one-shot jobs "
          f"{', '.join(f'{s[0]:.2f}' for s in shots)} s")
    later = rows[1:]
    if later:
        per_time = statistics.median(r.seconds for r in later)
        per_bytes = statistics.median(r.written for r in later)
        new = statistics.median(r.new_bytes for r in later)
        over = statistics.median(r.written / max(1, r.new_bytes) for r in later)
        clones = sorted({r.clone for r in later})
        print(f"per version after the first (median of {len(later)}): {per_time:.2f} s, "
              f"wrote {per_bytes / MB:.1f} MB for {new / MB:.1f} MB of new checkpoint "
              f"({over:.2f}x), clone {'/'.join(clones)}")
    print()
    print(f"{'ver':>4s} {'through':>7s} {'s':>7s} {'wrote MB':>9s} {'new MB':>8s} "
          f"{'wrote/new':>9s} {'output MB':>10s}  clone")
    for r in rows:
        took = f"{r.seconds:7.2f}" if r.clone != "one-shot" else f"{'-':>7s}"
        print(f"{r.number:4d} {r.through:7d} {took} {r.written / MB:9.1f} "
              f"{r.new_bytes / MB:8.1f} {r.written / max(1, r.new_bytes):9.2f} "
              f"{r.output_bytes / MB:10.1f}  {r.clone}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--simulate":
        a = sys.argv[2:]
        simulate(Path(a[0]), int(a[1]), int(a[2]), int(a[3]), None if a[4] == "none" else a[4],
                 int(a[5]), float(a[6]), float(a[7]), Path(a[8]), Path(a[9]))
        sys.exit(0)
    sys.exit(main())
