"""A store job spread over every node: its output assembled in the store from parts.

::

    chkq.stage ──► chord(chkq.fetch × batches: metadata only) ──► chkq.plan
               ──► chord(chkq.part × parts, on any node) ──► chkq.assemble (any node: publishes)

For a run whose rows are all plain chunk bytes (:func:`chkq.consolidation.output_parts.eligible`),
the staging worker fetches only the sources' metadata (the chunks are holes,
:mod:`chkq.consolidation.mirror`), plans as for any job and writes the skeleton,
sparse, in its scratch directory. The output is then its skeleton's bytes
with each source's rows at the addresses the skeleton allocated: a sequence
of source ranges and skeleton ranges, cut into the parts of one upload
shared by every node (:mod:`chkq.stores.shared_upload`). A part that is one
long source range is copied by the store itself (S3 ``UploadPartCopy``, a
local store's ``copy_file_range``); any other part is built by whichever
node takes it, from pinned ranged reads and the skeleton's bytes, which the
assembly record carries (metadata: about a thousandth of a large output).
The staging worker checks the skeleton against the template before it opens
the upload; from then on every step reads what it needs from the records
and the store, so the job survives the staging node's loss. ``chkq.assemble``
completes the upload create-if-absent once every part is recorded, then
proves the object from its metadata alone: its chunk index places every
chunk where the plan put it, and the store's checksums are the parts'.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import logging
import os
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import h5py
from celery import chord, group
from celery.exceptions import Ignore

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.checkpoint_files import stored_chunks
from chkq.consolidation.copy_rows import open_source
from chkq.consolidation.encoded_parts import write_chunks
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.output_parts import (
    SKELETON,
    OutputPart,
    Piece,
    build_part,
    chunk_maps,
    cut_parts,
    output_pieces,
    part_reads,
    parts_from_record,
)
from chkq.consolidation.plan import Plan
from chkq.consolidation.stamps import check_descriptor
from chkq.consolidation.temporaries import check_job_id
from chkq.errors import (
    BadCheckpointError,
    BadMessageError,
    CheckpointChangedError,
    ForgedRecordError,
    JobStateGoneError,
    OutputMismatchError,
    UnprovenJobError,
)
from chkq.jobs import keys
from chkq.jobs.records import check_target, task_id
from chkq.rundir import READ
from chkq.staging import SourceObject
from chkq.stores.base import CheckpointStore, ObjectVersion
from chkq.stores.objects import ObjectChecksums
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
from chkq.tasks.store_verify import (
    assembled_key,
    discard_staged,
    finish_spread,
    launch_row_checks,
)

log = logging.getLogger("chkq.tasks")


def _destination(found: StoreJob) -> CheckpointStore:
    return open_store(found.destination[0], timeouts=get_settings().core().timeouts)


def _assembly(job: str) -> tuple[SharedUpload, int, list[OutputPart]]:
    """The job's upload, output size and parts, as recorded (checked: untrusted)."""
    record = records().assembly(job)
    if record is None:
        raise JobStateGoneError(f"job {job} has no assembly record: nothing to send")
    try:
        upload = SharedUpload.from_record(record["upload"])
        size = record["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size {size!r}")
        parts = parts_from_record(record["parts"], size)
    except (KeyError, TypeError, ValueError, BadMessageError) as exc:
        raise ForgedRecordError(f"job record {keys.job_record(job, 'assembly')} is not an "
                                f"output's assembly ({exc}): refused") from None
    return upload, size, parts


#: Most bytes of skeleton (metadata, fixed datasets) an assembly record carries, so that any
#: node builds any part: about a thousandth of a large run's output.
MAX_RECORDED_SKELETON = 64 << 20


def _skeleton_bytes(plan: Plan, pieces: list[Piece]) -> bytes:
    """The skeleton's bytes of ``pieces``, one after the other.

    Raises
    ------
    BadCheckpointError
        If they are more than :data:`MAX_RECORDED_SKELETON`.
    """
    total = sum(p.length for p in pieces)
    if total > MAX_RECORDED_SKELETON:
        raise BadCheckpointError(
            f"job {plan.job_id} cannot be spread over the nodes: its output holds {total:,} "
            f"bytes besides the rows (metadata, fixed datasets, filtered chunks encoded "
            f"again), more than the "
            f"{MAX_RECORDED_SKELETON:,} a job record carries; nothing was published")
    with plan.open_run() as run:
        fd = run.open_file(plan.job.temp, READ)
    try:
        check_descriptor(plan.job.temp, fd, plan.temp_inode)
        return b"".join(os.pread(fd, p.length, p.start) for p in pieces)
    finally:
        os.close(fd)


