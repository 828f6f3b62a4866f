"""``chkq watch``: the sidecar that commits a running simulation's checkpoints.

It polls the run's directory and commits each checkpoint file once it is
complete (see :mod:`chkq.watcher`). With a broker configured it enqueues a
``chkq.commit`` per file; without one it commits in this process — no
broker, no worker pool beside a simulation that wants its CPUs. A commit
that fails for now (the store unreachable for its whole retry budget, the
file changing under the read) is said on stderr and tried again at the next
look. When the run has finished — the process ``--pid`` exited, the file
``--done-file`` appeared, or nothing new came for ``--idle`` seconds — it
waits for the commits and, with ``--consolidate``, consolidates: on the
cluster, or on an embedded cluster started only then. With ``--from-store``
the consolidation reads the run from the log, not from the directory, so
that workers with no view of this node's files can do it: the output is
published in the store (``runs/RUN/outputs/MODEL.h5``, or ``--to``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from celery.result import AsyncResult

from chkq.config.celery_app import get_settings
from chkq.consolidation.discovery import check_model_name, check_out_dir
from chkq.log import CheckpointLog, default_writer
from chkq.log.transfer import CommitOptions, FileChangedError
from chkq.stores import TransientStoreError, open_store
from chkq.watcher import CommitDeferred, CommitRequest, Watcher
from chkq.workers.cli.common import positive_int


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def committed_names(log: CheckpointLog, model: str) -> dict[str, str]:
    """Names of ``model``'s checkpoint files the log already holds, with their ids.

    Read from the run's name entries (format-1 logs: from the records), so
    a file whose bytes were already committed under another name still
    counts as committed only once its own name is in the log.
    """
    return {name: entry.id for name, entry in log.files(model).items()}


def run_finished(args: argparse.Namespace, idle_since: float) -> bool:
    if args.pid is not None and not pid_alive(args.pid):
        return True
    if args.done_file is not None and Path(args.done_file).exists():
        return True
    return args.idle is not None and time.monotonic() - idle_since >= args.idle


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def commit_options(request: CommitRequest, model: str) -> CommitOptions:
    """How the watcher commits a ready file: on its parent, as its step, checked by its id."""
    return CommitOptions(parent=request.parent, step=request.number, name=request.name,
                         model=model, expect_id=request.checkpoint_id)


def in_process_committer(args: argparse.Namespace, model: str
                         ) -> Callable[[CommitRequest], None]:
    """Commit each ready file in this process; defer (to the next look) what fails for now."""
    from chkq.workers.commit_client import commit_in_process, store_retries_reported

    writer = f"chkq watch@{default_writer()}"

    def commit(request: CommitRequest) -> None:
        try:
            with store_retries_reported(warn):
                commit_in_process(args.store, args.run, request.path,
                                  commit_options(request, model), writer=writer)
        except (TransientStoreError, FileChangedError) as exc:
            warn(f"{request.name} not committed yet ({exc}); trying again at the next look")
            raise CommitDeferred(str(exc)) from exc
        print(f"committed {request.name} {request.checkpoint_id}", flush=True)

    return commit


def watch(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out_dir)
    model = check_model_name(args.model)
    log = CheckpointLog(open_store(args.store), args.run)
    on_cluster = bool(get_settings().broker_url)
    pending: list[tuple[CommitRequest, AsyncResult]] = []

    def enqueue(request: CommitRequest) -> None:
        from chkq.workers.commit_client import submit_commit

        result = submit_commit(args.store, args.run, request.path,
                               commit_options(request, model))
        pending.append((request, result))
        print(f"enqueued {request.name} {request.checkpoint_id}", flush=True)

    watcher = Watcher(out_dir, model, committed_names(log, model),
                      enqueue if on_cluster else in_process_committer(args, model))
    idle_since = time.monotonic()
    while True:
        if watcher.poll():
            idle_since = time.monotonic()
        if run_finished(args, idle_since):
            break
        time.sleep(args.interval)
    time.sleep(args.interval)
    watcher.poll()
    watcher.poll()
    if watcher.deferred:
        raise RuntimeError(
            f"{len(watcher.deferred)} checkpoint file(s) not committed when the run ended "
            f"(first: {sorted(watcher.deferred)[0]}): run chkq watch again to commit them")
    for request, result in pending:
        result.get()
        print(f"committed {request.name}", flush=True)
    if args.consolidate:
        consolidate(args, model, out_dir, on_cluster)
    return 0


def consolidate(args: argparse.Namespace, model: str, out_dir: Path, on_cluster: bool) -> None:
    """Consolidate the finished run: on the cluster, or on an embedded one started now."""
    from chkq.workers.client import (
        run_consolidation,
        submit_consolidation,
        submit_store_consolidation,
    )

    source = args.store if args.from_store else None
    if on_cluster and not args.wait:
        job = (submit_store_consolidation(model, args.store, run=args.run, to=args.to,
                                          cleanup=args.cleanup) if source
               else submit_consolidation(model, out_dir, args.cleanup))
        print(f"consolidation {job.id}", flush=True)
        return
    summary = run_consolidation(
        model, out_dir, args.cleanup, workers=args.workers, source=source,
        run=args.run if source else None, to=args.to,
        on_submitted=lambda job: print(f"consolidation {job.id}", flush=True),
        on_notice=warn)
    for message in summary.warnings:
        warn(message)
    print(summary.output, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``chkq watch``."""
    p = sub.add_parser("watch", help="commit a running simulation's checkpoints as they "
                       "complete")
    p.add_argument("out_dir", type=Path, help="the simulation's output directory, where its "
                   "checkpoints appear")
    p.add_argument("model", help="the model name: the MODEL of MODEL_chkNNNNN")
    p.add_argument("--store", required=True, help="the log's store URL: file:///abs/dir, "
                   "s3://bucket/prefix, gs://bucket/prefix or memory://name")
    p.add_argument("--run", required=True, help="the run's id in the log")
    p.add_argument("--consolidate", action="store_true",
                   help="enqueue the consolidation when the run has finished")
    p.add_argument("--from-store", action="store_true",
                   help="with --consolidate: consolidate the run from the log in the store, "
                        "for workers that do not see this directory; the output is published "
                        "at the log's runs/RUN/outputs/MODEL.h5 (or --to)")
    p.add_argument("--to", metavar="URL",
                   help="with --from-store: the object to publish the output at")
    p.add_argument("--cleanup", action="store_true",
                   help="with --consolidate: delete the checkpoints once consolidated (with "
                        "--from-store: the run's names of them in the log, never a payload)")
    p.add_argument("--wait", action="store_true",
                   help="with --consolidate on a cluster: wait for the consolidation")
    p.add_argument("--pid", type=int, help="the run has finished when this process exits")
    p.add_argument("--done-file", type=Path,
                   help="the run has finished when this file exists")
    p.add_argument("--idle", type=float,
                   help="the run has finished after this many seconds without a new file")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between looks at the directory (default: 1)")
    p.add_argument("--workers", type=positive_int,
                   help="with --consolidate and no broker: processes of the embedded cluster "
                   "started to consolidate (default: CPUs, at most 4)")
    p.set_defaults(func=watch, check_usage=check_usage)


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse option combinations argparse cannot express (exit 2, as usage errors)."""
    if args.cleanup and not args.consolidate:
        parser.error("watch: --cleanup needs --consolidate (it deletes the checkpoints "
                     "once consolidated)")
    if args.wait and not args.consolidate:
        parser.error("watch: --wait needs --consolidate")
    if not args.consolidate and (args.from_store or args.to):
        parser.error("watch: --from-store and --to need --consolidate")
    if args.to and not args.from_store:
        parser.error("watch: --to needs --from-store")
