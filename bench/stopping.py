"""How long ``chkq consolidate`` and its embedded cluster take to go after Ctrl-C, SIGTERM, SIGHUP.

For each signal, ``--repeat`` times: start ``chkq consolidate`` (embedded, ``--workers 2``)
on a run that takes seconds, wait until its redis-server, worker and pool exist and the job
wrote temporaries, send the signal, then time the command's exit and the moment the last
process of its tree (every descendant seen while it ran) is gone (zombies count as gone).

    .venv/bin/python bench/stopping.py [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from chkq.demo import RunShape, make_run


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def once(run_dir: Path, sig: signal.Signals) -> tuple[float, float]:
    """(seconds to the command's exit, seconds to its whole tree gone) after ``sig``."""
    for stale in run_dir.glob(".chkq-*"):
        stale.unlink()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    env["CHKQ_BLOCK_BYTES"] = str(64 * 1024)
    command = subprocess.Popen(
        [sys.executable, "-m", "chkq.workers.cli", "consolidate", "run", "--out-dir",
         str(run_dir), "--workers", "2"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            for child in psutil.Process(command.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        if len(seen) >= 4 and any(p.name.startswith(".chkq-") for p in run_dir.iterdir()):
            break
        time.sleep(0.01)
    sent = time.monotonic()
    command.send_signal(sig)
    command.wait(60)
    exited = time.monotonic() - sent
    while not all(gone(p) for p in seen.values()):
        if time.monotonic() - sent > 30:
            raise SystemExit(f"still running 30 s after {sig.name}: {sorted(seen)}")
        time.sleep(0.002)
    if (run_dir / "run.h5").exists():
        raise SystemExit("the job finished before the signal: use a larger run")
    return exited, time.monotonic() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="where the run is written (and reused)")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="chkq-bench-stop-"))
    run_dir = base / "run"
    if not run_dir.exists():
        make_run(run_dir, "run", RunShape(checkpoints=4, writers=2, trials=3000,
                                          spec_columns=256, compression="gzip", shuffle=True))
    try:
        print(f"{'signal':<8} {'exit median':>12} {'tree median':>12} {'tree max':>9}")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            times = [once(run_dir, sig) for _ in range(args.repeat)]
            exits, trees = [t[0] for t in times], [t[1] for t in times]
            print(f"{sig.name:<8} {statistics.median(exits):>10.3f} s "
                  f"{statistics.median(trees):>10.3f} s {max(trees):>7.3f} s")
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
