"""The ``chkq`` command line.

Exit status: 0 on success; 1 with one ``error: ...`` line on stderr for a
failed job or bad input; 2 for a usage error (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from chkq import __version__

if TYPE_CHECKING:
    from chkq.workers.client import Progress

#: Modules that add subcommands: each has ``register(subparsers)``.
COMMAND_MODULES: tuple[str, ...] = (
    "chkq.workers.log_cli", "chkq.workers.watch", "chkq.workers.flower", "chkq.workers.status",
)


class ProgressLine:
    """One self-rewriting line of progress on a terminal; silent elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.width = 0

    def __call__(self, progress: Progress) -> None:
        if not self.enabled:
            return
        total = progress.total
        if total:
            line = (f"{progress.phase}: copied {progress.copied:,}/{total:,} rows, "
                    f"verified {progress.verified:,}/{total:,} rows")
        else:
            line = f"{progress.phase}..."
        self.width = max(self.width, len(line))
        print("\r" + line.ljust(self.width), end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.width:
            print("\r" + " " * self.width + "\r", end="", file=self.stream, flush=True)


def cmd_consolidate(args: argparse.Namespace) -> int:
    from chkq.workers.client import consolidate_checkpoints, submit_consolidation

    out_dir = args.out_dir or os.getcwd()
    if args.no_wait:
        if not os.environ.get("CHKQ_BROKER_URL"):
            raise ValueError("--no-wait needs a cluster: set CHKQ_BROKER_URL")
        print(submit_consolidation(args.model, out_dir, args.cleanup).id)
        return 0
    line = ProgressLine()
    try:
        output = consolidate_checkpoints(args.model, out_dir, args.cleanup,
                                         workers=args.workers, on_progress=line)
    finally:
        line.close()
    print(output)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from chkq.config.celery_app import app
    from chkq.config.routing import resolve_queues

    queues = resolve_queues(args.queues)
    argv = ["worker", "-Q", ",".join(queues), "--loglevel", args.loglevel, "-P", "prefork"]
    if args.concurrency:
        argv += ["-c", str(args.concurrency)]
    if args.hostname:
        argv += ["-n", args.hostname]
    app.worker_main(argv=argv)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from chkq.demo import RunShape, make_run

    files = make_run(args.out_dir, args.model, RunShape(
        checkpoints=args.checkpoints, writers=args.writers, trials=args.trials,
    ))
    print(f"wrote {len(files)} checkpoint files of model {args.model!r} in {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chkq", description="Distributed checkpoint workers: consolidate HDF5 "
        "checkpoints, commit them to a write-once log.")
    parser.add_argument("--version", action="version", version=f"chkq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("consolidate", help="merge a run's HDF5 checkpoints into MODEL.h5")
    p.add_argument("model")
    p.add_argument("--out-dir", type=Path, help="the run's output directory (default: .)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete the checkpoints once the output is verified and linked")
    p.add_argument("--workers", type=int, default=None,
                   help="embedded cluster size (default: CPU count; no broker configured)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.set_defaults(func=cmd_consolidate)

    p = sub.add_parser("worker", help="start a worker (CHKQ_BROKER_URL names the broker)")
    p.add_argument("-Q", "--queues", help="queues to serve: control,copy,verify,commit "
                   "(default: all)")
    p.add_argument("-c", "--concurrency", type=int, help="worker processes (default: CPUs)")
    p.add_argument("-n", "--hostname", help="node name (default: celery@HOST)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("demo", help="write a small slug-like checkpointed run to try chkq on")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", default="demo")
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--writers", type=int, default=2, help="files per checkpoint (0: one file)")
    p.add_argument("--trials", type=int, default=500, help="trials per file")
    p.set_defaults(func=cmd_demo)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI's contract: one line, exit 1
        lines = (str(exc) or type(exc).__name__).splitlines()
        print(f"error: {lines[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
