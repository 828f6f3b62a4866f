"""Planning a consolidation job: check the run, write the skeleton, cut the work.

``prepare`` is the core of the planning step. It writes the output's
skeleton under the job's temporary name and returns the plan; the task
layer keeps the plan where only workers write, and makes a redelivered
planning step reuse it (see ``chkq.jobs``). The run is found and scanned
by :mod:`chkq.consolidation.run_scan`, bounded by
:mod:`chkq.consolidation.memory_bounds`, its records of a dimension
aligned by :mod:`chkq.consolidation.record_dimensions`; what its template
holds is checked here.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from h5py import h5d, h5f, h5o, h5t

from chkq.consolidation.checkpoint_files import (
    DEFAULT_MAX_DECODED_BYTES,
    FileScan,
    check_same_structure,
    open_checkpoint_id,
    refuse_outside_storage,
    walk_objects,
)
from chkq.consolidation.discovery import Checkpoint, check_model_name, check_out_dir
from chkq.consolidation.filter_pipelines import (
    filter_label,
    pipeline_image,
    recreation_plist,
    stored_filters,
)
from chkq.consolidation.h5types import describe_type, element_count, has_reference
from chkq.consolidation.memory_bounds import check_decoded, check_memory, check_template_memory
from chkq.consolidation.plan import (
    DatasetPlan,
    Plan,
    cut_copy_units,
    cut_verify_units,
)
from chkq.consolidation.record_dimensions import padded_offsets, record_padding
from chkq.consolidation.run_scan import (
    ScannedFile,
    collector_paused,
    find_run,
    run_files,
    scan_files,
)
from chkq.consolidation.skeleton import create_skeleton, dataset_mode, output_access
from chkq.consolidation.stamps import open_unchanged
from chkq.consolidation.temporaries import JobFiles
from chkq.errors import BadCheckpointError, BadMessageError, OutputExistsError
from chkq.fsutil import check_writable_dir
from chkq.rundir import CREATE, RunDir

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


def describe_template(reference: Path, names: list[str], totals: dict[str, list[int]],
                      block_bytes: int = DEFAULT_BLOCK_BYTES,
                      fd: int | None = None,
                      scratch: tuple[RunDir, Path] | None = None) -> list[DatasetPlan]:
    """Plan every extensible dataset from the template; refuse what cannot be copied exactly.

    A filtered dataset whose filters' stored parameters no dataset created
    anew would get (:func:`chkq.consolidation.filter_pipelines.recreation_plist`)
    gets the image of an empty copy of itself
    (:func:`chkq.consolidation.filter_pipelines.pipeline_image`), made
    through the file ``scratch`` names in the run directory it gives;
    without ``scratch``, such a dataset is refused.

    Raises
    ------
    ValueError
        Naming the dataset and what chkq does not support (references of
        the new, 1.12-style kind in rows: they cannot be re-pointed; filters
        whose stored parameters a dataset created anew would not get,
        :func:`chkq.consolidation.filter_pipelines.recreation_plist`, without
        ``scratch``; filters that cannot encode a chunk with them), or
        what cannot be checked within ``block_bytes``
        (:func:`chkq.consolidation.memory_bounds.check_template_memory`).
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
            image = ""
            if mode == "chunks":
                where = f"extensible dataset '/{name}' of {str(reference)!r}"
                try:
                    recreation_plist(dsid, where)
                except BadCheckpointError:
                    if scratch is None:
                        raise
                    image = base64.b64encode(_pipeline(reference, fd, dsid, name, scratch,
                                                       where)).decode()
            datasets.append(DatasetPlan(
                name=name,
                mode=mode,
                offsets=totals[name],
                row_bytes=tid.get_size() * element_count(shape[1:]),
                chunk=list(dsid.get_create_plist().get_chunk()),
                trailing=list(shape[1:]),
                element_size=tid.get_size(),
                pipeline=image,
            ))
        _refuse_external_template(fid, reference)
        check_template_memory(fid, reference, block_bytes)
    finally:
        fid.close()
    return datasets


def _pipeline(reference: Path, fd: int | None, dsid: h5d.DatasetID, name: str,
              scratch: tuple[RunDir, Path], where: str) -> bytes:
    """:func:`chkq.consolidation.filter_pipelines.pipeline_image` through a scratch file.

    The scratch file is removed after.
    """
    run, path = scratch
    check_writable_dir(path.parent, "output directory")
    run.unlink(path)
    scratch_fd = run.open_file(path, CREATE, 0o600)
    dcpl = dsid.get_create_plist()
    try:
        return pipeline_image(reference, fd, name, scratch_fd, where, stored_filters(dcpl),
                              lambda i: filter_label(dcpl, i))
    finally:
        os.close(scratch_fd)
        run.unlink(path)


def _classic_references(tid: h5t.TypeID) -> bool:
    """Whether a reference type is an HDF5 1.8-style object or region reference."""
    return bool(tid.equal(h5t.STD_REF_OBJ) or tid.equal(h5t.STD_REF_DSETREG))


def _refuse_external_template(fid: h5f.FileID, reference: Path) -> None:
    """Refuse a template whose datasets keep data in other files (the output would too)."""

    for name, kind in walk_objects(fid, f"checkpoint file {str(reference)!r}"):
        if kind == h5o.TYPE_DATASET:
            refuse_outside_storage(reference, name.decode("utf-8", "surrogateescape"),
                                   h5d.open(fid, name).get_create_plist())


