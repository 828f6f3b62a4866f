"""Submitting consolidation jobs and waiting for them: the Python API.

``submit_consolidation`` returns a :class:`ConsolidationJob`, a Celery
``AsyncResult`` for the job id with progress on top; ``consolidate_checkpoints``
submits and waits, running an embedded cluster when no broker is configured.
``run_consolidation`` is the same with everything a command line shows: the
job's summary (rows, bytes, time, warnings) and notices while it waits.

Check first, start later: whatever can be refused without a cluster (a bad
name, a missing directory, an existing output, no checkpoints, and in
embedded mode unreadable, incomplete or mismatched files) is refused here,
in-process, before a job is sent or an embedded cluster starts.

A client waiting on a cluster tells (``on_notice``) within seconds when no
worker serves the queue its job waits in, then keeps waiting.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.exceptions import ChordError
from celery.result import AsyncResult

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.discovery import check_model_name, check_out_dir
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.errors import (  # noqa: F401 (re-exported)
    ForgedRecordError,
    JobCancelledError,
    JobFailedError,
    JobLostError,
    OutputExistsError,
    RunBusyError,
    RunNotFoundError,
    WaitTimeoutError,
)
from chkq.jobs.first_messages import plan_kwargs, stage_kwargs
from chkq.jobs.status import dataset_rows, rows_phrase
from chkq.tasks.canvas import consolidation_signature, root_cause
from chkq.tasks.parties import plan_credential, stage_credential
from chkq.tasks.state import job_status, records
from chkq.workers.claims import refuse_if_running, run_claim
from chkq.workers.sender import PLAN_TASK, STAGE_TASK, send_job
from chkq.workers.waiting import BROKER_ERRORS, EndSignal, QueueWatch

#: How often a waiting client reads the job's state; the job's end wakes it at once
#: (:class:`EndSignal`).
POLL_SECONDS = 0.25
PROGRESS_SECONDS = 0.25

#: How long ``wait_for_output`` rides out a broker it cannot reach (a Redis restart).
OUTAGE_GRACE_SECONDS = 120.0



@dataclass(frozen=True)
class Progress:
    """Where a job stands: its phase and rows copied and verified out of ``total``.

    ``copied``, ``verified`` and ``total`` count rows over every dataset;
    ``records`` is the rows of the longest dataset, what a user counts
    (trials, events), 0 while the job is not planned.
    """

    phase: str
    copied: int = 0
    verified: int = 0
    total: int = 0
    records: int = 0


@dataclass(frozen=True)
class JobSummary:
    """What a finished consolidation did, for the people who asked for it.

    Attributes
    ----------
    job
        The job id.
    output
        The consolidated file: its path, or its URL for a job published to an
        object store.
    rows, files
        Rows written (over every extensible dataset) and checkpoint files read.
    datasets
        Each extensible dataset's rows (its path in the output to its rows).
    records
        Rows of the longest dataset: what a user counts (trials, events).
    bytes
        Size of the output (None if this client cannot see it).
    seconds
        Wall time from submission to the end, as this client saw it.
    warnings
        What the job wants people to know, e.g. a checkpoint directory kept by
        ``cleanup`` because it holds other files.
    """

    job: str
    output: Path | str
    rows: int = 0
    files: int = 0
    bytes: int | None = None
    seconds: float | None = None
    warnings: list[str] = field(default_factory=list)
    datasets: dict[str, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return max(self.datasets.values(), default=self.rows)

    def line(self) -> str:
        """One line for people: ``wrote OUTPUT: D datasets of R rows from F files, B MB in S s``.

        Rows are counted as a user counts records: those of the longest
        dataset, not their sum over the datasets.
        """
        size = f", {self.bytes / 1e6:,.1f} MB" if self.bytes is not None else ""
        took = f" in {self.seconds:.1f} s" if self.seconds is not None else ""
        return (f"wrote {self.output}: {rows_phrase(self.datasets, self.rows)} from "
                f"{self.files:,} files{size}{took} (job {self.job})")


class ConsolidationWarning(UserWarning):
    """A finished job's warning (e.g. a checkpoint directory kept by ``cleanup``)."""


