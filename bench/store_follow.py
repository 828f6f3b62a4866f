"""Following a run kept in S3 against one one-shot ``--from`` consolidation of the finished run.

A writer thread writes a slug-like run into a local directory (``chkq.demo``'s
checkpoint files, checkpoint ``n`` holding ``--trials + 3 n`` trials) and puts
each finished file into a bucket of moto's S3 server (on 127.0.0.1, started
here), ``--interval`` seconds apart; it creates the done file once the last is
uploaded. A private redis-server and one ``chkq worker`` (``bench/consolidate.py``'s
``Cluster``) run the jobs. The bench process runs
:func:`chkq.workers.store_follow.follow_store_run` beside the writer, then
``--repeat`` one-shot ``--from`` consolidations of the same objects put under
another prefix (``submit_store_consolidation(...).wait_for_output()``), the
baseline, and checks that the follow's final version holds the same datasets,
row for row, as the one-shot output.

Printed, for each version: its number, last checkpoint, size, the bytes S3 copied
from the previous version (``UploadPartCopy``) and the bytes sent, and its job's
seconds; then the ratios: bytes sent to the store by the follow (every version)
over the one-shot output's size, and the latency from the done file to the final
version's publication over the one-shot job's submit-to-output time.

Usage::

    .venv/bin/python bench/store_follow.py [--checkpoints 8] [--trials 20000] \
        [--spec-columns 64] [--interval 3] [--repeat 3] [--workers 2] [--part-mib 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from consolidate import Cluster  # noqa: E402

MODEL = "sim"
BUCKET = "chkq-bench-bucket"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_run(run_dir: Path, url: str, args: argparse.Namespace, done: Path,
              errors: list[BaseException]) -> None:
    """The simulation: each checkpoint written locally, then put into the store."""
    from chkq.demo import RunShape, write_checkpoint_file
    from chkq.stores import open_store

    try:
        store = open_store(url)
        first = 0
        for number in range(1, args.checkpoints + 1):
            trials = args.trials + 3 * number
            path = run_dir / f"{MODEL}_chk{number:05d}.h5"
            write_checkpoint_file(path, RunShape(trials=trials, spec_columns=args.spec_columns,
                                                 chunk_rows=1024), first, trials, number)
            first += trials
            store.put(path.name, path.read_bytes())
            if number < args.checkpoints:
                time.sleep(args.interval)
        done.touch()
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)
        done.touch()


def same_rows(left: Path, right: Path) -> bool:
    """Both files hold the same datasets with the same values."""
    import h5py
    import numpy as np

    names: list[str] = []
    with h5py.File(left, "r") as a, h5py.File(right, "r") as b:
        a.visit(names.append)
        other: list[str] = []
        b.visit(other.append)
        if names != other:
            return False
        return all(np.ascontiguousarray(a[n][()]).tobytes()
                   == np.ascontiguousarray(b[n][()]).tobytes()
                   for n in names if isinstance(a[n], h5py.Dataset))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--trials", type=int, default=20000)
    parser.add_argument("--spec-columns", type=int, default=64)
    parser.add_argument("--interval", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--part-mib", type=int, default=5)
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                      CHKQ_UPLOAD_PART_BYTES=str(args.part_mib << 20))
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    try:
        with tempfile.TemporaryDirectory(prefix="chkq-bench-") as base_name:
            base = Path(base_name)
            os.environ["CHKQ_SCRATCH_DIR"] = str(base / "scratch")
            with Cluster(args.workers, base):
                return run(args, base)
    finally:
        server.stop()


def run(args: argparse.Namespace, base: Path) -> int:
    from chkq.stores import open_store
    from chkq.tasks.state import records
    from chkq.workers.client import submit_store_consolidation
    from chkq.workers.follow import Version
    from chkq.workers.store_follow import follow_store_run

    run_dir, done = base / "run", base / "done"
    run_dir.mkdir()
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/"
    published: list[tuple[Version, float]] = []
    errors: list[BaseException] = []
    writer = threading.Thread(target=write_run, args=(run_dir, url, args, done, errors))
    writer.start()
    summary = follow_store_run(MODEL, url, done_file=done, keep_versions=0.0,
                               on_version=lambda v: published.append((v, time.time())))
    writer.join()
    if errors:
        raise errors[0]
    ended = done.stat().st_mtime
    print(f"{args.checkpoints} checkpoints of ~{args.trials:,} trials × {args.spec_columns} "
          f"columns, {args.interval:g} s apart; parts of {args.part_mib} MiB; moto S3")
    print(f"{'version':>7} {'through':>7} {'bytes':>13} {'copied':>13} {'sent':>13} {'s':>6}")
    sent_total = 0
    for version, _ in published:
        done_result = records().finished_result(version.job) or {}
        size, copied = int(done_result.get("bytes") or 0), int(done_result.get("copied_bytes") or 0)
        sent_total += size - copied
        print(f"{version.number:>7} {version.through:>7} {size:>13,} {copied:>13,} "
              f"{size - copied:>13,} {version.seconds:>6.1f}")
    latency = published[-1][1] - ended
    store = open_store(url)
    final = base / "final.h5"
    final.write_bytes(store.get(f"{MODEL}.h5"))

    other = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/"
    copy = open_store(other)
    for path in sorted(run_dir.glob(f"{MODEL}_chk*.h5")):
        copy.put(path.name, path.read_bytes())
    times = []
    output_size = 0
    for attempt in range(args.repeat):
        target = f"{other}again-{attempt}/{MODEL}.h5"
        started = time.monotonic()
        submit_store_consolidation(MODEL, other, to=target).wait_for_output(timeout=600)
        times.append(time.monotonic() - started)
        key = target.removeprefix(other)
        output_size = copy.version(key).size
        if attempt == 0:
            reference = base / "one-shot.h5"
            reference.write_bytes(copy.get(key))
            if not same_rows(final, reference):
                print("error: the follow's final version is not the one-shot output")
                return 1
    baseline = statistics.median(times)
    print(f"follow: {len(published)} versions ({summary.line()})")
    whole = sum(int((records().finished_result(v.job) or {}).get("bytes") or 0)
                for v, _ in published)
    print(f"bytes sent to the store, follow / one-shot output: {sent_total:,} / "
          f"{output_size:,} = {sent_total / output_size:.2f}x (whole uploads would be "
          f"{whole / output_size:.2f}x)")
    print(f"latency, done file to the final version / one-shot submit to output: "
          f"{latency:.1f} s / {baseline:.1f} s (median of {args.repeat}) = "
          f"{latency / baseline:.2f}x")
    print("final version equal, dataset for dataset, to the one-shot output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
