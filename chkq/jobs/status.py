"""The status read model: what ``chkq status`` and a waiting client know of a job.

Read from the job's records and from each task's stored result; the stored
results are untrusted input (a name that is not a node name is dropped).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from chkq.consolidation.temporaries import check_job_id
from chkq.errors import JobNotFoundError
from chkq.jobs.records import JobRecords, task_id

#: Reads the stored result metadata of task ids (None: nothing stored).
MetaReader = Callable[[list[str]], dict[str, "dict[str, Any] | None"]]


class JobState(StrEnum):
    """Where a job is in its life."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    CANCELLED = "CANCELLED"


class Phase(StrEnum):
    """What a job is doing (or why it stopped)."""

    QUEUED = "queued"
    FETCHING = "fetching"
    PLANNING = "planning"
    COPYING = "copying"
    MERGING = "merging"
    VERIFYING = "verifying"
    LINKING = "linking"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

@dataclass
class UnitState:
    """The stored state of one task of a job.

    Attributes
    ----------
    task_id
        Its id (``JOB-copy-3``...).
    state
        Celery state: PENDING (not started, or unknown), STARTED, PROGRESS,
        SUCCESS, FAILURE...
    done, total
        Rows done and to do, from a PROGRESS state or a result.
    error, error_type
        ``Type: message`` of the exception of a failed task, and its type.
    worker, pid
        The worker node (``celery@host``) and pool process that last recorded the
        task as started or in progress; None when not recorded or not a node name.
    worker_gone
        Why that worker is taken for gone (``not answering``...), or None: it
        runs the task, or nobody looked (see ``chkq.workers.cli.status``).
    redelivery, redelivered_by
        For a task of a gone worker: when the broker hands its message to another
        worker, for people, and as seconds since the epoch when the broker's
        records give the moment (Redis), else None.
    """

    task_id: str
    state: str
    done: int | None = None
    total: int | None = None
    error: str | None = None
    error_type: str | None = None
    worker: str | None = None
    pid: int | None = None
    worker_gone: str | None = None
    redelivery: str | None = None
    redelivered_by: float | None = None


@dataclass
class JobStatus:
    """Everything ``chkq status JOB`` shows about one job."""

    job: str
    state: JobState
    phase: Phase
    model: str | None = None
    out_dir: str | None = None
    submitted: float | None = None
    output: str | None = None
    error: str | None = None
    failed_task: str | None = None
    plan: dict[str, Any] | None = None
    steps: dict[str, list[UnitState]] = field(default_factory=dict)
    finished: float | None = None
    seconds: float | None = None
    rows_written: int | None = None
    datasets_written: dict[str, int] = field(default_factory=dict)
    files_read: int | None = None
    bytes_written: int | None = None
    warnings: list[str] = field(default_factory=list)
    cancelled: float | None = None
    queue: str | None = None
    """For a job from an object store, the queue of the worker holding it (all its steps)."""
    follow: dict[str, Any] | None = None
    """For a version of a follow, its follow record (see :meth:`JobRecords.record_follow`)."""
    spread: bool = False
    """For a job from an object store, whether it is spread over every node (its output
    assembled in the store from parts) rather than done on the worker of :attr:`queue`."""
    verify_data: bool = False
    """For a spread job, whether its rows are read back before it publishes (``--verify-data``):
    its verify units are then the plan's file batches, without the one-node whole-output check."""

    @property
    def rows(self) -> tuple[int, int, int]:
        """Rows copied and verified so far, and the job's total, over every dataset.

        The rows of variable-length datasets are copied by the merge, not by
        copy tasks: they count as copied once the merge is done.
        """
        plan = self.plan or {}
        total = _count(plan.get("rows"))
        copied = sum(u.done or 0 for u in self.steps.get("copy", []))
        merge = self.steps.get("merge", [])
        if (merge and merge[0].state == "SUCCESS") or self.phase in _MERGED_PHASES:
            copied += _count(plan.get("whole_rows"))
        verified = sum(u.done or 0 for u in self.steps.get("verify", []))
        return min(copied, total), verified, total

    @property
    def records(self) -> int:
        """Rows of the job's longest dataset: what a user counts (trials, events)."""
        return _count((self.plan or {}).get("records"))


