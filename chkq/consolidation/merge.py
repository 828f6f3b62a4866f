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
checkpoint files block by block, as heap IDs and heap collections or
through HDF5 in its own memory form (:mod:`chkq.consolidation.vlen`), each
object or region reference re-pointed to the object of the same name in
the output.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5f, h5fd, h5p, h5r, h5t

from chkq.consolidation import vlen
from chkq.consolidation.checkpoint_files import MIN_HOLD_BYTES
from chkq.consolidation.copy_rows import PART_MAGIC, PART_RECORD, open_output_fd, open_source
from chkq.consolidation.h5types import hdf5_library
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.rowio import ByteCopier, block_rows, start_writeback
from chkq.errors import BadCheckpointError, ChkqError, MergeError
from chkq.fsutil import WRITE_ERRNOS
from chkq.rundir import CREATE, RunDir

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
        :data:`LOCK_WAIT_SECONDS`, or HDF5 fails on it; the message says
        what happened, not HDF5's own text (logged).
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


#: Bytes kept of a write :meth:`PieceJournal.replace_later` drops (what it is checked by).
HEAD_KEPT = 64

#: How long a piece waits for an earlier writer of the output to go: a node killed while
#: it fsynced the output keeps it until the disk answers.
LOCK_WAIT_SECONDS = 60.0

