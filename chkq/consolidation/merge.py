"""Moving part files and variable-length rows into the output, then making it durable.

Runs after every copy task, in pieces run one after another, never two at
once (HDF5 cannot be written by two processes), on the output the planner
made (checked by inode). The merge's work is a list of items
(:func:`merge_items`: each part file, then each checkpoint file's
variable-length rows); a piece does the next items that fit in a byte
bound (:func:`next_piece`), so that no piece outlasts a task's time budget,
and ends with the output fsynced.
``chunks`` datasets receive their part files' encoded chunks with
``write_direct_chunk`` (no decompression); ``whole``
datasets (variable-length data, references) receive their rows through
HDF5, file by file, in HDF5's own memory form (:mod:`chkq.consolidation.vlen`), each
object or region reference re-pointed to the object of the same name in
the output.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5f, h5p, h5r, h5t

from chkq.consolidation import vlen
from chkq.consolidation.checkpoint_files import MIN_HOLD_BYTES
from chkq.consolidation.copy_rows import PART_MAGIC, PART_RECORD, open_output_fd, open_source
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.rowio import block_rows
from chkq.consolidation.stamps import check_descriptor
from chkq.errors import BadCheckpointError
from chkq.rundir import READ, RunDir, fd_path

#: Most rows of variable-length data moved per read (their size in memory is not known).
WHOLE_BLOCK_ROWS = 65536


@dataclass(frozen=True)
class MergeItem:
    """One part file (``kind`` "part", ``index`` its copy unit) or one checkpoint file's rows
    of the variable-length and reference datasets (``kind`` "whole", ``index`` the file),
    with the plain ``bytes`` of its rows."""

    kind: str
    index: int
    bytes: int


def merge_items(plan: Plan) -> list[MergeItem]:
    """The merge's work in the order it is done: each part file, then each file's whole rows.

    Each item is merged by one piece of the merge, whole; its ``bytes`` are
    the plain size of its rows (what the merge rate is measured against),
    known from the plan alone.
    """
    items = []
    for index, d in enumerate(plan.datasets):
        if d.mode != "chunks":
            continue
        for number, unit in enumerate(plan.copy_units):
            if unit.part is not None and unit.pieces[0][0] == index:
                items.append(MergeItem("part", number, sum(
                    (b - a) * plan.datasets[i].row_bytes for i, a, b in unit.pieces)))
    whole = [d for d in plan.datasets if d.mode == "whole"]
    if whole:
        for file_index in range(len(plan.files)):
            size = sum((stop - start) * d.row_bytes
                       for d in whole for start, stop in [d.rows_of(file_index)])
            items.append(MergeItem("whole", file_index, size))
    return items


def next_piece(items: list[MergeItem], done: set[int], limit: int) -> list[int]:
    """The items (by position) the next piece of the merge does: at most ``limit`` bytes.

    The first items not ``done``, in order, as many as fit in ``limit``
    bytes, and always one at least (an item is never split).
    """
    piece: list[int] = []
    size = 0
    for number, item in enumerate(items):
        if number in done:
            continue
        if piece and size + item.bytes > limit:
            break
        piece.append(number)
        size += item.bytes
    return piece


def merge_parts(plan: Plan) -> int:
    """Merge every part file and variable-length row into the temporary output and fsync it.

    Returns the bytes moved: the merge in one piece (:func:`merge_piece`).
    """
    items = merge_items(plan)
    return merge_piece(plan, items, list(range(len(items))))


def merge_piece(plan: Plan, items: list[MergeItem], piece: list[int]) -> int:
    """Merge the items numbered ``piece`` of ``items`` into the temporary output and fsync it.

    Returns the bytes moved. The output is fsynced even when ``piece`` is
    empty (the copies wrote into it). Running a piece again, whole or after
    an interruption, writes the same bytes at the same places: chunks are
    stored at their offsets, rows written at their rows, references
    re-pointed from the checkpoint's own (never from the output). Part
    files are left for :func:`remove_parts`, called once the whole merge is
    recorded.
    """
    moved = 0
    chosen = [items[n] for n in piece]
    whole = [d for d in plan.datasets if d.mode == "whole"]
    with plan.open_run() as run:
        fd = open_output_fd(run, plan, READ)
        try:
            if chosen:
                with open_for_merge(fd_path(fd), plan.libver) as out:
                    check_descriptor(plan.job.temp, out.id.get_vfd_handle(), plan.temp_inode)
                    limit = max(plan.block_bytes, MIN_HOLD_BYTES)
                    for item in chosen:
                        if item.kind == "part":
                            unit = plan.copy_units[item.index]
                            d = plan.datasets[unit.pieces[0][0]]
                            if unit.part is None:
                                raise ValueError(f"copy unit {item.index} wrote no part file")
                            moved += _move_chunks(run, plan.job.part(unit.part), d,
                                                  out[d.name], limit)
                        else:
                            moved += _copy_whole(run, plan, whole, out, item.index)
            os.fsync(fd)
        finally:
            os.close(fd)
    return moved


def open_for_merge(name: str, libver: list[str]) -> h5py.File:
    """The output opened for writing by one piece of the merge, whatever a killed piece left.

    A process killed with the file open leaves it marked as open for
    writing (superblock version 3, written under bounds of 1.10 or later),
    and HDF5 would refuse it for ever: the mark is cleared on opening, as
    ``h5clear`` does. Pieces run one after another, and HDF5's file lock
    still refuses a second writer. The metadata cache holds every change of
    the piece until the file is closed (no eviction writes part of it
    earlier), so that a piece killed midway leaves the metadata as the last
    piece closed it, on which the piece, run again, writes the same rows.
    """
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(_LIBVER[libver[0]], _LIBVER[libver[1]])
    clear = ctypes.c_bool(True)
    if _hdf5(fapl).H5Pset(ctypes.c_int64(fapl.id), b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise RuntimeError("HDF5 has no file access property clear_status_flags")
    out = h5py.File(h5f.open(name.encode(), h5f.ACC_RDWR, fapl=fapl))
    try:
        config = out.id.get_mdc_config()
        config.evictions_enabled = False
        config.incr_mode = config.flash_incr_mode = config.decr_mode = 0
        out.id.set_mdc_config(config)
    except BaseException:
        out.close()
        raise
    return out


#: h5py's names of library version bounds, as HDF5's constants.
_LIBVER = {"earliest": h5f.LIBVER_EARLIEST, "v108": h5f.LIBVER_V18, "v110": h5f.LIBVER_V110,
           "v112": h5f.LIBVER_V112, "v114": h5f.LIBVER_V114, "v200": h5f.LIBVER_V200,
           "latest": h5f.LIBVER_LATEST}


def _hdf5(fapl: h5p.PropFAID) -> ctypes.CDLL:
    """The HDF5 library h5py runs on (for ``H5Pset``, which h5py does not wrap).

    Another copy of HDF5 may be loaded too (netCDF4's): h5py's is the one
    that knows ``fapl``.
    """
    for path in _loaded_hdf5():
        library = ctypes.CDLL(path)
        if library.H5Iis_valid(ctypes.c_int64(fapl.id)) > 0:
            return library
    raise RuntimeError("h5py's HDF5 library is not among those loaded in this process")


@functools.cache
def _loaded_hdf5() -> tuple[str, ...]:
    """Paths of the HDF5 libraries loaded in this process (h5py loads its own first)."""
    found: list[str] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            name = os.path.basename(path)
            if name.startswith("libhdf5") and not name.startswith("libhdf5_hl") \
                    and path not in found:
                found.append(path)
    return tuple(found)


def read_part(run: RunDir, path: Path, d: DatasetPlan, limit: int
              ) -> Iterator[tuple[tuple[int, ...], int, bytes]]:
    """The chunks of a part file (:class:`chkq.consolidation.copy_rows.PartWriter`), in order.

    Yields each chunk's output offset, filter mask and stored bytes. The
    file is opened through ``run`` (no link followed at any level). It sits
    in the run directory, whose owner could rewrite it: a record that does
    not fit (a chunk larger than ``limit`` bytes, an offset off the
    dataset's chunk grid or past its end, a file cut short) is refused,
    and any other change is what verification finds in the output's rows.

    Raises
    ------
    BadCheckpointError
        Naming the part file and what is wrong with it.
    """
    fd = run.open_file(path)
    axes = len(d.chunk)
    where_format = struct.Struct(f"<{axes}q")
    extent = [d.total, *d.trailing]
    with os.fdopen(fd, "rb", buffering=1 << 20) as fh:
        if fh.read(len(PART_MAGIC)) != PART_MAGIC:
            raise BadCheckpointError(f"part file {str(path)!r} of the job is not one it wrote")
        while True:
            head = fh.read(PART_RECORD.size)
            if not head:
                return
            raw = fh.read(where_format.size)
            if len(head) != PART_RECORD.size or len(raw) != where_format.size:
                raise BadCheckpointError(f"part file {str(path)!r} of the job is cut short")
            size, mask = PART_RECORD.unpack(head)
            where = where_format.unpack(raw)
            if size > limit or any(w < 0 or w >= n or w % c for w, n, c in zip(
                    where, extent, d.chunk, strict=True)):
                raise BadCheckpointError(
                    f"part file {str(path)!r} of the job holds a chunk at {where} of {size} "
                    f"bytes, which dataset '/{d.name}' cannot have: it was changed")
            data = fh.read(size)
            if len(data) != size:
                raise BadCheckpointError(f"part file {str(path)!r} of the job is cut short")
            yield where, mask, data


def remove_parts(plan: Plan) -> None:
    """Delete the job's part files (after the merge was recorded)."""
    with plan.open_run() as run:
        for unit in plan.copy_units:
            if unit.part is not None:
                run.unlink(plan.job.part(unit.part))


def _move_chunks(run: RunDir, path: Path, d: DatasetPlan, target: h5py.Dataset,
                 limit: int) -> int:
    """Store every chunk of the part file ``path`` in ``target`` as it stands; the bytes moved."""
    moved = 0
    for where, mask, data in read_part(run, path, d, limit):
        target.id.write_direct_chunk(where, data, mask)
        moved += len(data)
    return moved


def _copy_whole(run: RunDir, plan: Plan, datasets: list[DatasetPlan], out: h5py.File,
                file_index: int) -> int:
    """Copy file ``file_index``'s rows of variable-length and reference datasets."""
    moved = 0
    fid, fd = open_source(run, plan, file_index)
    try:
        source = h5py.File(fid)
        for d in datasets:
            start, stop = d.rows_of(file_index)
            if stop == start:
                continue
            src, dst = source[d.name], out[d.name]
            tid = dst.id.get_type()
            step = min(WHOLE_BLOCK_ROWS, block_rows(d.row_bytes, plan.block_bytes))
            for lo in range(0, stop - start, step):
                hi = min(stop - start, lo + step)
                if tid.get_class() == h5t.REFERENCE:
                    dst[start + lo:start + hi] = repoint(src[lo:hi], source, out, d.name,
                                                         plan.file_path(file_index))
                else:
                    with vlen.read_rows(src.id, lo, hi - lo, tid) as rows:
                        vlen.write_rows(dst.id, start + lo, rows, tid)
                moved += (hi - lo) * d.row_bytes
    finally:
        fid.close()
        os.close(fd)
    return moved


def repoint(rows: np.ndarray, source: h5py.File, out: h5py.File, name: str,
            shown: Path | None = None) -> np.ndarray:
    """The references in ``rows`` (of ``source``) re-pointed to the same-named objects of ``out``.

    ``shown`` names ``source`` in messages (HDF5 knows it by its descriptor only).

    Raises
    ------
    ValueError
        If a reference points to an object with no name (or one the output
        lacks), naming the dataset.
    """
    result = np.empty(rows.shape, dtype=rows.dtype)
    flat, target = rows.reshape(-1), result.reshape(-1)
    for i, ref in enumerate(flat):
        target[i] = _repoint_one(ref, source, out, name, shown)
    return result


def _repoint_one(ref: Any, source: h5py.File, out: h5py.File, name: str,
                 shown: Path | None) -> Any:
    if not ref:
        return ref
    path = source[ref].name
    if not path or path not in out:
        raise BadCheckpointError(
            f"a reference in dataset '/{name}' of {str(shown or source.filename)!r} points to "
            f"an object the output does not have ({path!r})")
    if isinstance(ref, h5py.RegionReference):
        region = h5r.get_region(ref, source.id)
        return h5r.create(out.id, path.encode(), h5r.DATASET_REGION, region)
    return out[path].ref
