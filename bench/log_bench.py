"""Measure the checkpoint log against its quality bars.

What is measured, on this machine, in one run:

* commit throughput to a local ``file://`` store: a chain of ``--chain``
  checkpoints of ``--size-mib`` MiB, each differing from its parent in
  ``--change`` of its bytes (scattered 32-byte runs); only the ``commit``
  calls are timed (bar: >= 150 MB/s);
* the stored size of each delta as a percentage of the checkpoint (bar: <= 2 %);
* loading the head (the end of a ``--chain - 1``-long delta chain) cold, in
  a new process, against reading the same bytes from a file and hashing them
  with SHA-256 in that same process (bar: <= 4x); for reference, the same
  load when the head copy is ignored (walking the whole delta chain).

Usage::

    .venv/bin/python bench/log_bench.py [--size-mib 64] [--chain 17] [--change 0.01]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chkq.log import CheckpointLog  # noqa: E402
from chkq.stores import LocalDirectoryStore, open_store  # noqa: E402

MiB = 1 << 20
RUN = "bench"


def mutate(data: bytes, fraction: float, rng: np.random.Generator, run: int = 32) -> bytes:
    """Return ``data`` with ``fraction`` of its bytes rewritten in scattered ``run``-byte runs."""
    array = np.frombuffer(data, dtype=np.uint8).copy()
    count = max(1, int(len(data) * fraction) // run)
    starts = rng.integers(0, len(data) - run, count)
    index = (starts[:, None] + np.arange(run)).ravel()
    array[index] = rng.integers(0, 256, index.size, dtype=np.uint8)
    return array.tobytes()


def child_load(url: str, checkpoint: str, raw_file: str, head_copies: bool, repeat: int) -> None:
    """Time, in this fresh process, a cold load and a plain read + SHA-256."""
    loads, reads = [], []
    for _ in range(repeat):
        log = CheckpointLog(open_store(url), RUN, head_copies=head_copies)
        start = time.perf_counter()
        data = log.load(checkpoint)
        loads.append(time.perf_counter() - start)
        assert hashlib.sha256(data).hexdigest() == checkpoint
        del data, log
        start = time.perf_counter()
        with open(raw_file, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        reads.append(time.perf_counter() - start)
        assert digest == checkpoint
    print(json.dumps({"load": statistics.median(loads), "read": statistics.median(reads)}))


def cold(url: str, checkpoint: str, raw_file: str, head_copies: bool, repeat: int) -> dict:
    """Run :func:`child_load` in a new interpreter and return its timings."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, checkpoint, raw_file,
         "1" if head_copies else "0", str(repeat)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def dir_bytes(root: Path, sub: str) -> int:
    """Total size of the files under ``root/sub``."""
    return sum(p.stat().st_size for p in (root / sub).rglob("*") if p.is_file())


def main() -> int:
    """Run the benchmark and print a table; exit 1 if a bar is missed."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, checkpoint, raw_file, head_copies, repeat = sys.argv[2:7]
        child_load(url, checkpoint, raw_file, head_copies == "1", int(repeat))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--chain", type=int, default=17, help="checkpoints committed")
    parser.add_argument("--change", type=float, default=0.01, help="fraction changed per step")
    parser.add_argument("--max-chain", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="cold loads per measurement")
    parser.add_argument("--dir", type=Path, default=None, help="store directory (temporary)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    size = args.size_mib * MiB
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "store"
        store = LocalDirectoryStore(root)
        log = CheckpointLog(store, RUN, max_chain=args.max_chain)
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        parent: str | None = None
        commit_times: list[float] = []
        for _ in range(args.chain):
            start = time.perf_counter()
            parent = log.commit(data, parent)
            commit_times.append(time.perf_counter() - start)
            last = data
            data = mutate(data, args.change, rng)
        assert parent is not None
        head = log.record(parent)
        raw_file = Path(tmp) / "head.bin"
        raw_file.write_bytes(last)
        del data, last, log

        records = CheckpointLog(store, RUN).manifest()
        deltas = [r.stored_size / r.full_size * 100 for r in records if r.kind == "delta"]
        rate = size * args.chain / sum(commit_times) / 1e6
        fast = cold(root.as_uri(), head.id, str(raw_file), True, args.repeat)
        chain = cold(root.as_uri(), head.id, str(raw_file), False, args.repeat)
        history = dir_bytes(root, f"runs/{RUN}/payloads")
        copies = dir_bytes(root, f"runs/{RUN}/heads")

    worst = max(deltas) if deltas else float("nan")
    ratio = fast["load"] / fast["read"]
    rows = [
        ("checkpoints committed", f"{args.chain} x {args.size_mib} MiB, {args.change:.1%} changed"),
        ("head depth (deltas since keyframe)", f"{head.depth}"),
        ("commit throughput", f"{rate:.0f} MB/s", ">= 150 MB/s", rate >= 150),
        ("delta stored size, median", f"{statistics.median(deltas):.2f} %"),
        ("delta stored size, worst", f"{worst:.2f} %", "<= 2 %", worst <= 2),
        ("history (payloads) / full bytes", f"{history / (size * args.chain) * 100:.1f} %"),
        ("head copies kept", f"{copies / MiB:.1f} MiB"),
        ("read file + SHA-256 (new process)", f"{fast['read'] * 1e3:.0f} ms"),
        ("cold head load (new process)", f"{fast['load'] * 1e3:.0f} ms"),
        ("cold head load / read+SHA-256", f"{ratio:.2f}x", "<= 4x", ratio <= 4),
        ("  same, walking the delta chain", f"{chain['load'] / chain['read']:.2f}x"),
    ]
    print(f"{'measure':38} {'value':28} {'bar':12} ok")
    for row in rows:
        name, value = row[0], row[1]
        bar, ok = (row[2], "yes" if row[3] else "NO") if len(row) == 4 else ("", "")
        print(f"{name:38} {value:28} {bar:12} {ok}")
    met = rate >= 150 and worst <= 2 and ratio <= 4
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
