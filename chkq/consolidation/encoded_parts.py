"""A filtered dataset's chunks laid out in a sparse skeleton, for an output assembled from parts.

In a job spread over the nodes (:mod:`chkq.consolidation.output_parts`)
the output's byte layout must be fixed before any row moves. A raw
dataset's chunks have a known size; a filtered (``chunks`` mode) dataset's
do not until they are encoded. Its output chunks are of two kinds:

- *moved*: a source's stored chunk that lands whole on the output's chunk
  grid, the source storing the dataset like the template (same type, chunk
  shape and filter pipeline, every chunk stored; the rule of the one-node
  copy, :func:`chkq.consolidation.copy_rows.moved_rows`). Its bytes and
  filter mask are the source's, its size is known from the source's chunk
  index alone: the store copies it from the source's own address.
- *encoded again*: every other chunk (rows of two files, a file whose
  first row is off the output's grid, a source stored otherwise). The
  planning node reads the source chunks it needs (fetched into sparse
  copies of the metadata mirrors), encodes it with the copy's encoders,
  reads it back through HDF5 against the source rows, and writes it into
  the skeleton: it reaches the output as skeleton bytes.

:func:`write_chunks` writes both kinds into the skeleton with
``write_direct_chunk``, so that HDF5 allocates every chunk and writes the
chunk index: a moved chunk as a *placeholder* of exactly its stored size
and filter mask, whose zeros are punched out of the file as soon as they
are written (the skeleton stays sparse: a run many times the node's disk is
laid out in its metadata's room). The chunk index then gives every chunk's
address, recorded in the plan (:attr:`chkq.consolidation.plan.DatasetPlan.chunk_sizes`
and the fields beside it), from which :func:`moved_pieces` lists the
source ranges and the proof of the assembled object checks the index.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import h5py
import numpy as np
from h5py import h5d, h5f

from chkq.consolidation.checkpoint_files import stored_chunks
from chkq.consolidation.chunk_encoding import ChunkEncoder, lossy_filters
from chkq.consolidation.copy_rows import (
    all_chunks_stored,
    chunk_starts,
    edge_chunk,
    moved_rows,
    open_output_fd,
    open_source,
    same_pipeline,
)
from chkq.consolidation.h5types import unfiltered_edges
from chkq.consolidation.hdf5_encoding import HDF5Encoder, unfiltered_chunk
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.rowio import as_bytes, read_padded
from chkq.consolidation.stamps import open_unchanged
from chkq.errors import BadCheckpointError, CheckpointCorruptionError, OutputMismatchError
from chkq.rundir import CREATE, READ, RunDir, fd_path

#: Most bytes of source chunks the planning node fetches to encode chunks again: what it
#: encodes lands in the skeleton, which a job record carries (at most as many bytes).
MAX_ENCODED_BYTES = 64 << 20
#: Bytes between two source chunks to encode again that one read takes in rather than two.
FILL_GAP_BYTES = 64 << 10
#: Placeholder bytes written before they are punched out of the skeleton.
PUNCH_BYTES = 8 << 20

#: ``pread(file index, offset, length)`` of a source's pinned bytes.
SourceReader = Callable[[int, int, int], bytes]

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk blocks of bytes ``[offset, offset + length)``: they read as zeros.

    Raises
    ------
    OSError
        If the filesystem cannot free a range of a file (the skeleton would
        hold every placeholder's zeros).
    """
    fallocate = getattr(_libc, "fallocate", None)
    if fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available to free a skeleton's "
                      "placeholders")
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"the scratch filesystem cannot free a range of a file "
                      f"({os.strerror(error)}): a filtered run cannot be spread over the "
                      "nodes from it")


@dataclass(frozen=True)
class Moved:
    """Output chunk row ``row`` (first row) of a dataset, moved from file ``file``.

    ``chunks`` holds, for each chunk of that row of chunks (row-major over
    the trailing grid), the source's ``(offset, size, filter mask)``.
    """

    row: int
    file: int
    chunks: tuple[tuple[int, int, int], ...]


