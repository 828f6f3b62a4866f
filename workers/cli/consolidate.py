"""``chkq consolidate``: merge a run's checkpoints into MODEL.h5, on a cluster or embedded."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.errors import ConfigurationError
from chkq.workers.cli.common import (
    Interrupted,
    ProgressLine,
    non_negative_float,
    positive_float,
    positive_int,
    say,
)

if TYPE_CHECKING:
    from chkq.workers.client import ConsolidationJob


def _job_fate(job: ConsolidationJob) -> str:
    """What a cluster job does after its client stops waiting, for the user."""
    phase = "queued or running"
    try:
        from chkq.tasks.state import job_status

        status = job_status(job.id)
        phase = {"PENDING": "queued", "RUNNING": f"running ({status.phase})"}.get(
            status.state, status.state.lower())
    except Exception:  # noqa: BLE001 - the broker may be what went away
        pass
    return (f"job {job.id} is still {phase} on the cluster: chkq status {job.id} follows "
            f"it, chkq cancel {job.id} cancels it")


def cmd_consolidate(args: argparse.Namespace) -> int:
    from chkq.workers.commit_client import store_retries_reported

    line = ProgressLine(log=args.verbose)

    def retrying(message: str) -> None:
        line.close()
        say(message)

    # The client reads a run in a store (--from) itself before it submits: say each retry
    # of a store that does not answer, as chkq log commit does, instead of waiting silently.
    with store_retries_reported(retrying):
        return _consolidate(args, line)


def _consolidate(args: argparse.Namespace, line: ProgressLine) -> int:
    from chkq.config.celery_app import get_settings
    from chkq.workers.client import run_consolidation, submit_consolidation

    if args.follow:
        return _follow(args, line)
    if args.dry_run:
        from chkq.workers.dry_run import dry_run

        found = dry_run(args.model, args.out_dir, allow_gaps=args.allow_gaps,
                        source=args.source, run=args.run, to=args.to)
        print("\n".join(found.lines()), flush=True)
        return 0
    if args.no_wait:
        if not get_settings().broker_url:
            raise ConfigurationError("--no-wait needs a cluster: set CHKQ_BROKER_URL")
        if args.source is not None:
            from chkq.workers.client import submit_store_consolidation

            job = submit_store_consolidation(args.model, args.source, run=args.run,
                                             to=args.to, cleanup=args.cleanup,
                                             allow_gaps=args.allow_gaps,
                                             verify_data=args.verify_data)
        else:
            job = submit_consolidation(args.model, args.out_dir, args.cleanup,
                                       allow_gaps=args.allow_gaps)
        for warning in job.client_warnings:
            say(f"warning: {warning}")
        print(job.id)
        return 0
    submitted: list[ConsolidationJob] = []
    try:
        summary = run_consolidation(
            args.model, args.out_dir, args.cleanup, workers=args.workers,
            timeout=args.timeout, allow_gaps=args.allow_gaps, source=args.source,
            run=args.run, to=args.to, verify_data=args.verify_data, on_progress=line,
            on_notice=line.notice, on_submitted=submitted.append)
    except Interrupted as exc:
        line.close()
        if get_settings().broker_url and submitted:
            say(f"error: interrupted; {_job_fate(submitted[0])}")
            exc.reported = True
        raise
    finally:
        line.close()
    for warning in summary.warnings:
        say(f"warning: {warning}")
    if args.verbose or line.terminal:
        say(summary.line())
    print(summary.output, flush=True)
    return 0


def _follow(args: argparse.Namespace, line: ProgressLine) -> int:
    """``--follow``: a version of MODEL.h5 after each completed checkpoint, until the end."""
    from chkq.workers.follow import Version, follow_run

    def published(version: Version) -> None:
        line.close()
        say(version.line())

    if args.source is not None:
        from chkq.workers.store_follow import KEEP_VERSIONS_SECONDS, follow_store_run

        keep = KEEP_VERSIONS_SECONDS if args.keep_versions is None else args.keep_versions
        found = follow_store_run(args.model, args.source, to=args.to,
                                 done_file=args.done_file, idle=args.idle,
                                 workers=args.workers, keep_versions=keep,
                                 on_version=published, on_notice=line.notice)
        for warning in found.warnings:
            say(f"warning: {warning}")
        say(found.line())
        print(found.output, flush=True)
        return 0
    try:
        summary = follow_run(args.model, args.out_dir, done_file=args.done_file,
                             idle=args.idle, cleanup=args.cleanup, workers=args.workers,
                             on_version=published)
    finally:
        line.close()
    for warning in summary.warnings:
        say(f"warning: {warning}")
    say(summary.line())
    print(summary.output, flush=True)
    return 0


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse option combinations argparse cannot express (exit 2, as usage errors)."""
    if args.source is None:
        for flag, value in (("--run", args.run), ("--to", args.to),
                            ("--verify-data", args.verify_data or None)):
            if value is not None:
                parser.error(f"consolidate: {flag} needs --from (a run kept in a store)")
    if args.dry_run and args.no_wait:
        parser.error("consolidate: --dry-run submits nothing; --no-wait has nothing to return")
    if args.source is not None and args.out_dir is not None:
        parser.error("consolidate: --out-dir and --from name two different runs; give one")
    if not args.follow:
        for flag, value in (("--done-file", args.done_file), ("--idle", args.idle),
                            ("--keep-versions", args.keep_versions)):
            if value is not None:
                parser.error(f"consolidate: {flag} needs --follow")
        return
    if args.done_file is None and args.idle is None:
        parser.error("consolidate: --follow needs --done-file PATH or --idle SECONDS to know "
                     "when the run has ended")
    if args.source is None and args.keep_versions is not None:
        parser.error("consolidate: --keep-versions needs --from (a follow of a store run)")
    if args.source is not None:
        for flag, value in (("--run", args.run), ("--cleanup", args.cleanup)):
            if value:
                parser.error(f"consolidate: --follow with --from does not take {flag} yet")
    for flag, value in (("--no-wait", args.no_wait),
                        ("--dry-run", args.dry_run), ("--allow-gaps", args.allow_gaps),
                        ("--timeout", args.timeout)):
        if value:
            parser.error(f"consolidate: --follow does not take {flag}")


