"""Planning a consolidation job: check the run, write the skeleton, cut the work.

``prepare`` is the core of the planning step. It writes the output's
skeleton under the job's temporary name and returns the plan; the task
layer keeps the plan where only workers write, and makes a redelivered
planning step reuse it (see ``chkq.tasks.protocol``).
"""

from __future__ import annotations

import os
from pathlib import Path

from h5py import h5d, h5f, h5o, h5t

from chkq.discovery import Checkpoint, check_model_name, check_out_dir, find_checkpoints
from chkq.h5types import describe_type, element_count, has_reference
from chkq.naming import JobFiles
from chkq.plan import (
    DatasetPlan,
    Plan,
    cut_copy_units,
    cut_verify_units,
    offsets_of,
)
from chkq.skeleton import create_skeleton, dataset_mode
from chkq.stamps import stamp_of
from chkq.structure import (
    FileScan,
    check_same_structure,
    open_checkpoint_id,
    refuse_outside_storage,
    scan_file,
)

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


def describe_template(reference: Path, names: list[str],
                      totals: dict[str, list[int]]) -> list[DatasetPlan]:
    """Plan every extensible dataset from the template; refuse what cannot be copied exactly.

    Raises
    ------
    ValueError
        Naming the dataset and what chkq does not support (references of
        the new, 1.12-style kind in rows: they cannot be re-pointed).
    """
    fid = open_checkpoint_id(reference)
    datasets = []
    try:
        for name in names:
            dsid = h5d.open(fid, name.encode())
            tid = dsid.get_type()
            if has_reference(tid) and (tid.get_class() != h5t.REFERENCE
                                       or not _classic_references(tid)):
                raise ValueError(
                    f"extensible dataset '/{name}' of {str(reference)!r} holds references "
                    f"inside a {describe_type(tid)} type, or of a kind chkq cannot re-point")
            shape = dsid.shape
            datasets.append(DatasetPlan(
                name=name,
                mode=dataset_mode(dsid),
                offsets=totals[name],
                row_bytes=tid.get_size() * element_count(shape[1:]),
                chunk=list(dsid.get_create_plist().get_chunk()),
                trailing=list(shape[1:]),
                element_size=tid.get_size(),
            ))
        _refuse_external_template(fid, reference)
    finally:
        fid.close()
    return datasets


def _classic_references(tid: h5t.TypeID) -> bool:
    """Whether a reference type is an HDF5 1.8-style object or region reference."""
    return bool(tid.equal(h5t.STD_REF_OBJ) or tid.equal(h5t.STD_REF_DSETREG))


def _refuse_external_template(fid: h5f.FileID, reference: Path) -> None:
    """Refuse a template whose datasets keep data in other files (the output would too)."""

    def visit(name: bytes, info: h5o._ObjInfo) -> None:
        if info.type == h5o.TYPE_DATASET:
            refuse_outside_storage(reference, name.decode("utf-8", "surrogateescape"),
                                   h5d.open(fid, name).get_create_plist())

    h5o.visit(fid, visit, info=True)


def discover_and_scan(out_dir: Path, model: str) -> tuple[list[Checkpoint], list[FileScan]]:
    """Find the run's checkpoints and scan every file, refusing a bad run.

    Raises
    ------
    FileNotFoundError
        If the run has no checkpoints.
    ValueError
        If a file is incomplete, unreadable, not HDF5, or differs in
        structure, or a checkpoint directory holds no ``.h5`` file.
    """
    checkpoints = find_checkpoints(out_dir, model)
    if not checkpoints:
        raise FileNotFoundError(
            f"no checkpoints of model {model!r} in {str(out_dir)!r} "
            f"(expected {model}_chkNNNNN.h5 or {model}_chkNNNNN/)"
        )
    for checkpoint in checkpoints:
        if not checkpoint.files:
            raise ValueError(f"checkpoint directory {str(checkpoint.path)!r} holds no .h5 file")
    scans = [scan_file(path) for checkpoint in checkpoints for path in checkpoint.files]
    check_same_structure(scans)
    return checkpoints, scans


def prepare(
    out_dir: str | Path,
    model: str,
    job_id: str,
    *,
    cleanup: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    task_bytes: int = DEFAULT_BLOCK_BYTES,
    task_files: int = 64,
) -> Plan:
    """Check the run, create the output skeleton under a temporary name, return the plan.

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
    directory = check_out_dir(out_dir)
    job = JobFiles(directory, check_model_name(model), job_id)
    if os.path.lexists(job.output):
        raise FileExistsError(f"output {str(job.output)!r} exists; it is never overwritten")
    checkpoints, scans = discover_and_scan(directory, model)
    stamps = [stamp_of(scan.path) for scan in scans]
    reference = checkpoints[-1].files[0]
    names = scans[0].extensible
    datasets = describe_template(reference, names, {n: offsets_of(n, scans) for n in names})
    job.temp.unlink(missing_ok=True)
    layout, inode = create_skeleton(
        job.temp, reference,
        rows={d.name: d.total for d in datasets},
        raw={d.name for d in datasets if d.mode == "raw"},
    )
    for d in datasets:
        d.chunk_offsets = layout.get(d.name, [])
    files = [[str(scan.path), *stamp.as_list()] for scan, stamp in zip(scans, stamps, strict=True)]
    file_sizes = [
        sum((d.offsets[f + 1] - d.offsets[f]) * d.row_bytes for d in datasets)
        for f in range(len(files))
    ]
    return Plan(
        job_id=job_id,
        model=model,
        out_dir=str(directory),
        cleanup=cleanup,
        block_bytes=block_bytes,
        checkpoints=[[c.number, str(c.path), c.path.is_dir()] for c in checkpoints],
        files=files,
        reference_file=str(reference),
        datasets=datasets,
        copy_units=cut_copy_units(datasets, len(files), task_bytes, task_files),
        verify_units=cut_verify_units(file_sizes, task_bytes, task_files),
        temp_inode=inode,
    )
