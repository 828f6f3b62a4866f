"""``chkq status [JOB]``: where consolidation jobs stand, read from the result backend.

A job's steps have deterministic task ids (``JOB-plan``, ``JOB-copy-N``,
``JOB-merge``, ``JOB-verify-N``, and ``JOB`` for the link), so one ``MGET``
of their results tells which steps are done, which are running (with the
rows done of their ``PROGRESS`` state), which failed, and why.

With a job id (or its first 8 or more digits, as long as they name one
job), ``chkq status`` prints that job step by step: for a finished job also
what it wrote, how long it took and its warnings; without, one line for each
recent job. A failed or cancelled job also prints ``error: ...`` on stderr
and exits 1, like ``chkq consolidate``; an unknown job exits 1.

A task recorded as running names the worker node that started it. When
anything runs, ``chkq status`` asks those nodes, once and only them, which
tasks they run (a broadcast that returns as soon as all have answered, or
after :data:`chkq.workers.liveness.LIVENESS_TIMEOUT`): a task whose node does not answer, or
answers but no longer runs it, is shown as on a gone worker, with when the
broker hands its message to another worker.

``chkq cancel JOB`` stops a job on a cluster (:func:`chkq.workers.cancel.cancel_job`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from chkq.errors import ConfigurationError

if TYPE_CHECKING:  # the module is imported for --help, which must not load Celery
    from chkq.jobs.status import FollowStatus, JobStatus, UnitState

STEPS = ("plan", "copy", "part", "merge", "verify", "link")

#: Units listed one per line at most, per step, in the detailed view.
MAX_LISTED = 10

def _summary(units: list[UnitState]) -> str:
    counts: dict[str, int] = {}
    for unit in units:
        counts[unit.state] = counts.get(unit.state, 0) + 1
    lost = sum(1 for unit in units if unit.worker_gone)
    words = {"SUCCESS": "done", "PROGRESS": "running", "STARTED": "running",
             "FAILURE": "failed", "PENDING": "pending", "RETRY": "retrying"}
    merged: dict[str, int] = {"on a gone worker": lost} if lost else {}
    for state, n in counts.items():
        word = words.get(state, state.lower())
        merged[word] = merged.get(word, 0) + n - (lost if word == "running" else 0)
    merged = {w: n for w, n in merged.items() if n}
    order = ["done", "running", "on a gone worker", "failed", "retrying", "pending"]
    parts = [f"{merged.pop(w)} {w}" for w in order if w in merged]
    parts += [f"{n} {w}" for w, n in merged.items()]
    return f"{len(units)} tasks: " + ", ".join(parts) if units else "no tasks yet"


def _where(unit: UnitState) -> str:
    """`` on celery@host`` and, for a gone worker, why and when the task runs again."""
    if not unit.worker:
        return ""
    where = f" on {unit.worker}"
    if unit.worker_gone:
        where += f" (worker gone: {unit.worker_gone}; {unit.redelivery})"
    return where


def _unit_line(unit: UnitState) -> str:
    name = unit.task_id.split("-", 1)[1] if "-" in unit.task_id else "link"
    line = f"    {name:<12} {unit.state:<9}"
    if unit.state == "FAILURE":
        return f"{line} {unit.error}"
    if unit.done is not None and unit.total is not None:
        line += f" {unit.done:,}/{unit.total:,} rows"
    return line + _where(unit)


def format_job(status: JobStatus) -> str:
    """The detailed, multi-line view of one job."""
    from chkq.jobs.status import rows_phrase, when

    copied, verified, total = status.rows
    lines = [f"job {status.job}: {status.state} ({status.phase})"]
    if status.model:
        lines.append(f"  model {status.model!r} in {status.out_dir}, "
                     f"submitted {when(status.submitted)}")
    if status.output:
        lines.append(f"  output {status.output}")
    if status.spread:
        lines.append("  spread over every node: the output is assembled in the store from "
                     f"{len(status.steps.get('part', []))} parts"
                     + (", every row read back before it is published (--verify-data)"
                        if status.verify_data else ""))
    elif status.queue:
        lines.append(f"  on one node: {status.queue.removeprefix('chkq.node.')} fetches, "
                     "consolidates and publishes it")
    if status.follow:
        lines.append(f"  version {status.follow.get('version')} of follow "
                     f"{str(status.follow.get('follow'))[:8]}: checkpoints up to "
                     f"{status.follow.get('through')} (chkq status lists the follow)")
    if status.rows_written is not None:
        size = (f", {status.bytes_written / 1e6:,.1f} MB" if status.bytes_written is not None
                else "")
        took = f" in {status.seconds:.1f} s" if status.seconds is not None else ""
        lines.append(f"  wrote {rows_phrase(status.datasets_written, status.rows_written)} "
                     f"from {status.files_read:,} files{size}{took}")
        named = list(status.datasets_written.items())
        for name, rows in named[:MAX_LISTED]:
            lines.append(f"    {name} {rows:,} rows")
        if len(named) > MAX_LISTED:
            lines.append(f"    ... and {len(named) - MAX_LISTED} more datasets")
    for warning in status.warnings:
        lines.append(f"  warning: {warning}")
    if status.cancelled is not None:
        lines.append(f"  cancelled {when(status.cancelled)}")
    if total:
        lines.append(f"  rows copied {copied:,}/{total:,}, verified {verified:,}/{total:,}"
                     " (over every dataset)")
    for step in STEPS:
        units = status.steps.get(step, [])
        if ((step == "part") != status.spread and step in ("copy", "part", "merge", "verify")
                and not (step == "verify" and status.verify_data)):
            continue
        if step in ("copy", "verify", "part"):
            lines.append(f"  {step:<8} {_summary(units)}")
            shown = [u for u in units if u.state not in ("SUCCESS", "PENDING")]
            for unit in shown[:MAX_LISTED]:
                lines.append(_unit_line(unit))
            if len(shown) > MAX_LISTED:
                lines.append(f"    ... and {len(shown) - MAX_LISTED} more")
            continue
        if not units:
            lines.append(f"  {step:<8} PENDING")
            continue
        unit = units[0]
        detail = f" {unit.error}" if unit.state == "FAILURE" else ""
        if unit.error and unit.error.startswith("ChordError"):
            detail = " (not run: a task it waits for failed)"
        if step == "plan" and status.plan:
            p = status.plan
            detail = (f" {p.get('files')} files, {p.get('rows', 0):,} rows, "
                      f"{p.get('copy_units')} copy and {p.get('verify_units')} verify tasks")
        lines.append(f"  {step:<8} {unit.state}{detail}{_where(unit)}")
    if status.state == "FAILURE":
        lines.append(f"  failed task: {status.failed_task}")
        lines.append(f"  reason: {status.error}")
    return "\n".join(lines)


def format_recent(statuses: list[JobStatus]) -> str:
    """One line per job, newest first."""
    from chkq.jobs.status import when

    if not statuses:
        return "no recent jobs"
    state_width = max(len("STATE"), *(len(s.state) for s in statuses))
    phase_width = max(len("PHASE"), *(len(s.phase) for s in statuses))
    lines = [f"{'JOB':<32}  {'STATE':<{state_width}} {'PHASE':<{phase_width}} "
             f"{'SUBMITTED':<19}  MODEL / DETAIL"]
    for s in statuses:
        copied, verified, total = s.rows
        if s.state == "SUCCESS":
            detail = (s.output or "") + (f" ({len(s.warnings)} warnings)" if s.warnings else "")
        elif s.state == "CANCELLED":
            detail = s.error or "cancelled"
        elif s.state == "FAILURE":
            detail = f"{s.failed_task}: {s.error}"
        elif total:
            detail = f"copied {copied:,}/{total:,}, verified {verified:,}/{total:,} rows"
        else:
            detail = ""
        lost = sum(1 for units in s.steps.values() for u in units if u.worker_gone)
        if lost:
            detail += (", " if detail else "") + f"{lost} tasks on a gone worker"
        where = f"{s.model} in {s.out_dir}" if s.model else ""
        lines.append(f"{s.job:<32}  {s.state:<{state_width}} {s.phase:<{phase_width}} "
                     f"{when(s.submitted):<19}  {where}" + (f": {detail}" if detail else ""))
    return "\n".join(lines)


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def format_follows(follows: list[FollowStatus], now: float) -> str:
    """A few lines per follow: its state, what is published, and how far behind the run it is."""
    from chkq.jobs.status import when

    lines = ["follows:"]
    for f in follows:
        if f.ended is not None:
            state = (f"finished {when(f.ended)}" if f.outcome == "done"
                     else f"stopped {when(f.ended)}: {f.outcome}")
        else:
            state = "running, or killed (no end recorded)"
        lines.append(f"  follow {f.follow[:8]} of {f.model} in {f.out_dir}: {state}; "
                     f"started {when(f.started)}")
        if f.through is None:
            lines.append("    no version published yet")
        else:
            latest = [j for j in f.jobs if j.state == "SUCCESS"][-1]
            lines.append(f"    {_plural(f.versions, 'version')} published, the latest through "
                         f"checkpoint {f.through} at {when(f.published)} (job {latest.job}): "
                         f"{f.output}")
        if f.running is not None:
            lines.append(f"    version {(f.running.follow or {}).get('version')} under way: "
                         f"job {f.running.job} ({f.running.phase})")
        if f.failed is not None:
            lines.append(f"    version {(f.failed.follow or {}).get('version')} failed: job "
                         f"{f.failed.job}: {f.failed.error}")
        waiting, newest = f.waiting, f.newest_complete
        if f.complete is None:
            lines.append("    lag: unknown (the run directory cannot be read here)")
        elif waiting:
            lines.append(f"    lag: {_plural(len(waiting), 'checkpoint')} complete but in no "
                         "version yet "
                         f"({waiting[0][0]}..{waiting[-1][0]}), the oldest complete for "
                         f"{_age(now - waiting[0][1])}")
        elif newest is not None:
            lines.append(f"    lag: none: the newest complete checkpoint, {newest[0]} "
                         f"(completed {_age(now - newest[1])} ago), is in the latest version")
        else:
            lines.append("    lag: none: the run directory holds no checkpoints now "
                         "(deleted by --cleanup, or moved)")
    return "\n".join(lines)


def complete_checkpoints(out_dir: str, model: str) -> list[tuple[int, float]] | None:
    """The run's complete checkpoints as this host sees them, or None if it cannot read them."""
    from chkq.consolidation.versions import completed_checkpoints
    from chkq.errors import ChkqError

    try:
        return completed_checkpoints(out_dir, model)
    except (OSError, ChkqError):
        return None


