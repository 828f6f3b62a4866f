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
after :data:`LIVENESS_TIMEOUT`): a task whose node does not answer, or
answers but no longer runs it, is shown as on a gone worker, with when the
broker hands its message to another worker.

``chkq cancel JOB`` stops a job on a cluster: it removes the job's messages
still queued in the broker, revokes its tasks (terminating running ones),
removes its temporaries, and records the job as cancelled, which ``chkq
status`` shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.errors import ConfigurationError

if TYPE_CHECKING:  # the module is imported for --help, which must not load Celery
    from chkq.tasks.protocol import JobStatus, UnitState

STEPS = ("plan", "copy", "merge", "verify", "link")

#: Units listed one per line at most, per step, in the detailed view.
MAX_LISTED = 10

#: Seconds ``chkq status`` waits for the workers running a job's tasks to answer.
LIVENESS_TIMEOUT = 1.5


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "?"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


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
    copied, verified, total = status.rows
    lines = [f"job {status.job}: {status.state} ({status.phase})"]
    if status.model:
        lines.append(f"  model {status.model!r} in {status.out_dir}, "
                     f"submitted {_when(status.submitted)}")
    if status.output:
        lines.append(f"  output {status.output}")
    if status.rows_written is not None:
        size = (f", {status.bytes_written / 1e6:,.1f} MB" if status.bytes_written is not None
                else "")
        took = f" in {status.seconds:.1f} s" if status.seconds is not None else ""
        lines.append(f"  wrote {status.rows_written:,} rows from {status.files_read:,} files"
                     f"{size}{took}")
    for warning in status.warnings:
        lines.append(f"  warning: {warning}")
    if status.cancelled is not None:
        lines.append(f"  cancelled {_when(status.cancelled)}")
    if total:
        lines.append(f"  rows copied {copied:,}/{total:,}, verified {verified:,}/{total:,}")
    for step in STEPS:
        units = status.steps.get(step, [])
        if step in ("copy", "verify"):
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
                     f"{_when(s.submitted):<19}  {where}" + (f": {detail}" if detail else ""))
    return "\n".join(lines)


def recent_statuses(limit: int) -> list[JobStatus]:
    """Statuses of the ``limit`` most recently submitted jobs (expired ones left out)."""
    from chkq.tasks.protocol import job_status, recent_jobs

    found = []
    for job in recent_jobs(limit):
        try:
            found.append(job_status(job))
        except (LookupError, ValueError):
            continue
    return found


def _running(statuses: list[JobStatus]) -> list[UnitState]:
    return [u for s in statuses for units in s.steps.values() for u in units
            if u.state in ("STARTED", "PROGRESS") and u.worker]


def check_workers(statuses: list[JobStatus]) -> str | None:
    """Mark the running tasks of ``statuses`` whose worker is gone, and when they run again.

    One ``inspect active`` to the nodes the tasks name, nothing when no task
    runs. A node that does not answer within :data:`LIVENESS_TIMEOUT` is
    gone; one that answers but does not run the task (its pool process died,
    or the node restarted under the same name) no longer runs it, once the
    task's state, read again after the answers, still names that node and
    process: a task that ended or moved meanwhile is shown as it is now.

    Returns
    -------
    str or None
        A warning for people when the workers could not be asked (the broker
        unreachable): the tasks are then shown as their states say.
    """
    from kombu.exceptions import OperationalError

    from chkq.config.celery_app import get_app
    from chkq.tasks.protocol import unit_states

    units = _running(statuses)
    if not units:
        return None
    nodes = sorted({str(u.worker) for u in units})
    try:
        replies = get_app().control.inspect(destination=nodes, timeout=LIVENESS_TIMEOUT,
                                            limit=len(nodes)).active() or {}
    except (OperationalError, OSError) as exc:
        return (f"could not ask the workers whether they still run these tasks: the broker "
                f"is unreachable ({type(exc).__name__}: {exc})")
    suspects: list[UnitState] = []
    for unit in units:
        if unit.worker not in replies:
            unit.worker_gone = "not answering"
            suspects.append(unit)
            continue
        active = replies.get(str(unit.worker)) or []
        if not any(isinstance(t, dict) and t.get("id") == unit.task_id for t in active):
            unit.worker_gone = "it answers but does not run the task"
            suspects.append(unit)
    if not suspects:
        return None
    now = unit_states([u.task_id for u in suspects])
    for unit in suspects:
        again = now[unit.task_id]
        if (again.state, again.worker, again.pid) != (unit.state, unit.worker, unit.pid):
            vars(unit).update(vars(again))  # it moved or ended meanwhile: show it as it is
    gone = [u for u in suspects if u.worker_gone]
    if gone:
        _redelivery(gone)
    return None


