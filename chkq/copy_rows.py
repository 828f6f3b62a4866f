"""Copying a unit of rows from checkpoint files into the output.

Raw-mode datasets are written as bytes straight into the chunks the
planner allocated (no HDF5 handle is opened for writing, so any number of
copy tasks can write one output at once, each to its own rows).
Other datasets are written to part files through HDF5 and merged later.
Memory stays within one block of rows whatever the dataset size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from chkq.errors import CheckpointChangedError
from chkq.plan import CopyUnit, DatasetPlan, Plan
from chkq.rowio import as_bytes, block_rows, iter_blocks
from chkq.skeleton import create_extensible
from chkq.structure import open_checkpoint

Progress = Callable[[int], None]


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


def check_unchanged(plan: Plan, file_index: int) -> Path:
    """Return file ``file_index`` of the plan, if it is still the file that was planned."""
    path, size, mtime_ns, inode = plan.files[file_index]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointChangedError(
            f"checkpoint file {path!r} disappeared while job {plan.job_id} was running"
        ) from None
    if (st.st_size, st.st_mtime_ns, st.st_ino) != (size, mtime_ns, inode):
        raise CheckpointChangedError(
            f"checkpoint file {path!r} changed while job {plan.job_id} was running"
        )
    return Path(path)


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
        per_chunk = d.chunk[0]
        raw = as_bytes(rows)
        n, i = len(rows), 0
        while i < n:
            row = first_row + i
            k, within = divmod(row, per_chunk)
            offset = d.chunk_offsets[k] + within * d.row_bytes
            take = min(n - i, per_chunk - within)
            while i + take < n:
                k_next = (row + take) // per_chunk
                if d.chunk_offsets[k_next] != offset + take * d.row_bytes:
                    break
                take += min(n - i - take, per_chunk)
            self._pwrite(raw[i * d.row_bytes:(i + take) * d.row_bytes], offset)
            i += take

    def _write_tiled(self, d: DatasetPlan, first_row: int, rows: np.ndarray) -> None:
        """Chunks tile the trailing dimensions too: write each chunk's slab of rows."""
        per_chunk, tile = d.chunk[0], d.chunk[1:]
        grid = [math.ceil(t / c) for t, c in zip(d.trailing, tile, strict=True)]
        per_row_chunk = math.prod(grid)
        fill = np.frombuffer(bytes.fromhex(d.fill), dtype=rows.dtype, count=1)[0]
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
                    padded = np.full((take, *tile), fill, dtype=rows.dtype)
                    padded[(slice(None), *(slice(0, s) for s in part.shape[1:]))] = part
                    part = padded
                offset = d.chunk_offsets[k * per_row_chunk + linear] + within * tile_row_bytes
                self._pwrite(as_bytes(part), offset)
            i += take


def copy_unit(plan: Plan, unit_index: int, progress: Progress | None = None) -> CopyStats:
    """Copy copy-unit ``unit_index`` of ``plan``; redoing it rewrites the same bytes."""
    unit = plan.copy_units[unit_index]
    stats = CopyStats()
    segments = segments_by_file(plan, unit)
    if unit.part is not None:
        return _copy_to_part(plan, unit, segments, stats, progress)
    fd = os.open(plan.job.temp, os.O_WRONLY)
    try:
        writer = RawWriter(fd)
        for file_index, file_segments in segments.items():
            path = check_unchanged(plan, file_index)
            with open_checkpoint(path) as src:
                stats.files += 1
                for seg in file_segments:
                    d = plan.datasets[seg.dataset]
                    base = d.offsets[file_index]
                    step = block_rows(d.row_bytes, plan.block_bytes)
                    for first, rows in iter_blocks(src[d.name], seg.start - base,
                                                   seg.stop - base, step):
                        writer.write(d, base + first, rows)
                        stats.rows += len(rows)
                        stats.bytes += rows.nbytes
                        if progress:
                            progress(stats.rows)
    finally:
        os.close(fd)
    return stats


def _copy_to_part(
    plan: Plan,
    unit: CopyUnit,
    segments: dict[int, list[Segment]],
    stats: CopyStats,
    progress: Progress | None,
) -> CopyStats:
    """Write one piece of a ``chunks``/``whole`` dataset to its part file through HDF5."""
    assert unit.part is not None
    index, start, stop = unit.pieces[0]
    d = plan.datasets[index]
    final = plan.job.part(unit.part)
    temp = final.with_name(final.name + ".new")
    with h5py.File(plan.reference_file, "r") as ref, h5py.File(temp, "w") as part:
        out = create_extensible(part, "data", ref[d.name], stop - start, early=False)
        per_chunk = d.chunk[0]
        half_block = block_rows(d.row_bytes, plan.block_bytes // 2)
        buffer_rows = max(per_chunk, half_block // per_chunk * per_chunk)
        pending: list[np.ndarray] = []
        pending_rows, written = 0, 0

        def flush() -> None:
            nonlocal pending, pending_rows, written
            if pending_rows:
                out[written:written + pending_rows] = np.concatenate(pending)
                written += pending_rows
                pending, pending_rows = [], 0

        for file_index, file_segments in segments.items():
            path = check_unchanged(plan, file_index)
            with open_checkpoint(path) as src:
                stats.files += 1
                for seg in file_segments:
                    base = d.offsets[file_index]
                    for _, rows in iter_blocks(src[d.name], seg.start - base, seg.stop - base,
                                               half_block):
                        while len(rows):
                            room = buffer_rows - pending_rows
                            pending.append(rows[:room])
                            pending_rows += len(pending[-1])
                            rows = rows[room:]
                            if pending_rows == buffer_rows:
                                flush()
                        stats.rows = written + pending_rows
                        if progress:
                            progress(stats.rows)
        flush()
        stats.bytes = written * d.row_bytes
    os.replace(temp, final)
    return stats
