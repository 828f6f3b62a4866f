"""Planning a consolidation job: check the run, write the skeleton and the plan.

``prepare`` is the planning step of the canvas. It is idempotent: when the
plan of the job already exists (the step was delivered again after it
finished) it is returned as it is, so copy tasks already writing into the
output are never disturbed.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py

from chkq.discovery import check_model_name, check_out_dir
from chkq.naming import JobFiles
from chkq.plan import (
    DatasetPlan,
    Plan,
    cut_copy_units,
    cut_verify_units,
    discover_and_scan,
    load_plan,
    offsets_of,
)
from chkq.skeleton import create_skeleton, dataset_mode
from chkq.structure import row_bytes

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


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
    """Check the run, create the output skeleton under a temporary name, save the plan.

    Raises
    ------
    FileNotFoundError
        No checkpoints.
    FileExistsError
        ``OUT_DIR/MODEL.h5`` exists.
    ValueError
        A file is incomplete, unreadable, not HDF5, or differs in structure.
    """
    directory = check_out_dir(out_dir)
    job = JobFiles(directory, check_model_name(model), job_id)
    if job.plan.exists():
        return load_plan(directory, model, job_id)
    if job.output.exists():
        raise FileExistsError(f"output {str(job.output)!r} exists; it is never overwritten")
    checkpoints, scans = discover_and_scan(directory, model)
    reference = checkpoints[-1].files[0]
    names = scans[0].extensible
    datasets = []
    with h5py.File(reference, "r") as ref:
        for name in names:
            source = ref[name]
            datasets.append(DatasetPlan(
                name=name,
                mode=dataset_mode(source),
                offsets=offsets_of(name, scans),
                row_bytes=row_bytes(source),
                chunk=list(source.chunks),
                trailing=list(source.shape[1:]),
            ))
    job.temp.unlink(missing_ok=True)
    layout = create_skeleton(
        job.temp, reference,
        modes={d.name: d.mode for d in datasets},
        rows={d.name: d.total for d in datasets},
    )
    for d in datasets:
        if d.name in layout:
            offsets, fill = layout[d.name]
            d.chunk_offsets, d.fill = offsets, fill.hex()
    files = []
    for scan in scans:
        st = os.stat(scan.path)
        files.append([str(scan.path), st.st_size, st.st_mtime_ns, st.st_ino])
    file_sizes = [
        sum((d.offsets[f + 1] - d.offsets[f]) * d.row_bytes for d in datasets)
        for f in range(len(files))
    ]
    plan = Plan(
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
    )
    plan.save()
    return plan
