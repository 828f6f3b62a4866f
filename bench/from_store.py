"""Measure consolidation of a run kept only in an object store against doing it by hand.

Set-up, before any timing: a private redis-server on a free port
(:class:`chkq.workers.broker.PrivateRedis`) and ``chkq worker -c 2`` (its
own ``CHKQ_SCRATCH_DIR``, logging to ``worker.log``); for ``--stores s3``
also moto's S3 server as a separate process (``moto_server``, so that it
shares no interpreter lock with the client or the workers) behind a byte
counting TCP proxy, itself a separate process (this file run with
``--proxy``). Every S3 request of both contenders (the workers', the
client's listing, the baseline's downloads and upload) goes through the
proxy; the bench's own housekeeping (uploading the runs, deleting outputs
between rounds) goes to moto directly and is not counted.

Per run and store, after one untimed warm-up of each, ``--repeat`` rounds
in rotating order of:

========  ==============================================================
store     ``submit_store_consolidation(MODEL, URL).wait_for_summary()``:
          stage, fetch onto the worker's scratch directory, consolidate
          there, publish beside the sources (deleted again, untimed,
          between rounds)
baseline  what a user does today on one machine: download the objects
          into a local directory (file store: ``shutil.copyfile``; S3:
          boto3 ``download_file``, 2 objects at a time, one GET stream
          each), ``submit_consolidation(MODEL, DIR).wait_for_output()``
          on the same cluster, then upload ``MODEL.h5`` (file store:
          ``shutil.copyfile``; S3: boto3 ``upload_file``, multipart, 2
          parts at a time); each step timed, and the three together
========  ==============================================================

For a log run (``--log-runs``, on ``--log-stores``): the run's files
committed to a checkpoint log in the store (untimed), ``store`` with
``run=RUN`` against ``baseline`` = ``restore_run`` (what ``chkq log
restore`` runs, in this process) + consolidate + upload. The log's output
entry and object are deleted between rounds (untimed) so that the run can
be consolidated again.

Reported: median/min/max seconds, the ratio store/baseline, bytes through
the S3 proxy per output byte, peak RSS of each pool process (VmHWM, reset
through ``/proc/PID/clear_refs`` before each job), peak scratch bytes (the
worker's scratch directory, or the baseline's download directory, sampled
every 0.1 s), and where a store job's time goes, read from the worker log's
``start task=...`` / ``end task=... seconds=...`` lines.

Usage::

    .venv/bin/python bench/from_store.py [--repeat 3] [--runs big,small]
        [--stores file,s3] [--log-runs big] [--log-stores file] [--quick]
        [--keep DIR] [--big-trials 7600] [--small-files 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

MiB = 1 << 20
MODEL = "run"
BUCKET = "chkq-bench"
LOG_RUN = "r1"
RSS_LIMIT_MIB = 400.0
RATIO_GOAL = 0.6
#: Steps of a store job in the order they start.
STEPS = ("stage", "fetch", "plan", "scan", "copy", "merge", "verify", "link")


# --------------------------------------------------------------------------- counting proxy

def serve_proxy(upstream: str) -> None:
    """Relay TCP to ``upstream`` (host:port), counting bytes each way; talk on stdin/stdout.

    Prints the listening port once; then, for each line read on stdin,
    prints ``SENT RECEIVED``: bytes clients sent upstream and bytes they got
    back so far. Ends when stdin closes.
    """
    host, port = upstream.rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    counts = [0, 0]
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket, way: int) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(view[:n])
                with lock:
                    counts[way] += n
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            server = socket.create_connection((host, int(port)))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=pump, args=(client, server, 0), daemon=True).start()
            threading.Thread(target=pump, args=(server, client, 1), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    for _line in sys.stdin:
        with lock:
            print(f"{counts[0]} {counts[1]}", flush=True)


class CountingProxy:
    """The proxy process in front of moto; :meth:`counts` is (bytes sent, bytes received)."""

    def __init__(self, upstream: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--proxy", upstream], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def counts(self) -> tuple[int, int]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("?\n")
        self.process.stdin.flush()
        sent, received = self.process.stdout.readline().split()
        return int(sent), int(received)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.terminate()
        self.process.wait(10)


class Moto:
    """``moto_server`` as its own process on a free port, bucket ``BUCKET`` created."""

    def __init__(self, log_path: Path) -> None:
        from chkq.workers.broker import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p",
             str(port)], stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        self.client().create_bucket(Bucket=BUCKET)

    def client(self, endpoint: str | None = None) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


# --------------------------------------------------------------------------- places

@dataclass
class Place:
    """One run in one store: its URL, how to clean up after a round, how to get bytes."""

    kind: str
    run: str
    url: str
    files: list[str]
    sizes: dict[str, int]
    log_run: str | None = None
    local_root: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.run}{'+log' if self.log_run else ''}/{self.kind}"

    @property
    def output_key(self) -> str:
        return f"runs/{self.log_run}/outputs/{MODEL}.h5" if self.log_run else f"{MODEL}.h5"

    @property
    def size(self) -> int:
        return sum(self.sizes.values())


class Stores:
    """The stores of this bench: a directory tree, and optionally moto behind the proxy."""

    def __init__(self, root: Path, kinds: list[str]) -> None:
        self.root = root / "stores"
        self.root.mkdir(exist_ok=True)
        self.moto: Moto | None = None
        self.proxy: CountingProxy | None = None
        if "s3" in kinds:
            self.moto = Moto(root / "moto.log")
            self.proxy = CountingProxy(self.moto.url.removeprefix("http://"))
            os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=self.proxy.url)
            self.direct = self.moto.client()
            self.via_proxy = self.moto.client(self.proxy.url)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.moto is not None:
            self.moto.close()

    def counts(self) -> tuple[int, int]:
        return self.proxy.counts() if self.proxy is not None else (0, 0)

    def put_run(self, kind: str, run: str, run_dir: Path, files: list[Path],
                log_run: str | None) -> Place:
        """The run's files in a fresh place of the store ``kind`` (plain objects or a log)."""
        name = f"{run}-{'log-' if log_run else ''}{uuid.uuid4().hex[:8]}"
        names = [str(p.relative_to(run_dir)) for p in files]
        sizes = {n: p.stat().st_size for n, p in zip(names, files, strict=True)}
        started = time.perf_counter()
        if kind == "file":
            local = self.root / name
            local.mkdir()
            url = local.as_uri() + "/"
        else:
            local = None
            url = f"s3://{BUCKET}/{name}/"
        if log_run:
            self._commit(url, run_dir, files)
        elif kind == "file":
            assert local is not None
            for n, path in zip(names, files, strict=True):
                (local / n).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, local / n)
        else:
            from boto3.s3.transfer import TransferConfig

            config = TransferConfig(multipart_threshold=1 << 40)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda np: self.direct.upload_file(
                    str(np[1]), BUCKET, f"{name}/{np[0]}", Config=config),
                    zip(names, files, strict=True)))
        print(f"# put {run} into {kind}{' (log run ' + log_run + ')' if log_run else ''}: "
              f"{len(files)} objects, {sum(sizes.values()) / 1e6:.1f} MB in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        return Place(kind, run, url, names, sizes, log_run, local)

    def _commit(self, url: str, run_dir: Path, files: list[Path]) -> None:
        from chkq.log import CheckpointLog

        log = CheckpointLog(self._direct_store(url), LOG_RUN)
        for path in files:
            log.commit(path.read_bytes(), None, name=str(path.relative_to(run_dir)),
                       model=MODEL)

    def _direct_store(self, url: str) -> Any:
        """The store at ``url``, reached without the proxy (housekeeping is not counted)."""
        from chkq.stores import S3Store, open_store

        if not url.startswith("s3://"):
            return open_store(url)
        assert self.moto is not None
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix.rstrip("/"), endpoint_url=self.moto.url,
                       region_name="us-east-1")

    def remove_output(self, place: Place) -> None:
        """Delete what a store job published (and a log run's output entry), untimed."""
        store = self._direct_store(place.url)
        keys = [place.output_key]
        if place.log_run:
            keys.append(f"runs/{place.log_run}/outputs/{MODEL}.json")
        for key in keys:
            with contextlib.suppress(KeyError, FileNotFoundError):
                store.delete(key)
        leftover = [k for k in store.list() if k in keys]
        if leftover:
            raise RuntimeError(f"could not delete {leftover} from {place.url}")

    def remove_baseline(self, key: str, place: Place) -> None:
        if place.kind == "file":
            (self.root / key).unlink(missing_ok=True)
        else:
            self.direct.delete_object(Bucket=BUCKET, Key=key)


