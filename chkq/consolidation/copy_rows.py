"""Copying a unit of rows from checkpoint files into the output.

Raw-mode datasets are written as bytes straight into the chunks the
planner allocated (no HDF5 handle is opened for writing, so any number of
copy tasks can write one output at once, each to its own rows); when the
source's chunks hold plain rows too, the bytes go from file to file in the
kernel (``ChunkCopier``), otherwise they are read through HDF5. Copy tasks
start the writeback of what they wrote, so the final fsync is short.
Other datasets are written to part files through HDF5 and merged later.
Memory stays within one block of rows whatever the dataset size.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import h5py
import numpy as np
from h5py import h5d, h5f

from chkq.consolidation.checkpoint_files import open_checkpoint_id
from chkq.consolidation.chunk_encoding import ChunkEncoder, lossy_filters
from chkq.consolidation.h5types import chunk_options, unfiltered_edges
from chkq.consolidation.hdf5_encoding import HDF5Encoder, unfiltered_chunk
from chkq.consolidation.plan import CopyUnit, DatasetPlan, Plan
from chkq.consolidation.rowio import (
    ByteCopier,
    as_bytes,
    block_rows,
    read_padded,
    start_writeback,
)
from chkq.consolidation.stamps import check_descriptor, open_unchanged
from chkq.rundir import CREATE, WRITE, RunDir

Progress = Callable[[int], None]

#: Bytes a copy task writes before it asks the kernel to start writing them back.
WRITEBACK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of dataset ``dataset`` in the output, all from one file."""

    dataset: int
    start: int
    stop: int


@dataclass
class CopyStats:
    """What a copy task did, for its log line and result."""

    rows: int = 0
    bytes: int = 0
    files: int = 0
    moved: int = 0
    digests: list[list[int | str]] = field(default_factory=list)


def segments_by_file(plan: Plan, unit: CopyUnit) -> dict[int, list[Segment]]:
    """Split a unit's pieces at file boundaries, keyed by file index, in file order."""
    found: dict[int, list[Segment]] = {}
    for index, start, stop in unit.pieces:
        offsets = plan.datasets[index].offsets
        first = max(0, _file_at(offsets, start))
        for f in range(first, len(offsets) - 1):
            lo, hi = max(start, offsets[f]), min(stop, offsets[f + 1])
            if offsets[f] >= stop:
                break
            if hi > lo:
                found.setdefault(f, []).append(Segment(index, lo, hi))
    return dict(sorted(found.items()))


def _file_at(offsets: list[int], row: int) -> int:
    """Index of the file whose rows include output row ``row`` (bisect on offsets)."""
    lo, hi = 0, len(offsets) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