def _redelivery(units: list[UnitState]) -> None:
    """Say when the broker hands the messages of ``units`` (tasks of gone workers) out again.

    RabbitMQ returns a consumer's unacknowledged messages to their queue as
    soon as its connection closes: at once when the worker's process died,
    within about two heartbeats when its host went silent. Redis keeps a
    delivered message in its unacknowledged index, stamped with the moment
    of delivery, until a live worker's sweep finds it older than the
    visibility timeout.
    """
    from chkq.config.celery_app import get_app, get_settings
    from chkq.config.settings import AMQP_SCHEMES, broker_scheme

    settings = get_settings()
    if broker_scheme(get_app().conf.broker_url) in AMQP_SCHEMES:
        within = (f"within ~{2 * settings.broker_heartbeat} s (two heartbeats)"
                  if settings.broker_heartbeat else "when TCP gives up (heartbeats are off)")
        for unit in units:
            unit.redelivery = ("RabbitMQ redelivers it once the worker's connection is closed: "
                               f"at once if its process died, {within} if its host went silent")
        return
    import redis

    try:
        delivered, queued = _redis_held({u.task_id for u in units})
    except (redis.RedisError, OSError) as exc:
        for unit in units:
            unit.redelivery = f"when is unknown: the broker could not be read ({exc})"
        return
    now = time.time()
    for unit in units:
        if unit.task_id in queued:
            unit.redelivery = "back in its queue: the next free worker runs it"
        elif unit.task_id in delivered:
            by = delivered[unit.task_id] + settings.takeover_bound
            unit.redelivered_by = by
            timeout = f"the broker's visibility timeout, {settings.visibility_timeout} s"
            unit.redelivery = (
                f"redelivered by {_when(by)}, in ~{round(by - now)} s ({timeout}, swept by a "
                "running worker)" if by > now else
                f"overdue since {_when(by)} ({timeout}): the next worker to start redelivers it")
        else:
            unit.redelivery = "its message is neither queued nor held by the broker"


def _redis_held(tasks: set[str]) -> tuple[dict[str, float], set[str]]:
    """Of ``tasks``: when each delivered but unacknowledged message was delivered, and
    which wait in a queue, read from kombu's Redis transport (its ``unacked`` hash of
    ``[message, exchange, routing key]`` by delivery tag, its ``unacked_index`` of
    delivery times, and the queues' lists)."""
    import redis

    from chkq.config.celery_app import get_app

    client = redis.Redis.from_url(get_app().conf.broker_url)
    delivered: dict[str, float] = {}
    try:
        for tag, raw in client.hscan_iter("unacked", count=1000):
            try:
                task = json.loads(raw)[0].get("headers", {}).get("id")
            except (ValueError, AttributeError, IndexError, KeyError, TypeError):
                continue
            if isinstance(task, str) and task in tasks:
                score = client.zscore("unacked_index", tag)
                if score is not None:
                    delivered[task] = max(delivered.get(task, 0.0), float(score))
        queued = {task for _, _, task in _redis_queued(client) if task in tasks}
    finally:
        client.close()
    return delivered, queued


