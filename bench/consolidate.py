"""Measure consolidation against the quality bars.

What is measured, on this machine, in one process tree:

* ``chkq``: ``submit_consolidation(...).wait_for_output()`` against a cluster
  that is already running (a private redis-server and one ``celery worker
  -c N`` subprocess started before any timing); time from submit to output.
* ``serial``: a single-process copy-then-verify consolidation written here
  with h5py: each file is opened once, each extensible dataset's rows are
  copied in 64 MiB blocks into an output whose datasets are created like the
  source's (same type, chunks, filters), the output is fsynced (chkq fsyncs
  too), then every row is read back and compared with its source.
* ``cp``: ``cp -r`` of the checkpoint files into a new directory, then ``sync``.

``wait_for_output`` polls the backend every ``chkq.workers.client.POLL_SECONDS``
(0.25 s as shipped); the bench sets it to ``--poll-seconds`` (0.02 s) so that
the polling granularity does not dominate a sub-second job, and says so.

Runs (generated into a temporary directory with :func:`chkq.demo.make_run`):

* ``big``: 8 single-file checkpoints, 7,600 trials each, 1,024-column
  float64 ``spectra/spec``, 256-row chunks, uncompressed (~0.5 GB);
* ``gzip``: the same, gzip level 4 with shuffle;
* ``small``: 2,000 one-trial checkpoint files of ~140 KB (32 spec columns).

Contenders run alternately (rotating order) ``--repeat`` times per run; the
table shows medians and the ratios against the bars, with the CPU seconds
each contender used (chkq: its pool processes; serial: this process; cp:
its child processes) and the load average before each run, since other
users' processes on a shared machine take cores from the parallel contender. Peak RSS of each pool
process is read from ``/proc/PID/status`` (``VmHWM``), reset before each
chkq run through ``/proc/PID/clear_refs`` (needs root or the same user).

Page cache: nothing here drops caches (it needs privileges this machine's
sandbox does not reliably give, and would punish every contender alike);
the input files were just written and fit in RAM many times over, so every
contender runs WARM-cache, and the output says so.

Usage::

    .venv/bin/python bench/consolidate.py [--repeat 3] [--runs big,gzip,small]
        [--workers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from chkq.consolidation.checkpoint_files import is_extensible  # noqa: E402
from chkq.consolidation.filter_pipelines import create_extensible  # noqa: E402
from chkq.demo import RunShape, make_run  # noqa: E402

MiB = 1 << 20
MODEL = "run"
BLOCK = 64 * MiB

RUNS: dict[str, RunShape] = {
    "big": RunShape(checkpoints=8, trials=7600, spec_columns=1024),
    "gzip": RunShape(checkpoints=8, trials=7600, spec_columns=1024, compression="gzip",
                     shuffle=True),
    "small": RunShape(checkpoints=2000, trials=1, spec_columns=32),
}

#: The quality bars: (run, contender, reference, at most this ratio).
BARS: list[tuple[str, str, str, float, str]] = [
    ("big", "chkq", "serial", 0.4, "1. uncompressed ~0.5 GB: chkq <= 0.4x serial"),
    ("big", "chkq", "cp", 3.0, "2. uncompressed ~0.5 GB: chkq <= 3x cp -r + sync"),
    ("gzip", "chkq", "serial", 0.6, "3. gzip+shuffle ~0.5 GB: chkq <= 0.6x serial"),
    ("small", "chkq", "serial", 0.6, "4. 2,000 one-trial files: chkq <= 0.6x serial"),
]


# --------------------------------------------------------------------------- serial baseline

def _extensible_names(f: h5py.File) -> list[str]:
    names: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and is_extensible(obj):
            names.append(name)

    f.visititems(visit)
    return names


def serial_consolidation(files: list[Path], output: Path, block_bytes: int = BLOCK) -> None:
    """Copy then verify ``files`` into ``output`` in one process, as a plain h5py script would.

    Each file is opened once for the copy and once for the verification;
    rows move in blocks of at most ``block_bytes``; the output's datasets are
    created like the sources (type, chunk shape, filters) and grown per file.
    """
    with h5py.File(output, "w") as out:
        names: list[str] = []
        for path in files:
            with h5py.File(path, "r") as src:
                if not names:
                    names = _extensible_names(src)
                    for name in names:
                        parent, _, leaf = name.rpartition("/")
                        create_extensible(out.require_group(parent or "/"), leaf, src[name], 0)
                for name in names:
                    source, target = src[name], out[name]
                    n = source.shape[0]
                    if n == 0:
                        continue
                    start = target.shape[0]
                    target.resize(start + n, axis=0)
                    step = max(1, block_bytes // max(1, source.dtype.itemsize
                                                     * int(np.prod(source.shape[1:]))))
                    for lo in range(0, n, step):
                        hi = min(n, lo + step)
                        target[start + lo:start + hi] = source[lo:hi]
    with open(output, "rb+") as fh:
        os.fsync(fh.fileno())
    with h5py.File(output, "r") as out:
        offsets = dict.fromkeys(names, 0)
        for path in files:
            with h5py.File(path, "r") as src:
                for name in names:
                    source, target = src[name], out[name]
                    n = source.shape[0]
                    step = max(1, block_bytes // 2 // max(1, source.dtype.itemsize
                                                          * int(np.prod(source.shape[1:]))))
                    for lo in range(0, n, step):
                        hi = min(n, lo + step)
                        expected = source[lo:hi]
                        actual = target[offsets[name] + lo:offsets[name] + hi]
                        if expected.tobytes() != actual.tobytes():
                            raise AssertionError(f"{name} differs in {path}")
                    offsets[name] += n


# --------------------------------------------------------------------------- the cluster

class Cluster:
    """A private redis-server and one chkq worker with ``workers`` pool processes."""

    #: Seconds the worker gets to start and answer ping.
    START_SECONDS = 60

    def __init__(self, workers: int, log_dir: Path) -> None:
        from chkq.workers.broker import PrivateRedis

        self.workers = workers
        self.redis = PrivateRedis()
        self.log_path = log_dir / "worker.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    #: Whether the worker talks to peers (gossip, mingle): off, as the embedded cluster's.
    PEERS = False

    def __enter__(self) -> Cluster:
        from chkq.config.celery_app import make_app, use_app
        from chkq.config.settings import Settings
        from chkq.workers.runtime.launch import launch_worker

        self.redis.start()
        os.environ["CHKQ_BROKER_URL"] = self.redis.url
        os.environ.pop("CHKQ_RESULT_BACKEND", None)
        settings = Settings.from_env()
        app = make_app(settings)
        use_app(app, settings)
        self.env = {**os.environ}
        with open(self.log_path, "wb") as log:
            self.process = launch_worker(
                f"bench-{uuid.uuid4().hex[:6]}@%h", log=log, env=self.env,
                concurrency=self.workers, peers=self.PEERS)
        deadline = time.monotonic() + self.START_SECONDS
        while len(self.pool_pids()) < self.workers or not app.control.ping(timeout=0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start: " + self.log_path.read_text()[-2000:])
            time.sleep(0.2)
        return self

    def pool_pids(self) -> list[int]:
        import psutil

        if self.process is None:
            return []
        try:
            return [c.pid for c in psutil.Process(self.process.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.redis.close()


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peaks(pids: list[int]) -> bool:
    """Reset VmHWM of ``pids`` (write 5 to clear_refs); False if not allowed."""
    ok = True
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


class RssWatch:
    """Samples RSS of the pool processes while a job runs (a fallback to VmHWM)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0)
        self.idle = {pid: _status_kib(pid, "VmRSS") for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    self.peak[pid] = max(self.peak[pid], _status_kib(pid, "VmRSS"))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for pid in self.pids:
            with contextlib.suppress(OSError):
                self.peak[pid] = max(self.peak[pid], _status_kib(pid, "VmHWM"))


# --------------------------------------------------------------------------- contenders

#: CPU seconds the last contender run used (set by each run_* function).
CPU_SECONDS: list[float] = []


def pool_cpu(pids: list[int]) -> float:
    """User + system CPU seconds used so far by the worker pool processes."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_chkq(run_dir: Path, cluster: Cluster, rss: list[dict[str, int]]) -> float:
    from chkq.workers.client import submit_consolidation

    (run_dir / f"{MODEL}.h5").unlink(missing_ok=True)
    pids = cluster.pool_pids()
    reset_peaks(pids)
    before = pool_cpu(pids)
    with RssWatch(pids) as watch:
        start = time.perf_counter()
        output = submit_consolidation(MODEL, run_dir).wait_for_output(timeout=1800)
        elapsed = time.perf_counter() - start
    CPU_SECONDS.append(pool_cpu(pids) - before)
    assert output == run_dir / f"{MODEL}.h5"
    for pid in pids:
        rss.append({"pid": pid, "idle": watch.idle[pid], "peak": watch.peak[pid]})
    output.unlink()
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".chkq-")]
    assert not leftovers, leftovers
    return elapsed


def run_serial(files: list[Path], scratch: Path) -> float:
    output = scratch / "serial.h5"
    output.unlink(missing_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    serial_consolidation(files, output)
    elapsed = time.perf_counter() - start
    CPU_SECONDS.append(time.process_time() - cpu)
    output.unlink()
    return elapsed


def run_cp(run_dir: Path, scratch: Path) -> float:
    target = scratch / "cp"
    shutil.rmtree(target, ignore_errors=True)
    sources = sorted(str(p) for p in run_dir.iterdir() if p.name.startswith(f"{MODEL}_chk"))
    target.mkdir()
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # Many files: pass them in slices so the argument list stays bounded.
    for i in range(0, len(sources), 500):
        subprocess.run(["cp", "-r", *sources[i:i + 500], str(target)], check=True)
    subprocess.run(["sync"], check=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_SECONDS.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    shutil.rmtree(target)
    return elapsed


# --------------------------------------------------------------------------- main

def generate(root: Path, name: str) -> tuple[Path, list[Path], int]:
    run_dir = root / name
    started = time.perf_counter()
    files = make_run(run_dir, MODEL, RUNS[name])
    size = sum(p.stat().st_size for p in files)
    print(f"# generated {name}: {len(files)} files, {size / 1e6:.1f} MB "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return run_dir, files, size


def bench_dirs(keep: Path | None, prefix: str
               ) -> tuple[tempfile.TemporaryDirectory[str] | None, Path, Path]:
    """Where runs are generated: ``keep`` (reused), or a temporary directory to clean up.

    Returns the temporary directory (None with ``keep``), the root and its
    ``scratch`` subdirectory, both created.
    """
    tmp = None if keep else tempfile.TemporaryDirectory(prefix=prefix)
    root = keep or Path(tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    scratch = root / "scratch"
    scratch.mkdir(exist_ok=True)
    return tmp, root, scratch


def tuning() -> str:
    """The workers' tuning settings from the environment, for a bench's header line."""
    return " ".join(f"{name}={os.environ.get(name, 'default')}"
                    for name in ("CHKQ_BLOCK_BYTES", "CHKQ_TASK_BYTES", "CHKQ_TASK_FILES"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", default="big,gzip,small")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--contenders", default="chkq,serial,cp")
    parser.add_argument("--keep", type=Path, default=None,
                        help="generate runs here (and reuse them if present)")
    parser.add_argument("--poll-seconds", type=float, default=0.02,
                        help="how often wait_for_output polls the backend (the client ships "
                             "with 0.05 s, which adds ~0.025 s on average to every job)")
    args = parser.parse_args(argv)
    import chkq.workers.client

    chkq.workers.client.POLL_SECONDS = args.poll_seconds
    runs = [r for r in args.runs.split(",") if r]
    contenders = [c for c in args.contenders.split(",") if c]
    tmp, root, scratch = bench_dirs(args.keep, "chkq-bench-")
    print(f"# machine: {os.cpu_count()} CPUs; workers: 1 celery worker -c {args.workers}; "
          f"{tuning()}")
    print(f"# client polls the result backend every {args.poll_seconds} s "
          "(chkq.workers.client.POLL_SECONDS; shipped default 0.25 s, woken by the job's end)")
    print("# page cache: WARM for every contender (inputs just written, RAM >> data; "
          "caches are not dropped)", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    loads: list[float] = []
    rss: dict[str, list[dict[str, int]]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    try:
        with Cluster(args.workers, scratch) as cluster:
            for name in runs:
                existing = sorted((root / name).glob(f"{MODEL}_chk*.h5"))
                if existing and len(existing) == RUNS[name].checkpoints:
                    run_dir, files = root / name, existing
                    size = sum(p.stat().st_size for p in files)
                else:
                    run_dir, files, size = generate(root, name)
                sizes[name] = (len(files), size)
                order: list[tuple[str, Callable[[], float]]] = []
                rss[name] = []
                if "chkq" in contenders:
                    order.append(("chkq", lambda d=run_dir, n=name: run_chkq(d, cluster,
                                                                             rss[n])))
                if "serial" in contenders:
                    order.append(("serial", lambda f=files: run_serial(f, scratch)))
                if "cp" in contenders and name == "big":
                    order.append(("cp", lambda d=run_dir: run_cp(d, scratch)))
                # One untimed warm-up of each contender, then alternating timed rounds.
                for _label, fn in order:
                    fn()
                for rep in range(args.repeat):
                    shift = rep % len(order)
                    for label, fn in order[shift:] + order[:shift]:
                        load = os.getloadavg()[0]
                        loads.append(load)
                        elapsed = fn()
                        times.setdefault((name, label), []).append(elapsed)
                        cpus.setdefault((name, label), []).append(CPU_SECONDS[-1])
                        print(f"#   {name:5s} {label:6s} round {rep + 1}: {elapsed:7.3f} s "
                              f"(cpu {CPU_SECONDS[-1]:6.2f} s, load avg before {load:.2f})",
                              flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report(times, cpus, rss, sizes, loads)
    return 0


def report(times: dict[tuple[str, str], list[float]], cpus: dict[tuple[str, str], list[float]],
           rss: dict[str, list[dict[str, int]]], sizes: dict[str, tuple[int, int]],
           loads: list[float]) -> None:
    """Print medians, the bars with their ratios, and peak RSS of the pool processes."""
    med = {key: statistics.median(v) for key, v in times.items()}
    print()
    print(f"# load average (1 min) before the timed runs: median {statistics.median(loads):.2f}, "
          f"max {max(loads):.2f} on {os.cpu_count()} CPUs (other users' processes included)")
    print(f"{'run':6s} {'files':>6s} {'MB':>8s} {'contender':10s} {'median s':>9s} "
          f"{'min s':>8s} {'max s':>8s} {'cpu s':>7s}  runs")
    for (name, label), values in times.items():
        n, size = sizes[name]
        print(f"{name:6s} {n:6d} {size / 1e6:8.1f} {label:10s} {med[name, label]:9.3f} "
              f"{min(values):8.3f} {max(values):8.3f} "
              f"{statistics.median(cpus[name, label]):7.2f}  {len(values)}")
    print()
    print(f"{'bar':50s} {'ratio':>7s} {'limit':>6s}  result")
    for name, contender, reference, limit, text in BARS:
        if (name, contender) not in med or (name, reference) not in med:
            continue
        ratio = med[name, contender] / med[name, reference]
        print(f"{text:50s} {ratio:7.3f} {limit:6.2f}  {'PASS' if ratio <= limit else 'FAIL'}")
    print()
    print("5. peak RSS of each worker pool process (VmHWM, reset before each chkq run), MiB;")
    block = int(os.environ.get("CHKQ_BLOCK_BYTES") or BLOCK)
    print(f"   block size {block / MiB:g} MiB (CHKQ_BLOCK_BYTES); "
          "'growth' = peak - idle RSS before the job")
    for name, samples in rss.items():
        if not samples:
            continue
        peak = max(s["peak"] for s in samples) / 1024
        idle = min(s["idle"] for s in samples) / 1024
        growth = max(s["peak"] - s["idle"] for s in samples) / 1024
        print(f"   {name:6s} idle {idle:7.1f}  peak {peak:7.1f}  growth {growth:7.1f}  "
              f"(max over {len(samples)} process-runs)")


if __name__ == "__main__":
    sys.exit(main())