def open_source(run: RunDir, plan: Plan, file_index: int) -> tuple[h5f.FileID, int]:
    """Open checkpoint file ``file_index`` as it was planned: an HDF5 id and a descriptor.

    The descriptor is opened through ``run`` (no link followed at any
    level) and checked against the file's recorded stamp; HDF5 reads that
    descriptor's file. The caller closes both.
    """
    path = plan.file_path(file_index)
    fd = open_unchanged(run, path, plan.stamp(file_index), plan.job_id)
    try:
        fid = open_checkpoint_id(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fid, fd


def open_output_fd(run: RunDir, plan: Plan, flags: int = WRITE) -> int:
    """Open the job's temporary output through ``run``, if it is the file the planner made."""
    path = plan.job.temp
    fd = run.open_file(path, flags)
    try:
        check_descriptor(path, fd, plan.temp_inode)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RawWriter:
    """Writes rows of raw-mode datasets into their pre-allocated chunks."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, d: DatasetPlan, first_row: int, rows: np.ndarray) -> None:
        """Write ``rows`` as output rows ``first_row...`` of dataset ``d``."""
        trailing_chunk = d.chunk[1:]
        if list(trailing_chunk) == list(d.trailing):
            self._write_full_width(d, first_row, rows)
        else:
            self._write_tiled(d, first_row, rows)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while data:
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written

    def _write_full_width(self, d: DatasetPlan, first_row: int, rows: np.ndarray) -> None:
        """Chunks span whole rows: write runs of rows in contiguous chunks at once."""
        raw, done = as_bytes(rows), 0
        for offset, count in output_runs(d, first_row, len(rows)):
            self._pwrite(raw[done:done + count], offset)
            done += count

    def _write_tiled(self, d: DatasetPlan, first_row: int, rows: np.ndarray) -> None:
        """Chunks tile the trailing dimensions too: write each chunk's slab of rows."""
        per_chunk, tile = d.chunk[0], d.chunk[1:]
        grid = [math.ceil(t / c) for t, c in zip(d.trailing, tile, strict=True)]
        per_row_chunk = math.prod(grid)
        tile_row_bytes = math.prod(tile) * rows.dtype.itemsize
        n, i = len(rows), 0
        while i < n:
            row = first_row + i
            k, within = divmod(row, per_chunk)
            take = min(n - i, per_chunk - within)
            for linear, coords in enumerate(np.ndindex(*grid)):
                sel = tuple(slice(c * t, (c + 1) * t) for c, t in zip(coords, tile, strict=True))
                part = rows[(slice(i, i + take), *sel)]
                if list(part.shape[1:]) != list(tile):
                    padded = np.zeros((take, *tile), dtype=rows.dtype)
                    padded[(slice(None), *(slice(0, s) for s in part.shape[1:]))] = part
                    part = padded
                offset = d.chunk_offsets[k * per_row_chunk + linear] + within * tile_row_bytes
                self._pwrite(as_bytes(part), offset)
            i += take


def output_runs(d: DatasetPlan, first_row: int, count: int) -> Iterator[tuple[int, int]]:
    """``(file offset, bytes)`` of output rows ``[first_row, first_row + count)`` of ``d``.

    For full-width chunks only (a chunk holds whole rows): runs of rows in
    chunks that are adjacent in the file are merged into one run.
    """
    per_chunk, row = d.chunk[0], d.row_bytes
    i = 0
    while i < count:
        k, within = divmod(first_row + i, per_chunk)
        offset = d.chunk_offsets[k] + within * row
        take = min(count - i, per_chunk - within)
        while i + take < count:
            k_next = (first_row + i + take) // per_chunk
            if d.chunk_offsets[k_next] != offset + take * row:
                break
            take += min(count - i - take, per_chunk)
        yield offset, take * row
        i += take


class ChunkCopier:
    """Copies a raw-mode dataset's rows from a source file's chunks into the output's chunks.

    Profiling showed copy tasks spending their time in HDF5's per-file and
    per-call overhead (small files) and in moving every row through user
    memory (big files). Where the planning scan found a source's chunks to
    hold plain rows (:attr:`chkq.consolidation.plan.DatasetPlan.source_chunks`), and the
    output's chunks hold plain rows too, the rows are moved with
    ``copy_file_range`` (a page-cache copy in the kernel) from one to the
    other: no HDF5, no decoding, no user-space buffer. The file is the one
    the scan read (its stamp is checked when it is opened), and the verify
    tasks read both files back through HDF5, so the offsets are checked
    independently of this path.
    """

    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd
        self.bytes = ByteCopier()
        self.unsynced = 0

    def copy(self, src_fd: int, source_chunks: list[int], d: DatasetPlan, base: int,
             start: int, stop: int) -> None:
        """Copy source rows ``[start, stop)`` to output rows ``base + start...``."""
        per_chunk, row = d.chunk[0], d.row_bytes
        for k in range(start // per_chunk, (stop - 1) // per_chunk + 1):
            lo, hi = max(start, k * per_chunk), min(stop, (k + 1) * per_chunk)
            source_offset, done = source_chunks[k] + (lo - k * per_chunk) * row, 0
            for out_offset, count in output_runs(d, base + lo, hi - lo):
                self.bytes.copy(src_fd, source_offset + done, self.out_fd, out_offset, count)
                done += count
            self.unsynced += done
        if self.unsynced >= WRITEBACK_BYTES:
            start_writeback(self.out_fd)
            self.unsynced = 0


def source_chunks(d: DatasetPlan, file_index: int) -> list[int]:
    """Where file ``file_index`` keeps ``d``'s rows as plain chunks ([]: read through HDF5)."""
    return d.source_chunks[file_index] if d.source_chunks else []


def copy_unit(plan: Plan, unit_index: int, progress: Progress | None = None) -> CopyStats:
    """Copy copy-unit ``unit_index`` of ``plan``; redoing it rewrites the same bytes.

    A file whose rows of this unit all lie in plain chunks is not opened
    through HDF5 at all (:class:`ChunkCopier`).
    """
    unit = plan.copy_units[unit_index]
    stats = CopyStats()
    segments = segments_by_file(plan, unit)
    with plan.open_run() as run:
        if unit.part is not None:
            return _copy_to_part(run, plan, unit, segments, stats, progress)
        return _copy_raw(run, plan, segments, stats, progress)


def _copy_raw(run: RunDir, plan: Plan, segments: dict[int, list[Segment]], stats: CopyStats,
              progress: Progress | None) -> CopyStats:
    """Copy a unit's rows of raw-mode datasets into the output's pre-allocated chunks."""
    fd = open_output_fd(run, plan)
    try:
        writer = RawWriter(fd)
        chunks = ChunkCopier(fd)
        for file_index, file_segments in segments.items():
            plain = all(source_chunks(plan.datasets[seg.dataset], file_index)
                        for seg in file_segments)
            if plain:
                fid = None
                src_fd = open_unchanged(run, plan.file_path(file_index),
                                        plan.stamp(file_index), plan.job_id)
            else:
                fid, src_fd = open_source(run, plan, file_index)
            try:
                stats.files += 1
                for seg in file_segments:
                    d = plan.datasets[seg.dataset]
                    base = d.offsets[file_index]
                    found = source_chunks(d, file_index)
                    if found:
                        chunks.copy(src_fd, found, d, base, seg.start - base, seg.stop - base)
                    else:
                        assert fid is not None
                        _copy_through_hdf5(plan, d, h5d.open(fid, d.name.encode()), base, seg,
                                           writer, d.offsets[file_index + 1] - base)
                    stats.rows += seg.stop - seg.start
                    stats.bytes += (seg.stop - seg.start) * d.row_bytes
                    if progress:
                        progress(stats.rows)
            finally:
                os.close(src_fd)
                if fid is not None:
                    fid.close()
        start_writeback(fd)
    finally:
        os.close(fd)
    return stats


def _copy_through_hdf5(plan: Plan, d: DatasetPlan, dsid: h5d.DatasetID, base: int,
                       seg: Segment, writer: RawWriter, provides: int) -> None:
    """Read a segment's rows through HDF5 (any layout) and write them as raw bytes.

    ``provides``: the rows the file provides to the output (:func:`read_padded`).
    """
    step = block_rows(d.row_bytes, plan.block_bytes)
    buffer = np.empty((min(step, seg.stop - seg.start), *d.trailing),
                      dtype=f"V{d.element_size}")
    for first in range(seg.start - base, seg.stop - base, step):
        rows = buffer[:min(step, seg.stop - base - first)]
        read_padded(dsid, first, rows, provides)
        writer.write(d, base + first, rows)


def same_pipeline(a: h5d.DatasetID, b: h5d.DatasetID) -> bool:
    """Whether two datasets store chunks alike: same type, chunk shape and filter pipeline.

    The filter pipeline compares every filter's id, flags and stored
    parameters, in order, and the chunk options (whether edge chunks are
    stored unfiltered, which HDF5 decides by where a chunk lies, not by its
    filter mask). With these equal, a chunk's stored bytes and filter mask
    decode to the same rows in either dataset.
    """
    pa, pb = a.get_create_plist(), b.get_create_plist()
    if pa.get_layout() != h5d.CHUNKED or pb.get_layout() != h5d.CHUNKED:
        return False
    if chunk_options(pa) != chunk_options(pb):
        return False
    if tuple(pa.get_chunk()) != tuple(pb.get_chunk()) or not a.get_type().equal(b.get_type()):
        return False
    if pa.get_nfilters() != pb.get_nfilters():
        return False
    return all(pa.get_filter(i)[:3] == pb.get_filter(i)[:3] for i in range(pa.get_nfilters()))


def moved_rows(d: DatasetPlan, file_index: int, start: int, stop: int) -> int:
    """End of the output rows from ``start`` on whose chunks file ``file_index`` stores whole.

    ``[start, stop)`` are output rows of that file, ``start`` on the chunk
    grid. A source chunk lands whole on the output's grid when the file's
    first output row is on it; the chunks from ``start`` to the last whole
    one then move unchanged, and so does the file's last, partial chunk if
    it is the output's last (the rows past the dataset's end are seen by no
    reader in either file). Returns ``start`` when nothing moves.
    """
    per_chunk, base = d.chunk[0], d.offsets[file_index]
    if base % per_chunk or start % per_chunk:
        return start
    if stop == d.total:
        return stop
    return start + (stop - start) // per_chunk * per_chunk


def chunk_starts(d: DatasetPlan) -> list[tuple[int, ...]]:
    """Offsets along the trailing axes of each chunk of one row of chunks, row-major."""
    tile = d.chunk[1:]
    grid = [math.ceil(t / c) for t, c in zip(d.trailing, tile, strict=True)]
    return [tuple(c * t for c, t in zip(coords, tile, strict=True)) for coords in np.ndindex(*grid)]


def edge_chunk(d: DatasetPlan, row: int, where: tuple[int, ...]) -> bool:
    """Whether the output's chunk at ``(row, *where)`` reaches past the dataset's extent."""
    return row + d.chunk[0] > d.total or any(
        w + c > t for w, c, t in zip(where, d.chunk[1:], d.trailing, strict=True))


def all_chunks_stored(dsid: h5d.DatasetID) -> bool:
    """Whether every chunk of ``dsid``'s grid is stored (none left to the fill value)."""
    chunk, shape = dsid.get_create_plist().get_chunk(), dsid.shape
    return bool(dsid.get_num_chunks() == math.prod(-(-n // c) for n, c in zip(shape, chunk,
                                                                           strict=True)))


#: A part file's first bytes; then one record per chunk: :data:`PART_RECORD` (stored
#: size, filter mask), the chunk's offset in the output (one ``<q`` per axis), the bytes.
PART_MAGIC = b"chkq-chunks-1\n"
PART_RECORD = struct.Struct("<QI")
#: Bytes of records a copy task gathers before it writes them to its part file.
PART_BUFFER_BYTES = 8 * 1024 * 1024


class PartWriter:
    """Writes encoded chunks, with their output offsets and filter masks, to a part file.

    A part file is not HDF5: chunks are appended as they come, and the
    merge step hands each to ``write_direct_chunk`` as it stands
    (:func:`chkq.consolidation.merge.read_part`), so neither side pays
    HDF5's per-chunk cost of a second file.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray(PART_MAGIC)

    def add(self, where: tuple[int, ...], data: bytes, mask: int = 0) -> None:
        """Append the chunk stored as ``data`` (filter mask ``mask``) at output offset ``where``."""
        self.buffer += PART_RECORD.pack(len(data), mask)
        self.buffer += struct.pack(f"<{len(where)}q", *where)
        self.buffer += data
        if len(self.buffer) >= PART_BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        view = memoryview(self.buffer)
        while view:
            view = view[os.write(self.fd, view):]
        self.buffer = bytearray()


def _copy_to_part(
    run: RunDir,
    plan: Plan,
    unit: CopyUnit,
    segments: dict[int, list[Segment]],
    stats: CopyStats,
    progress: Progress | None,
) -> CopyStats:
    """Write one piece of a ``chunks`` dataset's encoded chunks to its part file.

    Where a source's chunks land whole on the output's chunk grid
    (:func:`moved_rows`) and the source stores them like the template
    (same type, chunk shape and filter pipeline, every chunk stored), they
    are moved unchanged: stored bytes and filter mask, read with
    ``read_direct_chunk``, nothing decoded. Their rows are recorded as
    ``stored``, so that verification compares the output's stored chunks
    with the source's. Other rows are read through HDF5 as bytes of the
    file type (the file type as the memory type: nothing is converted, so
    full-width NULLTERM strings and compound padding bytes survive), and
    the SHA-256 of each file's source rows, as read, goes into the task's
    result: verification then reads the (compressed) output once and
    compares digests instead of decoding every source again. Whole chunks
    of a [shuffle,] deflate dataset are encoded with ISA-L
    (:mod:`chkq.consolidation.chunk_encoding`, twenty times HDF5's zlib);
    the rest through HDF5's own filters
    (:class:`chkq.consolidation.hdf5_encoding.HDF5Encoder`). The
    template is opened as planned (its stamp checked); the part file
    (:class:`PartWriter`) is created exclusively through ``run`` (never
    through a link planted at its name or above it), written through its
    descriptor and renamed into place.
    """
    assert unit.part is not None
    index, start, stop = unit.pieces[0]
    d = plan.datasets[index]
    final = plan.job.part(unit.part)
    temp = final.with_name(final.name + ".new")
    run.unlink(temp)
    ref_id, ref_fd = open_source(run, plan, plan.reference_index())
    os.close(ref_fd)
    try:
        part_fd = run.open_file(temp, CREATE, 0o644)
    except BaseException:
        ref_id.close()
        raise
    with h5py.File(ref_id) as ref:
        template = ref[d.name]
        part = PartWriter(part_fd)
        per_chunk = d.chunk[0]
        half_block = block_rows(d.row_bytes, plan.block_bytes // 2)
        buffer_rows = max(per_chunk, half_block // per_chunk * per_chunk)
        buffer = np.empty((min(buffer_rows, max(stop - start, 1)), *d.trailing),
                          dtype=f"V{d.element_size}")
        encoder = ChunkEncoder.for_dataset(template.id)
        fallback: HDF5Encoder | None = None
        lossy = lossy_filters(template.id.get_create_plist())
        raw_edges = unfiltered_edges(template.id.get_create_plist())
        tiles = chunk_starts(d)
        pending_rows, written = 0, 0

        def add(row: int, where: tuple[int, ...], chunk: bytes, mask: int = 0) -> None:
            """Store an encoded chunk, or its elements as they are where HDF5 keeps them so."""
            if raw_edges and edge_chunk(d, row, where):
                first = row - start - written
                chunk = unfiltered_chunk(buffer[first:min(first + per_chunk, pending_rows)],
                                         where, tuple(d.chunk))
                mask = 0
            part.add((row, *where), chunk, mask)

        def flush() -> None:
            nonlocal pending_rows, written, fallback
            done = 0
            if encoder is not None:
                done = pending_rows // per_chunk * per_chunk
                for first in range(0, done, per_chunk):
                    row = start + written + first
                    for where, chunk in encoder.encode_rows(buffer[first:first + per_chunk]):
                        add(row, where, chunk)
            if pending_rows > done:
                if fallback is None:
                    fallback = HDF5Encoder(template, len(buffer), d.pipeline, lossy)
                row = start + written + done
                for first, where, mask, chunk in fallback.encode(buffer[done:pending_rows],
                                                                 tiles, per_chunk):
                    add(row + first, where, chunk, mask)
            written += pending_rows
            pending_rows = 0

        def move(source: h5d.DatasetID, first: int, end: int, base: int) -> None:
            """Move the source's stored chunks of output rows ``[first, end)`` unchanged."""
            nonlocal written
            flush()
            for row in range(first, end, per_chunk):
                for where in tiles:
                    mask, data = source.read_direct_chunk((row - base, *where))
                    part.add((row, *where), data, mask)
                    stats.moved += len(data)
            written = end - start

        try:
            for file_index, file_segments in segments.items():
                fid, src_fd = open_source(run, plan, file_index)
                try:
                    source = h5d.open(fid, d.name.encode())
                    stats.files += 1
                    base = d.offsets[file_index]
                    provides = d.offsets[file_index + 1] - base
                    alike = (source.shape[0] == provides and same_pipeline(source, template.id)
                             and all_chunks_stored(source))
                    for seg in file_segments:
                        lo, end = seg.start - base, seg.stop - base
                        moved_end = moved_rows(d, file_index, seg.start, seg.stop) if alike \
                            else seg.start
                        if moved_end > seg.start:
                            move(source, seg.start, moved_end, base)
                            stats.digests.append([file_index, seg.start, moved_end, "",
                                                  "stored"])
                            lo = moved_end - base
                            stats.rows = written
                            if progress:
                                progress(stats.rows)
                        if lo == end:
                            continue
                        digest = hashlib.sha256()
                        first_row = lo + base
                        while lo < end:
                            if pending_rows == len(buffer):
                                flush()
                            take = min(len(buffer) - pending_rows, end - lo)
                            rows = buffer[pending_rows:pending_rows + take]
                            read_padded(source, lo, rows, provides)
                            digest.update(as_bytes(rows))
                            pending_rows, lo = pending_rows + take, lo + take
                            stats.rows = written + pending_rows
                            if progress:
                                progress(stats.rows)
                        stats.digests.append([file_index, first_row, seg.stop,
                                              digest.hexdigest()])
                finally:
                    fid.close()
                    os.close(src_fd)
            flush()
            part.flush()
        finally:
            os.close(part_fd)
            if fallback is not None:
                fallback.close()
        stats.bytes = written * d.row_bytes
    run.rename(temp, final)
    return stats
