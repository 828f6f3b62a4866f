"""``--verify-data`` for a store job spread over every node: every row read back before publishing.

::

    … ──► chkq.assemble (completes at a staging key) ──► chord(chkq.verify_object × verify units,
          on any node) ──► chkq.publish_verified (the staged object copied to the key)

A spread job's output is proven by ``chkq.assemble`` from metadata alone
(:func:`chkq.tasks.store_parts.prove_assembled`). With ``--verify-data`` it
is completed at a staging key of its own instead of the output's
(:func:`assembled_key`, beside it), proven there the same way, and then
read back: the plan's verify units (``plan.verify_units``, the files the
one-node canvas verifies per task) each compare every output row of their
files, read from the staged object through pinned ranged reads
(:class:`chkq.stores.fileobj.ObjectFile`), with the rows of the pinned
source objects (:func:`chkq.consolidation.verify_rows.verify_opened`). Once
every unit recorded its rows and they add up to the plan's, the staged
object is copied to the output's key create-if-absent, inside the store
(a shared upload of ranged copies of it: S3 ``UploadPartCopy``, a local
directory's ``copy_file_range``; GCS, which has no ranged copy, passes the
bytes through the publishing node), proven by the store's checksums of the
copies, and the staged object is deleted. The output's key never holds an
object whose rows were not read back; a failed job leaves nothing at either
key (:func:`discard_staged`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import h5py
from celery import chord, group
from celery.exceptions import Ignore
from h5py import h5f

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.output_parts import COPY_PART_BYTES
from chkq.consolidation.plan import Plan
from chkq.consolidation.temporaries import check_job_id
from chkq.consolidation.verify_rows import VerifyStats, verify_opened
from chkq.errors import (
    BadMessageError,
    CheckpointChangedError,
    ForgedRecordError,
    JobStateGoneError,
    OutputMismatchError,
    UnprovenJobError,
)
from chkq.jobs import keys
from chkq.jobs.records import check_target, task_id
from chkq.staging import SourceObject, delete_sources
from chkq.stores.base import CheckpointStore, ObjectVersion
from chkq.stores.fileobj import ObjectFile
from chkq.stores.publish import staged_key
from chkq.stores.shared_upload import PartRecord, SharedUpload, checksums_match
from chkq.stores.url import open_store
from chkq.tasks.base import Checked, ChkqTask, task_lifecycle
from chkq.tasks.canvas import fail_signature
from chkq.tasks.from_store import (
    StoreDestinationExistsError,
    StoreJob,
    discard_workspace,
    job_ended,
    store_job,
)
from chkq.tasks.state import records

log = logging.getLogger("chkq.tasks")

#: Bytes of each ranged read of the row check, and blocks kept per object read: a verify
#: unit holds at most two objects open (the output and one source), 64 MiB of blocks.
READ_BLOCK_BYTES = 8 << 20
READ_BLOCKS = 4


def assembled_key(found: StoreJob) -> str:
    """Where a spread job completes its output: the output's key, or with ``--verify-data``
    a key of the job's own beside it, until every row was read back."""
    key = found.destination[1]
    return staged_key(key, check_job_id(found.job)) if found.verify_data else key


def _store(url: str) -> CheckpointStore:
    return open_store(url, timeouts=get_settings().core().timeouts)


def planned_objects(found: StoreJob, plan: Plan) -> list[SourceObject]:
    """The pinned object each file of ``plan`` is, by file index.

    The plan names the files in the staging worker's scratch directory
    (``plan.out_dir``, maybe another node's): their names there are the run's.
    """
    by_name = {o.name: o for o in found.run.objects}
    prefix = plan.out_dir.rstrip("/") + "/"
    planned = []
    for entry in plan.files:
        name = str(entry[0]).removeprefix(prefix)
        if name not in by_name:
            raise UnprovenJobError(f"job {found.job} planned {name!r}, which is not one of "
                                   "its objects")
        planned.append(by_name[name])
    return planned


def _changed(url: str) -> Callable[[str], Exception]:
    return lambda _name: CheckpointChangedError(
        f"checkpoint file {url!r} changed since the job was planned (replaced, rewritten or "
        "deleted in the store): nothing was published")