class ConsolidationJob(AsyncResult):
    """A submitted consolidation: an AsyncResult on the job id, with progress.

    ``files`` (set by :func:`submit_consolidation`) names the job's files, so
    that a client that learns the job was lost can remove its temporaries.
    """

    files: JobFiles | None = None
    submitted_at: float | None = None
    #: What the submitting client found and the job's summary repeats (a gap it accepted).
    client_warnings: tuple[str, ...] = ()
    _progress_shown = 0.0

    @classmethod
    def sent(cls, job: str, files: JobFiles | None = None,
             submitted_at: float | None = None) -> ConsolidationJob:
        """The handle of job ``job``, just sent (``files``: its files in a run directory)."""
        handle = cls(job, app=get_app())
        handle.files = files
        handle.submitted_at = submitted_at
        return handle

    @property
    def progress(self) -> Progress:
        """Rows copied and verified so far: one batched read of the job's state.

        The same reader (:func:`chkq.jobs.status.job_status`) serves
        ``chkq status``, so the two never disagree on where a job stands.
        """
        if self.ready() and (self.successful() or records().finished_result(self.id) is not None):
            done = self._finished() if self._succeeded() else {}
            rows = int(done.get("rows") or 0)
            return Progress("done", rows, rows, rows,
                            max(dataset_rows(done).values(), default=rows))
        try:
            status = job_status(self.id)
        except LookupError:
            return Progress("queued")
        copied, verified, total = status.rows
        return Progress(status.phase, copied, verified, total, status.records)

    def wait_for_output(
        self,
        timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        is_alive: Callable[[], None] | None = None,
        outage_grace: float = OUTAGE_GRACE_SECONDS,
        on_notice: Callable[[str], None] | None = None,
    ) -> Path | str:
        """Block until the job ends; return the output path (or URL) or raise the job's error.

        See :meth:`wait_for_summary`, which this is, returning only the path.
        """
        return self.wait_for_summary(timeout, on_progress, is_alive, outage_grace,
                                     on_notice).output

    def wait_for_summary(
        self,
        timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        is_alive: Callable[[], None] | None = None,
        outage_grace: float = OUTAGE_GRACE_SECONDS,
        on_notice: Callable[[str], None] | None = None,
    ) -> JobSummary:
        """Block until the job ends; return its summary or raise the job's error.

        A broker that stops answering (Redis restarting) is waited for, up to
        ``outage_grace`` seconds at a time: with persistence the job carries
        on where it was.

        ``on_notice`` hears, within seconds, when no worker serves the queue
        the job waits in (the waiting goes on).

        Raises
        ------
        TimeoutError
            After ``timeout`` seconds (the job itself goes on).
        JobCancelledError
            If the job was cancelled (``chkq cancel``).
        JobLostError
            If the broker forgot the job (a Redis restart without persistence),
            or did not answer for ``outage_grace`` seconds. The job's
            temporaries are removed; its checkpoints were never touched.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        unreachable_since: float | None = None
        watch = QueueWatch(self, on_notice) if on_notice is not None else None
        with EndSignal(self) as end:
            while True:
                try:
                    if self._poll(on_progress):
                        break
                    unreachable_since = None
                except BROKER_ERRORS as exc:
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since > outage_grace:
                        raise JobLostError(
                            f"the broker has not answered for {outage_grace:.0f} s ({exc}); "
                            f"the fate of job {self.id} is unknown: check the broker, then "
                            "submit it again"
                        ) from exc
                if is_alive is not None:
                    is_alive()
                if watch is not None and unreachable_since is None:
                    watch.check()
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeoutError(
                        f"job {self.id} did not finish within {timeout:g} s; it goes on "
                        f"(chkq status {self.id}; chkq cancel {self.id} to cancel it)")
                end.wait(POLL_SECONDS)
        return self._outcome()

    def _poll(self, on_progress: Callable[[Progress], None] | None) -> bool:
        """True once the job ended; raise JobLostError if the broker forgot it."""
        if self.ready():
            return True
        if records().job_info(self.id) is None:
            if records().finished_result(self.id) is not None or self.ready():
                return True
            removed = discard_job_files(self.files) if self.files is not None else []
            raise JobLostError(
                f"the broker no longer knows job {self.id} (was Redis restarted "
                "without persistence?); its checkpoints are untouched"
                + (f" and its {len(removed)} temporary files were removed" if removed else "")
                + ": submit it again"
            )
        now = time.monotonic()
        if on_progress is not None and now - self._progress_shown >= PROGRESS_SECONDS:
            self._progress_shown = now
            on_progress(self.progress)
        return False

    def _succeeded(self) -> bool:
        """True if the job linked its output, as its own records prove.

        With signing configured, only the job's sealed done marker proves it:
        Celery's results are unsigned, so a SUCCESS under the job id with no
        such marker is refused, never reported.

        Raises
        ------
        ForgedRecordError
            If the done marker is not the job's own, or (signing on) the
            backend says the job succeeded without one.
        """
        if records().finished_result(self.id) is not None:
            return True
        if not self.successful():
            return False
        if records().authenticated:
            raise ForgedRecordError(
                f"the result backend says job {self.id} succeeded, but the job recorded no "
                "authenticated result (chkq-job-done-JOB): refused; someone with access to "
                "Redis but not the signing key may have written it (chkq status "
                f"{self.id})")
        return True

    def _finished(self) -> dict[str, Any]:
        """The link step's result of a job that succeeded."""
        done = records().finished_result(self.id)
        if done is None and not records().authenticated and self.successful() \
                and isinstance(self.result, dict):
            done = self.result
        return done or {}

    def summary(self) -> JobSummary:
        """The summary of a job that succeeded (KeyError if it has not)."""
        if not self._succeeded():
            raise KeyError(f"job {self.id} has not succeeded")
        done = self._finished()
        output: Path | str = str(done["output"])
        size: int | None = None
        if done.get("store"):
            size = int(done.get("bytes") or 0)
        else:
            output = Path(output)
            with contextlib.suppress(OSError):
                size = output.stat().st_size
        seconds = None
        if self.submitted_at is not None:
            seconds = time.monotonic() - self.submitted_at
        return JobSummary(self.id, output, rows=int(done.get("rows") or 0),
                          files=int(done.get("files") or 0), bytes=size, seconds=seconds,
                          warnings=[*self.client_warnings,
                                    *(str(w) for w in done.get("warnings") or [])],
                          datasets=dataset_rows(done))

    def _outcome(self) -> JobSummary:
        if self._succeeded():
            return self.summary()
        exc = self.result
        if isinstance(exc, ChordError):
            exc = root_cause(exc)
        entry = records().cancelled(self.id)
        if entry is not None:  # its steps then fail as revoked, or with a ChordError
            raise JobCancelledError(f"job {self.id} was cancelled ({entry.get('by')})")
        if isinstance(exc, BaseException):
            raise exc
        raise JobFailedError(f"job {self.id} failed: {exc!r}")