def _source_index(found: StoreJob, plan: Plan, file_index: int) -> int:
    """The index among the job's pinned objects of the one file ``file_index`` mirrors."""
    name = found.name_of(plan.files[file_index][0])
    for index, obj in enumerate(found.run.objects):
        if obj.name == name:
            return index
    raise UnprovenJobError(f"job {found.job} planned {name!r}, which is not one of its objects")


def _source(found: StoreJob, index: int) -> SourceObject:
    """Pinned object ``index`` of the job (a part's piece names it: untrusted)."""
    if not 0 <= index < len(found.run.objects):
        raise ForgedRecordError(f"job record {keys.job_record(found.job, 'assembly')} names "
                                f"object {index} of {len(found.run.objects)}: refused")
    return found.run.objects[index]


def lay_out_filtered(plan: Plan, found: StoreJob) -> None:
    """Write the filtered datasets' chunks into the sparse skeleton, their layout into ``plan``.

    Runs on the staging worker before the plan is recorded: the chunks
    encoded again read their source chunks from the pinned objects
    (:func:`chkq.consolidation.encoded_parts.write_chunks`).
    """
    if not any(d.mode == "chunks" for d in plan.datasets):
        return
    objects = [_source(found, _source_index(found, plan, f)) for f in range(len(plan.files))]
    store = open_store(found.run.store_url, timeouts=get_settings().core().timeouts)

    def read(file_index: int, start: int, length: int) -> bytes:
        return _pinned_range(store, found, objects[file_index], start, length)

    encoded = write_chunks(plan, read)
    log.info("job=%s filtered chunks laid out in the skeleton: %d bytes encoded again here",
             plan.job_id, encoded)


def _pinned_range(store: CheckpointStore, found: StoreJob, obj: SourceObject, start: int,
                  length: int) -> bytes:
    """``length`` bytes of the source at ``start``, of its pinned version, or a clear error."""
    data = store.get_range_pinned(obj.key, ObjectVersion(obj.size, obj.version), start, length)
    if data is None or len(data) != length:
        raise CheckpointChangedError(
            f"checkpoint file {found.run.url_of(obj.name)!r} changed since the job was "
            "planned (replaced, rewritten or deleted in the store): nothing was published")
    return data


def launch_parts(plan: Plan, found: StoreJob) -> None:
    """Lay out the output, open its upload (once), and send its parts, assembly as callback.

    Runs on the staging worker, where the sources' metadata and the skeleton
    are, and removes them once the parts are sent. Delivered again, it sends
    the same parts (same ids) to the upload recorded first, from the
    records; an upload it opened and lost the record to is aborted.
    """
    job = plan.job_id
    if records().assembly(job) is None:
        with plan.open_run() as run:
            fd = run.open_file(plan.job.temp, READ)
            try:
                check_descriptor(plan.job.temp, fd, plan.temp_inode)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)

            def opened(index: int) -> Any:
                fid, source_fd = open_source(run, plan, index)
                os.close(source_fd)
                return fid

            maps = chunk_maps(plan, opened)
        objects = [_source_index(found, plan, f) for f in range(len(plan.files))]
        pieces = [p if p.source == SKELETON else dataclasses.replace(p, source=objects[p.source])
                  for p in output_pieces(plan, size, maps)]
        parts = cut_parts(pieces, get_settings().upload_part_bytes)
        skeleton = _skeleton_bytes(plan, [p for p in pieces if p.source == SKELETON])
        check_plan_output(plan)
        store = _destination(found)
        upload = store.begin_shared_upload(assembled_key(found))
        recorded = records().record_assembly(job, {
            "upload": upload.to_record(), "size": size,
            "parts": [p.to_record() for p in parts],
            "skeleton": base64.b64encode(zlib.compress(skeleton, 6)).decode()})
        if recorded["upload"] != upload.to_record():
            store.abort_shared_upload(upload)
    _, size, parts = _assembly(job)
    built = sum(p.length for p in parts if not p.copied)
    log.info("job=%s spread over the nodes: %d parts of %d bytes, %d copied by the store, "
             "%d bytes built", job, len(parts), size, sum(p.copied for p in parts), built)
    out_dir, model = plan.out_dir, plan.model
    # Any node assembles: what it needs is in the records, so losing this node from here on
    # leaves the job to the others. With --verify-data the job ends with its publish instead.
    assemble_sig = assemble.si(out_dir, model, job).set(
        task_id=task_id(job, "assemble") if found.verify_data else job,
        link_error=[fail_signature(out_dir, model, job)])
    sends = [send_part.si(job, index, bytes=part.length, copied=part.copied).set(
        task_id=task_id(job, "part", index)) for index, part in enumerate(parts)]
    chord(group(sends).set(task_id=task_id(job, "parts")), assemble_sig).apply_async()
    # The mirrors and the skeleton are needed no more: every later step reads the records.
    discard_workspace(job)


