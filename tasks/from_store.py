"""Consolidation of a run whose checkpoints are in an object store, not a shared filesystem.

::

    chkq.stage ──► chord(chkq.fetch × object batches) ──► chkq.plan ──► … ──► chkq.link
                                                                        (publishes)

The stage step lists the run in the store (plain objects under a prefix, or
a checkpoint log's named files), pins every object (its size and version,
or its checkpoint id), refuses a destination that exists, and records the
job's store record. It places the job on its own worker: every later step
goes to that worker's queue (``chkq.node.NODENAME``, which every worker
serves), because the job's files are in that worker's scratch directory.
The fetch units write the pinned objects into ``SCRATCH/JOB/run``, laid out
as a run directory, each byte checked against its pin; from there on the
job is the ordinary canvas (:mod:`chkq.tasks.consolidate`) on that
directory, whose link step, for a store job, hands the verified output to
:func:`publish_output`: published create-if-absent, its stored bytes proven
equal to the verified ones, recorded in the log (a log run), the sources
deleted (cleanup), the workspace removed.
"""

from __future__ import annotations

import contextlib
import copy as copying
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import chord, group, signature

from chkq.access import resolve_allowed
from chkq.config.celery_app import get_app, get_settings
from chkq.config.routing import NODE_QUEUE_PREFIX
from chkq.consolidation.discovery import check_model_name
from chkq.consolidation.mirror import sealed_mirror
from chkq.consolidation.temporaries import check_job_id
from chkq.errors import (
    BadMessageError,
    BadMessageTypeError,
    ChkqError,
    ForgedRecordError,
    JobStateGoneError,
    UnprovenJobError,
)
from chkq.fsutil import private_directory
from chkq.jobs import keys
from chkq.jobs.first_messages import stage_kwargs
from chkq.jobs.records import task_id
from chkq.log.records import OutputEntry
from chkq.staging import (
    FetchedFile,
    SourceObject,
    StoreRun,
    check_room,
    default_output_key,
    delete_sources,
    fetch_objects,
    find_store_run,
)
from chkq.staging.listing import open_run_log
from chkq.stores.publish import Published, publish_file
from chkq.stores.url import open_store, parse_store_url
from chkq.tasks.base import Checked, ChkqTask, task_lifecycle
from chkq.tasks.canvas import consolidation_signature, fail_signature
from chkq.tasks.parties import admit_store_run, authorize_stage
from chkq.tasks.spread_rule import spread_over_nodes
from chkq.tasks.state import records

if TYPE_CHECKING:
    from chkq.consolidation.plan import Plan

log = logging.getLogger("chkq.tasks")

#: Name of the run directory inside a job's workspace.
RUN_DIR = "run"


class StoreDestinationExistsError(ChkqError, FileExistsError):
    """The output's key in the store is taken (by an earlier consolidation or anyone)."""