def recent_statuses(limit: int) -> list[JobStatus]:
    """Statuses of the ``limit`` most recently submitted jobs (expired ones left out)."""
    from chkq.tasks.state import job_status, records

    found = []
    for job in records().recent_jobs(limit):
        try:
            found.append(job_status(job))
        except (LookupError, ValueError):
            continue
    return found


def _warn(warning: str | None) -> None:
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    """``chkq status [JOB]``."""
    from chkq.config.celery_app import get_settings
    from chkq.tasks.state import job_status, records
    from chkq.workers.liveness import check_workers

    if not get_settings().broker_url:
        raise ConfigurationError("chkq status needs a cluster: set CHKQ_BROKER_URL")
    if args.job is None:
        statuses = recent_statuses(args.limit)
        _warn(check_workers(statuses))
        if args.json:
            print(json.dumps([asdict(s) for s in statuses], indent=2, default=str))
        else:
            import time

            from chkq.jobs.status import follow_statuses

            print(format_recent(statuses))
            follows = follow_statuses(statuses, complete_checkpoints)
            if follows:
                print(format_follows(follows, time.time()))
        return 0
    status = job_status(records().resolve_job(args.job))
    _warn(check_workers([status]))
    print(json.dumps(asdict(status), indent=2, default=str) if args.json else format_job(status))
    sys.stdout.flush()
    if status.state == "FAILURE":
        print(f"error: job {status.job} failed in {status.failed_task}: {status.error}",
              file=sys.stderr)
        return 1
    if status.state == "CANCELLED":
        print(f"error: job {status.job} was {status.error}", file=sys.stderr)
        return 1
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """``chkq cancel JOB``."""
    from chkq.config.celery_app import get_settings
    from chkq.tasks.state import records

    if not get_settings().broker_url:
        raise ConfigurationError("chkq cancel needs a cluster: set CHKQ_BROKER_URL (a job of the "
                         "embedded cluster ends with its command)")
    from chkq.workers.cancel import cancel_job

    print(cancel_job(records().resolve_job(args.job)))
    return 0


def register(sub: Any) -> None:
    """Add ``chkq status [JOB] [--limit N] [--json]`` and ``chkq cancel JOB``."""
    p = sub.add_parser(
        "status", help="show a job's steps (done, running, failed and why), or recent jobs",
        description="Read the state of consolidation jobs from the result backend "
        "(CHKQ_RESULT_BACKEND or CHKQ_BROKER_URL). Exit status 1 if JOB failed or is unknown.")
    p.add_argument("job", nargs="?", help="job id, or its first 8 or more digits "
                   "(default: list the recent jobs)")
    p.add_argument("--limit", type=_positive, default=20,
                   help="recent jobs to list (default: 20)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "cancel", help="cancel a job: revoke its tasks, remove its temporaries",
        description="Cancel a consolidation job on the cluster: remove its queued tasks, "
        "terminate its running ones, remove its temporary files, and record it as "
        "cancelled (chkq status shows it). Its checkpoints are never touched.")
    p.add_argument("job", help="job id, or its first 8 or more digits")
    p.set_defaults(func=cmd_cancel)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
