"""Measure one store job spread over 1, 2 and 3 nodes against today's one-node store job.

Set-up, before any timing: a private redis-server, moto's S3 server as its
own process behind a byte-counting TCP proxy (both from ``from_store.py``:
every S3 request of the workers goes through the proxy), and an uncompressed
run of ``--checkpoints`` single-file checkpoints (``chkq.demo``'s slug-like
layout, ``--trials`` rows each, a 1,024-column ``spec`` dataset) uploaded to
the bucket, untimed.

Per row, ``--repeat`` jobs (``submit_store_consolidation(...).wait_for_summary()``,
the output deleted between them, untimed), with fresh ``chkq worker -c 2``
nodes, each with its own scratch directory:

==========  ============================================================
one node    today's path (``CHKQ_SPREAD_BYTES`` above the run): one worker
            fetches every object, consolidates in its scratch, publishes
spread N    ``CHKQ_SPREAD_BYTES=0`` on N nodes: metadata mirrors on the
            staging node, parts copied by S3 (``UploadPartCopy``) or built
            by any node, the upload completed create-if-absent
spread N    with ``--verify-data``, the same as ``spread N`` with the job's
+ verify    ``--verify-data``: the output completed at a staging key, every
            row read back from S3 and compared with its source, then
            copied to the key (``UploadPartCopy``)
==========  ============================================================

Reported per row: median/min/max seconds, the ratio to the one-node row,
bytes through the S3 proxy per output byte (both ways), and the peak
scratch of the busiest node (allocated blocks, sampled every 0.1 s).

Usage::

    .venv/bin/python bench/spread.py [--checkpoints 8] [--trials 30000] [--repeat 3]
        [--nodes 1,2,3] [--verify-data] [--no-one-node] [--keep DIR] [--wide | --gzip]

With ``--verify-data``, each ``spread N`` row is followed by the same job with
``--verify-data`` on the same nodes, and the ratio of the two is printed.

With ``--gzip`` the run is thread directories of shuffle+gzip files
(:func:`gzip_run`), and the spread rows' nodes each get a tmpfs scratch of a
quarter of the run (run as root): a filtered run is spread only when it does
not fit in the staging node's scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from consolidate import bench_dirs  # noqa: E402
from from_store import BUCKET, CountingProxy, DiskWatch, Moto  # noqa: E402

MODEL = "run"


@contextlib.contextmanager
def nodes(count: int, root: Path, env: dict[str, str],
          tmpfs_mib: int = 0) -> Iterator[list[Path]]:
    """``count`` worker nodes, each ``chkq worker -c 2`` with a scratch of its own.

    With ``tmpfs_mib``, each scratch is a tmpfs of that size (mounted here: root only).
    """
    from chkq.config.celery_app import get_app
    from chkq.workers.runtime.launch import launch_worker

    scratches, processes, logs = [], [], []
    try:
        for n in range(count):
            scratch = root / f"node{n}-{uuid.uuid4().hex[:6]}"
            scratch.mkdir(mode=0o700)
            scratches.append(scratch)
            if tmpfs_mib:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_mib}m,mode=0700",
                                "tmpfs", str(scratch)], check=True)
            log = open(root / f"{scratch.name}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            processes.append(launch_worker(
                f"bench-{scratch.name}@%h", log=log, concurrency=2, peers=False,
                env={**os.environ, **env, "CHKQ_SCRATCH_DIR": str(scratch / "work")}))
        deadline = time.monotonic() + 60
        while len(get_app().control.ping(timeout=0.5) or []) < count:
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not start")
        yield scratches
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()
        if tmpfs_mib:
            for scratch in scratches:
                subprocess.run(["umount", "-l", str(scratch)], check=False)


def wide_run(run_dir: Path, checkpoints: int, rows: int) -> list[Path]:
    """Single-file checkpoints holding one extensible ``rows`` x 1,024 float64 dataset."""
    import h5py
    import numpy as np

    run_dir.mkdir(parents=True)
    rng = np.random.default_rng(1)
    files = []
    for number in range(1, checkpoints + 1):
        path = run_dir / f"{MODEL}_chk{number:05d}.h5"
        with h5py.File(path, "w") as f:
            f.attrs["trials_completed"] = np.uint64(number * rows)
            f.create_dataset("grid", data=np.linspace(0.0, 1.0, 1024))
            spec = f.create_dataset("spec", shape=(rows, 1024), maxshape=(None, 1024),
                                    dtype="f8", chunks=(256, 1024))
            for start in range(0, rows, 8192):
                spec[start:start + 8192] = rng.random((min(8192, rows - start), 1024))
        files.append(path)
    return files


def gzip_run(run_dir: Path, checkpoints: int, rows: int) -> list[Path]:
    """Thread directories of three writers (the last of none), shuffle+gzip, h5py's chunks.

    Each writer appends (its datasets created empty, then grown), so h5py
    guesses the same chunks in every file: 64 x 63 of a 1,000-column
    ``spec``, 1,024 rows of ``trial``. Writers' rows differ, multiples of 64
    (``spec``'s chunks move unchanged, ``trial``'s are mostly encoded again),
    the run's last file 17 rows more.
    """
    import h5py
    import numpy as np

    rng = np.random.default_rng(1)
    files, total = [], 0
    for number in range(1, checkpoints + 1):
        folder = run_dir / f"{MODEL}_chk{number:05d}"
        folder.mkdir(parents=True)
        for writer, count in enumerate((rows // 128 * 64 + 64 * number, rows // 128 * 64, 0)):
            count += 17 if number == checkpoints and writer == 1 else 0
            path = folder / f"thread_{writer:04d}.h5"
            with h5py.File(path, "w") as f:
                f.attrs["trials_completed"] = np.uint64(total + count)
                f.create_dataset("grid", data=np.linspace(0.0, 1.0, 77))
                trial = f.create_dataset("trial", shape=(0,), maxshape=(None,), dtype="u8",
                                         chunks=True, compression="gzip", shuffle=True)
                spec = f.create_dataset("spec", shape=(0, 1000), maxshape=(None, 1000),
                                        dtype="f8", chunks=True, compression="gzip",
                                        shuffle=True)
                trial.resize(count, axis=0)
                spec.resize(count, axis=0)
                trial[:] = np.arange(total, total + count)
                for start in range(0, count, 4096):
                    stop = min(count, start + 4096)
                    spec[start:stop] = np.round(rng.random((stop - start, 1000)), 3)
            total += count
            files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--trials", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--wide", action="store_true",
                        help="checkpoints of one 1,024-column dataset (every dataset >= 64 MiB "
                        "a checkpoint) instead of the demo layout's seven")
    parser.add_argument("--verify-data", action="store_true",
                        help="also run each spread row with --verify-data, on the same nodes")
    parser.add_argument("--no-one-node", action="store_true",
                        help="leave out the one-node row (ratios are then to the first row)")
    parser.add_argument("--gzip", action="store_true",
                        help="thread directories of shuffle+gzip files (h5py's chunks, "
                        "--trials rows a checkpoint); the spread rows' nodes get a tmpfs "
                        "scratch of a quarter of the run (a filtered run is spread only when "
                        "it does not fit)")
    args = parser.parse_args(argv)

    from chkq.config.celery_app import make_app, use_app
    from chkq.config.settings import Settings
    from chkq.demo import RunShape, make_run
    from chkq.tasks.state import records
    from chkq.workers.broker import PrivateRedis
    from chkq.workers.client import submit_store_consolidation

    tmp, root, _ = bench_dirs(args.keep, "chkq-spread-")
    redis = PrivateRedis()
    redis.start()
    moto = Moto(root / "moto.log")
    proxy = CountingProxy(moto.url.removeprefix("http://"))
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=proxy.url,
                      CHKQ_BROKER_URL=redis.url, CHKQ_ALLOWED_ROOTS=str(root))
    os.environ.pop("CHKQ_RESULT_BACKEND", None)
    settings = Settings.from_env()
    use_app(make_app(settings), settings)
    try:
        run_dir = root / "run"
        if run_dir.is_dir():
            files = sorted(run_dir.rglob("*.h5"))
        elif args.gzip:
            files = gzip_run(run_dir, args.checkpoints, args.trials)
        elif args.wide:
            files = wide_run(run_dir, args.checkpoints, args.trials)
        else:
            files = make_run(run_dir, MODEL, RunShape(checkpoints=args.checkpoints,
                                                      trials=args.trials, spec_columns=1024))
        prefix = f"spread-{uuid.uuid4().hex[:8]}"
        direct = moto.client()
        for path in files:
            direct.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(run_dir)}")
        url = f"s3://{BUCKET}/{prefix}/"
        run_bytes = sum(p.stat().st_size for p in files)
        parts = os.environ.get("CHKQ_UPLOAD_PART_BYTES", "16 MiB")
        print(f"# run: {len(files)} files, {run_bytes / 1e6:,.1f} MB; host load "
              f"{os.getloadavg()[0]:.2f}; parts {parts}", flush=True)

        rows = [] if args.no_one_node else [("one node", 1, {"CHKQ_SPREAD_BYTES": str(1 << 50)})]
        rows += [(f"spread {n}", n, {"CHKQ_SPREAD_BYTES": "0"})
                 for n in (int(x) for x in args.nodes.split(","))]
        results: dict[str, tuple[list[float], list[float], list[int], dict]] = {}
        runs = [(label, count, env, verify) for label, count, env in rows
                for verify in ((False, True) if args.verify_data and label != "one node"
                               else (False,))]
        shown = []
        for label, count, env, verify in runs:
            label += " --verify-data" if verify else ""
            shown.append((label, count))
            seconds, moved, peaks, done = [], [], [], {}
            small = run_bytes // 4 >> 20 if args.gzip and label != "one node" else 0
            with nodes(count, root, env, small) as scratches:
                for _ in range(args.repeat + 1):
                    with contextlib.suppress(Exception):
                        direct.delete_object(Bucket=BUCKET, Key=f"{prefix}/{MODEL}.h5")
                    before = sum(proxy.counts())
                    with contextlib.ExitStack() as stack:
                        watches = [stack.enter_context(DiskWatch([s])) for s in scratches]
                        started = time.perf_counter()
                        job = submit_store_consolidation(MODEL, url, verify_data=verify)
                        summary = job.wait_for_summary(timeout=3600)
                        took = time.perf_counter() - started
                    output = summary.bytes or 1
                    seconds.append(took)
                    moved.append((sum(proxy.counts()) - before) / output)
                    peaks.append(max(w.peak for w in watches))
                    done = records().finished_result(job.id) or {}
            # The first job of each row warms the nodes up (imports, connections): dropped.
            results[label] = (seconds[1:], moved[1:], peaks[1:], done)
            print(f"# {label}: {', '.join(f'{s:.2f}' for s in seconds[1:])} s", flush=True)

        base = statistics.median(results[shown[0][0]][0])
        print("\n| path | nodes | seconds (median, min–max) | / one node | S3 bytes through "
              "the workers / output byte | peak scratch, busiest node |")
        print("|---|---|---|---|---|---|")
        for label, count in shown:
            secs, moved, peaks, done = results[label]
            med = statistics.median(secs)
            built = done.get("through_workers")
            note = (f" (built parts: {built / done['bytes']:.1%} of the output)"
                    if built is not None else "")
            print(f"| {label} | {count} | {med:.2f} ({min(secs):.2f}–{max(secs):.2f}) | "
                  f"{med / base:.2f}x | {statistics.median(moved):.3f}{note} | "
                  f"{max(peaks) / 2**20:,.1f} MiB |")
        for label, _ in shown:
            if label.endswith(" --verify-data"):
                plain = results[label.removesuffix(" --verify-data")]
                secs, moved, _, done = results[label]
                print(f"# {label}: {statistics.median(secs) / statistics.median(plain[0]):.2f}x "
                      f"the wall time of {label.removesuffix(' --verify-data')}, "
                      f"{statistics.median(moved) - statistics.median(plain[1]):+.3f} S3 bytes "
                      f"through the workers per output byte; {done.get('verified_rows', 0):,} "
                      "rows read back")
        print(f"# host load after: {os.getloadavg()[0]:.2f}")
    finally:
        proxy.close()
        moto.close()
        redis.close()
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
