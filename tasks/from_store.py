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
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import chord, group, signature

from chkq.access import resolve_allowed
from chkq.config.celery_app import get_app, get_settings
from chkq.config.routing import NODE_QUEUE_PREFIX
from chkq.consolidation.discovery import check_model_name
from chkq.consolidation.store_run import (
    SourceObject,
    StoreRun,
    default_output_key,
    delete_sources,
    fetch_objects,
    find_store_run,
)
from chkq.consolidation.temporaries import check_job_id
from chkq.errors import BadMessageError, BadMessageTypeError, ChkqError, JobStateGoneError
from chkq.fsutil import private_directory
from chkq.log.checkpoint_log import CheckpointLog
from chkq.log.records import OutputEntry
from chkq.stores.publish import Published, publish_file
from chkq.stores.url import open_store, parse_store_url
from chkq.tasks import protocol
from chkq.tasks.base import Checked, ChkqTask, task_lifecycle
from chkq.tasks.protocol import consolidation_signature, fail_signature, task_id

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
    """

    run: StoreRun
    destination: tuple[str, str]
    queue: str
    job: str
    cleanup: bool

    @property
    def run_dir(self) -> Path:
        """The run directory the fetch units fill, in this worker's scratch directory."""
        return get_settings().scratch_root / check_job_id(self.job) / RUN_DIR

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
                "cleanup": self.cleanup}

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
            return cls(run, (store, key), str(record["queue"]), job, bool(record["cleanup"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise protocol.ForgedRecordError(
                f"job record {protocol.record_key_of(job, 'store')} is not a store job "
                f"({exc!r}): refused") from None


def _url(store_url: str, key: str) -> str:
    return store_url.rstrip("/") + "/" + key


def own_queue(task: ChkqTask) -> str:
    """The queue only the worker running ``task`` serves."""
    return NODE_QUEUE_PREFIX + str(task.request.hostname)


def store_job(job: str) -> StoreJob | None:
    """The store job ``job`` is, or None for a job on a run directory."""
    record = protocol.store_job_record(job)
    return None if record is None else StoreJob.from_record(record, job)


def placed_queue(job: str, out_dir: str) -> str | None:
    """The queue every step of ``job`` goes to: its worker's for a store job, else None.

    Only a job whose directory lies in this worker's scratch directory can be
    a store job; others are not looked up.
    """
    if not Path(out_dir).is_relative_to(get_settings().scratch_root):
        return None
    found = store_job(job)
    return None if found is None else found.queue


def scratch_roots() -> tuple[str, ...]:
    """Directories a store job's steps may touch besides ``CHKQ_ALLOWED_ROOTS``."""
    return (str(get_settings().scratch_root),)


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
    store = open_store(destination[0])
    if run.run_id is not None:
        entry = CheckpointLog(open_store(run.store_url), run.run_id).output(run.model)
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
                   allow_gaps: bool = False) -> Checked:
    """The stage message checked: names, types; nothing is read yet."""
    job = check_job_id(job)
    model = check_model_name(model)
    for name, value in (("source", source), ("run", run), ("to", to)):
        if value is not None and not isinstance(value, str):
            raise BadMessageTypeError(f"{name} must be a string, got {value!r}")
    if not isinstance(source, str):
        raise BadMessageTypeError(f"source must be a store URL, got {source!r}")
    for name, flag in (("cleanup", cleanup), ("allow_gaps", allow_gaps)):
        if not isinstance(flag, bool):
            raise BadMessageTypeError(f"{name} must be true or false, got {flag!r}")
    return Checked(job, (source, model, job, run, to, cleanup, allow_gaps), {},
                   {"model": model, "source": source})


@get_app().task(name="chkq.stage", bind=True, base=ChkqTask)
@task_lifecycle(_stage_message)
def stage(self: ChkqTask, source: str, model: str, job: str, run: str | None = None,
          to: str | None = None, cleanup: bool = False,
          allow_gaps: bool = False) -> dict[str, Any]:
    """List and pin the run in the store, claim the job for this worker, launch the fetches.

    Delivered again after the job was claimed, it launches the same fetches
    (same ids) on the worker that claimed it.
    """
    if protocol.cancelled(job) is not None:
        return {"cancelled": True}
    recorded = store_job(job)
    if recorded is None:
        check_store_allowed(source)
        found = find_store_run(source, model, run)
        destination = destination_of(found, to)
        check_store_allowed(destination[0])
        check_destination_free(found, destination)
        private_directory(get_settings().scratch_root)
        sweep_workspaces()
        recorded = StoreJob.from_record(protocol.record_store_job(job, StoreJob(
            found, destination, own_queue(self), job, cleanup).to_record()), job)
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
    units = fetch_units(found.run.objects, get_settings().task_bytes, get_settings().task_files)
    fetches = [fetch.si(job, i).set(task_id=task_id(job, "fetch", i), queue=queue)
               for i in range(len(units))]
    chord(group(fetches).set(task_id=task_id(job, "fetches")), plan).apply_async()


def _fetch_message(self: ChkqTask, job: str, unit: int) -> Checked:
    job = check_job_id(job)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 0:
        raise BadMessageError(f"job {job} has no fetch unit {unit!r}")
    return Checked(job, (job, unit), {}, {"unit": unit})


@get_app().task(name="chkq.fetch", bind=True, base=ChkqTask)
@task_lifecycle(_fetch_message)
def fetch(self: ChkqTask, job: str, unit: int) -> dict[str, Any]:
    """Write one batch of the run's objects into the job's run directory, checked against pins."""
    found = store_job(job)
    if found is None:
        raise JobStateGoneError(f"job {job} has no store record: nothing to fetch")
    if found.queue != own_queue(self):
        raise BadMessageError(f"fetch unit {unit} of job {job} belongs to {found.queue}, "
                              f"not to this worker ({own_queue(self)}): refused")
    units = fetch_units(found.run.objects, get_settings().task_bytes, get_settings().task_files)
    if unit >= len(units):
        raise BadMessageError(f"job {job} has no fetch unit {unit!r}")
    if protocol.cancelled(job) is not None:
        return {"cancelled": True}
    first, stop = units[unit]
    names = [o.name for o in found.run.objects[first:stop]]
    found.run_dir.mkdir(parents=True, exist_ok=True)
    written = fetch_objects(found.run, names, found.run_dir)
    return {"objects": len(names), "bytes": written}


def publish_output(found: StoreJob, job: str, output: Path, files: list[str]) -> dict[str, Any]:
    """Publish a store job's verified output, record it, and delete the sources if asked.

    Delivered again, it recognises its own object at the destination (same
    bytes) and its own log entry, and does not publish twice; the parts of an
    upload of the same key left unfinished (a publish killed midway) are
    aborted once the object is there.
    """
    store = open_store(found.destination[0])
    published: Published = publish_file(store, found.destination[1], output,
                                        part_bytes=get_settings().upload_part_bytes)
    abandoned = [u for u in store.stray_uploads(published.key) if u.key == published.key]
    for upload in abandoned:
        store.abort_upload(upload)
    run = found.run
    if run.run_id is not None:
        CheckpointLog(open_store(run.store_url), run.run_id).record_output(OutputEntry(
            model=run.model, key=published.key, size=published.size, sha256=published.sha256,
            checkpoints=tuple(o.version for o in run.objects),
            names=tuple(o.name for o in run.objects), job=job))
    warnings = delete_sources(run) if found.cleanup else []
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
            ended = (protocol.finished_result(job) or protocol.failure(job)
                     or protocol.cancelled(job))
            if ended is not None and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(job)
    return removed


def stage_signature(source: str, model: str, job: str, *, run: str | None = None,
                    to: str | None = None, cleanup: bool = False,
                    allow_gaps: bool = False) -> Any:
    """The message that starts a store job: ``chkq.stage``, with ``chkq.fail`` as errback."""
    kwargs: dict[str, Any] = {"run": run, "to": to, "cleanup": cleanup}
    if allow_gaps:
        kwargs["allow_gaps"] = True
    return signature("chkq.stage", args=(source, model, job), kwargs=kwargs,
                     app=get_app(), immutable=True).set(
        task_id=task_id(job, "stage"), link_error=[fail_signature("", model, job)])


__all__ = ["StoreJob", "fail_signature", "publish_output", "stage_signature", "store_job"]