def _source_layout(plan: Plan, d: DatasetPlan, template: h5d.DatasetID, file_index: int,
                   fid: h5f.FileID) -> tuple[list[Moved], tuple[int, int]]:
    """The chunk rows file ``file_index`` gives ``d`` unchanged, and its output rows left.

    Returns the moved rows of chunks, and ``[start, stop)``, the output rows
    of the file that are encoded again (empty when every row moves).
    """
    start, stop = d.rows_of(file_index)
    if stop == start:
        return [], (start, start)
    source = h5d.open(fid, d.name.encode())
    alike = (source.shape[0] == stop - start and same_pipeline(source, template)
             and all_chunks_stored(source))
    end = moved_rows(d, file_index, start, stop) if alike else start
    if end == start:
        return [], (start, stop)
    per_chunk, tiles = d.chunk[0], len(chunk_starts(d))
    index = stored_chunks(source, tuple(d.chunk), source.shape)
    where = f"dataset /{d.name} of {plan.files[file_index][0]}"
    moved = []
    for k in range(0, -(-(end - start) // per_chunk)):
        row = []
        for _, info in index[k * tiles:(k + 1) * tiles]:
            if info is None or info.byte_offset is None:
                raise CheckpointCorruptionError(f"{where}: a chunk of its rows from "
                                                f"{k * per_chunk} on is not stored, though "
                                                "its index counts it")
            row.append((int(info.byte_offset), int(info.size), int(info.filter_mask)))
        moved.append(Moved(start + k * per_chunk, file_index, tuple(row)))
    return moved, (end, stop)


def _sparse_copy(run: RunDir, plan: Plan, file_index: int, path: str) -> int:
    """Copy file ``file_index`` (a metadata mirror) to ``path``, holes left holes; its fd."""
    src = open_unchanged(run, plan.file_path(file_index), plan.stamp(file_index), plan.job_id)
    try:
        out = run.open_file(path, CREATE, 0o600)
        try:
            size = os.fstat(src).st_size
            at = 0
            while at < size:
                try:
                    data = os.lseek(src, at, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno != errno.ENXIO:  # no data past ``at``: the rest is a hole
                        raise
                    break
                hole = os.lseek(src, data, os.SEEK_HOLE)
                while data < hole:
                    chunk = os.pread(src, min(8 << 20, hole - data), data)
                    if not chunk:
                        raise OSError(errno.EIO, f"{plan.file_path(file_index)} shrank while "
                                      "it was copied")
                    view = memoryview(chunk)
                    while view:
                        written = os.pwrite(out, view, data)
                        view, data = view[written:], data + written
                at = hole
            os.ftruncate(out, size)
        except BaseException:
            os.close(out)
            raise
        return out
    finally:
        os.close(src)


def _needed_chunks(source: h5d.DatasetID, lo: int, hi: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the source's stored chunks holding its rows ``[lo, hi)``."""
    chunk = tuple(source.get_create_plist().get_chunk())
    found = []
    for coords, info in stored_chunks(source, chunk, source.shape):
        first = coords[0] * chunk[0]
        if first < hi and first + chunk[0] > lo and info is not None \
                and info.byte_offset is not None:
            found.append((int(info.byte_offset), int(info.size)))
    return found


class _Filled:
    """Sparse copies of the mirrors with the source chunks a chunk encoded again reads."""

    def __init__(self, run: RunDir, plan: Plan, read: SourceReader) -> None:
        self.run, self.plan, self.read = run, plan, read
        self.paths: dict[int, str] = {}
        self.files: dict[int, h5py.File] = {}
        self.fetched = 0

    def fill(self, file_index: int, ranges: list[tuple[int, int]]) -> None:
        """Fetch ``(offset, size)`` ranges of the pinned source into its copy."""
        self.fetched += sum(size for _, size in ranges)
        if self.fetched > MAX_ENCODED_BYTES:
            raise BadCheckpointError(
                f"job {self.plan.job_id} cannot be spread over the nodes: more than "
                f"{MAX_ENCODED_BYTES:,} bytes of its filtered chunks would be encoded again "
                "on one node (files whose rows do not start on the output's chunk grid, or "
                "stored otherwise than its template); nothing was published")
        if file_index not in self.paths:
            path = f"{self.plan.file_path(file_index)}.filled"
            self.run.unlink(path)
            self.paths[file_index] = path
            fd = _sparse_copy(self.run, self.plan, file_index, path)
        else:
            fd = self.run.open_file(self.paths[file_index], os.O_WRONLY | os.O_NOFOLLOW
                                    | os.O_CLOEXEC)
        # Chunks close together in the source in one read: the bytes between are the
        # source's too (its metadata, as in the mirror, or other chunks).
        reads: list[list[int]] = []
        for offset, size in sorted(ranges):
            if reads and offset - (reads[-1][0] + reads[-1][1]) <= FILL_GAP_BYTES:
                reads[-1][1] = max(reads[-1][1], offset + size - reads[-1][0])
            else:
                reads.append([offset, size])
        try:
            for offset, size in reads:
                view = memoryview(self.read(file_index, offset, size))
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
        finally:
            os.close(fd)

    def dataset(self, file_index: int, name: str) -> h5py.Dataset:
        if file_index not in self.files:
            fd = self.run.open_file(self.paths[file_index], READ)
            try:
                self.files[file_index] = h5py.File(fd_path(fd), "r", locking=False)
            finally:
                os.close(fd)
        return self.files[file_index][name]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for path in self.paths.values():
            self.run.unlink(path)


def _source_rows(plan: Plan, d: DatasetPlan, filled: _Filled, first: int, out: np.ndarray
                 ) -> None:
    """Output rows ``first...`` of ``d`` (``len(out)`` of them), read from the filled copies."""
    at = 0
    while at < len(out):
        row = first + at
        f = bisect.bisect_right(d.offsets, row) - 1
        take = min(len(out) - at, d.offsets[f + 1] - row)
        source = filled.dataset(f, d.name)
        where = f"dataset /{d.name} of {plan.files[f][0]}"
        try:
            read_padded(source.id, row - d.offsets[f], out[at:at + take],
                        d.offsets[f + 1] - d.offsets[f])
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointCorruptionError(
                f"{where} cannot be read (rows {row - d.offsets[f]} to "
                f"{row - d.offsets[f] + take - 1}: {exc}): damaged; nothing was "
                "published") from None
        at += take


class _Encoder:
    """Encodes one output row of chunks of ``d`` as the copy step would (its encoders)."""

    def __init__(self, d: DatasetPlan, template: h5py.Dataset) -> None:
        self.d = d
        self.tiles = chunk_starts(d)
        self.fast = ChunkEncoder.for_dataset(template.id)
        self.slow = HDF5Encoder(template, d.chunk[0], d.pipeline,
                                lossy_filters(template.id.get_create_plist()))
        self.raw_edges = unfiltered_edges(template.id.get_create_plist())

    def encode(self, row: int, rows: np.ndarray) -> Iterator[tuple[tuple[int, ...], bytes, int]]:
        """``(chunk offset, stored bytes, filter mask)`` of the chunks of ``rows`` at ``row``."""
        per_chunk = self.d.chunk[0]
        if self.fast is not None and len(rows) == per_chunk:
            found = [(w, c, 0) for w, c in self.fast.encode_rows(rows)]
        else:
            found = [(w, c, m) for _, w, m, c in self.slow.encode(rows, self.tiles, per_chunk)]
        for where, data, mask in found:
            if self.raw_edges and edge_chunk(self.d, row, where):
                data, mask = unfiltered_chunk(rows, where, tuple(self.d.chunk)), 0
            yield (row, *where), data, mask

    def close(self) -> None:
        self.slow.close()


class _Punched:
    """Placeholder ranges written into the skeleton, freed every :data:`PUNCH_BYTES`."""

    def __init__(self, fd: int) -> None:
        self.fd, self.held = fd, 0
        self.pending: list[tuple[int, int]] = []

    def add(self, offset: int, size: int) -> None:
        self.pending.append((offset, size))
        self.held += size
        if self.held >= PUNCH_BYTES:
            self.flush(last=False)

    def flush(self, last: bool = True) -> None:
        """Free the ranges written (merged: a block two of them share is freed too); all but
        the last unless ``last``, whose final block the next range may share."""
        merged: list[list[int]] = []
        for offset, size in sorted(self.pending):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1][1] += size
            else:
                merged.append([offset, size])
        kept = [] if last or not merged else [merged.pop()]
        for offset, size in merged:
            punch_hole(self.fd, offset, size)
        self.pending = [(o, s) for o, s in kept]
        self.held = sum(s for _, s in self.pending)


def write_chunks(plan: Plan, read: SourceReader) -> int:
    """Write every chunk of every ``chunks`` dataset into the sparse skeleton; record the layout.

    Moved chunks are placeholders (their zeros freed from the disk at
    once); the others are encoded here from the source rows, fetched with
    ``read`` (pinned reads of file index, offset, length) into sparse copies
    of the mirrors, and read back through HDF5 from the skeleton against
    those rows. Fills each such dataset's ``chunk_offsets`` and the fields
    beside it from the skeleton's chunk index. Returns the bytes encoded
    again.

    Raises
    ------
    BadCheckpointError
        If more than :data:`MAX_ENCODED_BYTES` of source chunks would be
        encoded again (the job cannot be spread), naming the job.
    CheckpointCorruptionError
        If a source chunk encoded again cannot be read, naming the file and
        dataset.
    OutputMismatchError
        If a chunk encoded again does not read back as its source rows.
    """
    chosen = [i for i, d in enumerate(plan.datasets) if d.mode == "chunks"]
    if not chosen:
        return 0
    encoded = 0
    with plan.open_run() as run, ExitStack() as stack:
        ref_id, ref_fd = open_source(run, plan, plan.reference_index())
        os.close(ref_fd)
        reference = stack.enter_context(h5py.File(ref_id))
        filled = _Filled(run, plan, read)
        stack.callback(filled.close)
        layouts: dict[int, tuple[dict[int, Moved], list[int]]] = {}
        for i in chosen:
            d = plan.datasets[i]
            template = reference[d.name].id
            moved: dict[int, Moved] = {}
            for f in range(len(plan.files)):
                fid, src_fd = open_source(run, plan, f)
                os.close(src_fd)
                try:
                    given, (lo, hi) = _source_layout(plan, d, template, f, fid)
                    moved.update((m.row, m) for m in given)
                    if hi > lo:
                        source = h5d.open(fid, d.name.encode())
                        filled.fill(f, _needed_chunks(source, lo - d.offsets[f],
                                                      hi - d.offsets[f]))
                finally:
                    fid.close()
            per_chunk = d.chunk[0]
            again = [row for row in range(0, d.total, per_chunk) if row not in moved]
            layouts[i] = (moved, again)
        out_fd = open_output_fd(run, plan, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        stack.callback(os.close, out_fd)
        digests: dict[tuple[int, int], str] = {}
        punched = _Punched(out_fd)
        with h5py.File(fd_path(out_fd), "r+", libver=tuple(plan.libver), locking=False) as out:
            for i in chosen:
                d = plan.datasets[i]
                dsid = out[d.name].id
                # The template's own chunks freed first: their room, one run, takes the new ones
                # in order, as long runs of them lie in the sources.
                dsid.set_extent((0, *d.trailing))
                dsid.set_extent((d.total, *d.trailing))
                encoder = _Encoder(d, reference[d.name])
                try:
                    moved, again = layouts[i]
                    zeros = bytes(max((s for m in moved.values() for _, s, _ in m.chunks),
                                      default=0))
                    tiles = chunk_starts(d)
                    # In each source's order: its chunks one run in the output as in the source.
                    placed = sorted((m.file, start, size, mask, (m.row, *where))
                                    for m in moved.values()
                                    for where, (start, size, mask) in zip(tiles, m.chunks,
                                                                          strict=True))
                    for _, _, size, mask, offset in placed:
                        dsid.write_direct_chunk(offset, zeros[:size], filter_mask=mask)
                        info = dsid.get_chunk_info_by_coord(offset)
                        punched.add(int(info.byte_offset), size)
                    for row in again:
                        rows = np.empty((min(d.chunk[0], d.total - row), *d.trailing),
                                        dtype=f"V{d.element_size}")
                        _source_rows(plan, d, filled, row, rows)
                        digests[i, row] = hashlib.sha256(as_bytes(rows)).hexdigest()
                        for offset, data, mask in encoder.encode(row, rows):
                            dsid.write_direct_chunk(offset, data, filter_mask=mask)
                            encoded += len(data)
                finally:
                    encoder.close()
        punched.flush()
        os.fsync(out_fd)
        _check_and_record(plan, chosen, layouts, digests, out_fd)
    return encoded


def _check_and_record(plan: Plan, chosen: list[int],
                      layouts: dict[int, tuple[dict[int, Moved], list[int]]],
                      digests: dict[tuple[int, int], str], out_fd: int) -> None:
    """Read the skeleton back: chunks encoded again must decode to their source rows; record
    every chunk's address, size, mask and source in the plan."""
    with h5py.File(fd_path(out_fd), "r", locking=False) as out:
        for i in chosen:
            d = plan.datasets[i]
            dsid = out[d.name].id
            moved, again = layouts[i]
            for row in again:
                rows = np.empty((min(d.chunk[0], d.total - row), *d.trailing),
                                dtype=f"V{d.element_size}")
                read_padded(dsid, row, rows, d.total)
                if hashlib.sha256(as_bytes(rows)).hexdigest() != digests[i, row]:
                    raise OutputMismatchError(
                        f"dataset /{d.name}: the chunks of output rows {row} to "
                        f"{row + len(rows) - 1}, encoded again on the planning node, do not "
                        "decode to their source rows; nothing was published")
            tiles = len(chunk_starts(d))
            offsets, sizes, masks, files, starts = [], [], [], [], []
            for n, (_, info) in enumerate(stored_chunks(dsid, tuple(d.chunk), dsid.shape)):
                if info is None or info.byte_offset is None:
                    raise OutputMismatchError(f"dataset /{d.name} of the skeleton left chunk "
                                              f"{n} unwritten")
                offsets.append(int(info.byte_offset))
                sizes.append(int(info.size))
                masks.append(int(info.filter_mask))
                source = moved.get(n // tiles * d.chunk[0])
                if source is None:
                    files.append(-1)
                    starts.append(0)
                    continue
                start, size, mask = source.chunks[n % tiles]
                if (size, mask) != (sizes[-1], masks[-1]):
                    raise OutputMismatchError(
                        f"dataset /{d.name}: the skeleton's chunk {n} holds {sizes[-1]} bytes "
                        f"(filter mask {masks[-1]}), not its source's {size} ({mask})")
                files.append(source.file)
                starts.append(start)
            d.chunk_offsets, d.chunk_sizes, d.chunk_masks = offsets, sizes, masks
            d.chunk_files, d.chunk_starts = files, starts


def moved_pieces(plan: Plan) -> list[tuple[int, int, int, int]]:
    """``(offset, length, file, start)`` of the moved chunks of every ``chunks`` dataset.

    Adjacent chunks that are adjacent in one file too are one range. Chunks
    encoded again are not listed: they are the skeleton's bytes.
    """
    found: list[tuple[int, int, int, int]] = []
    for d in plan.datasets:
        if d.mode != "chunks":
            continue
        for offset, size, f, start in sorted(zip(d.chunk_offsets, d.chunk_sizes, d.chunk_files,
                                                 d.chunk_starts, strict=True)):
            if f < 0 or size == 0:
                continue
            if found and found[-1][2] == f and found[-1][0] + found[-1][1] == offset \
                    and found[-1][3] + found[-1][1] == start:
                last = found[-1]
                found[-1] = (last[0], last[1] + size, f, last[3])
            else:
                found.append((offset, size, f, start))
    return found


def check_moved(plan: Plan, dataset: int, file_index: int, fid: h5f.FileID) -> int:
    """Check a file's chunks the plan moves from it against its own chunk index; their number.

    Each moved chunk must be the file's stored chunk of the same rows, at the
    planned offset, of the planned size and filter mask. The chunks checked
    are the run of them from the file's first row on: the caller compares
    their number with the chunks the plan moves from the file.

    Raises
    ------
    CheckpointCorruptionError
        Naming the file and dataset, where they differ.
    """
    d = plan.datasets[dataset]
    tiles = len(chunk_starts(d))
    # A file's moved chunks are those of its first rows: a run of the output's from its first.
    base_chunk = d.offsets[file_index] // d.chunk[0] * tiles
    if (d.mode != "chunks" or base_chunk >= len(d.chunk_files)
            or d.chunk_files[base_chunk] != file_index):
        return 0
    source = h5d.open(fid, d.name.encode())
    index = stored_chunks(source, tuple(source.get_create_plist().get_chunk()), source.shape)
    n = base_chunk
    while n < len(d.chunk_files) and d.chunk_files[n] == file_index:
        info = index[n - base_chunk][1] if n - base_chunk < len(index) else None
        if info is None or (int(info.byte_offset), int(info.size), int(info.filter_mask)) != (
                d.chunk_starts[n], d.chunk_sizes[n], d.chunk_masks[n]):
            raise CheckpointCorruptionError(
                f"dataset /{d.name} of {plan.files[file_index][0]}: its chunk {n - base_chunk} "
                "is not the one planned to be moved into the output")
        n += 1
    return n - base_chunk