# --------------------------------------------------------------------------- sampling

def tree_bytes(root: Path) -> int:
    """Bytes allocated under ``root`` (st_blocks) by files of one link only.

    A file with other links (an object of a local store hard-linked into
    the scratch directory, or the output once published by a link) takes
    no space of its own there and is not counted.
    """
    total = 0
    stack = [root]
    while stack:
        top = stack.pop()
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                        continue
                    found = entry.stat(follow_symlinks=False)
                    if found.st_nlink == 1:
                        total += found.st_blocks * 512
    return total


class DiskWatch:
    """Peak of :func:`tree_bytes` over some directories, sampled every ``interval`` s."""

    def __init__(self, roots: list[Path], interval: float = 0.1) -> None:
        self.roots, self.interval, self.peak = roots, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, sum(tree_bytes(r) for r in self.roots))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class PeakWatch:
    """Peak RSS of each pool process and when it was sampled (VmRSS every 20 ms, then VmHWM).

    ``when`` is the epoch of the highest sample; a peak only VmHWM saw (a
    spike between samples) keeps the time of the highest sample.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0)
        self.when = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from consolidate import _status_kib

        while not self._stop.wait(0.02):
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    rss = _status_kib(pid, "VmRSS")
                    if rss > self.peak[pid]:
                        self.peak[pid], self.when[pid] = rss, time.time()

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        from consolidate import _status_kib

        self._stop.set()
        self._thread.join()
        for pid in self.pids:
            with contextlib.suppress(OSError):
                self.peak[pid] = max(self.peak[pid], _status_kib(pid, "VmHWM"))


@dataclass
class Sample:
    """One timed round of one contender."""

    seconds: float
    steps: dict[str, float] = field(default_factory=dict)
    moved: int = 0
    output: int = 0
    disk: int = 0
    rss: list[int] = field(default_factory=list)
    rss_when: float = 0.0
    load: float = 0.0
    job: str = ""
    started: float = 0.0
    ended: float = 0.0
    log_offset: int = 0
    log_end: int = 0


# --------------------------------------------------------------------------- contenders

class Bench:
    def __init__(self, cluster: Any, stores: Stores, root: Path, scratch: Path) -> None:
        self.cluster, self.stores, self.root, self.scratch = cluster, stores, root, scratch

    @contextlib.contextmanager
    def measured(self, sample: Sample, disk: list[Path]) -> Iterator[None]:
        from consolidate import reset_peaks

        pids = self.cluster.pool_pids()
        reset_peaks(pids)
        sample.log_offset = self.cluster.log_path.stat().st_size
        before = self.stores.counts()
        sample.load = os.getloadavg()[0]
        with PeakWatch(pids) as rss, DiskWatch(disk) as du:
            sample.started = time.time()
            yield
            sample.ended = time.time()
        after = self.stores.counts()
        sample.moved = after[0] - before[0] + after[1] - before[1]
        sample.disk = du.peak
        sample.rss = [rss.peak[p] for p in pids]
        if pids:
            sample.rss_when = rss.when[max(pids, key=lambda p: rss.peak[p])]
        time.sleep(0.3)  # the tasks' last log lines
        sample.log_end = self.cluster.log_path.stat().st_size

    def store(self, place: Place) -> Sample:
        from chkq.workers.client import submit_store_consolidation

        self.stores.remove_output(place)
        sample = Sample(0.0)
        with self.measured(sample, [self.scratch]):
            t0 = time.perf_counter()
            job = submit_store_consolidation(MODEL, place.url, run=place.log_run)
            summary = job.wait_for_summary(timeout=3600)
            sample.seconds = time.perf_counter() - t0
        sample.job = job.id
        if summary.output != place.url + place.output_key:
            raise RuntimeError(f"store job published {summary.output!r}")
        sample.output = int(summary.bytes or 0)
        left = list(self.scratch.iterdir()) if self.scratch.is_dir() else []
        if left:
            raise RuntimeError(f"workspace left in the scratch directory: {left}")
        self.stores.remove_output(place)
        return sample

    def baseline(self, place: Place, sync: bool = False) -> Sample:
        """Download, consolidate, upload; with ``sync``, each copy fsynced as chkq's are."""
        from chkq.workers.client import submit_consolidation

        local = self.root / "baseline" / uuid.uuid4().hex[:8]
        local.mkdir(parents=True)
        key = f"baseline-{uuid.uuid4().hex[:8]}/{MODEL}.h5"
        sample = Sample(0.0)
        try:
            with self.measured(sample, [local]):
                t0 = time.perf_counter()
                self._download(place, local, sync)
                t1 = time.perf_counter()
                output = submit_consolidation(MODEL, local).wait_for_output(timeout=3600)
                t2 = time.perf_counter()
                self._upload(place, Path(output), key, sync)
                t3 = time.perf_counter()
            sample.seconds = t3 - t0
            sample.steps = {"download": t1 - t0, "consolidate": t2 - t1, "upload": t3 - t2}
            sample.output = Path(output).stat().st_size
        finally:
            shutil.rmtree(local, ignore_errors=True)
            self.stores.remove_baseline(key, place)
        return sample

    def _download(self, place: Place, local: Path, sync: bool) -> None:
        if place.log_run:
            from chkq.log import CheckpointLog
            from chkq.log.transfer import restore_run
            from chkq.stores import open_store

            result = restore_run(CheckpointLog(open_store(place.url), place.log_run), local,
                                 MODEL)
            if result.failed:
                raise RuntimeError(f"restore failed: {result.failed}")
            return

        def one(name: str) -> None:
            target = local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if place.kind == "file":
                assert place.local_root is not None
                shutil.copyfile(place.local_root / name, target)
                if sync:
                    fsync(target)
            else:
                from boto3.s3.transfer import TransferConfig

                prefix = place.url.removeprefix(f"s3://{BUCKET}/")
                self.stores.via_proxy.download_file(
                    BUCKET, prefix + name, str(target),
                    Config=TransferConfig(use_threads=False, multipart_threshold=1 << 40))

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, place.files))

    def _upload(self, place: Place, output: Path, key: str, sync: bool) -> None:
        if place.kind == "file":
            target = self.stores.root / key
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(output, target)
            if sync:
                fsync(target)
        else:
            from boto3.s3.transfer import TransferConfig

            self.stores.via_proxy.upload_file(str(output), BUCKET, key,
                                              Config=TransferConfig(max_concurrency=2))