def out_dir_of(out_dir: str | Path | None) -> Path:
    """``out_dir`` (default: the current directory), absolute and checked.

    Raises
    ------
    FileNotFoundError
        If it does not exist (naming it).
    NotADirectoryError
        If it is not a directory.
    """
    path = Path(out_dir if out_dir is not None else os.getcwd()).expanduser()
    if not path.exists():
        raise RunNotFoundError(f"output directory {str(path)!r} does not exist")
    return check_out_dir(path)


def precheck(model_name: str, out_dir: str | Path | None, *, scan: bool,
             allow_gaps: bool = False, notes: list[str] | None = None) -> tuple[Path, str]:
    """Refuse, in this process, a job that would be refused anyway; return (directory, model).

    Checks the model name, the directory, that ``MODEL.h5`` does not exist,
    that it can be written, that there are checkpoints and no gap in their
    numbers (unless ``allow_gaps``: the gap's description is then appended
    to ``notes``); with ``scan``, also reads every checkpoint
    file's structure (incomplete, unreadable, non-HDF5 or mismatched files),
    as the planning step would. Costs well under a second for a normal run,
    against seconds for starting an embedded cluster.

    Raises
    ------
    ChkqError
        As :func:`consolidate_checkpoints`.
    """
    from chkq.consolidation.discovery import check_numbering, find_checkpoints, no_checkpoints
    from chkq.fsutil import check_writable_dir

    model = check_model_name(model_name)
    directory = out_dir_of(out_dir)
    output = directory / f"{model}.h5"
    if output.exists() or output.is_symlink():
        raise OutputExistsError(f"output {str(output)!r} exists; it is never overwritten")
    if scan:
        from chkq.consolidation.run_scan import discover_and_scan

        checkpoints, _ = discover_and_scan(directory, model, allow_gaps=allow_gaps)
    else:
        checkpoints = find_checkpoints(directory, model)
        if not checkpoints:
            raise no_checkpoints(directory, model)
    gap = check_numbering(checkpoints, model, allow_gaps=allow_gaps)
    if gap is not None and notes is not None:
        notes.append(gap)
    check_writable_dir(directory, "output directory")
    return directory, model


