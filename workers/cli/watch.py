"""``chkq watch``: the sidecar that commits a running simulation's checkpoints.

It polls the run's directory and commits each checkpoint file once it is
complete (see :mod:`chkq.watcher`). With a broker configured it enqueues a
``chkq.commit`` per file; without one it commits in this process — no
broker, no worker pool beside a simulation that wants its CPUs. A commit
that fails for now (the store unreachable for its whole retry budget, the
file changing under the read) is said on stderr and tried again at the next
look. The run has finished when the process ``--pid`` exited, the file
``--done-file`` appeared, or nothing new came for ``--idle`` seconds; the
watch then waits for the commits.

With ``--consolidate`` it also follows the run, as ``chkq consolidate
--follow`` does (:mod:`chkq.workers.follow`, the same :class:`Follow`):
between its looks, a new verified version of ``OUT_DIR/MODEL.h5`` whenever
more checkpoints are complete, on the cluster or on an embedded one started
with the watch; once the run has finished and its files are committed, the
final version, equal to a one-shot consolidation. With ``--from-store`` it
consolidates once, when the run has finished, reading the run from the log
rather than the directory, so that workers with no view of this node's files
can do it: the output is published in the store
(``runs/RUN/outputs/MODEL.h5``, or ``--to``)."""

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
from chkq.errors import ChkqError, NoCheckpointsError, RunBusyError
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


class Sidecar:
    """The watch's commits: a look at the directory, and the end of the run's commits.

    Attributes
    ----------
    idle_since
        When the last look found a file to commit (or the watch started).
    failure
        What a look raised (a commit that cannot be made), kept so that the
        caller tells it from a failure of the follow it was called from.
    """

    def __init__(self, watcher: Watcher, interval: float) -> None:
        self.watcher = watcher
        self.interval = interval
        self.pending: list[tuple[CommitRequest, AsyncResult]] = []
        self.idle_since = time.monotonic()
        self.failure: BaseException | None = None
        self._last_look = float("-inf")

    def look(self) -> None:
        """Commit (or enqueue) what became ready."""
        self._last_look = time.monotonic()
        try:
            if self.watcher.poll():
                self.idle_since = time.monotonic()
        except BaseException as exc:
            self.failure = exc
            raise

    def look_if_due(self) -> None:
        """:meth:`look`, if ``interval`` seconds passed since the last (while a version builds)."""
        if time.monotonic() - self._last_look >= self.interval:
            self.look()

    def settle(self) -> None:
        """Once the run has finished: commit the last files, and wait for the enqueued commits.

        Raises
        ------
        RuntimeError
            Files not committed yet (their commits were deferred), naming the first.
        """
        time.sleep(self.interval)
        self.watcher.poll()
        self.watcher.poll()
        if self.watcher.deferred:
            raise RuntimeError(
                f"{len(self.watcher.deferred)} checkpoint file(s) not committed when the run "
                f"ended (first: {sorted(self.watcher.deferred)[0]}): run chkq watch again to "
                "commit them")
        for request, result in self.pending:
            result.get()
            print(f"committed {request.name}", flush=True)


def watch(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out_dir)
    model = check_model_name(args.model)
    log = CheckpointLog(open_store(args.store), args.run)
    on_cluster = bool(get_settings().broker_url)
    sidecar: Sidecar

    def enqueue(request: CommitRequest) -> None:
        from chkq.workers.commit_client import submit_commit

        result = submit_commit(args.store, args.run, request.path,
                               commit_options(request, model))
        sidecar.pending.append((request, result))
        print(f"enqueued {request.name} {request.checkpoint_id}", flush=True)

    watcher = Watcher(out_dir, model, committed_names(log, model),
                      enqueue if on_cluster else in_process_committer(args, model))
    sidecar = Sidecar(watcher, args.interval)
    if args.consolidate and not args.from_store:
        return watch_and_follow(args, model, out_dir, sidecar)
    while True:
        sidecar.look()
        if run_finished(args, sidecar.idle_since):
            break
        time.sleep(args.interval)
    sidecar.settle()
    if args.consolidate:
        consolidate(args, model, out_dir, on_cluster)
    return 0


def watch_and_follow(args: argparse.Namespace, model: str, out_dir: Path,
                     sidecar: Sidecar) -> int:
    """Commit the run's files and keep ``OUT_DIR/MODEL.h5`` current, as a follow does.

    Between two looks at the directory the follow publishes a version if
    more checkpoints are complete, and while a version's job runs the
    looks go on. Once the run has finished and its files are committed,
    the follow publishes the final version (and cleans up, with
    ``--cleanup``). A follow that fails (a damaged or rewritten checkpoint)
    is said at once, leaves the last good version, and lets the commits go
    on to the end of the run; the watch then exits with its error.
    """
    from chkq.workers.follow import Version, following

    def published(version: Version) -> None:
        print(version.line(), flush=True)

    if get_settings().broker_url:
        wait_for_run(args, model, out_dir, sidecar)
    with following(model, out_dir, cleanup=args.cleanup, workers=args.workers,
                   on_version=published, on_wait=sidecar.look_if_due) as follow:
        stopped: ChkqError | None = None
        while True:
            sidecar.look()
            if run_finished(args, sidecar.idle_since):
                break
            if stopped is None:
                try:
                    follow.step()
                except ChkqError as exc:
                    if sidecar.failure is not None:
                        raise
                    stopped = exc
                    warn(f"the follow stopped ({exc}); the commits go on to the run's end")
            time.sleep(args.interval)
        sidecar.settle()
        if stopped is not None:
            raise stopped
        summary = follow.finish()
    for message in summary.warnings:
        warn(message)
    if not summary.versions:
        raise NoCheckpointsError(f"no checkpoint of model {model!r} in {str(out_dir)!r} was "
                                 "complete when the run finished: nothing to consolidate")
    print(summary.output, flush=True)
    return 0


def wait_for_run(args: argparse.Namespace, model: str, out_dir: Path,
                 sidecar: Sidecar) -> None:
    """On a cluster, until no job consolidates the run any more, committing meanwhile.

    A watch killed and started again finds the job of its last version
    still running: the follow starts once that job has ended, so that two
    follows never publish at once. One still running when the run has
    finished (lost for good, or another user's) is refused.

    Raises
    ------
    RunBusyError
        The run is still being consolidated when it has finished, naming the job.
    """
    from chkq.workers.claims import refuse_if_running

    said = False
    while True:
        try:
            refuse_if_running(model, str(out_dir))
            return
        except RunBusyError as exc:
            if run_finished(args, sidecar.idle_since):
                raise
            if not said:
                warn(f"the follow waits: {exc}")
                said = True
        sidecar.look()
        time.sleep(args.interval)


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
                   help="keep OUT_DIR/MODEL.h5 current as chkq consolidate --follow does: a "
                   "new verified version after each completed checkpoint, the final one "
                   "once the run has finished (with --from-store: consolidate once then)")
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
                   help="with --consolidate --from-store on a cluster: wait for the "
                   "consolidation (else its job id is printed); following a local run "
                   "always waits for each version")
    p.add_argument("--pid", type=int, help="the run has finished when this process exits")
    p.add_argument("--done-file", type=Path,
                   help="the run has finished when this file exists")
    p.add_argument("--idle", type=float,
                   help="the run has finished after this many seconds without a new file")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between looks at the directory (default: 1)")
    p.add_argument("--workers", type=positive_int,
                   help="with --consolidate and no broker: processes of the embedded cluster "
                   "(started with the watch to follow the run; with --from-store, at the "
                   "run's end) (default: CPUs, at most 4)")
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