def fsync(path: Path) -> None:
    """Flush ``path`` and its directory to disk, as chkq does with what it writes."""
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the worker log

def store_breakdown(log_path: Path, sample: Sample) -> tuple[dict[str, float],
                                                              dict[str, float], str]:
    """Consecutive segments of a store job (adding up to its wall time), busy seconds, and
    the segment in which the highest RSS sample of the pool was taken.

    Segments: ``dispatch`` (submit to the stage's start, including the
    client's listing), then each step from its first start to the next
    step's first start, ``link`` to its end, and ``tail`` (link's end to
    the client's noticing). Busy: each step's logged seconds summed over
    both pool processes.
    """
    from cli import FIELD, LINE, _epoch

    with open(log_path, "rb") as fh:
        fh.seek(sample.log_offset)
        text = fh.read(sample.log_end - sample.log_offset).decode(errors="replace")
    first: dict[str, float] = {}
    last_end: dict[str, float] = {}
    busy: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        kind, _, rest = match.group(3).partition(" ")
        if kind not in ("start", "end"):
            continue
        fields = dict(FIELD.findall(rest))
        if fields.get("job") != sample.job or not fields.get("task", "").startswith("chkq."):
            continue
        step = fields["task"].removeprefix("chkq.")
        when = _epoch(match.group(1))
        if kind == "start":
            first.setdefault(step, when)
        else:
            last_end[step] = max(last_end.get(step, 0.0), when)
            busy[step] += float(fields.get("seconds", 0))
    segments: dict[str, float] = {}
    present = sorted((first[s], s) for s in STEPS if s in first)
    if not present or "link" not in last_end:
        return segments, dict(busy), "?"
    segments["dispatch"] = present[0][0] - sample.started
    peak_in = "dispatch" if sample.rss_when < present[0][0] else "tail"
    for (when, step), (after, _) in zip(present, [*present[1:], (last_end["link"], "")],
                                        strict=True):
        segments[step] = after - when
        if when <= sample.rss_when < after:
            peak_in = step
    segments["tail"] = sample.ended - last_end["link"]
    return segments, dict(busy), peak_in