def submit_consolidation(
    model_name: str, out_dir: str | Path | None = None, cleanup: bool = False,
    *, allow_gaps: bool = False, through: int | None = None,
) -> ConsolidationJob:
    """Send a consolidation job to the configured cluster; return its handle at once.

    ``through``: consolidate only the checkpoints numbered up to it (the first
    version of a followed run, whose later checkpoints are still being written).

    Obvious mistakes (see :func:`precheck`: a bad name or directory, an
    existing output, no checkpoints, a gap in their numbers) are refused
    here, before anything is sent. With ``allow_gaps``, a gap is accepted:
    the handle's ``client_warnings`` (and its summary's warnings) name the
    missing checkpoints.
    """
    notes: list[str] = []
    directory, model = precheck(model_name, out_dir, scan=False, allow_gaps=allow_gaps,
                                notes=notes)
    refuse_if_running(model, str(directory))
    job = uuid.uuid4().hex
    submitted = time.monotonic()
    party = plan_credential(job, str(directory), model, cleanup, allow_gaps)
    records().record_submitted(job, model, str(directory))
    args = [str(directory), model, job]
    if not send_job(get_app(), PLAN_TASK, job, args,
                    plan_kwargs(cleanup, allow_gaps, party, through), args):
        consolidation_signature(str(directory), model, job, cleanup, allow_gaps,
                                party=party, through=through).apply_async()
    handle = ConsolidationJob.sent(job, JobFiles(directory, model, job), submitted)
    handle.client_warnings = tuple(notes)
    return handle


def submit_store_consolidation(
    model_name: str, source: str, *, run: str | None = None, to: str | None = None,
    cleanup: bool = False, allow_gaps: bool = False, verify_data: bool = False,
) -> ConsolidationJob:
    """Send the consolidation of a run kept in an object store; return its handle at once.

    ``source`` is a store URL (``s3://bucket/prefix/``, ``gs://…``,
    ``file:///dir/``): with ``run``, the checkpoint log there and that run's
    named files; without, the checkpoint objects under the prefix, named as
    in a run directory. The output is published at ``to`` (an object URL;
    default beside the sources: ``MODEL.h5`` under the prefix, or the log's
    ``runs/RUN/outputs/MODEL.h5``), create-if-absent, once verified. A source
    with no checkpoints of the model, or a destination that exists, is
    refused here, before anything is sent. With ``verify_data``, a job spread
    over the nodes reads every row of its output back and compares it with
    its source before publishing it (a job on one node does so anyway).
    """
    from chkq.staging import find_store_run
    from chkq.tasks.from_store import check_destination_free, destination_of, stage_signature

    model = check_model_name(model_name)
    found = find_store_run(source, model, run)
    check_destination_free(found, destination_of(found, to))
    refuse_if_running(model, source)
    job = uuid.uuid4().hex
    submitted = time.monotonic()
    party = stage_credential(job, source, model, run, to, cleanup, allow_gaps, verify_data)
    records().record_submitted(job, model, source)
    if not send_job(get_app(), STAGE_TASK, job, [source, model, job],
                    stage_kwargs(run, to, cleanup, allow_gaps, party, verify_data),
                    ["", model, job]):
        stage_signature(source, model, job, run=run, to=to, cleanup=cleanup,
                        allow_gaps=allow_gaps, party=party, verify_data=verify_data).apply_async()
    return ConsolidationJob.sent(job, submitted_at=submitted)


