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
datasets (variable-length data, references) receive their rows from the
checkpoint files block by block, as heap IDs and heap collections
(:mod:`chkq.consolidation.heap_collections`) or
through HDF5 in its own memory form (:mod:`chkq.consolidation.vlen`), each
object or region reference re-pointed to the object of the same name in
the output.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5f, h5r, h5t

from chkq.consolidation import heap_collections, vlen
from chkq.consolidation.checkpoint_files import MIN_HOLD_BYTES
from chkq.consolidation.copy_rows import PART_MAGIC, PART_RECORD, open_output_fd, open_source
from chkq.consolidation.piece_journal import (
    READ_WRITE,
    PieceJournal,
    hold_output,
    open_for_merge,
)
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.rowio import block_rows, start_writeback
from chkq.errors import BadCheckpointError, ChkqError, MergeError
from chkq.fsutil import WRITE_ERRNOS
from chkq.rundir import RunDir

log = logging.getLogger(__name__)

#: Most rows of variable-length data moved per read (their size in memory is not known).
WHOLE_BLOCK_ROWS = 65536
#: Heap bytes a block of variable-length rows is cut to (or half a block, if more): HDF5
#: holds a block's heap in memory two or three times over while it writes it.
WHOLE_HEAP_BYTES = 32 * 1024 * 1024
#: Most rows of one dataset in one merge item of variable-length rows (whole chunks of
#: them): the merge's pieces are cut between items, so that no piece outlasts its budget.
WHOLE_ITEM_ROWS = 4 * WHOLE_BLOCK_ROWS


@dataclass(frozen=True)
class MergeItem:
    """One part file (``kind`` "part", ``index`` its copy unit) or rows ``[start, stop)`` of
    dataset ``dataset`` (variable-length data or references) from one checkpoint file
    (``kind`` "whole", ``index`` the file), with the plain ``bytes`` of its rows."""

    kind: str
    index: int
    bytes: int
    dataset: int = -1
    start: int = 0
    stop: int = 0


