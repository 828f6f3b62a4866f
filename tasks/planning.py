"""The planning step of a consolidation job: ``chkq.plan``, and for a large run its scan units.

A run of more files than one task scans quickly is scanned by a chord of
``chkq.scan`` units whose callback is ``chkq.plan`` again; the plan is made only
from the scan units' sealed records, checked against the run as it is now.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from celery import chord, group

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.discovery import (
    Checkpoint,
    check_numbering,
)
from chkq.consolidation.merge import merge_items
from chkq.consolidation.output_parts import eligible
from chkq.consolidation.plan import Plan, unit_bytes
from chkq.consolidation.prepare import job_files, prepare
from chkq.consolidation.run_scan import (
    SCAN_FILES,
    ScannedFile,
    checkpoints_from_record,
    checkpoints_to_record,
    find_run,
    run_files,
    scan_files,
    scan_units,
    scans_from_record,
    scans_to_record,
)
from chkq.errors import (
    BadCheckpointError,
    BadMessageError,
    BadMessageTypeError,
    JobStateGoneError,
    UnprovenJobError,  # noqa: F401 (re-exported)
)
from chkq.jobs import keys
from chkq.jobs.paths import check_recorded_checkpoints
from chkq.jobs.proof import verify_unit_count
from chkq.jobs.records import task_id
from chkq.lru import LRU
from chkq.rundir import RunDir
from chkq.tasks.base import ChkqTask, slowest_rates
from chkq.tasks.consolidate import (
    _checked_unit,
    _names,
    job_step,
    launch_copies,
    placed,
)
from chkq.tasks.from_store import (
    check_planned_sources,
    placed_queue,
    proven_fetches,
    scratch_job,
)
from chkq.tasks.parties import authorize_plan
from chkq.tasks.state import records, worker_roots
from chkq.tasks.store_parts import launch_parts, lay_out_filtered

log = logging.getLogger("chkq.tasks")


@get_app().task(name="chkq.plan", bind=True, base=ChkqTask)
@job_step
def plan_job(self: ChkqTask, out_dir: str, model: str, job: str,
             cleanup: bool = False, allow_gaps: bool = False, party: Any = None,
             through: int | None = None) -> dict[str, Any]:
    """Check the run, write the skeleton, record the plan, and launch the copies.

    A run of more than ``SCAN_FILES`` files is first scanned by scan units
    in parallel: this step replaces itself with them, and runs again (same
    id) as their chord's callback. A gap in the checkpoint numbers is
    refused unless ``allow_gaps``. ``through``: only the checkpoints numbered up to
    it (the first version of a followed run, still being written).
    """
    if through is not None and (isinstance(through, bool) or not isinstance(through, int)):
        raise BadMessageTypeError(f"through must be a checkpoint number, got {through!r}")
    if not isinstance(cleanup, bool):
        raise BadMessageTypeError(f"cleanup must be true or false, got {cleanup!r}")
    if not isinstance(allow_gaps, bool):
        raise BadMessageTypeError(f"allow_gaps must be true or false, got {allow_gaps!r}")
    authorize_plan(job, out_dir, model, cleanup, allow_gaps, party,
                   placed_queue(job, out_dir) is not None)
    in_store = scratch_job(job, out_dir)
    spread = in_store is not None and in_store.spread
    plan = records().recorded_plan(job)
    if plan is None:
        if in_store is not None:
            proven_fetches(in_store, job)
        settings = get_settings()
        rates = slowest_rates(self.app)
        budget = settings.budget_seconds
        prepared = prepare(
            out_dir, model, job, cleanup=cleanup, block_bytes=settings.block_bytes,
            task_bytes=unit_bytes(settings.task_bytes, rates["copy"], budget),
            verify_bytes=unit_bytes(settings.task_bytes, rates["verify"], budget),
            task_files=settings.task_files,
            run=_scanned_run(self, out_dir, model, job, cleanup, allow_gaps, through),
            allow_gaps=allow_gaps, max_decoded_bytes=settings.max_decoded_bytes,
            through=through, digest=not spread, reserve=not spread,
        )
        if in_store is not None:
            check_planned_sources(in_store, job, prepared)
        why = eligible(prepared) if spread else None
        if why is not None:
            raise BadCheckpointError(
                f"job {job} cannot be spread over the nodes, as its size asked: {why}; "
                "nothing was published (a run this large is consolidated on one node only "
                "if CHKQ_SPREAD_BYTES is above its size and it fits in that node's scratch)")
        if spread:
            assert in_store is not None
            lay_out_filtered(prepared, in_store)
        plan = records().store_plan(prepared)
        _warn_long_tasks(plan, rates, settings.soft_time_limit)
    if spread:
        assert in_store is not None
        launch_parts(plan, in_store)
    else:
        launch_copies(plan)
    return {
        "model": model,
        "out_dir": out_dir,
        "files": len(plan.files),
        "datasets": len(plan.datasets),
        "rows": plan.total_rows,
        "records": max((d.total for d in plan.datasets), default=0),
        "whole_rows": sum(d.total for d in plan.datasets if d.mode == "whole"),
        "bytes": sum(d.total * d.row_bytes for d in plan.datasets),
        "copy_units": len(plan.copy_units),
        "verify_units": verify_unit_count(plan),
    }


def unit_sizes(plan: Plan) -> dict[str, int]:
    """Plain bytes of the largest task of each kind the plan makes: copy, verify, merge.

    The largest piece of a merge that cannot be cut is one item: a part file, or a
    block of a file's rows of a variable-length dataset
    (:func:`chkq.consolidation.merge.merge_items`).
    """
    def file_bytes(index: int) -> int:
        return sum((d.offsets[index + 1] - d.offsets[index]) * d.row_bytes
                   for d in plan.datasets)

    copies = [sum((stop - start) * plan.datasets[i].row_bytes for i, start, stop in u.pieces)
              for u in plan.copy_units]
    verifies = [sum(file_bytes(f) for f in range(first, stop))
                for first, stop in plan.verify_units]
    return {"copy": max(copies, default=0), "verify": max(verifies, default=0),
            "merge": max((item.bytes for item in merge_items(plan)), default=0)}


def _warn_long_tasks(plan: Plan, rates: dict[str, float | None], soft_limit: int) -> None:
    """Log a warning for each kind of task of ``plan`` expected to outlast half the soft limit.

    Units are cut to the time budget, but some work cannot be cut: a part
    file or a block of a file's variable-length rows is merged by one piece
    of the merge, a file is verified by one. At the slowest rate measured, a job with too much
    of such work would be stopped by its time limit; the warning names the
    settings to raise.
    """
    for kind, size in unit_sizes(plan).items():
        rate = rates.get(kind)
        if rate is None or not size / rate > soft_limit / 2:
            continue
        log.warning("job=%s a %s task of %d bytes is expected to take %.0f s at %.0f bytes/s, "
                    "more than half of CHKQ_SOFT_TIME_LIMIT (%d s): raise CHKQ_TIME_LIMIT, "
                    "CHKQ_SOFT_TIME_LIMIT and CHKQ_VISIBILITY_TIMEOUT together for such jobs",
                    plan.job_id, kind, size, size / rate, rate, soft_limit)


def _scanned_run(task: ChkqTask, out_dir: str, model: str, job: str, cleanup: bool,
                 allow_gaps: bool = False, through: int | None = None
                 ) -> tuple[list[Checkpoint], list[ScannedFile]] | None:
    """The run's checkpoints and every file's scan, as the scan units recorded them.

    None for a run small enough to scan in the planning step itself. For a
    larger run not yet scanned, the planning step is replaced by a chord of
    scan units whose callback is the planning step again.
    """
    recorded = records().recorded_run(job, out_dir, model)
    if recorded is None:
        job_files(out_dir, model, job)
        with RunDir.open(out_dir, exact=True) as run:
            checkpoints = find_run(Path(out_dir), model, run, allow_gaps=allow_gaps,
                                   through=through)
        gap = check_numbering(checkpoints, model, allow_gaps=True)
        if gap:
            log.warning("job=%s %s (allowed by its submitter)", job, gap)
        if len(run_files(checkpoints)) <= SCAN_FILES:
            return None
        recorded = records().record_run(job, out_dir, model, checkpoints_to_record(checkpoints))
    checkpoints = _checked_run(recorded, out_dir, model, job)
    paths = run_files(checkpoints)
    units = scan_units(len(paths))
    scanned = records().scanned(job, len(units))
    if scanned is not None:
        now = find_run(Path(out_dir), model, allow_gaps=allow_gaps, through=through)
        if now != checkpoints:
            changed = next((str(a.path) for a, b in zip(now, checkpoints, strict=False)
                            if a != b), str((now if len(now) > len(checkpoints)
                                             else checkpoints)[-1].path))
            raise BadMessageError(f"the checkpoints recorded for job {job} are not the run's as it "
                             f"is now (first difference: {changed!r}): the run changed while it "
                             "was scanned, or the record is not the job's own; nothing was "
                             "written")
        return checkpoints, [s for record in scanned for s in scans_from_record(record)]
    if task.request.get("replaced_task_nesting", 0):
        raise UnprovenJobError(f"job {job} cannot be planned: its scan units finished "
                               "without recording their scans")
    queue = placed_queue(job, out_dir)
    scans = [
        placed(scan.si(out_dir, model, job, i, files=_names(out_dir, paths[first:stop])).set(
            task_id=task_id(job, "scan", i)), queue)
        for i, (first, stop) in enumerate(units)
    ]
    body = placed(plan_job.si(out_dir, model, job, cleanup=cleanup,
                              **({"allow_gaps": True} if allow_gaps else {}),
                              **({"through": through} if through is not None else {})), queue)
    raise task.replace(chord(group(scans).set(task_id=task_id(job, "scans")), body))


#: The files of the runs this process scanned last, by job: a run of 20,000 files has a
#: list of a megabyte and a half, which every one of its scan units would parse again.
RUN_FILES_CACHE = 4
_RUN_FILES: LRU[str, tuple[str, str, list[Path]]] = LRU(RUN_FILES_CACHE)


def _recorded_files(job: str, out_dir: str, model: str) -> list[Path]:
    """The files recorded for ``job``'s scan units (FileNotFoundError if none)."""
    cached = _RUN_FILES.get(job)
    if cached is None or cached[:2] != (out_dir, model):
        recorded = records().recorded_run(job, out_dir, model)
        if recorded is None:
            raise JobStateGoneError(
                f"consolidation job {job} has no recorded checkpoints to scan")
        cached = (out_dir, model, run_files(_checked_run(recorded, out_dir, model, job)))
        _RUN_FILES.put(job, cached)
    return cached[2]


def _checked_run(recorded: list[Any], out_dir: str, model: str, job: str) -> list[Checkpoint]:
    """The checkpoints of a job's run record, each checked to be one of the run's by name."""
    return check_recorded_checkpoints(
        checkpoints_from_record(recorded), out_dir, model,
        f"the run record of job {job} ({keys.job_record(job, 'run')})", worker_roots())


@get_app().task(name="chkq.scan", bind=True, base=ChkqTask)
@job_step
def scan(self: ChkqTask, out_dir: str, model: str, job: str, unit: int,
         **what: Any) -> dict[str, Any]:
    """Scan one unit of a large run's files (stamp, skeleton, row counts) and record it."""
    paths = _recorded_files(job, out_dir, model)
    units = scan_units(len(paths))
    first, stop = units[_checked_unit(unit, len(units), job, "scan")]
    records().record_scanned(job, unit, scans_to_record(scan_files(paths[first:stop], out_dir)))
    return {"files": stop - first}