@dataclass(frozen=True)
class StoreJob:
    """Where a job from an object store reads, works and publishes.

    Attributes
    ----------
    run
        The run in the store, every object pinned (:class:`StoreRun`).
    destination
        The store URL and key the output is published at.
    queue
        The queue of the worker whose scratch directory holds the job.
    job
        The job's id, which names its workspace there (``SCRATCH/JOB``).
    cleanup
        Delete the sources once the output is published (and recorded).
    units
        The fetch units: ``[first, stop)`` ranges of :attr:`StoreRun.objects`,
        fixed when the job is staged (empty: cut from this worker's settings).
    spread
        The job is spread over every node: its worker fetches only the
        sources' metadata and plans, and the output is assembled in the store
        from parts that any node sends (:mod:`chkq.tasks.store_parts`).
    verify_data
        ``--verify-data``: a spread job reads every row of its output back and
        compares it with its source before publishing (:mod:`chkq.tasks.store_verify`);
        a job on one node verifies every row anyway.
    """

    run: StoreRun
    destination: tuple[str, str]
    queue: str
    job: str
    cleanup: bool
    units: tuple[tuple[int, int], ...] = ()
    spread: bool = False
    verify_data: bool = False

    @property
    def fetch_units(self) -> tuple[tuple[int, int], ...]:
        """The fetch units, as recorded or (a record without them) as this worker cuts them."""
        return self.units or tuple(fetch_units(self.run.objects, get_settings().task_bytes,
                                               get_settings().task_files))

    @property
    def run_dir(self) -> Path:
        """The run directory the fetch units fill, in this worker's scratch directory."""
        return get_settings().scratch_root / check_job_id(self.job) / RUN_DIR

    @property
    def resolved_run_dir(self) -> str:
        """:attr:`run_dir` with its links resolved, as a job's steps name their directory."""
        return os.path.realpath(self.run_dir)

    def name_of(self, path: str | Path) -> str:
        """The run's file name (``M_chk00001.h5``...) of a path in the run directory."""
        return str(path).removeprefix(self.resolved_run_dir + "/")

    @property
    def output_url(self) -> str:
        """The URL the output is published at, for people."""
        return _url(*self.destination)

    def to_record(self) -> dict[str, Any]:
        run = self.run
        return {"source": run.source, "store": run.store_url, "prefix": run.prefix,
                "run": run.run_id, "model": run.model,
                "objects": [[o.name, o.key, o.size, o.version, o.mode] for o in run.objects],
                "destination": list(self.destination), "queue": self.queue,
                "cleanup": self.cleanup, "units": [list(u) for u in self.fetch_units],
                "spread": self.spread, "verify_data": self.verify_data}

    @classmethod
    def from_record(cls, record: dict[str, Any], job: str) -> StoreJob:
        """The store job a record describes (its own, sealed), every field's type checked."""
        try:
            objects = tuple(SourceObject(str(n), str(k), int(s), str(v), int(m))
                            for n, k, s, v, m in record["objects"])
            run = StoreRun(source=str(record["source"]), store_url=str(record["store"]),
                           prefix=str(record["prefix"]),
                           run_id=None if record["run"] is None else str(record["run"]),
                           model=str(record["model"]), objects=objects)
            store, key = (str(x) for x in record["destination"])
            units = tuple((int(a), int(b)) for a, b in record.get("units") or ())
            bounds = [0, *(b for _, b in units)]
            if units and ([a for a, _ in units] != bounds[:-1] or bounds[-1] != len(objects)
                          or any(a >= b for a, b in units)):
                raise ValueError(f"fetch units {units} do not cover its {len(objects)} files")
            spread, verify_data = record.get("spread", False), record.get("verify_data", False)
            if not isinstance(spread, bool) or not isinstance(verify_data, bool):
                raise ValueError(f"spread is {spread!r}, verify_data {verify_data!r}")
            return cls(run, (store, key), str(record["queue"]), job, bool(record["cleanup"]),
                       units, spread, verify_data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ForgedRecordError(
                f"job record {keys.job_record(job, 'store')} is not a store job "
                f"({exc!r}): refused") from None


def _url(store_url: str, key: str) -> str:
    return store_url.rstrip("/") + "/" + key


def own_queue(task: ChkqTask) -> str:
    """The queue only the worker running ``task`` serves."""
    return NODE_QUEUE_PREFIX + str(task.request.hostname)


def store_job(job: str) -> StoreJob | None:
    """The store job ``job`` is, or None for a job on a run directory."""
    record = records().store_job_record(job)
    return None if record is None else StoreJob.from_record(record, job)


def scratch_job(job: str, out_dir: str) -> StoreJob | None:
    """The store job whose run directory ``out_dir`` is, or None for a directory job.

    Only a job whose directory lies in this worker's scratch directory can be
    a store job; others are not looked up. A directory there is never a
    directory job: one without its store record (deleted, expired), or not
    the record's own run directory, is refused.
    """
    if not Path(out_dir).is_relative_to(os.path.realpath(get_settings().scratch_root)):
        return None
    found = store_job(job)
    if found is None or found.resolved_run_dir != out_dir:
        raise JobStateGoneError(
            f"job {job} works in {out_dir!r}, in this worker's scratch directory, but "
            f"{'has no store record' if found is None else 'its store record names another'}"
            f" ({keys.job_record(job, 'store')}): refused")
    return found


def placed_queue(job: str, out_dir: str) -> str | None:
    """The queue every step of ``job`` goes to: its worker's for a store job, else None."""
    found = scratch_job(job, out_dir)
    return None if found is None else found.queue


def check_store_allowed(url: str) -> None:
    """Refuse a ``file://`` store outside ``CHKQ_ALLOWED_ROOTS``, as for run directories.

    A store job's message names where it reads and publishes; a local store
    is a directory of this worker's machine like any run directory.
    """
    location = parse_store_url(url)
    if location.local_root is not None:
        resolve_allowed(location.local_root, get_settings().allowed_roots)


def destination_of(run: StoreRun, to: str | None) -> tuple[str, str]:
    """The store URL and key the output of ``run`` goes to: ``to``, or beside the sources.

    ``to`` names an object (``s3://bucket/key``, ``gs://…``, ``file:///dir/key``):
    its last component is the key's last, the rest the store.
    """
    if to is None:
        return run.store_url, default_output_key(run)
    if not isinstance(to, str) or to.endswith("/") or "/" not in to.split("://", 1)[-1]:
        raise BadMessageError(f"destination {to!r} must name an object, e.g. "
                              "s3://bucket/path/MODEL.h5")
    store_part, _, name = to.rpartition("/")
    parse_store_url(store_part + "/")
    return store_part + "/", name


def check_destination_free(run: StoreRun, destination: tuple[str, str]) -> None:
    """Refuse a destination that exists, or a log run already consolidated for the model."""
    core = get_settings().core()
    store = open_store(destination[0], timeouts=core.timeouts)
    if run.run_id is not None:
        entry = open_run_log(open_store(run.store_url, timeouts=core.timeouts), run.run_id, core,
                             cache_bytes=0).output(run.model)
        if entry is not None:
            raise StoreDestinationExistsError(
                f"run {run.run_id!r} of {run.store_url} was already consolidated for model "
                f"{run.model!r} into {entry.key} ({entry.size} bytes, sha256 "
                f"{entry.sha256[:16]}…); it is never overwritten")
    if store.exists(destination[1]):
        raise StoreDestinationExistsError(
            f"output {_url(*destination)} exists; it is never overwritten")


def fetch_units(objects: tuple[SourceObject, ...], limit: int, files: int
                ) -> list[tuple[int, int]]:
    """Consecutive batches of ``objects``, each at most ``limit`` bytes and ``files`` objects
    (or one object)."""
    units: list[tuple[int, int]] = []
    first, size = 0, 0
    for index, obj in enumerate(objects):
        if index > first and (size + obj.size > limit or index - first >= files):
            units.append((first, index))
            first, size = index, 0
        size += obj.size
    if first < len(objects):
        units.append((first, len(objects)))
    return units


def _stage_message(self: ChkqTask, source: str, model: str, job: str, run: str | None = None,
                   to: str | None = None, cleanup: bool = False,
                   allow_gaps: bool = False, party: Any = None,
                   verify_data: bool = False) -> Checked:
    """The stage message checked: names, types; nothing is read yet."""
    job = check_job_id(job)
    model = check_model_name(model)
    for name, value in (("source", source), ("run", run), ("to", to)):
        if value is not None and not isinstance(value, str):
            raise BadMessageTypeError(f"{name} must be a string, got {value!r}")
    if not isinstance(source, str):
        raise BadMessageTypeError(f"source must be a store URL, got {source!r}")
    for name, flag in (("cleanup", cleanup), ("allow_gaps", allow_gaps),
                       ("verify_data", verify_data)):
        if not isinstance(flag, bool):
            raise BadMessageTypeError(f"{name} must be true or false, got {flag!r}")
    kwargs = {} if party is None else {"party": party}
    return Checked(job, (source, model, job, run, to, cleanup, allow_gaps),
                   {**kwargs, "verify_data": True} if verify_data else kwargs,
                   {"model": model, "source": source})


@get_app().task(name="chkq.stage", bind=True, base=ChkqTask)
@task_lifecycle(_stage_message)
def stage(self: ChkqTask, source: str, model: str, job: str, run: str | None = None,
          to: str | None = None, cleanup: bool = False,
          allow_gaps: bool = False, party: Any = None,
          verify_data: bool = False) -> dict[str, Any]:
    """List and pin the run in the store, claim the job for this worker, launch the fetches.

    Delivered again after the job was claimed, it launches the same fetches
    (same ids) on the worker that claimed it.
    """
    if records().cancelled(job) is not None:
        return {"cancelled": True}
    recorded = store_job(job)
    if recorded is None:
        admitted = authorize_stage(job, source, model, run, to, cleanup, allow_gaps, party,
                                   verify_data=verify_data)
        check_store_allowed(source)
        found = find_store_run(source, model, run, core=get_settings().core())
        destination = destination_of(found, to)
        check_store_allowed(destination[0])
        admit_store_run(job, admitted, found, destination, cleanup)
        check_destination_free(found, destination)
        private_directory(get_settings().scratch_root)
        sweep_workspaces()
        spread = spread_over_nodes(found, destination)
        if not spread:
            check_room(found, found.objects, get_settings().scratch_root)
        recorded = StoreJob.from_record(records().record_store_job(job, StoreJob(
            found, destination, own_queue(self), job, cleanup, spread=spread,
            verify_data=verify_data).to_record()), job)
    if recorded.queue == own_queue(self):
        recorded.run_dir.mkdir(parents=True, exist_ok=True)
    launch_fetches(recorded, job, allow_gaps)
    return {"objects": len(recorded.run.objects),
            "bytes": sum(o.size for o in recorded.run.objects), "node": recorded.queue}


def launch_fetches(found: StoreJob, job: str, allow_gaps: bool) -> None:
    """Send the fetch units to the job's worker, planning as their chord's callback."""
    queue, model = found.queue, found.run.model
    plan = consolidation_signature(str(found.run_dir), model, job, False, allow_gaps, queue)
    plan.set_immutable(True)
    fetches = [fetch.si(job, i).set(task_id=task_id(job, "fetch", i), queue=queue)
               for i in range(len(found.fetch_units))]
    chord(group(fetches).set(task_id=task_id(job, "fetches")), plan).apply_async()


def _fetch_message(self: ChkqTask, job: str, unit: int) -> Checked:
    job = check_job_id(job)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 0:
        raise BadMessageError(f"job {job} has no fetch unit {unit!r}")
    return Checked(job, (job, unit), {}, {"unit": unit})


@get_app().task(name="chkq.fetch", bind=True, base=ChkqTask)
@task_lifecycle(_fetch_message)
def fetch(self: ChkqTask, job: str, unit: int) -> dict[str, Any]:
    """Write one batch of the run's objects into the job's run directory, checked against pins,
    and record what it wrote (names, sizes, SHA-256, identities): planning starts from that."""
    found = store_job(job)
    if found is None:
        raise JobStateGoneError(f"job {job} has no store record: nothing to fetch")
    if found.queue != own_queue(self):
        raise BadMessageError(f"fetch unit {unit} of job {job} belongs to {found.queue}, "
                              f"not to this worker ({own_queue(self)}): refused")
    units = found.fetch_units
    if unit >= len(units):
        raise BadMessageError(f"job {job} has no fetch unit {unit!r}")
    if job_ended(job):
        return {"ended": True}
    first, stop = units[unit]
    names = [o.name for o in found.run.objects[first:stop]]
    files: list[FetchedFile] = []
    try:
        found.run_dir.mkdir(parents=True, exist_ok=True)
        written = fetch_objects(found.run, names, found.run_dir, files,
                                core=get_settings().core(),
                                mirror=sealed_mirror if found.spread else None)
    finally:
        if job_ended(job):
            discard_workspace(job)
    records().record_fetched(job, unit, [f.to_record() for f in files])
    return {"objects": len(names), "bytes": written}


def job_ended(job: str) -> bool:
    """Whether ``job`` finished, failed or was cancelled.

    A fetch unit still running when its job ends (planning refused a chord
    fired early, say) writes into a workspace the job's end already removed:
    it looks again once it has written, and removes the workspace itself.
    The job's failure removes its workspace both before and after it is
    recorded, so that one of the two always comes after such a unit's writes.
    """
    return (records().cancelled(job) is not None or records().failure(job) is not None
            or records().finished_result(job) is not None)


def proven_fetches(found: StoreJob, job: str) -> dict[str, FetchedFile]:
    """Every file of the job's run as its fetch unit recorded it, by name, once all did.

    The hand-off from fetching to planning rests on these sealed records, never
    on the fetch chord having fired: a chord whose counter was changed, or
    whose fetch messages were deleted, fires early, and planning would then see
    only some files.

    Raises
    ------
    UnprovenJobError
        If a unit recorded nothing, or something other than its share of the
        pinned files (names and sizes).
    """
    fetched = records().fetched(job)
    objects = found.run.objects
    missing = [u for u in range(len(found.fetch_units)) if u not in fetched]
    if missing:
        raise UnprovenJobError(
            f"job {job} cannot be planned: fetch units {missing[:5]}"
            f"{' and more' if len(missing) > 5 else ''} of {len(found.fetch_units)} recorded "
            "no files (the fetch chord's callback ran before they finished: its counter in "
            "the result backend was changed or their messages were lost); nothing was "
            "planned, published or deleted")
    files: dict[str, FetchedFile] = {}
    for unit, (first, stop) in enumerate(found.fetch_units):
        try:
            entries = [FetchedFile.from_record(e) for e in fetched[unit]]
        except (TypeError, ValueError) as exc:
            raise ForgedRecordError(
                f"job record {keys.job_record(job, 'fetched')}[{unit}] is not a fetch "
                f"record ({exc}): refused") from None
        pinned = [(o.name, o.size) for o in objects[first:stop]]
        if [(f.name, f.size) for f in entries] != pinned:
            raise UnprovenJobError(
                f"job {job} cannot be planned: fetch unit {unit} recorded other files than "
                f"its share of the pinned run ({len(entries)} recorded, {len(pinned)} pinned)")
        files.update((f.name, f) for f in entries)
    return files


def check_planned_sources(found: StoreJob, job: str, plan: Plan) -> dict[str, FetchedFile]:
    """The fetched files, if the plan covers exactly them, each the very file fetched.

    Planning discovers the run in the job's directory; what it found must be
    every pinned file and nothing else, each with the identity (size, mtime,
    ctime, inode, device) its fetch recorded, so that the files planned,
    copied and verified are the fetched bytes of the pinned objects.

    Raises
    ------
    UnprovenJobError
        Naming the first file missing from the plan, or planned but not fetched.
    """
    fetched = proven_fetches(found, job)
    planned = {found.name_of(f[0]): list(f[1:]) for f in plan.files}
    extra = sorted(planned.keys() - fetched.keys())
    missing = sorted(fetched.keys() - planned.keys())
    changed = sorted(n for n in planned.keys() & fetched.keys()
                     if planned[n] != fetched[n].stamp)
    if extra or missing or changed:
        what = (f"{found.run.url_of(missing[0])} was fetched but not planned" if missing else
                f"{extra[0]!r} was planned but not fetched" if extra else
                f"{found.run.url_of(changed[0])} was planned from another file than the one "
                "fetched")
        raise UnprovenJobError(f"job {job} does not consolidate the pinned run: {what} "
                               f"({len(missing)} missing, {len(extra)} extra, {len(changed)} "
                               "changed); nothing is published or deleted")
    return fetched


def publish_output(found: StoreJob, job: str, output: Path, files: list[str]) -> dict[str, Any]:
    """Publish a store job's verified output, record it, and delete the sources if asked.

    ``files`` are the files the output was planned and verified from; cleanup
    deletes only the objects fetched into them, each only if it is still the
    version pinned.

    Delivered again, it recognises its own object at the destination (same
    bytes) and its own log entry, and does not publish twice; the parts of an
    upload of the same key left unfinished (a publish killed midway) are
    aborted once the object is there.
    """
    core = get_settings().core()
    store = open_store(found.destination[0], timeouts=core.timeouts)
    published: Published = publish_file(store, found.destination[1], output,
                                        part_bytes=get_settings().upload_part_bytes)
    abandoned = [u for u in store.stray_uploads(published.key) if u.key == published.key]
    for upload in abandoned:
        store.abort_upload(upload)
    run = found.run
    if run.run_id is not None:
        open_run_log(open_store(run.store_url, timeouts=core.timeouts), run.run_id, core,
                     cache_bytes=0).record_output(OutputEntry(
            model=run.model, key=published.key, size=published.size, sha256=published.sha256,
            checkpoints=tuple(o.version for o in run.objects),
            names=tuple(o.name for o in run.objects), job=job))
    planned = {found.name_of(f) for f in files}
    consolidated = dataclasses.replace(run, objects=tuple(o for o in run.objects
                                                           if o.name in planned))
    warnings = delete_sources(consolidated, core=core) if found.cleanup else []
    log.info("job=%s published %s (%d bytes, sha256 %s; %s)", job, published.url,
             published.size, published.sha256, published.proof)
    return {"output": published.url, "bytes": published.size, "sha256": published.sha256,
            "proof": published.proof, "store": True, "files": len(files), "warnings": warnings}


def in_store_terms(exc: BaseException, found: StoreJob) -> BaseException:
    """``exc`` with the job's local run directory named as the store the files came from.

    A refusal met while planning, copying or verifying names a file of the
    worker's scratch copy; the user knows the object.
    """
    local, remote = str(found.run_dir) + "/", found.run.url_of("")

    def shown(value: Any) -> Any:
        return value.replace(local, remote) if isinstance(value, str) else value

    named = [*exc.args, getattr(exc, "filename", None), getattr(exc, "filename2", None)]
    if not any(isinstance(a, str) and local in a for a in named):
        return exc
    renamed = copying.copy(exc)
    renamed.args = tuple(shown(a) for a in exc.args)
    if isinstance(renamed, OSError):
        renamed.strerror = shown(renamed.strerror)
        renamed.filename = shown(renamed.filename)
        renamed.filename2 = shown(renamed.filename2)
    return renamed


def discard_workspace(job: str) -> bool:
    """Remove the job's workspace in this worker's scratch directory, if any; True if gone.

    The path is derived from the job id, never read from a record: only a
    job's own directory of the scratch directory is ever removed.
    """
    path = get_settings().scratch_root / check_job_id(job)
    if path.is_symlink() or not path.is_dir():
        return not path.exists()
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


def sweep_workspaces() -> list[str]:
    """Remove workspaces in this worker's scratch directory whose jobs ended; return them.

    What a cancelled job, or a worker killed between a job's end and its
    cleanup, left behind.
    """
    root = get_settings().scratch_root
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        job = path.name
        with contextlib.suppress(ValueError, ChkqError):
            check_job_id(job)
            ended = (records().finished_result(job) or records().failure(job)
                     or records().cancelled(job))
            if ended is not None and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(job)
    return removed


def stage_signature(source: str, model: str, job: str, *, run: str | None = None,
                    to: str | None = None, cleanup: bool = False,
                    allow_gaps: bool = False, party: dict[str, Any] | None = None,
                    verify_data: bool = False) -> Any:
    """The message that starts a store job: ``chkq.stage``, with ``chkq.fail`` as errback.

    ``party``: the submitter's credential (:func:`chkq.tasks.parties.stage_credential`).
    ``verify_data`` is sent only when set, so that a message without it is what it was.
    """
    kwargs = stage_kwargs(run, to, cleanup, allow_gaps, party, verify_data)
    return signature("chkq.stage", args=(source, model, job), kwargs=kwargs,
                     app=get_app(), immutable=True).set(
        task_id=task_id(job, "stage"), link_error=[fail_signature("", model, job)])


__all__ = ["StoreJob", "fail_signature", "publish_output", "stage_signature", "store_job"]