#: Opening the output for a piece: reading and writing, no link followed.
READ_WRITE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def hold_output(fd: int, plan: Plan, wait: float | None = None) -> None:
    """Hold the output open as ``fd`` for this piece alone (an exclusive ``flock``).

    The job's records let one piece run at a time, but a writer of an
    earlier delivery on a node that was killed can outlive it a while (a
    process killed inside ``fsync`` goes only when the disk answers; a
    broker hands its message on as soon as the node's connection drops).
    Its lock goes with it, and the piece waits for that, up to ``wait``
    seconds (:data:`LOCK_WAIT_SECONDS`). HDF5's own file lock, which
    refuses at once, is not used: the output is opened through this
    descriptor (:class:`PieceJournal`).

    Raises
    ------
    MergeError
        If the output is still held after ``wait`` seconds.
    """
    deadline = time.monotonic() + (LOCK_WAIT_SECONDS if wait is None else wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise MergeError(
                    f"the temporary output of job {plan.job_id} ({str(plan.job.temp)!r}) is "
                    "still held by another process after "
                    f"{LOCK_WAIT_SECONDS if wait is None else wait:.0f} s (a merge of an "
                    "earlier delivery that has not ended?); the job goes no further") from None
            time.sleep(0.05)


class PieceJournal:
    """The output as HDF5 sees it during one piece of the merge, changed as one transaction.

    HDF5 writes a file's metadata in place, when it closes the file: a
    writer killed midway leaves old and new metadata mixed, which no later
    open can read or extend. Here HDF5 writes through this object (h5py's
    file-object driver) and never opens the file itself. The output's size
    when the piece starts is its committed length: bytes written past it
    (new chunks, heaps, metadata) go to the file at once, since undoing
    them is a truncation; overwrites of committed bytes are held here, and
    reads see them. At :meth:`commit` the committed bytes about to be
    overwritten are saved into an undo journal (a file beside the output,
    renamed into place once complete and fsynced), then the held writes
    are applied and the output is fsynced, then the journal is removed.
    :meth:`roll_back`, which every piece calls first, puts a journal's
    saved bytes back and truncates the output to its committed length.
    A piece is thus undone from any instant until its journal is removed,
    and from then on it is done.
    """

    MAGIC = b"chkq merge undo journal 1\n"
    _HEAD = struct.Struct("<QQ")
    _ENTRY = struct.Struct("<QQ")

    def __init__(self, run: RunDir, path: Path, fd: int) -> None:
        self.run, self.path, self.fd = run, path, fd
        self.committed = self.size = os.fstat(fd).st_size
        self.position = 0
        self.held: list[tuple[int, bytes]] = []
        self.copier = ByteCopier()
        self.replaced: dict[int, int] = {}
        self.dropped: dict[int, bytes] = {}

    # -- the journal's life

    def roll_back(self) -> bool:
        """Undo what a killed piece did to the output, if it left a journal; whether it did."""
        self.run.unlink(self._staging)
        try:
            jfd = self.run.open_file(self.path)
        except FileNotFoundError:
            return False
        with os.fdopen(jfd, "rb") as fh:
            raw = fh.read()
        committed, regions = self._parse(raw)
        for offset, data in regions:
            _pwrite_all(self.fd, data, offset)
        os.ftruncate(self.fd, committed)
        os.fsync(self.fd)
        self.run.unlink(self.path)
        self.run.fsync()
        self.committed = self.size = committed
        log.info("merge piece of %r undone from its journal (%d regions, committed length %d)",
                 str(self.run.path), len(regions), committed)
        return True

    def begin(self) -> None:
        """Record the committed length before anything is written past it."""
        self.committed = self.size = os.fstat(self.fd).st_size
        self.held = []
        self._write_journal([])

    def commit(self) -> None:
        """Make the piece's writes the output's, durably, and remove the journal."""
        regions = _union([(offset, len(data)) for offset, data in self.held])
        if self.size < self.committed:
            regions = _union([*regions, (self.size, self.committed - self.size)])
        self._write_journal([(offset, _pread_all(self.fd, length, offset))
                             for offset, length in regions])
        for offset, data in self.held:
            _pwrite_all(self.fd, data, offset)
        if self.size < self.committed:
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        self.held = []
        self.run.unlink(self.path)
        self.run.fsync()
        self.committed = self.size

    @property
    def _staging(self) -> Path:
        return self.path.with_name(self.path.name + ".new")

    def _write_journal(self, regions: list[tuple[int, bytes]]) -> None:
        body = bytearray(self.MAGIC + self._HEAD.pack(self.committed, len(regions)))
        for offset, data in regions:
            body += self._ENTRY.pack(offset, len(data)) + data
        body += hashlib.sha256(body).digest()
        self.run.unlink(self._staging)
        jfd = self.run.open_file(self._staging, CREATE)
        try:
            _pwrite_all(jfd, bytes(body), 0)
            os.fsync(jfd)
        finally:
            os.close(jfd)
        self.run.rename(self._staging, self.path)
        self.run.fsync()

    def _parse(self, raw: bytes) -> tuple[int, list[tuple[int, bytes]]]:
        """The committed length and saved regions of a journal (BadCheckpointError if not one)."""
        bad = BadCheckpointError(f"the merge journal {str(self.path)!r} of the job is not one it "
                                 "wrote: the run directory was changed; submit the job again")
        body, digest = raw[:-32], raw[-32:]
        if (len(raw) < len(self.MAGIC) + self._HEAD.size + 32 or not body.startswith(self.MAGIC)
                or hashlib.sha256(body).digest() != digest):
            raise bad
        at = len(self.MAGIC)
        committed, count = self._HEAD.unpack_from(body, at)
        at += self._HEAD.size
        regions = []
        for _ in range(count):
            if at + self._ENTRY.size > len(body):
                raise bad
            offset, length = self._ENTRY.unpack_from(body, at)
            at += self._ENTRY.size
            if offset + length > committed or at + length > len(body):
                raise bad
            regions.append((offset, body[at:at + length]))
            at += length
        if at != len(body):
            raise bad
        return committed, regions

    # -- the file object HDF5 writes through

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read_at(self.position, len(view))
        view[:len(data)] = data
        self.position += len(data)
        return len(data)

    def read_at(self, start: int, length: int) -> bytes:
        """The output's bytes ``[start, start + length)`` as this piece sees them (to its end)."""
        stop = min(start + length, self.size)
        if stop <= start:
            return b""
        data = bytearray(_pread_all(self.fd, stop - start, start))
        data += bytes(stop - start - len(data))
        if start < self.committed:
            for offset, held in self.held:
                lo, hi = max(start, offset), min(stop, offset + len(held))
                if lo < hi:
                    data[lo - start:hi - start] = held[lo - offset:hi - offset]
        return bytes(data)

    def copy_in(self, fd: int, offset_in: int, offset: int, count: int) -> None:
        """Copy ``count`` bytes of file ``fd`` from ``offset_in`` to ``offset`` of the output.

        Past the committed length in the kernel
        (:class:`chkq.consolidation.rowio.ByteCopier`: a roll-back's
        truncation undoes it); over committed bytes as a held write.
        """
        held = max(0, min(count, self.committed - offset))
        if held:
            data = _pread_all(fd, held, offset_in)
            if len(data) != held:
                raise BadCheckpointError("a checkpoint file ended while the merge read it")
            self.write_at(offset, data)
        if count > held:
            self.copier.copy(fd, offset_in + held, self.fd, offset + held, count - held)
            self.size = max(self.size, offset + count)

    def replace_later(self, offset: int, size: int) -> None:
        """Drop HDF5's write of exactly ``size`` bytes at ``offset`` (past the committed length).

        Its first bytes are kept (:meth:`written_head`): the caller writes
        the bytes itself once HDF5 has closed the output (a placeholder
        heap collection, :class:`chkq.consolidation.vlen.HeapWriter`).
        """
        self.replaced[offset] = size

    def written_head(self, offset: int, length: int) -> bytes:
        """The first ``length`` bytes HDF5 wrote at ``offset``, whether or not they were dropped."""
        self.replaced.pop(offset, None)
        kept = self.dropped.pop(offset, None)
        return kept[:length] if kept is not None else self.read_at(offset, length)

    def write_at(self, offset: int, data: bytes) -> None:
        """:meth:`write` ``data`` at ``offset``, wherever HDF5 was."""
        position = self.position
        self.seek(offset)
        self.write(data)
        self.position = position

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, self.size - self.position)
        buffer = bytearray(size)
        return bytes(buffer[:self.readinto(buffer)])

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        start, stop = self.position, self.position + len(view)
        if start >= self.committed and self.replaced.get(start) == written:
            del self.replaced[start]
            self.dropped[start] = bytes(view[:HEAD_KEPT])
            self.size = max(self.size, stop)
            self.position = stop
            return written
        if start < self.committed:
            cut = min(stop, self.committed) - start
            self.held.append((start, bytes(view[:cut])))
            view, start = view[cut:], start + cut
        if len(view):
            _pwrite_all(self.fd, view, start)
        self.size = max(self.size, stop)
        self.position = stop
        return written

    def truncate(self, size: int | None = None) -> int:
        size = self.position if size is None else size
        os.ftruncate(self.fd, max(size, self.committed))
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing: the piece is made durable at :meth:`commit`."""


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges merged where they overlap or touch, in order."""
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
        elif length:
            merged.append([offset, length])
    return [(a, b) for a, b in merged]


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        length, offset = length - len(data), offset + len(data)
    return b"".join(parts)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@contextlib.contextmanager