def _part_message(self: ChkqTask, job: str, unit: int, **what: Any) -> Checked:
    job = check_job_id(job)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 0:
        raise BadMessageError(f"job {job} has no part {unit!r}")
    return Checked(job, (job, unit), {}, {"unit": unit})


@get_app().task(name="chkq.part", bind=True, base=ChkqTask)
@task_lifecycle(_part_message)
def send_part(self: ChkqTask, job: str, unit: int) -> dict[str, Any]:
    """Send one part of a spread job's output: copied by the store, or built here and sent.

    Sent again (a redelivery), it sends the same bytes as the same part.
    """
    found = store_job(job)
    if found is None or not found.spread:
        raise JobStateGoneError(f"job {job} is not a spread store job: no part to send")
    if job_ended(job):
        return {"ended": True}
    upload, _, parts = _assembly(job)
    if unit >= len(parts):
        raise BadMessageError(f"job {job} has no part {unit!r}")
    part = parts[unit]
    store = _destination(found)
    if part.copied:
        piece = part.pieces[0]
        obj = _source(found, piece.source)
        sent = store.copy_part(upload, part.number, obj.key, ObjectVersion(obj.size, obj.version),
                               piece.start, piece.length, part.offset)
    else:
        sent = store.put_part(upload, part.number, _built(found, part, parts), part.offset)
    records().record_part(job, unit, sent.to_record())
    return {"part": part.number, "bytes": part.length, "copied": part.copied}


def _built(found: StoreJob, part: OutputPart, parts: list[OutputPart]) -> bytes:
    """A part's bytes: its source ranges read pinned (nearby ones at once), its skeleton bytes
    from the assembly record."""
    store = open_store(found.run.store_url, timeouts=get_settings().core().timeouts)
    fetched: dict[int, list[tuple[int, bytes]]] = {}
    for source, start, length in part_reads(part):
        data = _pinned_range(store, found, _source(found, source), start, length)
        fetched.setdefault(source, []).append((start, data))
    skeleton = _recorded_skeleton(found.job, parts) if part.needs_skeleton else None

    def read(source: int, start: int, length: int) -> bytes:
        if skeleton is not None and source == SKELETON:
            return skeleton(start, length)
        for at, data in fetched[source]:
            if at <= start and start + length <= at + len(data):
                return data[start - at:start - at + length]
        raise AssertionError(f"bytes {start}+{length} of object {source} were not read")

    return build_part(part, read)


def _recorded_skeleton(job: str, parts: list[OutputPart]) -> Callable[[int, int], bytes]:
    """Reads of the skeleton's bytes from the assembly record (checked: untrusted).

    ``parts``: the record's parts, as :func:`_assembly` checked them.
    """
    record = records().assembly(job) or {}
    pieces = [p for part in parts for p in part.pieces if p.source == SKELETON]
    where = f"job record {keys.job_record(job, 'assembly')}"
    try:
        data = zlib.decompress(base64.b64decode(str(record.get("skeleton")), validate=True))
    except (ValueError, zlib.error) as exc:
        raise ForgedRecordError(f"{where}: its skeleton cannot be read ({exc}): "
                                "refused") from None
    if len(data) != sum(p.length for p in pieces):
        raise ForgedRecordError(f"{where}: its skeleton does not fit its pieces: refused")
    starts, at = {}, 0
    for p in pieces:
        starts[p.start] = at
        at += p.length
    ordered = sorted(starts)

    def read(start: int, length: int) -> bytes:
        first = ordered[bisect.bisect_right(ordered, start) - 1]
        begin = starts[first] + start - first
        return data[begin:begin + length]
    return read