def merge_items(plan: Plan) -> list[MergeItem]:
    """The merge's work in the order it is done: each part file, then each file's whole rows.

    Each item is merged by one piece of the merge, whole; its ``bytes`` are
    the plain size of its rows (what the merge rate is measured against),
    known from the plan alone. A file's rows of a variable-length dataset
    make items of at most :data:`WHOLE_ITEM_ROWS` rows, cut on the
    output's chunk grid.
    """
    items = []
    for index, d in enumerate(plan.datasets):
        if d.mode != "chunks":
            continue
        for number, unit in enumerate(plan.copy_units):
            if unit.part is not None and unit.pieces[0][0] == index:
                items.append(MergeItem("part", number, sum(
                    (b - a) * plan.datasets[i].row_bytes for i, a, b in unit.pieces)))
    whole = [(i, d) for i, d in enumerate(plan.datasets) if d.mode == "whole"]
    for file_index in range(len(plan.files)):
        for i, d in whole:
            start, stop = d.rows_of(file_index)
            step = max(1, WHOLE_ITEM_ROWS // d.chunk[0]) * d.chunk[0]
            lo = start
            while lo < stop:
                hi = min(stop, (lo // step + 1) * step)
                items.append(MergeItem("whole", file_index, (hi - lo) * d.row_bytes, i, lo, hi))
                lo = hi
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

    Returns the bytes moved. The piece changes the output as one
    transaction (:class:`PieceJournal`): whatever instant a writer of an
    earlier delivery was killed at, its changes are first undone, so that
    the piece starts from the output as the last finished piece left it,
    and a piece killed itself leaves an undo journal that the next
    delivery applies. A piece run again after it finished but before it
    was recorded writes the same rows at the same places (chunks stored
    at their offsets, rows written at their rows, references re-pointed
    from the checkpoint's own; the heap collections of variable-length rows
    copied again, past the earlier copies, which nothing points to any
    more). The output is fsynced even when ``piece``
    is empty (the copies wrote into it). Part files are left for
    :func:`remove_parts`, called once the whole merge is recorded.

    Raises
    ------
    MergeError
        If the output is still held by an earlier writer after
        :data:`chkq.consolidation.piece_journal.LOCK_WAIT_SECONDS`, or HDF5 fails on it;
        the message says what happened, not HDF5's own text (logged).
    """
    moved = 0
    chosen = [items[n] for n in piece]
    with plan.open_run() as run:
        fd = open_output_fd(run, plan, READ_WRITE)
        try:
            hold_output(fd, plan)
            journal = PieceJournal(run, plan.job.journal_path(), fd)
            journal.roll_back()
            if chosen:
                journal.begin()
                try:
                    parts = [item for item in chosen if item.kind == "part"]
                    if parts:
                        with open_for_merge(journal, plan.libver) as out:
                            limit = max(plan.block_bytes, MIN_HOLD_BYTES)
                            for item in parts:
                                unit = plan.copy_units[item.index]
                                d = plan.datasets[unit.pieces[0][0]]
                                if unit.part is None:
                                    raise ValueError(
                                        f"copy unit {item.index} wrote no part file")
                                moved += _move_chunks(run, plan.job.part(unit.part), d,
                                                      out[d.name], limit)
                    placed: dict[int, dict[int, int]] = {}
                    for item in chosen:
                        if item.kind != "part":
                            moved += _copy_whole(run, plan, journal, item,
                                                 placed.setdefault(item.index, {}))
                except (ChkqError, ValueError):
                    raise
                except (OSError, RuntimeError) as exc:
                    if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
                        raise
                    log.warning("job=%s merge piece failed in HDF5: %s", plan.job_id, exc)
                    raise MergeError(
                        f"the merge of job {plan.job_id} could not write its temporary "
                        f"output {str(plan.job.temp)!r} (HDF5 failed on it); its checkpoints "
                        "are untouched: submit the job again") from None
                journal.commit()
            else:
                os.fsync(fd)
        finally:
            os.close(fd)
    return moved


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


def _copy_whole(run: RunDir, plan: Plan, journal: PieceJournal, item: MergeItem,
                placed: dict[int, int]) -> int:
    """Copy one item's rows of a variable-length or reference dataset from its checkpoint file.

    Block by block (at most :data:`WHOLE_BLOCK_ROWS` rows, fewer where their
    heap collections hold more than :data:`WHOLE_HEAP_BYTES`), in HDF5
    sessions (:func:`open_for_merge`) of a few blocks (:func:`_copy_blocks`),
    so that HDF5's metadata cache, which holds every heap collection written
    until the file is closed, holds a bounded part of the heap.
    Variable-length rows move as heap IDs and heap bytes where they can
    (:class:`chkq.consolidation.heap_collections.HeapWriter`), else through HDF5 in
    its memory form; references are re-pointed (:func:`repoint`).
    ``placed``: the file's heap collections this piece copied already
    (:meth:`chkq.consolidation.heap_collections.HeapWriter.move_rows`). Returns the
    plain bytes of the rows the file stores.
    """
    d, file_index = plan.datasets[item.dataset], item.index
    first = d.offsets[file_index]
    fid, fd = open_source(run, plan, file_index)
    try:
        source = h5py.File(fid)
        src = source[d.name]
        stored = min(d.offsets[file_index + 1] - first, src.shape[0])
        lo, hi = item.start - first, item.stop - first
        if hi > stored:  # records of its dimension it lacks: its fill value
            padded = max(lo, stored)
            with open_for_merge(journal, plan.libver) as out:
                dst = out[d.name]
                heap = heap_collections.HeapWriter.for_output(out.id, dst.id, journal.read_at)
                if heap is not None:
                    heap.clear(first + padded, hi - padded)
                vlen.write_string_fill(dst.id, first + padded, hi - padded,
                                       vlen.string_fill(src.id))
            hi = padded
        references = src.id.get_type().get_class() == h5t.REFERENCE
        limit = max(plan.block_bytes // 2, WHOLE_HEAP_BYTES)
        a = lo
        while a < hi:
            with open_for_merge(journal, plan.libver) as out:
                a, patches = _copy_blocks(plan, out, journal, (fid, source, fd), d,
                                          file_index, a, hi, placed, limit, references)
            for patch in patches:
                patch.apply(journal.written_head, journal.copy_in, journal.write_at)
            if patches:
                start_writeback(journal.fd)  # the piece's fsync then finds the heap on its way
    finally:
        fid.close()
        os.close(fd)
    return max(0, hi - lo) * d.row_bytes


def _copy_blocks(plan: Plan, out: h5py.File, journal: PieceJournal,
                 opened: tuple[h5f.FileID, h5py.File, int], d: DatasetPlan, file_index: int,
                 a: int, hi: int, placed: dict[int, int], limit: int, references: bool
                 ) -> tuple[int, list[heap_collections.HeapPatch]]:
    """Copy blocks of a file's rows ``[a, hi)`` in one HDF5 session; where it stopped, and
    the heap collections to copy in once HDF5 has closed the output.

    The session ends once its blocks' heap collections hold ``limit`` bytes
    (HDF5 holds them in memory until then), or after a block that went
    through HDF5 (whose heap collections may have room HDF5 would put a
    placeholder in).
    """
    fid, source, fd = opened
    src, dst = source[d.name], out[d.name]
    step = min(WHOLE_BLOCK_ROWS, block_rows(d.row_bytes, plan.block_bytes))
    heap = None if references else heap_collections.HeapWriter.for_output(
        out.id, dst.id, journal.read_at)
    patches: list[heap_collections.HeapPatch] = []
    held = 0
    first = d.offsets[file_index]
    while a < hi and held < limit:
        b = a + (min(step, hi - a) if references else heap_collections.heap_rows(
            fid, src.id, fd, a, min(step, hi - a), limit))
        if references:
            dst[first + a:first + b] = repoint(src[a:b], source, out, d.name,
                                               plan.file_path(file_index))
            a = b
            continue
        patch = None if heap is None else heap.move_rows(
            fid, src.id, fd, a, b - a, first + a, placed,
            in_place=file_index == plan.reference_index())
        if patch is None:
            if heap is not None:
                heap.clear(first + a, b - a)
            tid = dst.id.get_type()
            with vlen.read_rows(src.id, a, b - a, tid) as rows:
                vlen.write_rows(dst.id, first + a, rows, tid)
            return b, patches
        if patch.runs:
            journal.replace_later(patch.address, patch.size)
            patches.append(patch)
            placed.update(patch.copied)
            held += patch.used
        a = b
    return a, patches


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