def _warn(warning: str | None) -> None:
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    """``chkq status [JOB]``."""
    from chkq.config.celery_app import get_settings
    from chkq.tasks.protocol import job_status, resolve_job

    if not get_settings().broker_url:
        raise ConfigurationError("chkq status needs a cluster: set CHKQ_BROKER_URL")
    if args.job is None:
        statuses = recent_statuses(args.limit)
        _warn(check_workers(statuses))
        if args.json:
            print(json.dumps([asdict(s) for s in statuses], indent=2, default=str))
        else:
            print(format_recent(statuses))
        return 0
    status = job_status(resolve_job(args.job))
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


#: How long ``chkq cancel`` waits for the job's running tasks to stop.
CANCEL_WAIT_SECONDS = 15.0


def job_task_ids(job: str, plan: dict[str, Any] | None) -> list[str]:
    """Every task and group id the job has or will have (as far as its plan tells)."""
    from chkq.tasks.consolidate import task_id

    ids = [task_id(job, "plan"), task_id(job, "merge"), job, f"{job}-copies", f"{job}-verifies"]
    if plan:
        ids += [task_id(job, "copy", n) for n in range(int(plan.get("copy_units") or 0))]
        ids += [task_id(job, "verify", n) for n in range(int(plan.get("verify_units") or 0))]
    return ids


def _of_job(task: str, job: str) -> bool:
    return task == job or task.startswith(job + "-")


def purge_queued(job: str) -> int:
    """Remove the job's messages still waiting in the broker's queues; return how many.

    A revoke reaches only the workers alive now: a message left in a queue
    would run on a worker started later.
    """
    from chkq.config.celery_app import get_app
    from chkq.config.settings import AMQP_SCHEMES, broker_scheme

    if broker_scheme(get_app().conf.broker_url) in AMQP_SCHEMES:
        return _purge_amqp(job)
    return _purge_redis(job)


def _redis_queued(client: Any) -> Iterator[tuple[bytes, bytes, str]]:
    """``(list key, raw message, task id)`` of every message waiting in chkq's queues.

    kombu's Redis transport keeps each queue as lists (one per priority step)
    of JSON messages whose headers carry the task id.
    """
    from chkq.config.routing import QUEUES

    for queue in QUEUES:
        keys = [k for k in client.scan_iter(match=f"{queue}*", count=1000)
                if k.decode(errors="replace") == queue
                or k.decode(errors="replace").startswith(queue + "\x06\x16")]
        for key in keys:
            for raw in client.lrange(key, 0, -1):
                try:
                    task = json.loads(raw).get("headers", {}).get("id", "")
                except (ValueError, AttributeError):
                    continue
                if isinstance(task, str):
                    yield key, raw, task


def _purge_redis(job: str) -> int:
    """Remove the job's messages from the queues' lists in Redis."""
    import redis

    from chkq.config.celery_app import get_app

    client = redis.Redis.from_url(get_app().conf.broker_url)
    removed = 0
    try:
        for key, raw, task in list(_redis_queued(client)):
            if _of_job(task, job):
                removed += int(client.lrem(key, 0, raw))  # type: ignore[arg-type]
    finally:
        client.close()
    return removed