def read_back(found: StoreJob, plan: Plan, staged: ObjectVersion, first: int, stop: int,
              progress: Callable[[int], None] | None = None) -> VerifyStats:
    """Compare the staged output's rows of files ``[first, stop)`` with their pinned sources.

    Raises
    ------
    OutputMismatchError
        Naming the dataset, the output row and the source object's URL.
    CheckpointChangedError
        If the staged object or a source is not the version pinned any more.
    """
    sources = planned_objects(found, plan)
    source_store = _store(found.run.store_url)
    staged_url = found.destination[0].rstrip("/") + "/" + assembled_key(found)
    output = ObjectFile(_store(found.destination[0]), assembled_key(found),
                        block_size=READ_BLOCK_BYTES, cache_blocks=READ_BLOCKS, pinned=staged,
                        changed=lambda _name: CheckpointChangedError(
                            f"the staged output {staged_url} of job {found.job} changed before "
                            "its rows were read back: nothing was published"))
    opened: list[ObjectFile] = [output]

    def open_source(index: int) -> h5f.FileID:
        obj = sources[index]
        file = ObjectFile(source_store, obj.key, block_size=READ_BLOCK_BYTES,
                          cache_blocks=READ_BLOCKS, pinned=ObjectVersion(obj.size, obj.version),
                          changed=_changed(found.run.url_of(obj.name)))
        opened[1:] = [file]
        return h5py.File(file, "r").id

    try:
        with h5py.File(output, "r") as out:
            return verify_opened(plan, first, stop, out.id, open_source, progress,
                                 source_name=lambda i: found.run.url_of(sources[i].name))
    except OutputMismatchError as exc:
        raise OutputMismatchError(f"job {found.job}, reading its output back from the store: "
                                  f"{exc}; nothing was published") from None
    except (OSError, ValueError, KeyError, RuntimeError):
        failure = next((f.failure for f in opened if f.failure is not None), None)
        if failure is not None:
            raise failure from None
        raise


def _verifying(job: str) -> StoreJob:
    found = store_job(job)
    if found is None or not found.spread or not found.verify_data:
        raise JobStateGoneError(f"job {job} is not a spread store job whose rows are read back")
    return found