def open_for_merge(journal: PieceJournal, libver: list[str]) -> Iterator[h5py.File]:
    """The output opened by HDF5 for one piece of the merge, writing through ``journal``.

    A file written under bounds of 1.10 or later (superblock version 3) is
    marked as open for writing while it is: the piece clears a mark that
    it finds (one a piece of an older chkq left, killed), as ``h5clear``
    does. The metadata cache holds every change of the piece until the
    file is closed (no eviction writes part of it earlier), so that the
    overwrites the journal holds are few and small.
    """
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fileobj_driver(h5fd.fileobj_driver, journal)
    fapl.set_libver_bounds(_LIBVER[libver[0]], _LIBVER[libver[1]])
    clear = ctypes.c_bool(True)
    if hdf5_library().H5Pset(ctypes.c_int64(fapl.id), b"clear_status_flags",
                                     ctypes.byref(clear)) < 0:
        raise RuntimeError("HDF5 has no file access property clear_status_flags")
    out = h5py.File(h5f.open(repr(journal).encode(), h5f.ACC_RDWR, fapl=fapl))
    try:
        config = out.id.get_mdc_config()
        config.evictions_enabled = False
        config.incr_mode = config.flash_incr_mode = config.decr_mode = 0
        out.id.set_mdc_config(config)
        yield out
    finally:
        out.close()
        del fapl


#: h5py's names of library version bounds, as HDF5's constants.
_LIBVER = {"earliest": h5f.LIBVER_EARLIEST, "v108": h5f.LIBVER_V18, "v110": h5f.LIBVER_V110,
           "v112": h5f.LIBVER_V112, "v114": h5f.LIBVER_V114, "v200": h5f.LIBVER_V200,
           "latest": h5f.LIBVER_LATEST}


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
    (:class:`chkq.consolidation.vlen.HeapWriter`), else through HDF5 in
    its memory form; references are re-pointed (:func:`repoint`).
    ``placed``: the file's heap collections this piece copied already
    (:meth:`chkq.consolidation.vlen.HeapWriter.move_rows`). Returns the
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
                heap = vlen.HeapWriter.for_output(out.id, dst.id, journal.read_at)
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
                 ) -> tuple[int, list[vlen.HeapPatch]]:
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
    heap = None if references else vlen.HeapWriter.for_output(out.id, dst.id, journal.read_at)
    patches: list[vlen.HeapPatch] = []
    held = 0
    first = d.offsets[file_index]
    while a < hi and held < limit:
        b = a + (min(step, hi - a) if references else vlen.heap_rows(
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