def register(sub: Any) -> None:
    p = sub.add_parser("consolidate", help="merge a run's HDF5 checkpoints into MODEL.h5",
                       description="Merge the checkpoints MODEL_chkNNNNN.h5 or "
                       "MODEL_chkNNNNN/*.h5 of a run into one verified MODEL.h5 beside them "
                       "(or, with --from, of a run kept in an object store), on the cluster "
                       "CHKQ_BROKER_URL names or, with none set, on an embedded one started "
                       "for the job. Prints the output's path.")
    p.add_argument("model", help="the model name: the MODEL of MODEL_chkNNNNN")
    p.add_argument("--out-dir", type=Path, help="the run's output directory (default: .)")
    p.add_argument("--from", dest="source", metavar="STORE_URL",
                   help="consolidate a run kept in an object store (s3://bucket/prefix/, "
                        "gs://..., file:///dir/): its checkpoint objects, or with --run a "
                        "checkpoint log's run; no shared filesystem needed")
    p.add_argument("--run", help="with --from: the checkpoint log's run to consolidate")
    p.add_argument("--to", metavar="URL",
                   help="with --from: the object to publish the output at (default: "
                        "MODEL.h5 beside the sources, or the log's runs/RUN/outputs/MODEL.h5)")
    p.add_argument("--verify-data", action="store_true",
                   help="with --from: a job spread over the nodes reads every row of its "
                        "output back from the store and compares it with its source before "
                        "publishing it (costs a read of the output and of the sources); a job "
                        "on one node verifies every row anyway, so there it changes nothing")
    p.add_argument("--follow", action="store_true",
                   help="run beside the simulation: after each completed checkpoint, publish "
                   "a new verified version of MODEL.h5 holding every checkpoint so far "
                   "(atomically replaced: a reader always opens one whole version; with "
                   "--from, an object per version under DEST.versions/ and a pointer to it)")
    p.add_argument("--done-file", type=Path, metavar="PATH",
                   help="with --follow: the run has ended once PATH exists (a path on this "
                   "machine, which workers need not see); the final version is then published")
    p.add_argument("--idle", type=positive_float, metavar="SECONDS",
                   help="with --follow: the run has ended after SECONDS without a new "
                   "completed checkpoint")
    p.add_argument("--keep-versions", type=non_negative_float, metavar="SECONDS",
                   help="with --from and --follow: keep the interim versions this long after "
                   "the final one is published, for readers still reading one (default: 30)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete the checkpoints once the output is verified and linked")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="embedded cluster size (default: the CPU count, at most 4; no broker "
                   "configured)")
    p.add_argument("--allow-gaps", action="store_true",
                   help="consolidate even if checkpoint numbers are missing between the first "
                   "and the last (a warning names them); refused otherwise")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--dry-run", action="store_true",
                   help="check the run as the job would and print its checkpoints, files, "
                   "bytes and each dataset's rows; submit, write and delete nothing")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="give up waiting after this long (exit 1; a cluster job goes on)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print progress lines (at each step, and at most every 10 s) and "
                   "what the job did (rows, bytes, time) on stderr where it is not a "
                   "terminal, as in a batch job's log; a terminal shows both anyway")
    p.set_defaults(func=cmd_consolidate, check_usage=check_usage)
