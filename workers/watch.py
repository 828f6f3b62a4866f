"""``chkq watch``: the sidecar that commits a running simulation's checkpoints.

It polls the run's directory, enqueues a ``chkq.commit`` for each checkpoint
file once it is complete (see :mod:`chkq.watcher`), and when the run has
finished — the process ``--pid`` exited, the file ``--done-file`` appeared,
or nothing new came for ``--idle`` seconds — waits for the commits and,
with ``--consolidate``, enqueues the consolidation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery.result import AsyncResult

from chkq.config.celery_app import get_settings
from chkq.discovery import check_model_name, check_out_dir
from chkq.log import CheckpointLog
from chkq.stores import open_store
from chkq.watcher import CommitRequest, Watcher


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def cluster_for(workers: int | None) -> Iterator[Any]:
    """The configured cluster, or an embedded one for the length of the watch."""
    if get_settings().broker_url:
        yield None
        return
    from chkq.workers.embedded import EmbeddedCluster

    with EmbeddedCluster(workers) as cluster:
        yield cluster


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


def watch(args: argparse.Namespace) -> int:
    from chkq.workers.client import submit_consolidation
    from chkq.workers.commits import submit_commit

    out_dir = check_out_dir(args.out_dir)
    model = check_model_name(args.model)
    log = CheckpointLog(open_store(args.store), args.run)
    pending: list[tuple[CommitRequest, AsyncResult]] = []

    def enqueue(request: CommitRequest) -> None:
        result = submit_commit(
            args.store, args.run, request.path, parent=request.parent, step=request.number,
            name=request.name, model=model, expect_id=request.checkpoint_id,
        )
        pending.append((request, result))
        print(f"enqueued {request.name} {request.checkpoint_id}", flush=True)

    with cluster_for(args.workers) as cluster:
        watcher = Watcher(out_dir, model, committed_names(log, model), enqueue)
        idle_since = time.monotonic()
        while True:
            if watcher.poll():
                idle_since = time.monotonic()
            if cluster is not None:
                cluster.check_alive()
            if run_finished(args, idle_since):
                break
            time.sleep(args.interval)
        time.sleep(args.interval)
        watcher.poll()
        watcher.poll()
        for request, result in pending:
            (cluster.wait(result) if cluster is not None else result.get())
            print(f"committed {request.name}", flush=True)
        if args.consolidate:
            job = submit_consolidation(model, out_dir, args.cleanup)
            print(f"consolidation {job.id}", flush=True)
            if cluster is not None or args.wait:
                wait = cluster.check_alive if cluster is not None else None
                print(job.wait_for_output(is_alive=wait), flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``chkq watch``."""
    p = sub.add_parser("watch", help="commit a running simulation's checkpoints as they "
                       "complete")
    p.add_argument("out_dir", type=Path)
    p.add_argument("model")
    p.add_argument("--store", required=True, help="the log's store URL: file:///abs/dir, "
                   "s3://bucket/prefix, gs://bucket/prefix or memory://name")
    p.add_argument("--run", required=True, help="the run's id in the log")
    p.add_argument("--consolidate", action="store_true",
                   help="enqueue the consolidation when the run has finished")
    p.add_argument("--cleanup", action="store_true",
                   help="with --consolidate: delete the checkpoints once consolidated")
    p.add_argument("--wait", action="store_true",
                   help="with --consolidate on a cluster: wait for the consolidation")
    p.add_argument("--pid", type=int, help="the run has finished when this process exits")
    p.add_argument("--done-file", type=Path,
                   help="the run has finished when this file exists")
    p.add_argument("--idle", type=float,
                   help="the run has finished after this many seconds without a new file")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks")
    p.add_argument("--workers", type=int, help="embedded cluster size (no broker configured)")
    p.set_defaults(func=watch)

