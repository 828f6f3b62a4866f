"""Moving part files into the output, then making the output durable.

Runs once, after every copy task, in one process (HDF5 cannot be written
by two at once). ``chunks`` datasets move as encoded chunks with
``read_direct_chunk``/``write_direct_chunk`` (no decompression);
``whole`` datasets are copied with H5Ocopy.
"""

from __future__ import annotations

import os

import h5py
from h5py import h5o

from chkq.fsutil import write_durably
from chkq.plan import Plan
from chkq.skeleton import create_extensible


def merge_parts(plan: Plan) -> int:
    """Merge every part file into the temporary output, fsync it, remove the parts.

    Returns the bytes moved. Idempotent: a marker written once the output is
    durable (before the parts go) makes a second run do nothing, and a
    dataset merged by an earlier, interrupted attempt is replaced.
    """
    job = plan.job
    if job.merged.exists():
        return 0
    moved = 0
    part_datasets = [i for i, d in enumerate(plan.datasets) if d.mode != "raw"]
    if part_datasets:
        with h5py.File(plan.reference_file, "r") as ref, h5py.File(plan.job.temp, "r+") as out:
            for index in part_datasets:
                d = plan.datasets[index]
                units = [(n, u) for n, u in enumerate(plan.copy_units)
                         if u.part is not None and u.pieces[0][0] == index]
                if d.name in out:
                    del out[d.name]
                parent = out.require_group(d.name.rpartition("/")[0] or "/")
                leaf = d.name.rpartition("/")[2]
                if d.mode == "whole":
                    ((_, unit),) = units
                    assert unit.part is not None
                    with h5py.File(plan.job.part(unit.part), "r") as part:
                        h5o.copy(part.id, b"data", parent.id, leaf.encode())
                        moved += part["data"].id.get_storage_size()
                    continue
                target = create_extensible(parent, leaf, ref[d.name], d.total, early=False)
                for _, unit in units:
                    assert unit.part is not None
                    start = unit.pieces[0][1]
                    with h5py.File(plan.job.part(unit.part), "r") as part:
                        moved += _move_chunks(part["data"], target, start)
    with open(job.temp, "rb+") as fh:
        os.fsync(fh.fileno())
    write_durably(job.merged, str(moved))
    for unit in plan.copy_units:
        if unit.part is not None:
            job.part(unit.part).unlink(missing_ok=True)
    return moved


def _move_chunks(source: h5py.Dataset, target: h5py.Dataset, row_offset: int) -> int:
    """Copy every stored chunk of ``source`` into ``target``, ``row_offset`` rows down."""
    moved = 0
    stored: list[tuple[int, ...]] = []
    source.id.chunk_iter(lambda info: stored.append(info.chunk_offset))
    for offset in stored:
        mask, data = source.id.read_direct_chunk(offset)
        where = (offset[0] + row_offset, *offset[1:])
        target.id.write_direct_chunk(where, data, mask)
        moved += len(data)
    return moved