def _assemble_message(self: ChkqTask, out_dir: str, model: str, job: str) -> Checked:
    return Checked(check_job_id(job), (out_dir, model, job), {}, {"model": model})


@get_app().task(name="chkq.assemble", bind=True, base=ChkqTask)
@task_lifecycle(_assemble_message)
def assemble(self: ChkqTask, out_dir: str, model: str, job: str) -> dict[str, Any]:
    """Complete the output's upload once every part is recorded, prove it, and finish the job."""
    done = records().finished_result(job)
    if done is not None:
        return done
    found = store_job(job)
    if found is None or not found.spread:
        raise JobStateGoneError(f"job {job} is not a spread store job")
    plan = records().layout_plan(job)
    if plan is None:
        raise JobStateGoneError(f"job {job} has no recorded plan: it failed, was cancelled, "
                                "or its records expired")
    # The planning worker's directory, maybe on another node: named, never touched.
    check_target(job, (out_dir, found.run.model), (plan.out_dir, plan.model))
    upload, size, parts = _assembly(job)
    sent = records().parts(job)
    missing = [u for u in range(len(parts)) if u not in sent]
    if missing:
        raise UnprovenJobError(
            f"job {job} cannot be assembled: parts {missing[:5]}"
            f"{' and more' if len(missing) > 5 else ''} of {len(parts)} recorded nothing "
            "(the parts chord's callback ran before they finished); nothing was published")
    try:
        records_of = [PartRecord.from_record(sent[u]) for u in range(len(parts))]
    except (TypeError, ValueError) as exc:
        raise ForgedRecordError(f"job record {keys.job_record(job, 'parts')} is not a list "
                                f"of sent parts ({exc}): refused") from None
    for part, record in zip(parts, records_of, strict=True):
        if (record.number, record.size) != (part.number, part.length):
            raise UnprovenJobError(f"job {job}'s part {part.number} was recorded as part "
                                   f"{record.number} of {record.size} bytes, not "
                                   f"{part.length}: nothing was published")
    if records().cancelled(job) is not None or records().failure(job) is not None:
        abort_assembly(job, found)
        raise Ignore()
    store = _destination(found)
    key = assembled_key(found)
    expected = store.shared_upload_checksums(records_of)
    completed = store.exists(key) and checksums_match(store.checksums(key), expected)
    # Completed already: this step delivered again after it completed the upload.
    if not completed and not store.complete_shared_upload(upload, records_of):
        raise StoreDestinationExistsError(
            f"output {found.output_url} was created by someone else while job {job} "
            "assembled it; it is never overwritten, and nothing of this job's was left")
    try:
        if not checksums_match(store.checksums(key), expected):
            raise OutputMismatchError(
                f"the assembled {found.output_url} is not the {len(parts)} parts sent: the "
                f"store's checksums of it ({store.checksums(key)}) are not theirs ({expected})")
        proof = prove_assembled(store, key, plan, size, parts) + "; " + _described(expected)
    except OutputMismatchError:
        store.delete(key)  # this job's own object, just completed: never left unproven
        raise
    summary = {"bytes": size, "parts": len(parts),
               "copied_bytes": sum(p.length for p in parts if p.copied),
               "through_workers": sum(p.length for p in parts
                                      if not p.copied or not store.copies_ranges),
               "proof": proof}
    if found.verify_data:
        return launch_row_checks(plan, found, store.version(key), summary)
    return finish_spread(found, plan, summary)