def job_files(out_dir: str | Path, model: str, job_id: str, *,
              extending: bool = False) -> JobFiles:
    """The job's file names in a checked directory (resolved), refusing an existing output.

    ``extending``: the job makes a new version of the output, which then exists.

    Raises
    ------
    FileExistsError
        If ``OUT_DIR/MODEL.h5`` exists.
    ValueError
        If the directory or the model name is bad.
    """
    job = JobFiles(Path(os.path.realpath(check_out_dir(out_dir))), check_model_name(model), job_id)
    if not extending and os.path.lexists(job.output):
        raise OutputExistsError(f"output {str(job.output)!r} exists; it is never overwritten")
    return job


def _plain_offsets(scan: FileScan, d: DatasetPlan) -> list[int]:
    """Offsets of one file's plain chunks of ``d`` if they have the output's chunk rows, else []."""
    found = scan.plain_chunks.get(d.name)
    if d.mode != "raw" or not found or found[0] != d.chunk[0]:
        return []
    return found[1:]


@dataclass
class SurveyedRun:
    """A run checked as planning checks it, its run directory and template still open.

    Everything a plan is made from, before anything is written: the
    checkpoints, every file's scan, the template, the padding of short record
    variables and each extensible dataset's plan (rows, how it moves).
    """

    job: JobFiles
    rundir: RunDir
    template: int
    checkpoints: list[Checkpoint]
    scanned: list[ScannedFile]
    reference: Path
    padding: dict[str, dict[int, int]]
    datasets: list[DatasetPlan]

    @property
    def scans(self) -> list[FileScan]:
        return [s.scan for s in self.scanned]


@contextlib.contextmanager
def surveyed_run(
    out_dir: str | Path,
    model: str,
    job_id: str,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    run: tuple[list[Checkpoint], list[ScannedFile]] | None = None,
    allow_gaps: bool = False,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    through: int | None = None,
    extending: bool = False,
    digest: bool = True,
) -> Iterator[SurveyedRun]:
    """Check the run as planning does; yield what a plan is made from, nothing written.

    ``run``, ``allow_gaps``, ``max_decoded_bytes`` and ``through`` as for :func:`prepare`,
    which plans from what this yields; ``chkq consolidate --dry-run`` shows it.
    ``extending``: for a new version of an output that exists (``job_files``).
    ``digest``: as for :func:`prepare`.

    Raises
    ------
    FileNotFoundError
        No checkpoints.
    ValueError
        A file is incomplete, unreadable, not HDF5, differs in structure, is
        a symbolic link, or holds something chkq cannot copy exactly.
    """
    job = job_files(out_dir, model, job_id, extending=extending)
    with RunDir.open(job.out_dir, exact=True) as rundir:
        if run is None:
            checkpoints = find_run(job.out_dir, model, rundir, allow_gaps=allow_gaps,
                                   through=through)
            scanned = scan_files(run_files(checkpoints), job.out_dir, rundir, digest=digest)
        else:
            checkpoints, scanned = run
            if [str(s.scan.path) for s in scanned] != [str(p) for p in run_files(checkpoints)]:
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
                                         block_bytes, template, (rundir, job.pipeline))
            check_decoded(datasets, [s.scan.path for s in scanned], max_decoded_bytes)
            yield SurveyedRun(job, rundir, template, checkpoints, scanned, reference, padding,
                              datasets)
        finally:
            os.close(template)


@collector_paused()
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
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    through: int | None = None,
    digest: bool = True,
    reserve: bool = True,
) -> Plan:
    """Check the run, create the output skeleton under a temporary name, return the plan.

    ``run`` is the run's checkpoints and their files' scans when other
    processes scanned them (:func:`chkq.consolidation.run_scan.scan_files`
    on slices of :func:`chkq.consolidation.run_scan.run_files`); without
    it, the run is found and scanned here, and a gap in its checkpoint
    numbers is refused unless ``allow_gaps``. With ``through``, only the
    checkpoints numbered up to it are consolidated (a run still being written).
    Copy units are cut to about ``task_bytes``, verification units to
    ``verify_bytes`` (default: ``task_bytes``). The run's filtered rows may
    decode to at most ``max_decoded_bytes``
    (:func:`chkq.consolidation.memory_bounds.check_decoded`).

    ``digest``: whether the scan digests small files' rows (``FileScan.digest``,
    the plan's ``file_digests``); ``reserve``: whether the skeleton's full size
    is reserved on disk (:func:`chkq.consolidation.skeleton.create_skeleton`).
    Planning a run of metadata mirrors (:mod:`chkq.consolidation.mirror`), whose raw
    chunks are holes, takes neither: ``digest=False`` reads no row, and
    ``reserve=False`` leaves the skeleton as sparse as its mirrors. Planning
    reads no other byte of those chunks.

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
    with surveyed_run(out_dir, model, job_id, block_bytes=block_bytes, run=run,
                      allow_gaps=allow_gaps, max_decoded_bytes=max_decoded_bytes,
                      through=through, digest=digest) as survey:
        job, rundir, datasets = survey.job, survey.rundir, survey.datasets
        checkpoints, scanned, scans = survey.checkpoints, survey.scanned, survey.scans
        reference, padding = survey.reference, survey.padding
        check_writable_dir(job.out_dir, "output directory")
        rundir.unlink(job.temp)
        layout, inode, bounds = create_skeleton(
            job.temp, reference,
            access=output_access([s.scan.access for s in scanned]),
            rows={d.name: d.total for d in datasets},
            raw={d.name for d in datasets if d.mode == "raw"},
            run=rundir, template=survey.template, reserve=reserve,
        )
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
