"""Planning a consolidation job: check the run, write the skeleton, cut the work.

``prepare`` is the core of the planning step. It writes the output's
skeleton under the job's temporary name and returns the plan; the task
layer keeps the plan where only workers write, and makes a redelivered
planning step reuse it (see ``chkq.tasks.protocol``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from h5py import h5a, h5d, h5ds, h5f, h5i, h5o, h5t

from chkq.consolidation.checkpoint_files import (
    MIN_HOLD_BYTES,
    UNWRITTEN_SLACK,
    FileScan,
    check_same_structure,
    open_checkpoint_id,
    refuse_outside_storage,
    scan_file,
    walk_objects,
)
from chkq.consolidation.chunk_encoding import lossy_filter
from chkq.consolidation.discovery import (
    Checkpoint,
    check_model_name,
    check_numbering,
    check_out_dir,
    find_checkpoints,
)
from chkq.consolidation.h5types import describe_type, element_count, has_reference, is_variable
from chkq.consolidation.plan import (
    DatasetPlan,
    Plan,
    cut_copy_units,
    cut_verify_units,
)
from chkq.consolidation.rowio import fill_element
from chkq.consolidation.skeleton import (
    create_skeleton,
    dataset_mode,
    output_access,
    recreation_plist,
)
from chkq.consolidation.stamps import FileStamp, check_same, open_unchanged, stamp_of
from chkq.consolidation.temporaries import JobFiles
from chkq.errors import BadCheckpointError, BadMessageError, NoCheckpointsError, OutputExistsError
from chkq.fsutil import check_writable_dir
from chkq.rundir import RunDir

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


def describe_template(reference: Path, names: list[str], totals: dict[str, list[int]],
                      block_bytes: int = DEFAULT_BLOCK_BYTES,
                      fd: int | None = None) -> list[DatasetPlan]:
    """Plan every extensible dataset from the template; refuse what cannot be copied exactly.

    Raises
    ------
    ValueError
        Naming the dataset and what chkq does not support (references of
        the new, 1.12-style kind in rows: they cannot be re-pointed; filters
        whose stored parameters a dataset created anew would not get,
        :func:`chkq.consolidation.skeleton.recreation_plist`), or
        what cannot be checked within ``block_bytes``
        (:func:`check_template_memory`).
    """
    fid = open_checkpoint_id(reference, fd)
    datasets = []
    try:
        for name in names:
            dsid = h5d.open(fid, name.encode())
            tid = dsid.get_type()
            if has_reference(tid) and (tid.get_class() != h5t.REFERENCE
                                       or not _classic_references(tid)):
                raise BadCheckpointError(
                    f"extensible dataset '/{name}' of {str(reference)!r} holds references "
                    f"inside a {describe_type(tid)} type, or of a kind chkq cannot re-point")
            shape = dsid.shape
            mode = dataset_mode(dsid)
            if mode == "chunks":
                # Copy tasks encode this dataset's chunks in part files created anew.
                recreation_plist(dsid, f"extensible dataset '/{name}' of {str(reference)!r}")
            datasets.append(DatasetPlan(
                name=name,
                mode=mode,
                offsets=totals[name],
                row_bytes=tid.get_size() * element_count(shape[1:]),
                chunk=list(dsid.get_create_plist().get_chunk()),
                trailing=list(shape[1:]),
                element_size=tid.get_size(),
            ))
        _refuse_external_template(fid, reference)
        check_template_memory(fid, reference, block_bytes)
    finally:
        fid.close()
    return datasets


def check_lossy_chunks(reference: Path, template: int, datasets: list[DatasetPlan],
                       paths: list[Path]) -> None:
    """Refuse a run whose lossily filtered rows could not all move as the chunks they are in.

    A lossy filter (:func:`chkq.consolidation.chunk_encoding.lossy_filter`) gives other
    values when rows are decoded and encoded again at other chunk
    boundaries, so such a dataset's chunks must move unchanged: every file
    with rows must start on the dataset's chunk grid in the output, and end
    on it too unless it ends the dataset. ``template`` is the template's
    descriptor, ``paths`` the run's files in row order.

    Raises
    ------
    BadCheckpointError
        Naming the dataset, its filter and the first file whose rows fall
        off the grid, before anything is written.
    """
    fid = open_checkpoint_id(reference, template)
    try:
        lossy = {d.name: lossy_filter(h5d.open(fid, d.name.encode()).get_create_plist())
                 for d in datasets if d.mode == "chunks"}
    finally:
        fid.close()
    for d in datasets:
        codec = lossy.get(d.name)
        if codec is None:
            continue
        per_chunk = d.chunk[0]
        for index, path in enumerate(paths):
            start, stop = d.rows_of(index)
            if stop == start or (start % per_chunk == 0
                                 and (stop % per_chunk == 0 or stop == d.total)):
                continue
            where = (f"starts at row {start} of the output" if start % per_chunk
                     else f"ends at row {stop} of the output, inside a chunk")
            raise BadCheckpointError(
                f"dataset '/{d.name}' is stored with a lossy filter ({codec}): chkq can only "
                f"move its chunks unchanged, and checkpoint file {str(path)!r} {where}, off "
                f"the dataset's grid of {per_chunk}-row chunks, so its rows would have to be "
                "encoded again, which would change their values; nothing was written (for "
                f"such a run each file's rows must be a multiple of {per_chunk}, but the "
                "last file's)")


def check_memory(scans: list[FileScan], block_bytes: int) -> None:
    """Refuse a run whose rows a task could not move within ``block_bytes`` at once.

    (Or within :data:`chkq.consolidation.checkpoint_files.MIN_HOLD_BYTES`, if that is larger.)

    Raises
    ------
    ValueError
        Naming the file, the dataset and the bytes it needs (:func:`memory_need`).
    """
    hold = max(block_bytes, MIN_HOLD_BYTES)
    for scan in scans:
        need, name = scan.memory
        if need > hold:
            raise BadCheckpointError(
                f"dataset '/{name}' of checkpoint file {str(scan.path)!r} needs {need} bytes "
                f"in memory at once (one row, or one chunk's rows when filtered), more than "
                f"a task may hold (CHKQ_BLOCK_BYTES={block_bytes}): raise CHKQ_BLOCK_BYTES "
                "or store smaller rows or chunks")


def check_template_memory(fid: h5f.FileID, reference: Path, block_bytes: int) -> None:
    """Refuse a template whose fixed data or attributes cannot be checked within a block.

    The whole-output check reads every attribute at once (HDF5 reads no
    part of one), an element at least, and a whole chunk of a filtered
    dataset (HDF5 decodes whole chunks); each must fit in ``block_bytes`` (or in
    :data:`chkq.consolidation.checkpoint_files.MIN_HOLD_BYTES`, if that is larger).

    Raises
    ------
    ValueError
        Naming the object and the bytes it needs.
    """
    where = f"checkpoint file {str(reference)!r}"
    hold = max(block_bytes, MIN_HOLD_BYTES)
    for raw, kind in [(b".", h5o.TYPE_GROUP), *walk_objects(fid, where)]:
        name = "" if raw == b"." else raw.decode("utf-8", "surrogateescape")
        obj = h5o.open(fid, raw)
        for index in range(h5a.get_num_attrs(obj)):
            attr = h5a.open(obj, index=index)
            need = attr.get_type().get_size() * attr.get_space().get_simple_extent_npoints()
            if need > hold:
                label = attr.name.decode("utf-8", "surrogateescape")
                raise BadCheckpointError(
                    f"attribute {label!r} of '/{name}' in {where} holds {need} "
                    f"bytes, more than a task may hold (CHKQ_BLOCK_BYTES="
                                 f"{block_bytes})")
        if kind != h5o.TYPE_DATASET:
            continue
        assert isinstance(obj, h5d.DatasetID)
        dcpl, size = obj.get_create_plist(), obj.get_type().get_size()
        need = size
        if dcpl.get_layout() == h5d.CHUNKED and dcpl.get_nfilters():
            need = size * element_count(dcpl.get_chunk())
        if need > hold:
            raise BadCheckpointError(
                f"dataset '/{name}' of {where} needs {need} bytes in memory at "
                "once (one element, or one chunk when filtered), more than a task "
                             f"may hold (CHKQ_BLOCK_BYTES={block_bytes})")


def _classic_references(tid: h5t.TypeID) -> bool:
    """Whether a reference type is an HDF5 1.8-style object or region reference."""
    return bool(tid.equal(h5t.STD_REF_OBJ) or tid.equal(h5t.STD_REF_DSETREG))


def _refuse_external_template(fid: h5f.FileID, reference: Path) -> None:
    """Refuse a template whose datasets keep data in other files (the output would too)."""

    for name, kind in walk_objects(fid, f"checkpoint file {str(reference)!r}"):
        if kind == h5o.TYPE_DATASET:
            refuse_outside_storage(reference, name.decode("utf-8", "surrogateescape"),
                                   h5d.open(fid, name).get_create_plist())


#: How netCDF-4 names a dimension scale that is not a variable (its length means nothing:
#: netCDF-C leaves it at 0 and takes an unlimited dimension's length from its variables).
_NETCDF_PHONY_SCALE = b"This is a netCDF dimension but not a netCDF variable"


def record_groups(fid: h5f.FileID, names: list[str]) -> dict[str, list[str]]:
    """Extensible datasets that share an extensible dimension scale on their first axis.

    Keyed by the scale's name; the members are the datasets attached to it
    on axis 0 (``DIMENSION_LIST``) and the scale itself when it is one of
    ``names`` and a variable (not netCDF-4's stand-in for a dimension
    without a coordinate variable). Their rows are records of one dimension:
    row ``i`` of each belongs with row ``i`` of the others (netCDF-4's
    unlimited dimensions, ``h5py``'s ``dims``). An attachment HDF5 cannot
    read is left out (the output keeps the template's attributes as they are).
    """
    extensible = set(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
        scales: list[h5d.DatasetID] = []
        try:
            if h5ds.get_num_scales(dsid, 0) > 0:
                h5ds.iterate(dsid, 0, scales.append)
        except (ValueError, RuntimeError, OSError, KeyError, TypeError):
            continue
        for scale in scales:
            scale_name = (h5i.get_name(scale) or b"").decode("utf-8", "surrogateescape")
            scale_name = scale_name.lstrip("/")
            if scale_name not in extensible:
                continue
            members = groups.setdefault(scale_name, [])
            if not members and not _phony_scale(scale):
                members.append(scale_name)
            if name not in members:
                members.append(name)
    return {scale: members for scale, members in groups.items() if len(members) > 1}


def _phony_scale(scale: h5d.DatasetID) -> bool:
    """Whether a dimension scale is netCDF-4's stand-in for a dimension with no variable."""
    try:
        if not h5a.exists(scale, b"NAME"):
            return False
        attr = h5a.open(scale, b"NAME")
        value = np.zeros((), dtype=f"S{max(1, attr.get_type().get_size())}")
        attr.read(value, mtype=attr.get_type())
    except (ValueError, RuntimeError, OSError, KeyError, TypeError):
        return False
    return bytes(value).startswith(_NETCDF_PHONY_SCALE)


def record_padding(reference: Path, scans: list[FileScan], template: int | None = None,
                   open_file: Callable[[int], int] | None = None) -> dict[str, dict[int, int]]:
    """Rows of fill value each file's shorter records of a dimension get, keeping records aligned.

    A netCDF-4 file may hold record variables of different lengths (the
    unlimited dimension's length is the longest's; readers see the missing
    records of the others as their fill value). Concatenated one by one, a
    shorter variable in any file but the run's last would have its later
    records shifted against the other variables of its dimension. So, as
    ``ncrcat`` does, in every file but the last each dataset of a record
    group (:func:`record_groups`, the template's, open as ``template``) is
    given as many rows as the group's longest there: the rows it lacks are
    its fill value (:func:`chkq.consolidation.rowio.read_padded`). The run's
    last file keeps its rows as they are (readers of the output see its
    missing records as the fill value, as in the file).

    ``open_file(i)`` opens file ``i`` of ``scans`` as planned (its stamp
    checked) and returns a descriptor, closed here once the file is
    checked; without it, files are opened by path.

    Returns
    -------
    Per dataset, per file index, the rows of fill value that file provides
    after its own (only where there are any).

    Raises
    ------
    BadCheckpointError
        Naming the file, the dimension and each dataset's rows where padding
        cannot be exact: a dataset of variable-length data or references, one
        with no fill value (or another than the template's), or more padding
        than :data:`UNWRITTEN_SLACK` bytes in one file.
    """
    fid = open_checkpoint_id(reference, template)
    try:
        groups = record_groups(fid, scans[0].extensible)
        fills: dict[str, bytes] = {}
        padding: dict[str, dict[int, int]] = {}
        for index, scan in enumerate(scans[:-1]):
            for scale, members in groups.items():
                counts = {name: scan.rows.get(name, 0) for name in members}
                longest = max(counts.values())
                for name, count in counts.items():
                    if count == longest:
                        continue
                    shown = ", ".join(f"'/{n}' {c}" for n, c in counts.items())
                    where = (f"checkpoint file {str(scan.path)!r} holds records of dimension "
                             f"'/{scale}' in datasets of different lengths ({shown} rows)")
                    if name not in fills:
                        fills[name] = _padding_fill(fid, name, where)
                    padding.setdefault(name, {})[index] = longest - count
        files_padded = sorted({f for pads in padding.values() for f in pads})
    finally:
        fid.close()
    for index in files_padded:
        scan = scans[index]
        pads = {name: rows[index] for name, rows in padding.items() if index in rows}
        _check_padding(scan, pads, fills, open_file(index) if open_file else None)
    return padding


def _padding_fill(fid: h5f.FileID, name: str, where: str) -> bytes:
    """The template's fill value of dataset ``name``, which its missing records get."""
    dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
    tid = dsid.get_type()
    if is_variable(tid) or has_reference(tid):
        raise BadCheckpointError(
            f"{where}: '/{name}' holds variable-length data or references, which chkq "
            "cannot give fill-value records to keep them aligned with the others")
    try:
        return fill_element(dsid)
    except ValueError as exc:
        raise BadCheckpointError(
            f"{where}: '/{name}' cannot be given fill-value records to keep it aligned with "
            f"the others: {exc}") from None


def _check_padding(scan: FileScan, pads: dict[str, int], fills: dict[str, bytes],
                   fd: int | None) -> None:
    """Refuse padding file ``scan`` cannot give exactly: another fill value, or too many bytes."""
    fid = open_checkpoint_id(scan.path, fd)
    try:
        total = 0
        for name, rows in pads.items():
            dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
            total += rows * dsid.get_type().get_size() * element_count(dsid.shape[1:])
            try:
                mine = fill_element(dsid)
            except ValueError as exc:
                mine = str(exc).encode()
            if mine != fills[name]:
                raise BadCheckpointError(
                    f"dataset '/{name}' of checkpoint file {str(scan.path)!r} lacks {rows} "
                    "records of its dimension, which would be its fill value, but its fill "
                    "value is not the template's: chkq cannot align its records exactly")
        if total > UNWRITTEN_SLACK:
            raise BadCheckpointError(
                f"checkpoint file {str(scan.path)!r} lacks {total} bytes of records its "
                f"dimensions' longest datasets have (at most {UNWRITTEN_SLACK} bytes of rows "
                "may be unwritten in a file): the file is damaged or forged")
    finally:
        fid.close()
        if fd is not None:
            os.close(fd)


def padded_offsets(name: str, scans: list[FileScan],
                   padding: dict[str, dict[int, int]]) -> list[int]:
    """:func:`chkq.consolidation.plan.offsets_of`, each file's fill-value records included."""
    pads = padding.get(name, {})
    offsets = [0]
    for index, scan in enumerate(scans):
        offsets.append(offsets[-1] + scan.rows[name] + pads.get(index, 0))
    return offsets


#: Files per scan unit when a run's files are scanned by several tasks at once.
SCAN_FILES = 256


@dataclass
class ScannedFile:
    """A checkpoint file as planning saw it: its stamp (taken first), then its skeleton."""

    scan: FileScan
    stamp: FileStamp


def find_run(directory: Path, model: str, run: RunDir | None = None, *,
             allow_gaps: bool = False) -> list[Checkpoint]:
    """The run's checkpoints, each holding at least one file, with no gap in their numbers.

    ``run``: the directory, already open (planning reads the run through one descriptor).

    Raises
    ------
    NoCheckpointsError
        If the run has no checkpoints (a FileNotFoundError).
    CheckpointGapError
        If numbers are missing between the first and last checkpoint and
        ``allow_gaps`` is false (a ValueError).
    BadCheckpointError
        If a checkpoint directory holds no ``.h5`` file (a ValueError).
    """
    checkpoints = find_checkpoints(directory, model, run)
    if not checkpoints:
        raise NoCheckpointsError(
            f"no checkpoints of model {model!r} in {str(directory)!r} "
            f"(expected {model}_chkNNNNN.h5 or {model}_chkNNNNN/)"
        )
    for checkpoint in checkpoints:
        if not checkpoint.files:
            raise BadCheckpointError(
                f"checkpoint directory {str(checkpoint.path)!r} holds no .h5 file")
    check_numbering(checkpoints, model, allow_gaps=allow_gaps)
    return checkpoints


def scan_units(count: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[first, stop)`` of a run's ``count`` files, one per scan unit."""
    return [(first, min(count, first + SCAN_FILES)) for first in range(0, count, SCAN_FILES)]


def scans_to_record(scanned: list[ScannedFile]) -> dict[str, Any]:
    """A scan unit's result as JSON-ready data, for the job's records.

    Each distinct skeleton is written once; each file then gives its path,
    the index of its skeleton, its extensible datasets' row counts (in the
    skeleton's order), its stamp and where plain chunks are: a few hundred
    bytes a file.
    """
    skeletons: list[dict[str, str]] = []
    files: list[list[Any]] = []
    for s in scanned:
        if s.scan.objects not in skeletons:
            skeletons.append(s.scan.objects)
        files.append([str(s.scan.path), skeletons.index(s.scan.objects),
                      list(s.scan.rows.values()), s.stamp.as_list(),
                      [s.scan.plain_chunks.get(name) for name in s.scan.rows], s.scan.digest,
                      list(s.scan.memory), list(s.scan.access)])
    return {"skeletons": skeletons, "files": files}


def scans_from_record(record: Any) -> list[ScannedFile]:
    """The scans :func:`scans_to_record` wrote.

    Raises
    ------
    ValueError
        If the record is malformed.
    """
    try:
        skeletons = [{str(k): str(v) for k, v in objects.items()}
                     for objects in record["skeletons"]]
        scanned = []
        for (path, index, rows, stamp, chunks, digest, (need, needy),
             (mode, uid, gid)) in record["files"]:
            objects = skeletons[index]
            names = [n for n, kind in objects.items() if kind.startswith("extensible ")]
            if len(rows) != len(names) or not all(type(r) is int for r in rows):
                raise ValueError("row counts do not match the skeleton")
            plain = {name: [int(x) for x in found]
                     for name, found in zip(names, chunks, strict=True) if found is not None}
            scan = FileScan(Path(path), objects, dict(zip(names, rows, strict=True)), plain,
                            str(digest), (int(need), str(needy)),
                            (int(mode), int(uid), int(gid)))
            scanned.append(ScannedFile(scan, FileStamp(*(int(x) for x in stamp))))
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
        raise BadMessageError(f"malformed scan record: {exc}") from None
    return scanned


def checkpoints_to_record(checkpoints: list[Checkpoint]) -> list[list[Any]]:
    """The run's checkpoints as JSON-ready data: number, path and files of each."""
    return [[c.number, str(c.path), [str(f) for f in c.files]] for c in checkpoints]


def checkpoints_from_record(record: Any) -> list[Checkpoint]:
    """The checkpoints :func:`checkpoints_to_record` wrote (ValueError if malformed)."""
    try:
        return [Checkpoint(int(number), Path(path), tuple(Path(f) for f in files))
                for number, path, files in record]
    except (TypeError, ValueError) as exc:
        raise BadMessageError(f"malformed checkpoint record: {exc}") from None


def job_files(out_dir: str | Path, model: str, job_id: str) -> JobFiles:
    """The job's file names in a checked directory (resolved), refusing an existing output.

    Raises
    ------
    FileExistsError
        If ``OUT_DIR/MODEL.h5`` exists.
    ValueError
        If the directory or the model name is bad.
    """
    job = JobFiles(Path(os.path.realpath(check_out_dir(out_dir))), check_model_name(model), job_id)
    if os.path.lexists(job.output):
        raise OutputExistsError(f"output {str(job.output)!r} exists; it is never overwritten")
    return job


def run_files(checkpoints: list[Checkpoint]) -> list[Path]:
    """Every file of the run, in row order."""
    return [path for checkpoint in checkpoints for path in checkpoint.files]


def scan_files(paths: list[Path], out_dir: str | Path,
               run: RunDir | None = None) -> list[ScannedFile]:
    """Stamp and scan each file of the run in ``out_dir``; the stamp is checked after the scan.

    Each file is opened once through the run directory's descriptor
    (``run``, else ``out_dir``, resolved already, opened here), no link
    followed at any level; its stamp
    is the opened descriptor's, and HDF5 reads that descriptor. A file that
    changed while it was scanned is refused, so the rows the scan counted
    belong to the version every later open is checked against.

    Raises
    ------
    ValueError
        If a file is incomplete, unreadable, not HDF5, or a symbolic link
        (or reached through one).
    CheckpointChangedError
        If a file changed while it was scanned.
    """
    if run is None:
        with RunDir.open(out_dir, exact=True) as opened:
            return scan_files(paths, out_dir, opened)
    scanned = []
    for path in paths:
        fd = run.open_file(path)
        try:
            stamp = stamp_of(path, os.fstat(fd))
            scan = scan_file(path, fd=fd)
            st = os.fstat(fd)
            check_same(path, stamp, st, "changed while it was being planned")
        finally:
            os.close(fd)
        scan.access = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        scanned.append(ScannedFile(scan, stamp))
    return scanned


def discover_and_scan(out_dir: Path, model: str, *, allow_gaps: bool = False
                      ) -> tuple[list[Checkpoint], list[FileScan]]:
    """Find the run's checkpoints and scan every file here, refusing a bad run.

    For a check before a job is sent: the files' rows are not digested.

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`find_run`, or if a file is incomplete, unreadable, not
        HDF5, or differs in structure.
    """
    checkpoints = find_run(out_dir, model, allow_gaps=allow_gaps)
    scans = [scan_file(path, digest=False) for path in run_files(checkpoints)]
    check_same_structure(scans)
    record_padding(checkpoints[-1].files[0], scans)
    return checkpoints, scans


def _plain_offsets(scan: FileScan, d: DatasetPlan) -> list[int]:
    """Offsets of one file's plain chunks of ``d`` if they have the output's chunk rows, else []."""
    found = scan.plain_chunks.get(d.name)
    if d.mode != "raw" or not found or found[0] != d.chunk[0]:
        return []
    return found[1:]


def prepare(
    out_dir: str | Path,
    model: str,
    job_id: str,
    *,
    cleanup: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    task_bytes: int = DEFAULT_BLOCK_BYTES,
    task_files: int = 64,
    verify_bytes: int | None = None,
    run: tuple[list[Checkpoint], list[ScannedFile]] | None = None,
    allow_gaps: bool = False,
) -> Plan:
    """Check the run, create the output skeleton under a temporary name, return the plan.

    ``run`` is the run's checkpoints and their files' scans when other
    processes scanned them (:func:`scan_files` on slices of
    :func:`run_files`); without it, the run is found and scanned here, and
    a gap in its checkpoint numbers is refused unless ``allow_gaps``.
    Copy units are cut to about ``task_bytes``, verification units to
    ``verify_bytes`` (default: ``task_bytes``).

    Raises
    ------
    FileNotFoundError
        No checkpoints.
    FileExistsError
        ``OUT_DIR/MODEL.h5`` exists.
    ValueError
        A file is incomplete, unreadable, not HDF5, differs in structure, is
        a symbolic link, or holds something chkq cannot copy exactly.
    """
    job = job_files(out_dir, model, job_id)
    with RunDir.open(job.out_dir, exact=True) as rundir:
        if run is None:
            checkpoints = find_run(job.out_dir, model, rundir, allow_gaps=allow_gaps)
            scanned = scan_files(run_files(checkpoints), job.out_dir, rundir)
        else:
            checkpoints, scanned = run
            if [s.scan.path for s in scanned] != run_files(checkpoints):
                raise BadMessageError(
                    f"the scans of job {job_id} do not match its checkpoint files")
        scans = [s.scan for s in scanned]
        check_same_structure(scans)
        check_memory(scans, block_bytes)
        reference = checkpoints[-1].files[0]
        names = scans[0].extensible
        reference_stamp = scanned[len(scanned) - len(checkpoints[-1].files)].stamp
        template = open_unchanged(rundir, reference, reference_stamp, job_id)
        try:
            padding = record_padding(
                reference, scans, template,
                lambda i: open_unchanged(rundir, scans[i].path, scanned[i].stamp, job_id))
            datasets = describe_template(reference, names,
                                         {n: padded_offsets(n, scans, padding) for n in names},
                                         block_bytes, template)
            check_lossy_chunks(reference, template, datasets, [s.scan.path for s in scanned])
            check_writable_dir(job.out_dir, "output directory")
            rundir.unlink(job.temp)
            layout, inode, bounds = create_skeleton(
                job.temp, reference,
                access=output_access([s.scan.access for s in scanned]),
                rows={d.name: d.total for d in datasets},
                raw={d.name for d in datasets if d.mode == "raw"},
                run=rundir, template=template,
            )
        finally:
            os.close(template)
        out_dir_id = rundir.identity()
    for d in datasets:
        d.chunk_offsets = layout.get(d.name, [])
        pads = padding.get(d.name, {})
        d.padding = [[index, rows] for index, rows in sorted(pads.items())]
        d.source_chunks = [[] if index in pads else _plain_offsets(scan, d)
                           for index, scan in enumerate(scans)]
    files = [[str(s.scan.path), *s.stamp.as_list()] for s in scanned]
    file_sizes = [
        sum((d.offsets[f + 1] - d.offsets[f]) * d.row_bytes for d in datasets)
        for f in range(len(files))
    ]
    return Plan(
        job_id=job_id,
        model=model,
        out_dir=str(job.out_dir),
        cleanup=cleanup,
        block_bytes=block_bytes,
        checkpoints=[[c.number, str(c.path), c.is_directory] for c in checkpoints],
        files=files,
        reference_file=str(reference),
        datasets=datasets,
        copy_units=cut_copy_units(datasets, len(files), task_bytes, task_files),
        file_digests=["" if any(i in pads for pads in padding.values()) else s.scan.digest
                      for i, s in enumerate(scanned)],
        verify_units=cut_verify_units(file_sizes, verify_bytes or task_bytes, task_files),
        temp_inode=inode,
        out_dir_id=out_dir_id,
        libver=list(bounds),
    )