def _described(checksums: ObjectChecksums) -> str:
    """What the store's checksums proved, for the job's result."""
    said = [f"{checksums.size:,} bytes"]
    if checksums.sha256:
        said.append(f"composite SHA-256 {checksums.sha256[:12]}… of {checksums.sha256_parts} parts")
    if checksums.etag:
        said.append(f"ETag {checksums.etag}")
    if checksums.crc32c is not None:
        said.append(f"CRC32C {checksums.crc32c:08x}")
    return "the store's checksums are the parts': " + ", ".join(said)


def prove_assembled(store: CheckpointStore, key: str, plan: Plan, size: int,
                    parts: list[OutputPart]) -> str:
    """Prove the assembled object's metadata: the skeleton's, with every chunk where planned.

    Called once the store's checksums showed the object to be exactly the
    parts sent, on any node. The parts' skeleton bytes are the assembly
    record's (sealed by the planning worker, which checked the skeleton
    against the template before it opened the upload); laid out at their
    offsets in a sparse file in this worker's scratch directory, their chunk
    index, read through HDF5, must give each dataset's planned address for
    every chunk, with the planned rows: a raw dataset's unfiltered, a
    filtered one's of the planned stored size and filter mask (a moved
    chunk's are its source's, the piece taken from that source chunk's own
    address; a chunk encoded again was read back against its source rows
    before the upload was opened, :mod:`chkq.consolidation.encoded_parts`);
    and the object's first bytes, read back, must be the skeleton's (the
    superblock). With the pieces derived from the sources' own chunk indexes
    and each copy pinned to its source's version, every row then lies where
    the output's own index says. No row is read, and of the object only its
    first piece (a ranged read).

    Raises
    ------
    OutputMismatchError
        Naming what differs.
    """
    if store.size(key) != size:
        raise OutputMismatchError(f"the assembled {key} holds {store.size(key)} bytes, "
                                  f"{size} were planned")
    pieces = [p for part in parts for p in part.pieces if p.source == SKELETON]
    recorded = _recorded_skeleton(plan.job_id, parts)
    head = pieces[0] if pieces and pieces[0].offset == 0 else None
    if head is not None and store.get_range(key, 0, head.length) != recorded(0, head.length):
        raise OutputMismatchError(f"the assembled {key} does not begin with its skeleton")
    root = get_settings().scratch_root
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    checked = 0
    with tempfile.NamedTemporaryFile(dir=root, prefix=f".{plan.job_id}-",
                                     suffix=".skeleton") as image:
        os.ftruncate(image.fileno(), size)
        for p in pieces:
            os.pwrite(image.fileno(), recorded(p.start, p.length), p.start)
        with h5py.File(image.name, "r", locking=False) as out:
            for d in plan.datasets:
                dsid = out[d.name].id
                found = [info for _, info in stored_chunks(dsid, tuple(d.chunk), dsid.shape)]
                if [None if i is None else int(i.byte_offset) for i in found] != d.chunk_offsets:
                    raise OutputMismatchError(f"the assembled {key}'s dataset /{d.name} does "
                                              "not place its chunks where they were planned")
                if d.mode == "chunks":
                    stored = [None if i is None else (int(i.size), int(i.filter_mask))
                              for i in found]
                    planned = list(zip(d.chunk_sizes, d.chunk_masks, strict=True))
                else:
                    stored = [None if i is None else (0, int(i.filter_mask)) for i in found]
                    planned = [(0, 0)] * len(found)
                if stored != planned or dsid.shape[0] != d.total:
                    raise OutputMismatchError(f"the assembled {key}'s dataset /{d.name} is not "
                                              f"{d.total} rows stored as planned")
                checked += len(found)
    return (f"{checked} chunks placed as planned in the metadata the parts were built from "
            f"({len(pieces)} runs), and the superblock read back")


def abort_assembly(job: str, found: StoreJob) -> None:
    """Abort a failed or cancelled spread job's upload, if it opened one; never raise.

    Its parts are then gone from the store, and a part sent after this fails
    against the aborted upload. A ``--verify-data`` job's staged object goes too.
    """
    discard_staged(job, found)
    try:
        if records().assembly(job) is None:
            return
        upload, _, _ = _assembly(job)
        _destination(found).abort_shared_upload(upload)
    except Exception:  # noqa: BLE001 - the failure is recorded whatever the abort meets
        log.exception("job=%s failed; aborting its upload failed too (chkq gc removes it)", job)