# --------------------------------------------------------------------------- main

def generate(root: Path, name: str, shape: Any) -> tuple[Path, list[Path]]:
    from chkq.demo import make_run

    run_dir = root / "runs" / name
    existing = sorted(run_dir.glob(f"{MODEL}_chk*.h5"))
    if existing and len(existing) == shape.checkpoints:
        return run_dir, existing
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    files = make_run(run_dir, MODEL, shape)
    print(f"# generated {name}: {len(files)} files, "
          f"{sum(p.stat().st_size for p in files) / 1e6:.1f} MB "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return run_dir, files


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxy", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", default="big,small")
    parser.add_argument("--stores", default="file,s3")
    parser.add_argument("--log-runs", default="big", help="runs also committed to a log "
                        "and consolidated with run=RUN ('' for none)")
    parser.add_argument("--log-stores", default="file")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--big-trials", type=int, default=7600,
                        help="trials per file of the big run (8 files; 7600: ~0.5 GB)")
    parser.add_argument("--small-files", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a "
                        "minute: --repeat 1, big of 1,900 trials a file, small of 300 files")
    parser.add_argument("--keep", type=Path, default=None,
                        help="generate runs here (and reuse them if present)")
    parser.add_argument("--poll-seconds", type=float, default=0.02)
    args = parser.parse_args(argv)
    if args.proxy:
        serve_proxy(args.proxy)
        return 0
    if args.quick:
        args.repeat, args.big_trials, args.small_files = 1, 1900, 300
    from cli import Cluster
    from consolidate import bench_dirs, tuning

    import chkq.workers.client
    from chkq.demo import RunShape

    chkq.workers.client.POLL_SECONDS = args.poll_seconds
    shapes = {"big": RunShape(checkpoints=8, trials=args.big_trials, spec_columns=1024),
              "small": RunShape(checkpoints=args.small_files, trials=1, spec_columns=32)}
    runs = [r for r in args.runs.split(",") if r]
    kinds = [k for k in args.stores.split(",") if k]
    log_runs = [r for r in args.log_runs.split(",") if r and r in runs]
    log_kinds = [k for k in args.log_stores.split(",") if k and k in kinds]
    tmp, root, _scratch = bench_dirs(args.keep, "chkq-bench-store-")
    worker_scratch = root / "worker-scratch"
    os.environ["CHKQ_SCRATCH_DIR"] = str(worker_scratch)
    os.environ["CHKQ_ALLOWED_ROOTS"] = str(root)
    print("# command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"# machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
          f"workers: chkq worker -c {args.workers}; {tuning()} "
          f"CHKQ_UPLOAD_PART_BYTES={os.environ.get('CHKQ_UPLOAD_PART_BYTES', 'default')}")
    print("# S3: moto_server as its own process, behind a byte-counting TCP proxy process "
          "(both contenders' requests go through it)" if "s3" in kinds else "# S3: not run")
    print("# baseline: file store shutil.copyfile (no fsync); S3 boto3 download_file, "
          "2 objects at a time, one stream each; upload_file multipart, 2 parts at a time; "
          "log run: restore_run in this process", flush=True)
    samples: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    breakdowns: dict[str, list[tuple[dict[str, float], dict[str, float], str]]] = \
        defaultdict(list)
    sizes: dict[str, Place] = {}
    stores = Stores(root, kinds)
    cluster = None
    try:
        generated = {name: generate(root, name, shapes[name]) for name in runs}
        places = [stores.put_run(kind, name, *generated[name], None)
                  for name in runs for kind in kinds]
        places += [stores.put_run(kind, name, *generated[name], LOG_RUN)
                   for name in log_runs for kind in log_kinds]
        with Cluster(args.workers, root) as cluster:
            bench = Bench(cluster, stores, root, worker_scratch)
            for place in places:
                sizes[place.label] = place
                order: list[tuple[str, Callable[[], Sample]]] = [
                    ("store", functools.partial(bench.store, place)),
                    ("baseline", functools.partial(bench.baseline, place))]
                if place.kind == "file" and not place.log_run:
                    order.append(("synced", functools.partial(bench.baseline, place, True)))
                for _label, fn in order:
                    fn()
                for rep in range(args.repeat):
                    shift = rep % len(order)
                    for label, fn in order[shift:] + order[:shift]:
                        sample = fn()
                        samples[place.label, label].append(sample)
                        if label == "store":
                            breakdowns[place.label].append(
                                store_breakdown(cluster.log_path, sample))
                        steps = " ".join(f"{k} {v:.2f}" for k, v in sample.steps.items())
                        print(f"#   {place.label:14s} {label:8s} round {rep + 1}: "
                              f"{sample.seconds:7.2f} s {steps} (load before "
                              f"{sample.load:.2f})", flush=True)
    finally:
        stores.close()
        if tmp is not None:
            tmp.cleanup()
    report(samples, breakdowns, sizes)
    return 0