def _purge_amqp(job: str) -> int:
    """Take every message waiting in chkq's RabbitMQ queues, keep the job's, hand back the rest.

    AMQP removes a message only by acknowledging it, so each queue's
    messages are fetched one by one (``basic.get``, as many as the queue
    held when the sweep began) and held unacknowledged: the job's are then
    acknowledged (removed), every other one is returned to its queue
    (``basic.reject`` with requeue). Should this process die meanwhile, RabbitMQ
    returns all it held when its connection closes: no message is lost, and
    for the sweep's few seconds other workers merely do not see them.
    Messages that workers hold reserved are out of reach here; the revoke
    that :func:`cancel_job` broadcasts drops those.
    """
    from chkq.config.celery_app import get_app
    from chkq.config.routing import task_queues

    removed = 0
    with get_app().connection_for_write() as connection:
        channel = connection.default_channel
        for queue in task_queues(quorum=True):
            bound = queue.bind(channel)
            try:
                _, waiting, _ = bound.queue_declare(passive=True)
            except connection.channel_errors:
                channel = connection.channel()  # a queue never declared: nothing queued
                continue
            others: list[Any] = []
            for _ in range(waiting):
                message = bound.get(no_ack=False)
                if message is None:
                    break
                task = (message.headers or {}).get("id")
                if isinstance(task, str) and _of_job(task, job):
                    message.ack()
                    removed += 1
                else:
                    others.append(message)
            for message in others:
                message.requeue()
    return removed


def _running_tasks(job: str) -> list[str]:
    """Ids of the job's tasks that live workers are running or hold reserved."""
    from chkq.config.celery_app import get_app

    inspect = get_app().control.inspect(timeout=1.0)
    found = []
    for replies in (inspect.active() or {}, inspect.reserved() or {}):
        for tasks in replies.values():
            found += [t["id"] for t in tasks or [] if _of_job(str(t.get("id")), job)]
    return found


def cancel_job(job: str) -> str:
    """Cancel consolidation job ``job`` on the cluster; return what was done, for people.

    Order matters: record the cancellation first (so nothing takes it for a
    lost job), remove queued messages, revoke and terminate running tasks,
    wait for them to stop, then remove the temporaries they were writing.

    Raises
    ------
    LookupError
        Unknown job.
    ValueError
        The job already finished or failed: there is nothing to cancel.
    """
    from chkq.config.celery_app import get_app
    from chkq.consolidation.temporaries import JobFiles, discard_job_files
    from chkq.tasks.protocol import job_status, record_cancelled

    status = job_status(job)
    if status.state == "SUCCESS":
        raise ValueError(f"job {job} already finished ({status.output}): nothing to cancel")
    if status.state == "FAILURE":
        raise ValueError(f"job {job} already failed ({status.error}): nothing to cancel")
    if status.state == "CANCELLED":
        return f"job {job} was already {status.error}"
    record_cancelled(job)
    purged, revoked, stopped = 0, set[str](), set[str]()
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    running: set[str] = set()
    while True:
        # The plan may finish meanwhile and launch copies: look again until all is still.
        current = job_status(job)
        ids = [i for i in job_task_ids(job, current.plan) if i not in revoked]
        purged += purge_queued(job)
        if ids:
            get_app().control.revoke(ids, terminate=True, signal="SIGTERM")
            revoked.update(ids)
        running = set(_running_tasks(job)) | {
            u.task_id for units in current.steps.values() for u in units
            if u.state in ("STARTED", "PROGRESS", "RETRY")}
        stopped |= running
        if (not running and not ids) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    get_app().backend.mark_as_revoked(job, reason="cancelled")
    removed: list[Path] = []
    where = ""
    if status.out_dir and status.model:
        try:
            removed = discard_job_files(JobFiles(Path(status.out_dir), status.model, job))
        except OSError as exc:
            where = f"; its temporaries in {status.out_dir} could not be removed here ({exc})"
    still = f", {len(running)} still stopping" if running else ""
    return (f"cancelled job {job}: {purged} queued tasks removed, {len(stopped)} running tasks "
            f"stopped{still}, {len(removed)} temporary files removed{where}")


def cmd_cancel(args: argparse.Namespace) -> int:
    """``chkq cancel JOB``."""
    from chkq.config.celery_app import get_settings
    from chkq.tasks.protocol import resolve_job

    if not get_settings().broker_url:
        raise ConfigurationError("chkq cancel needs a cluster: set CHKQ_BROKER_URL (a job of the "
                         "embedded cluster ends with its command)")
    print(cancel_job(resolve_job(args.job)))
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