def _staged(job: str) -> tuple[str, ObjectVersion, dict[str, Any]]:
    """The staged object's key and version, and what its assembly proved (checked)."""
    record = records().staged(job)
    if record is None:
        raise JobStateGoneError(f"job {job} has no staged output: nothing to read back")
    try:
        size, version, summary = record["size"], record["version"], record["summary"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size {size!r}")
        if not isinstance(version, str) or not isinstance(summary, dict):
            raise ValueError("version or summary")
        return str(record["key"]), ObjectVersion(size, version), summary
    except (KeyError, TypeError, ValueError) as exc:
        raise ForgedRecordError(f"job record {keys.job_record(job, 'staged')} is not a staged "
                                f"output ({exc}): refused") from None


def launch_row_checks(plan: Plan, found: StoreJob, version: ObjectVersion,
                      summary: dict[str, Any]) -> dict[str, Any]:
    """Record the staged object and send the verify units, the publish as their callback.

    ``summary``: what the assembly proved and sent (the job's result has it).
    """
    job = plan.job_id
    records().record_staged(job, {"key": assembled_key(found), "size": version.size,
                                  "version": version.version, "summary": summary})
    publish = publish_verified.si(plan.out_dir, plan.model, job).set(
        task_id=job, link_error=[fail_signature(plan.out_dir, plan.model, job)])
    checks = [verify_object.si(job, unit, files=last - first).set(
        task_id=task_id(job, "verify", unit))
        for unit, (first, last) in enumerate(plan.verify_units)]
    chord(group(checks).set(task_id=task_id(job, "verifies")), publish).apply_async()
    log.info("job=%s assembled at %s; its rows are read back by %d verify units", job,
             assembled_key(found), len(checks))
    return {"staged": assembled_key(found), "verify_units": len(checks)}


def _unit_message(self: ChkqTask, job: str, unit: int, **what: Any) -> Checked:
    job = check_job_id(job)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 0:
        raise BadMessageError(f"job {job} has no verify unit {unit!r}")
    return Checked(job, (job, unit), {}, {"unit": unit})


@get_app().task(name="chkq.verify_object", bind=True, base=ChkqTask)
@task_lifecycle(_unit_message)
def verify_object(self: ChkqTask, job: str, unit: int) -> dict[str, Any]:
    """Read the staged output's rows of one verify unit back and compare them with the sources."""
    found = _verifying(job)
    if job_ended(job):
        return {"ended": True}
    plan = records().layout_plan(job)
    if plan is None:
        raise JobStateGoneError(f"job {job} has no recorded plan")
    if unit >= len(plan.verify_units):
        raise BadMessageError(f"job {job} has no verify unit {unit!r}")
    _, staged, _ = _staged(job)
    first, stop = plan.verify_units[unit]
    total = sum(plan.file_rows(i) for i in range(first, stop))
    stats = read_back(found, plan, staged, first, stop,
                      lambda done: self.report(done, total, job=job, kind="verify"))
    records().record_verified(job, unit, [staged.size, stats.rows, stats.bytes])
    self.report(stats.rows, stats.rows, job=job, kind="verify")
    return {"rows": stats.rows, "bytes": stats.bytes, "files": stats.files}


def _publish_message(self: ChkqTask, out_dir: str, model: str, job: str) -> Checked:
    return Checked(check_job_id(job), (out_dir, model, job), {}, {"model": model})


def _rows_read(job: str, plan: Plan, size: int) -> tuple[int, int]:
    """Rows and bytes every verify unit recorded, once all did and they are the plan's."""
    verified = records().verified(job)
    units = len(plan.verify_units)
    missing = [u for u in range(units) if u not in verified]
    if missing:
        raise UnprovenJobError(
            f"job {job} cannot be published: verify units {missing[:5]}"
            f"{' and more' if len(missing) > 5 else ''} of {units} recorded nothing (the "
            "verify chord's callback ran before they finished); nothing was published")
    try:
        stamps = [(int(s), int(r), int(b)) for s, r, b in (verified[u] for u in range(units))]
    except (TypeError, ValueError) as exc:
        raise ForgedRecordError(f"job record {keys.job_record(job, 'verified')} is not a list "
                                f"of rows read back ({exc}): refused") from None
    rows = sum(r for _, r, _ in stamps)
    if any(s != size for s, _, _ in stamps) or rows != plan.total_rows:
        raise UnprovenJobError(f"job {job}'s verify units read {rows} rows back, not the "
                               f"{plan.total_rows} planned, of its staged output: nothing was "
                               "published")
    return rows, sum(b for _, _, b in stamps)


@get_app().task(name="chkq.publish_verified", bind=True, base=ChkqTask)
@task_lifecycle(_publish_message)
def publish_verified(self: ChkqTask, out_dir: str, model: str, job: str) -> dict[str, Any]:
    """Copy the staged output, every row read back, to the output's key; finish the job."""
    done = records().finished_result(job)
    if done is not None:
        return done
    found = _verifying(job)
    plan = records().layout_plan(job)
    if plan is None:
        raise JobStateGoneError(f"job {job} has no recorded plan")
    check_target(job, (out_dir, found.run.model), (plan.out_dir, plan.model))
    staged_key, staged, summary = _staged(job)
    rows, read = _rows_read(job, plan, staged.size)
    if records().cancelled(job) is not None or records().failure(job) is not None:
        discard_staged(job, found)
        raise Ignore()
    store = _store(found.destination[0])
    try:
        copied = publish_copy(store, job, staged_key, staged, found)
    except BaseException:
        # This step's id is the job's: its failure is what the client sees first, so the
        # staged object goes before it, not only in the errback.
        discard_staged(job, found)
        raise
    store.delete(staged_key)
    return finish_spread(found, plan, {
        **summary, "verified_rows": rows, "verified_bytes": read,
        "proof": f"{summary['proof']}; every row read back from the store and compared with "
                 f"its source ({rows:,} rows in {len(plan.verify_units)} verify units); "
                 f"published by a copy in the store ({copied})"})


def publish_copy(store: CheckpointStore, job: str, staged_key: str, staged: ObjectVersion,
                 found: StoreJob) -> str:
    """Copy the staged object to the output's key, create-if-absent; what proved the copy.

    The copy is a shared upload of ranged copies of the staged object
    (pinned to its version), recorded before it completes: delivered again,
    the step completes the recorded upload, or recognises the object it
    completed by the store's checksums of its parts.

    Raises
    ------
    StoreDestinationExistsError
        If another object took the key meanwhile (left as found; the upload aborted).
    OutputMismatchError
        If the store's checksums of the object are not the copies' (deleted: it was this job's).
    """
    key = found.destination[1]
    recorded = records().publish_record(job)
    if recorded is None:
        upload = store.begin_shared_upload(key)
        parts = [store.copy_part(upload, number, staged_key, staged, start,
                                 min(COPY_PART_BYTES, staged.size - start), start)
                 for number, start in enumerate(range(0, staged.size, COPY_PART_BYTES), 1)]
        recorded = records().record_publish(job, {"upload": upload.to_record(),
                                                  "parts": [p.to_record() for p in parts]})
        if recorded["upload"] != upload.to_record():
            store.abort_shared_upload(upload)
    try:
        upload = SharedUpload.from_record(recorded["upload"])
        parts = [PartRecord.from_record(p) for p in recorded["parts"]]
    except (KeyError, TypeError, ValueError, BadMessageError) as exc:
        raise ForgedRecordError(f"job record {keys.job_record(job, 'publish')} is not an "
                                f"output's publish ({exc}): refused") from None
    expected = store.shared_upload_checksums(parts)
    completed = store.exists(key) and checksums_match(store.checksums(key), expected)
    if not completed and not store.complete_shared_upload(upload, parts):
        raise StoreDestinationExistsError(
            f"output {found.output_url} was created by someone else while job {job} read its "
            "rows back; it is never overwritten, and nothing of this job's was left")
    for stray in store.stray_uploads(key):
        if stray.key == key:  # an earlier delivery's, begun but never recorded
            store.abort_upload(stray)
    if not checksums_match(store.checksums(key), expected):
        store.delete(key)
        raise OutputMismatchError(f"the copy of job {job}'s staged output at {found.output_url} "
                                  f"is not the staged object: the store's checksums of it "
                                  f"({store.checksums(key)}) are not the copies' ({expected})")
    return f"{len(parts)} ranged copies, {expected.size:,} bytes"


def finish_spread(found: StoreJob, plan: Plan, summary: dict[str, Any]) -> dict[str, Any]:
    """Delete the sources if asked, record the job's result, drop its records and workspace.

    ``summary``: what the assembly sent and proved (bytes, parts, proof...).
    """
    job = found.job
    warnings = []
    if found.cleanup:
        planned = {o.name for o in planned_objects(found, plan)}
        warnings = delete_sources(dataclasses.replace(found.run, objects=tuple(
            o for o in found.run.objects if o.name in planned)), core=get_settings().core())
    result = {"output": found.output_url, "rows": plan.total_rows, "files": len(plan.files),
              "datasets": {f"/{d.name}": d.total for d in plan.datasets}, "store": True,
              "spread": True, **summary, "warnings": warnings}
    records().record_finished(job, result)
    records().forget_progress(job)
    discard_workspace(job)
    log.info("job=%s published %s (%d bytes in %d parts; %s)", job, found.output_url,
             summary.get("bytes", 0), summary.get("parts", 0), summary.get("proof"))
    return result


def discard_staged(job: str, found: StoreJob) -> None:
    """Remove a failed or cancelled ``--verify-data`` job's staged object and its publish upload.

    The staged key is the job's own (named by its id); the object at the
    output's key is never touched here. Never raises.
    """
    if not found.verify_data:
        return
    try:
        store = _store(found.destination[0])
        store.delete(assembled_key(found))
        recorded = records().publish_record(job)
        if recorded is not None:
            store.abort_shared_upload(SharedUpload.from_record(recorded["upload"]))
    except Exception:  # noqa: BLE001 - the failure is recorded whatever the removal meets
        log.exception("job=%s failed; removing its staged output failed too", job)