def report(samples: dict[tuple[str, str], list[Sample]],
           breakdowns: dict[str, list[tuple[dict[str, float], dict[str, float], str]]],
           places: dict[str, Place]) -> None:
    """Print the table, the ratios, bytes moved, RSS, scratch bytes and the breakdown."""
    loads = [s.load for v in samples.values() for s in v]
    print()
    print(f"# load average (1 min) before the timed rounds: median {median(loads):.2f}, "
          f"max {max(loads, default=0):.2f} on {os.cpu_count()} CPUs")
    print("# caveats: warm page cache (inputs just written); shared 2-CPU machine; moto is "
          "a Python emulator far slower than S3, and its cost lands on the same 2 CPUs;\n"
          "# the file-store baseline's copies are kernel copies (copy_file_range) left "
          "unsynced, as cp leaves them; 'synced' fsyncs them as chkq fsyncs its own;\n"
          "# S3 MB: bytes through the proxy both ways, per output byte (/out) and per source "
          "byte (/in); RSS: peak of any pool process; disk: peak bytes of the worker's "
          "scratch directory (store) or the download directory (baselines), files of one "
          "link only (a local store's objects are hard-linked into the scratch directory)")
    print(f"{'run/store':14s} {'files':>6s} {'MB':>7s} {'contender':9s} {'median s':>9s} "
          f"{'min s':>7s} {'max s':>7s} {'S3 MB':>7s} {'/out B':>6s} {'/in B':>5s} "
          f"{'RSS MiB':>7s} {'disk MB':>7s}  steps (median s)")
    for (label, contender), values in samples.items():
        place = places[label]
        times = [s.seconds for s in values]
        moved = median([s.moved for s in values])
        output = median([s.output for s in values])
        rss = max((r for s in values for r in s.rss), default=0) / 1024
        disk = max(s.disk for s in values) / 1e6
        steps = " ".join(f"{k} {median([s.steps[k] for s in values]):.2f}"
                         for k in values[0].steps)
        print(f"{label:14s} {len(place.files):6d} {place.size / 1e6:7.1f} {contender:9s} "
              f"{median(times):9.2f} {min(times):7.2f} {max(times):7.2f} "
              + (f"{moved / 1e6:7.1f} {moved / output:6.2f} {moved / place.size:5.2f} "
                 if place.kind == "s3" else f"{'-':>7s} {'-':>6s} {'-':>5s} ")
              + f"{rss:7.1f} {disk:7.1f}  {steps}")
    print()
    print(f"{'ratio of medians':40s} {'ratio':>6s} {'goal':>5s}")
    for label in places:
        for reference in ("baseline", "synced"):
            if (label, "store") not in samples or (label, reference) not in samples:
                continue
            ratio = (median([s.seconds for s in samples[label, "store"]])
                     / median([s.seconds for s in samples[label, reference]]))
            graded = places[label].kind == "file" and reference == "baseline"
            goal = f"{RATIO_GOAL:5.2f}" if graded else "    -"
            verdict = "" if not graded else "PASS" if ratio <= RATIO_GOAL else "FAIL"
            print(f"{label + ' store/' + reference:40s} {ratio:6.3f} {goal}  {verdict}")
    peak = max((r for v in samples.values() for s in v for r in s.rss), default=0) / 1024
    print(f"peak RSS per pool process, every job: {peak:.1f} MiB (goal <= {RSS_LIMIT_MIB:.0f}) "
          f"{'PASS' if peak <= RSS_LIMIT_MIB else 'FAIL'}")
    print()
    print("where a store job's time goes (median s; segments add up to the wall time; "
          "busy = logged task seconds summed over the pool processes)")
    for label, items in breakdowns.items():
        names = [n for n in ("dispatch", *STEPS, "tail")
                 if any(n in seg for seg, _, _ in items)]
        segs = " ".join(f"{n} {median([seg.get(n, 0.0) for seg, _, _ in items]):.2f}"
                        for n in names)
        busy = " ".join(f"{n} {median([b.get(n, 0.0) for _, b, _ in items]):.2f}"
                        for n in STEPS if any(n in b for _, b, _ in items))
        rounds = [s for (lab, c), v in samples.items() if lab == label and c == "store"
                  for s in v]
        peaks = ", ".join(f"{max(s.rss, default=0) / 1024:.0f} MiB in {where}"
                          for s, (_, _, where) in zip(rounds, items, strict=True))
        print(f"  {label:14s} segments: {segs}")
        print(f"  {'':14s} busy:     {busy}")
        print(f"  {'':14s} peak RSS of a pool process, each round: {peaks}")


if __name__ == "__main__":
    sys.exit(main())