#: Phases of a job whose merge is done.
_MERGED_PHASES = ("verifying", "linking", "done")


def _count(value: Any) -> int:
    """``value`` if it is a count (a non-negative int) of a stored result, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def dataset_rows(done: dict[str, Any]) -> dict[str, int]:
    """Each dataset's rows in a finished job's result (``{}`` where it holds none)."""
    datasets = done.get("datasets")
    if not isinstance(datasets, dict):
        return {}
    return {str(name): _count(rows) for name, rows in list(datasets.items())[:100_000]}


def rows_phrase(datasets: dict[str, int], rows: int) -> str:
    """What an output holds as a user counts it: ``5 datasets of 220,000 rows``.

    The rows of the longest dataset are the records a user counts (trials,
    events), not the sum over datasets; ``rows`` (that sum) is said only
    when the datasets are not known (a result of an older worker).
    """
    if not datasets:
        return f"{rows:,} rows"
    longest = max(datasets.values())
    if len(datasets) == 1:
        return f"{longest:,} rows"
    equal = "" if len(set(datasets.values())) == 1 else "up to "
    return f"{len(datasets):,} datasets of {equal}{longest:,} rows"


def describe_error(exc: Any) -> str:
    """``Type: message`` of a stored exception (first line of the message)."""
    if isinstance(exc, BaseException):
        message = (str(exc) or "").splitlines()
        return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    if isinstance(exc, dict) and "exc_type" in exc:
        return f"{exc['exc_type']}: {exc.get('exc_message')}"
    return repr(exc)


#: What a worker node name may look like (``celery@host``, ``chkq-3@node12.site``).
_NODE_NAME = re.compile(r"[\w.+-]{1,100}@[\w.-]{1,155}")

#: States of a task that a worker runs now.
RUNNING_STATES = ("STARTED", "PROGRESS")


def _worker_of(result: dict[str, Any]) -> tuple[str | None, int | None]:
    """The worker node and pool pid a STARTED or PROGRESS meta names.

    The meta is untrusted input: a name that does not look like a node name
    is dropped, so nothing else is shown or asked for.
    """
    hostname, pid = result.get("hostname"), result.get("pid")
    if not isinstance(hostname, str) or not _NODE_NAME.fullmatch(hostname):
        return None, None
    return hostname, pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _unit(task_id: str, meta: dict[str, Any] | None) -> UnitState:
    if meta is None:
        return UnitState(task_id, "PENDING")
    state, result = meta.get("status", "PENDING"), meta.get("result")
    unit = UnitState(task_id, state)
    if state == "FAILURE":
        unit.error = describe_error(result)
        unit.error_type = unit.error.split(":", 1)[0]
    elif isinstance(result, dict):
        done = result.get("done", result.get("rows"))
        unit.done = int(done) if isinstance(done, int) else None
        total = result.get("total", result.get("rows"))
        unit.total = int(total) if isinstance(total, int) else None
        if state in RUNNING_STATES:
            unit.worker, unit.pid = _worker_of(result)
    return unit


def unit_states(fetch_metas: MetaReader, task_ids: list[str]) -> dict[str, UnitState]:
    """The stored state of each of ``task_ids`` now (one read)."""
    return {t: _unit(t, meta) for t, meta in fetch_metas(task_ids).items()}


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of a stored ``date_done`` (ISO text or datetime), or None."""
    if isinstance(value, datetime.datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _add_summary(status: JobStatus, done: dict[str, Any], link_meta: dict[str, Any] | None
                 ) -> None:
    """Fill in what a finished job wrote, how long it took, and its warnings."""
    status.rows_written = _count(done.get("rows"))
    status.datasets_written = dataset_rows(done)
    status.files_read = int(done.get("files") or 0)
    status.warnings = [str(w) for w in done.get("warnings") or []]
    try:
        status.bytes_written = Path(str(done.get("output"))).stat().st_size
    except OSError:
        status.bytes_written = None
    status.finished = _timestamp((link_meta or {}).get("date_done"))
    if status.finished is not None and status.submitted is not None:
        status.seconds = max(0.0, status.finished - status.submitted)


def job_status(records: JobRecords, fetch_metas: MetaReader, job: str) -> JobStatus:
    """Read the state of consolidation job ``job`` from its records and its tasks' results.

    Raises
    ------
    LookupError
        If the backend knows nothing of ``job`` (never submitted, or expired).
    """
    check_job_id(job)
    info = records.job_info(job) or {}
    plan_id, stage_id = task_id(job, "plan"), task_id(job, "stage")
    first = fetch_metas([plan_id, task_id(job, "merge"), job, stage_id])
    plan_meta, merge_meta, link_meta = first[plan_id], first[task_id(job, "merge")], first[job]
    stored = records.store_job_record(job)
    plan = plan_meta.get("result") if plan_meta and plan_meta.get("status") == "SUCCESS" else None
    plan = plan if isinstance(plan, dict) else None
    if not info and plan_meta is None and link_meta is None:
        raise JobNotFoundError(f"no job {job} in the result backend (never submitted, or expired)")

    steps: dict[str, list[UnitState]] = {"plan": [_unit(plan_id, plan_meta)]}
    spread = bool(stored and stored.get("spread") is True)
    for step, count_key in (("copy", "copy_units"), ("verify", "verify_units")):
        count = int(plan.get(count_key) or 0) if plan else 0
        if spread and step == "verify":
            count = max(0, count - 1)
        ids = [task_id(job, step, n) for n in range(count)]
        metas = fetch_metas(ids) if ids else {}
        steps[step] = [_unit(t, metas[t]) for t in ids]
    steps["merge"] = [_unit(task_id(job, "merge"), merge_meta)]
    assembly = records.assembly(job) if stored and stored.get("spread") is True else None
    parts = assembly.get("parts") if assembly else None
    if isinstance(parts, list):
        ids = [task_id(job, "part", n) for n in range(len(parts))]
        metas = fetch_metas(ids) if ids else {}
        steps["part"] = [_unit(t, metas[t]) for t in ids]

    status = JobStatus(job=job, state=JobState.PENDING, phase=Phase.QUEUED, model=info.get("model"),
                       out_dir=info.get("out_dir"), submitted=info.get("submitted"),
                       plan=plan, steps=steps,
                       queue=str(stored.get("queue")) if stored else None)
    status.follow = records.follow_record(job)
    status.spread = spread
    status.verify_data = spread and bool(stored and stored.get("verify_data") is True)
    done = records.finished_result(job)
    link = _unit(job, link_meta)
    causes = [(step, u) for step in ("plan", "copy", "merge", "verify") for u in steps[step]
              if u.state == "FAILURE"]
    real = [(s, u) for s, u in causes if u.error_type != "ChordError"]
    cancel = records.cancelled(job) if done is None else None
    recorded = records.failure(job) if done is None else None
    if done is not None:
        link = UnitState(job, "SUCCESS")
        status.state, status.phase = JobState.SUCCESS, Phase.DONE
        status.output = str(done.get("output"))
        _add_summary(status, done, link_meta)
    elif cancel is not None:
        status.state, status.phase = JobState.CANCELLED, Phase.CANCELLED
        status.cancelled = float(cancel.get("cancelled") or 0) or None
        status.error = f"cancelled {when(status.cancelled)}"
    elif recorded is not None or link.state == "FAILURE" or causes:
        status.state, status.phase = JobState.FAILURE, Phase.FAILED
        if recorded is not None:
            status.failed_task = recorded.get("task") or recorded["step"]
            message = (recorded.get("message") or "").splitlines()
            status.error = f"{recorded['type']}: {message[0]}" if message else recorded["type"]
        elif real:
            status.failed_task, status.error = real[0][1].task_id, real[0][1].error
        else:
            status.failed_task, status.error = job, link.error
        if link.state == "FAILURE" and status.failed_task != job:
            link = UnitState(job, "NOT RUN")
    elif plan_meta is None and (stored is not None or first[stage_id] is not None):
        status.state, status.phase = JobState.RUNNING, Phase.FETCHING
    else:
        status.state = JobState.RUNNING if plan_meta is not None else JobState.PENDING
        status.phase = _phase(steps, link)
    steps["link"] = [link]
    return status


def _phase(steps: dict[str, list[UnitState]], link: UnitState) -> Phase:
    """The step a running job is at."""
    if link.state in ("STARTED", "PROGRESS"):
        return Phase.LINKING
    if any(u.state != "PENDING" for u in steps.get("verify", [])):
        return Phase.VERIFYING
    if any(u.state != "PENDING" for u in steps.get("part", [])):
        return Phase.COPYING
    for step in ("verify", "merge", "copy"):
        if any(u.state not in ("PENDING",) for u in steps[step]):
            if step == "copy" and all(u.state == "SUCCESS" for u in steps[step]):
                return Phase.MERGING
            return {"verify": Phase.VERIFYING, "merge": Phase.MERGING,
                    "copy": Phase.COPYING}[step]
    plan = steps["plan"][0]
    return Phase.PLANNING if plan.state in ("STARTED", "PROGRESS") else (
        Phase.COPYING if plan.state == "SUCCESS" else Phase.QUEUED)


@dataclass
class FollowStatus:
    """What ``chkq status`` shows of one follow, read from its versions' jobs.

    Attributes
    ----------
    follow
        The follow's id.
    jobs
        Its versions' jobs, oldest first (published, failed or under way).
    versions
        Versions published.
    through
        The newest checkpoint the published ``MODEL.h5`` holds (None: no version yet).
    published
        When the newest version was published.
    running
        The job of a version under way, or None.
    ended, outcome
        When the follow ended and how (``done``, or the error it stopped
        with); None while it runs, or if it was killed before it could say.
    complete
        Each complete checkpoint of the run now, with when it completed
        (None: the run directory cannot be read here).
    """

    follow: str
    model: str | None
    out_dir: str | None
    started: float | None
    jobs: list[JobStatus]
    versions: int = 0
    through: int | None = None
    published: float | None = None
    output: str | None = None
    running: JobStatus | None = None
    failed: JobStatus | None = None
    ended: float | None = None
    outcome: str | None = None
    complete: list[tuple[int, float]] | None = None

    @property
    def waiting(self) -> list[tuple[int, float]]:
        """Checkpoints complete but in no published version yet, with when they completed."""
        return [(n, t) for n, t in self.complete or [] if self.through is None or n > self.through]

    @property
    def newest_complete(self) -> tuple[int, float] | None:
        """The newest complete checkpoint the run directory holds, with when it completed."""
        return self.complete[-1] if self.complete else None


#: Reads the complete checkpoints of a run (``out_dir``, ``model``) with when each completed.
CompleteReader = Callable[[str, str], "list[tuple[int, float]] | None"]


def follow_statuses(statuses: list[JobStatus], complete: CompleteReader) -> list[FollowStatus]:
    """The follows among ``statuses`` (any order), newest first, each with its run's progress."""
    grouped: dict[str, list[JobStatus]] = {}
    for status in statuses:
        tag = status.follow or {}
        if isinstance(tag.get("follow"), str) and isinstance(tag.get("version"), int):
            grouped.setdefault(tag["follow"], []).append(status)
    found = []
    for follow, jobs in grouped.items():
        jobs.sort(key=lambda s: (s.follow or {})["version"])
        first = jobs[0]
        view = FollowStatus(follow, first.model, first.out_dir,
                            _number((first.follow or {}).get("started")), jobs)
        for job in jobs:
            tag = job.follow or {}
            if job.state == JobState.SUCCESS:
                view.versions += 1
                view.through = _count(tag.get("through")) or view.through
                view.published, view.output = job.finished, job.output
            elif job.state in (JobState.PENDING, JobState.RUNNING):
                view.running = job
            else:
                view.failed = job
            if tag.get("ended") is not None:
                view.ended = _number(tag.get("ended"))
                view.outcome = str(tag.get("outcome") or "")
        if view.model and view.out_dir:
            view.complete = complete(view.out_dir, view.model)
        found.append(view)
    found.sort(key=lambda v: v.started or 0.0, reverse=True)
    return found


def _number(value: Any) -> float | None:
    """``value`` if it is a stored time (a number), else None."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def when(timestamp: float | None) -> str:
    """A time of the job's records, as ``chkq status`` shows it (local time, to the second)."""
    if timestamp is None:
        return "?"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")
