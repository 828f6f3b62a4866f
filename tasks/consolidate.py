"""The consolidation canvas: plan -> copy group -> merge -> verify group -> link.

::

    chkq.plan [──► chord(chkq.scan × file batches) ──► chkq.plan]
              ──► chord(chkq.copy × units) ──► chkq.merge
              ──► chord(chkq.verify × (file batches + whole-output check)) ──► chkq.link

(The bracket: a run of more than ``SCAN_FILES`` files, scanned in parallel.)

Every task takes only ``out_dir``, ``model``, ``job`` and a unit number (plus
names for people reading Flower), reads the job's plan from the result
backend (never from the run directory), and can run again without harm:
copies rewrite the same bytes, verification re-reads, merge is recorded
once, link recognises its own output. Task and group ids are derived from
the job id, so a step delivered twice launches the same tasks, which the
chord counts once. Each step records what it did in the job's state
(:mod:`chkq.jobs`), and the link publishes only what those
records prove.

The job's result lives under the job id, the id of ``chkq.link``: success
is the output path; any failure, anywhere, runs ``chkq.fail``, which
removes the job's temporaries (never a checkpoint), records the failure as
data, and stores the root cause under the job id.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import chord, group
from celery.exceptions import Ignore, TaskRevokedError

from chkq.access import check_allowed
from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.discovery import (
    check_model_name,
    check_out_dir,
)
from chkq.consolidation.link import discard_job_files, link_output, remove_checkpoints
from chkq.consolidation.merge import merge_items, merge_piece, next_piece, remove_parts
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.plan import Plan, unit_bytes
from chkq.consolidation.temporaries import JobFiles, check_job_id
from chkq.consolidation.verify_rows import digests_by_dataset, verify_files
from chkq.errors import (
    BadMessageError,
    BadMessageTypeError,
    ChkqError,
    ForgedRecordError,
    UnprovenJobError,  # noqa: F401 (re-exported)
)
from chkq.fsutil import WRITE_ERRNOS, write_failure
from chkq.jobs.proof import output_stamp, prove, verify_unit_count
from chkq.jobs.records import task_id
from chkq.tasks.base import Checked, ChkqTask, JobInterruptedError, slowest_rates, task_lifecycle
from chkq.tasks.canvas import consolidation_signature, fail_signature, failing_task, root_cause
from chkq.tasks.from_store import (
    check_planned_sources,
    discard_workspace,
    in_store_terms,
    placed_queue,
    publish_output,
    scratch_job,
    store_job,
)
from chkq.tasks.parties import authorize_link
from chkq.tasks.state import records, worker_roots
from chkq.tasks.store_parts import abort_assembly

log = logging.getLogger("chkq.tasks")

__all__ = ["consolidation_signature", "root_cause", "task_id"]  # re-exported


def _checked(out_dir: str, model: str, job: str) -> tuple[Path, str, str]:
    """Validate a message's arguments before any file is touched.

    The directory is resolved (links, ``..``) and must lie inside the
    allowed roots; every later path derives from the resolved directory.
    """
    if not isinstance(out_dir, str) or not Path(out_dir).is_absolute():
        raise BadMessageError(f"output directory {out_dir!r} must be an absolute path")
    check_allowed(out_dir, worker_roots())
    directory = check_out_dir(os.path.realpath(out_dir))
    return directory, check_model_name(model), check_job_id(job)


def _stop_if_cancelled(job: str) -> None:
    if records().cancelled(job) is not None:
        log.warning("job=%s was cancelled: task %s not run", job, job)
        raise Ignore()


def _stop_if_done(job: str) -> None:
    """A step of a job already published (a message delivered again late) does nothing."""
    if records().finished_result(job) is not None:
        log.warning("job=%s is done: a late delivery of one of its steps not run", job)
        raise Ignore()


def _checked_unit(unit: Any, count: int, job: str, kind: str) -> int:
    """``unit`` if it is an int naming one of the job's ``count`` units, else ValueError."""
    if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < count:
        raise BadMessageError(f"job {job} has no {kind} unit {unit!r}")
    return unit