def run_consolidation(
    model_name: str, out_dir: str | Path | None = None, cleanup: bool = False,
    *, workers: int | None = None, timeout: float | None = None, allow_gaps: bool = False,
    source: str | None = None, run: str | None = None, to: str | None = None,
    verify_data: bool = False, on_progress: Callable[[Progress], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    on_submitted: Callable[[ConsolidationJob], None] | None = None,
) -> JobSummary:
    """Consolidate and wait, as :func:`consolidate_checkpoints`; return the job's summary.

    With ``source`` (and ``run``, ``to``, ``verify_data``), the run is in an object store
    (:func:`submit_store_consolidation`) and ``out_dir`` is not used.
    ``on_submitted`` gets the job's handle as soon as it is sent (a command
    line interrupted later can then say what becomes of it), ``on_notice``
    what the user should know while waiting. In embedded mode, a job cut
    short (an exception, an interrupt, a timeout) ends with its cluster and
    its temporaries are removed.
    """
    from chkq.workers.embedded import EmbeddedCluster, drop_result_subscriptions

    def submit() -> ConsolidationJob:
        if source is not None:
            return submit_store_consolidation(model_name, source, run=run, to=to,
                                              cleanup=cleanup, allow_gaps=allow_gaps,
                                              verify_data=verify_data)
        return submit_consolidation(model_name, out_dir, cleanup, allow_gaps=allow_gaps)

    if get_settings().broker_url:
        job = submit()
        if on_submitted is not None:
            on_submitted(job)
        try:
            return job.wait_for_summary(timeout, on_progress, on_notice=on_notice)
        finally:
            drop_result_subscriptions()
    if source is None:
        directory, model = precheck(model_name, out_dir, scan=True, allow_gaps=allow_gaps)
        target = str(directory)
    else:
        model, target = check_model_name(model_name), source
    with run_claim(model, target) as claimed, EmbeddedCluster(workers) as cluster:
        job = submit()
        claimed(job.id)
        if job.files is not None:
            cluster.guard(job.files)
        if on_submitted is not None:
            on_submitted(job)
        return job.wait_for_summary(timeout, on_progress, is_alive=cluster.check_alive)


def consolidate_checkpoints(
    model_name: str, out_dir: str | Path | None = None, cleanup: bool = False,
    *, workers: int | None = None, allow_gaps: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
) -> Path | str:
    """Consolidate ``model_name``'s checkpoints into ``OUT_DIR/MODEL.h5``; return its path.

    With ``CHKQ_BROKER_URL`` set, the job runs on that cluster; otherwise on
    an embedded cluster of ``workers`` local processes (default: CPU count).
    A gap in the checkpoint numbers (``_chk00001`` and ``_chk00003`` but no
    ``_chk00002``) is refused unless ``allow_gaps``. The job's warnings (a
    gap accepted, a checkpoint directory kept by ``cleanup``) are issued as
    :class:`ConsolidationWarning`.

    Every error below derives from :class:`chkq.ChkqError` and from the
    built-in named with it.

    Raises
    ------
    BadNameError (ValueError)
        ``model_name`` cannot name files in one directory.
    RunNotFoundError (FileNotFoundError)
        No directory ``out_dir``.
    OutputNotWritableError (PermissionError)
        ``out_dir`` cannot be written (read-only filesystem, permissions).
    NoCheckpointsError (FileNotFoundError)
        No checkpoints.
    CheckpointGapError (ValueError)
        Checkpoint numbers missing between the first and the last.
    OutputExistsError (FileExistsError)
        ``MODEL.h5`` exists, or appeared while the job ran.
    BadCheckpointError (ValueError)
        An incomplete, unreadable or non-HDF5 file, files that differ in
        structure, or something chkq cannot copy exactly.
    OutputMismatchError (ValueError)
        Output rows that differ from their source.
    OutputWriteError (OSError)
        Writing the output failed (disk full), naming the file and filesystem.
    """
    summary = run_consolidation(model_name, out_dir, cleanup, workers=workers,
                                allow_gaps=allow_gaps, on_progress=on_progress)
    for message in summary.warnings:
        warnings.warn(message, ConsolidationWarning, stacklevel=2)
    return summary.output