def describe_unit(plan: Plan, index: int) -> dict[str, Any]:
    """What a copy unit works on, for task arguments people read in Flower."""
    unit = plan.copy_units[index]
    names = [plan.datasets[d].name for d, _, _ in unit.pieces]
    rows = sum(b - a for _, a, b in unit.pieces)
    return {"datasets": names[:8] + (["..."] if len(names) > 8 else []), "rows": rows}


def describe_files(plan: Plan, unit: int) -> list[str]:
    """The checkpoint files of a verify unit, named relative to the run directory."""
    if unit == len(plan.verify_units):
        return ["(whole-output check)"]
    first, stop = plan.verify_units[unit]
    return _names(plan.out_dir, [Path(plan.files[i][0]) for i in range(first, stop)])


def _names(out_dir: str, paths: list[Path]) -> list[str]:
    """Files named relative to the run directory, for people reading Flower (at most 3)."""
    names = [str(path.relative_to(out_dir)) for path in paths]
    return names if len(names) <= 4 else [names[0], "...", names[-1]]


def placed(sig: Any, queue: str | None) -> Any:
    """``sig`` sent to ``queue`` (the worker holding a store job), or routed as usual."""
    return sig if queue is None else sig.set(queue=queue)


def launch_copies(plan: Plan) -> None:
    """Send the copy group, with merge as its chord callback."""
    job, out_dir, model = plan.job_id, plan.out_dir, plan.model
    queue = placed_queue(job, out_dir)
    merge_sig = placed(merge.si(out_dir, model, job).set(
        task_id=task_id(job, "merge"), link_error=[fail_signature(out_dir, model, job, queue)]
    ), queue)
    copies = [
        placed(copy.si(out_dir, model, job, i, **describe_unit(plan, i)).set(
            task_id=task_id(job, "copy", i)
        ), queue)
        for i in range(len(plan.copy_units))
    ]
    if not copies:
        merge_sig.apply_async()
        return
    chord(group(copies).set(task_id=task_id(job, "copies")), merge_sig).apply_async()


def launch_verification(plan: Plan) -> None:
    """Send the verify group (file batches, then the whole-output check), link as callback."""
    job, out_dir, model = plan.job_id, plan.out_dir, plan.model
    queue = placed_queue(job, out_dir)
    link_sig = placed(link.si(out_dir, model, job).set(
        task_id=task_id(job, "link"), link_error=[fail_signature(out_dir, model, job, queue)]
    ), queue)
    verifies = [
        placed(verify.si(out_dir, model, job, i, files=describe_files(plan, i)).set(
            task_id=task_id(job, "verify", i)
        ), queue)
        for i in range(verify_unit_count(plan))
    ]
    chord(group(verifies).set(task_id=task_id(job, "verifies")), link_sig).apply_async()


def job_step(body: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The lifecycle of every step of a job (:func:`chkq.tasks.base.task_lifecycle`).

    The message's directory, model and job id are checked (the directory
    resolved and checked against ``CHKQ_ALLOWED_ROOTS``) before any file is
    touched, and a step of a cancelled or finished job stops, before the delivery is
    counted and the start line logged. The body gets the resolved
    directory. A write that fails for want of space (or a filesystem turned
    read-only) is restated naming the file and the filesystem.
    """
    @functools.wraps(body)
    def run(self: ChkqTask, out_dir: str, model: str, job: str, *args: Any,
            **kwargs: Any) -> dict[str, Any]:
        try:
            return body(self, out_dir, model, job, *args, **kwargs)
        except OSError as exc:
            if exc.errno in WRITE_ERRNOS and not isinstance(exc, ChkqError):
                directory = Path(out_dir)
                raise write_failure(directory, exc,
                                    JobFiles(directory, model, job).temp) from None
            raise
    return task_lifecycle(_job_message)(run)


def _job_message(self: ChkqTask, out_dir: str, model: str, job: str, *args: Any,
                 **kwargs: Any) -> Checked:
    """A job step's message checked: its directory resolved, its job not cancelled."""
    directory, model, job = _checked(out_dir, model, job)
    _stop_if_cancelled(job)
    _stop_if_done(job)
    return Checked(job, (str(directory), model, job, *args), kwargs,
                   {"model": model, **_what(args, kwargs)})


def _what(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a step works on, for its log lines: its unit, datasets or files.

    These descriptive arguments are for people reading Flower; a message
    whose descriptions are of the wrong type is refused like any other
    malformed message.
    """
    what: dict[str, Any] = {"unit": args[0]} if args else {}
    for key in ("datasets", "files"):
        if key in kwargs:
            value = kwargs[key]
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise BadMessageTypeError(
                    f"task argument {key} must be a list of names, got {value!r}")
            what[key] = ",".join(value)
    if "rows" in kwargs and (isinstance(kwargs["rows"], bool)
                             or not isinstance(kwargs["rows"], int)):
        raise BadMessageTypeError(f"task argument rows must be an integer, got {kwargs['rows']!r}")
    return what


@get_app().task(name="chkq.copy", bind=True, base=ChkqTask)
@job_step
def copy(self: ChkqTask, out_dir: str, model: str, job: str, unit: int,
         **what: Any) -> dict[str, Any]:
    """Copy one unit of rows into the output (raw chunks or a part file)."""
    plan = records().load_plan(job, out_dir, model)
    unit = _checked_unit(unit, len(plan.copy_units), job, "copy")
    if records().merged(job) is not None:
        raise Ignore()
    total = describe_unit(plan, unit)["rows"]
    started = time.monotonic()
    stats = copy_unit(plan, unit, lambda done: self.report(done, total, job=job, kind="copy"))
    self.record_rate("copy", stats.bytes, time.monotonic() - started)
    records().record_copied(job, unit, stats.digests)
    self.report(stats.rows, stats.rows, job=job, kind="copy")
    return {"rows": stats.rows, "bytes": stats.bytes, "files": stats.files}


@get_app().task(name="chkq.merge", bind=True, base=ChkqTask)
@job_step
def merge(self: ChkqTask, out_dir: str, model: str, job: str) -> dict[str, Any]:
    """Move part files into the output, piece by piece; once all are in, record it and verify.

    Each delivery merges the next piece (:func:`chkq.consolidation.merge.next_piece`:
    at most ``CHKQ_TASK_BYTES`` and what the slowest node's merge rate moves in the time
    budget), fsyncs the output, records the piece's items, and, while items remain,
    replaces itself (same id) by the next piece: pieces run one after another, never two
    at once, and a cancelled job stops between them. A piece delivered again does its
    items again, which writes the same rows at the same places (variable-length rows'
    heap collections copied again, past the earlier copies). The last piece records
    the output's stamp, removes the part files and launches verification.
    """
    plan = records().load_plan(job, out_dir, model)
    moved = 0
    if records().merged(job) is None:
        gaps = [u for u in range(len(plan.copy_units)) if u not in records().copied(job)]
        if gaps:
            raise UnprovenJobError(f"job {job} cannot merge: copy units {gaps[:5]} "
                                   "did not finish")
        items = merge_items(plan)
        done = records().merge_items_done(job)
        piece = next_piece(items, done, merge_piece_bytes(self))
        started = time.monotonic()
        moved = merge_piece(plan, items, piece)
        # Timed against the rows' plain size, which the planner knows in advance.
        self.record_rate("merge", sum(items[n].bytes for n in piece),
                         time.monotonic() - started)
        records().record_merge_items(job, piece, moved)
        if len(done | set(piece)) < len(items):
            log.info("job=%s merged %d of %d part files and files of variable-length rows",
                     job, len(done | set(piece)), len(items))
            raise self.replace(placed(merge.si(out_dir, model, job),
                                      placed_queue(job, out_dir)))
        records().record_merged(job, output_stamp(plan))
        remove_parts(plan)
    launch_verification(plan)
    return {"bytes": moved}


def merge_piece_bytes(task: ChkqTask) -> int:
    """Plain bytes of one piece of a merge: the task byte bound and the time budget."""
    settings = get_settings()
    return unit_bytes(settings.task_bytes, slowest_rates(task.app)["merge"],
                      settings.budget_seconds)


@get_app().task(name="chkq.verify", bind=True, base=ChkqTask)
@job_step
def verify(self: ChkqTask, out_dir: str, model: str, job: str, unit: int,
           **what: Any) -> dict[str, Any]:
    """Verify the output: the rows of a batch of files, or (last unit) the whole structure."""
    plan = records().load_plan(job, out_dir, model)
    unit = _checked_unit(unit, verify_unit_count(plan), job, "verify")
    stamp = records().merged(job)
    if stamp is None:
        raise UnprovenJobError(f"job {job} cannot be verified before its merge finished")
    if unit == len(plan.verify_units):
        return _verify_structure(plan, stamp)
    first, stop = plan.verify_units[unit]
    total = sum(plan.file_rows(i) for i in range(first, stop))
    digests = digests_by_dataset(records().copied(job), plan)
    started = time.monotonic()
    stats = verify_files(plan, first, stop, digests,
                         lambda done: self.report(done, total, job=job, kind="verify"))
    self.record_rate("verify", stats.bytes, time.monotonic() - started)
    records().record_verified(plan.job_id, unit, _still(plan, stamp))
    self.report(stats.rows, stats.rows, job=job, kind="verify")
    return {"rows": stats.rows, "bytes": stats.bytes, "files": stats.files}


def _still(plan: Plan, stamp: list[int]) -> list[int]:
    """``stamp`` if the output still has it (it was not changed while being verified)."""
    if output_stamp(plan) != stamp:
        raise UnprovenJobError(f"the output of job {plan.job_id} changed while it was verified")
    return stamp


def _verify_structure(plan: Plan, stamp: list[int]) -> dict[str, Any]:
    """Check the whole output against its template (links, types, attributes, fixed data)."""
    check_plan_output(plan)
    records().record_verified(plan.job_id, len(plan.verify_units), _still(plan, stamp))
    return {"rows": 0, "bytes": stamp[0], "structure": "ok"}


@get_app().task(name="chkq.link", bind=True, base=ChkqTask)
@job_step
def link(self: ChkqTask, out_dir: str, model: str, job: str) -> dict[str, Any]:
    """Publish the verified output (create-if-absent) and clean up — only if proven.

    A link message for a job whose records are incomplete (an early,
    forged or replayed message) publishes nothing, deletes nothing and
    stores nothing under the job id: the job goes on (or has failed) as it
    would have. Records that are complete but disagree with the output as
    it is now (it changed after verification) fail the job.
    """
    done = records().finished_result(job)
    if done is not None:
        return done
    plan = records().load_plan(job, out_dir, model)
    authorize_link(job, out_dir, model, plan.cleanup,
                   store_job(job) if placed_queue(job, out_dir) else None)
    proof = prove(records(), plan)
    if proof.unfinished:
        log.warning("job=%s link refused, nothing published: %s", job,
                    "; ".join(proof.unfinished + proof.contradicted))
        raise Ignore()
    in_store = scratch_job(job, out_dir)
    try:
        if proof.contradicted:
            raise UnprovenJobError(f"job {job} was not published: "
                                   + "; ".join(proof.contradicted))
        if in_store is not None:
            check_planned_sources(in_store, job, plan)
        output = link_output(plan)
    except BaseException:
        # Celery makes this step's failure visible before its errback runs: clean up first,
        # so that a failed job has left no temporaries by the time anyone sees it failed.
        discard_job_files(plan.job)
        raise
    warnings = remove_checkpoints(plan) if plan.cleanup else []
    result = {"output": str(output), "rows": plan.total_rows, "files": len(plan.files),
              "datasets": {f"/{d.name}": d.total for d in plan.datasets},
              "bytes": os.lstat(output).st_size, "warnings": warnings}
    if in_store is not None:
        try:
            result |= publish_output(in_store, job, output, [f for f, *_ in plan.files])
        except BaseException as exc:
            discard_workspace(job)
            raise in_store_terms(exc, in_store) from None
    records().record_finished(job, result)
    discard_job_files(plan.job)
    records().forget_progress(job)
    if in_store is not None:
        discard_workspace(job)
    return result


def explained(cause: BaseException, job: str) -> BaseException:
    """The error a user is shown for ``cause``, the root cause of a failed job.

    A step terminated from outside surfaces from Celery as a bare
    ``TaskRevokedError('terminated')``: say what that means. It happens when
    a worker loses its broker connection (a Redis restart) while the step
    runs: Celery then terminates the step, and with the broker down it
    cannot hand it back, so it records it as revoked.
    """
    if isinstance(cause, TaskRevokedError):
        return JobInterruptedError(
            f"job {job} was interrupted: one of its steps was terminated ({cause}), either "
            "because its worker lost the connection to the broker (a Redis restart?) or "
            "because it was revoked; the checkpoints are untouched: submit the job again"
        )
    return cause


def _trusted(read: Callable[[str], Any], job: str) -> Any:
    """``read(job)``, a job record for the failure path: one that is not the job's own is None.

    The failure path must always end by recording the failure, so a planted
    record there is logged and treated as absent rather than raised.
    """
    try:
        return read(job)
    except ForgedRecordError as exc:
        log.warning("job=%s %s", job, exc)
        return None


def _discard_quietly(out_dir: str, model: str, job: str) -> list[Path]:
    """Remove the job's temporaries if its arguments can name them; never raise."""
    try:
        directory, model, job = _checked(out_dir, model, job)
    except Exception as bad:  # noqa: BLE001 - bad arguments: nothing they name is touched
        log.warning("job=%s failed; its temporaries were left: %s", job, bad)
        return []
    try:
        return discard_job_files(JobFiles(directory, model, job))
    except Exception:  # noqa: BLE001 - the failure is recorded whatever cleanup does
        log.exception("job=%s failed; removing its temporaries failed too", job)
        return []


def _root_cause(exc: BaseException, task: str | None, job: str) -> tuple[str | None,
                                                                          BaseException]:
    """The failing task and its explained exception (``exc`` itself if looking it up fails)."""
    try:
        task, exc = failing_task(exc, task)
    except Exception:  # noqa: BLE001 - a header's stored result may be unreadable
        log.exception("job=%s: the failing task's result could not be read", job)
    return task, explained(exc, job)


@get_app().task(name="chkq.fail", base=ChkqTask)
def fail(request: Any, exc: BaseException, traceback: Any, out_dir: str, model: str,
         job: str) -> None:
    """Errback of every step: remove the job's temporaries, record the root cause.

    Checkpoints are never touched. The job's result (its id) is set to the
    failure unless the job already succeeded (a late, redelivered step).
    The failure is recorded whatever cleanup meets (a planted directory or
    link named like a temporary, an unreadable directory, a failing look-up
    of the cause): no client waits for ever. When the message's own
    arguments are what failed (a directory outside the allowed roots, say),
    the temporaries are left alone, since the arguments cannot be trusted
    to name them. Done, failure and cancellation markers that are not the
    job's own are ignored here, and the planted ones are deleted.
    """
    job = check_job_id(job)
    task, cause = _root_cause(exc, getattr(request, "id", None), job)
    in_store = _trusted(store_job, job)
    if in_store is not None:
        cause = in_store_terms(cause, in_store)
    jobs = records()
    if _trusted(jobs.finished_result, job) is not None or _trusted(jobs.failure, job) is not None:
        log.warning("job=%s failure after the job ended ignored: %r", job, cause)
        return
    if _trusted(records().cancelled, job) is not None:
        _discard_quietly(out_dir, model, job) if out_dir else None
        if in_store is not None:
            if in_store.spread:
                abort_assembly(job, in_store)
            discard_workspace(job)
        records().forget_progress(job)
        return
    removed = _discard_quietly(out_dir, model, job) if out_dir else []
    if in_store is not None:
        if in_store.spread:
            abort_assembly(job, in_store)
        discard_workspace(job)
    try:
        records().record_failed(job, task, cause)
        records().forget_refused(job)
        records().forget_progress(job)
        if in_store is not None:
            discard_workspace(job)
    finally:
        log.warning("fail task=chkq.job job=%s model=%s failed=%s error=%r removed=%d", job,
                    model, task, cause, len(removed))
        get_app().backend.mark_as_failure(job, cause)
