"""Verifying the written output against the checkpoint files, bit for bit.

Every row of every extensible dataset is read back from the output file
and compared with the row read from its checkpoint file. Rows of
fixed-size types compare as the bytes of the file type (so NaNs in the
same places, with the same bits, are equal, and nothing numpy cannot
express is lost); variable-length rows compare by value, references by
the name of the object they point to.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5f, h5r

from chkq.consolidation import heap_collections, vlen
from chkq.consolidation.checkpoint_files import open_checkpoint_id
from chkq.consolidation.copy_rows import (
    chunk_starts,
    open_output_fd,
    open_source,
    same_pipeline,
)
from chkq.consolidation.h5types import is_variable
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.rowio import (
    as_bytes,
    block_rows,
    digest_rows,
    read_into,
    read_padded,
    read_rows,
    same_bytes,
)
from chkq.consolidation.stamps import check_descriptor
from chkq.errors import OutputMismatchError
from chkq.rundir import READ, RunDir, fd_path

Progress = Callable[[int], None]


@dataclass
class VerifyStats:
    """What a verify task checked, for its log line and result."""

    rows: int = 0
    bytes: int = 0
    files: int = 0


def first_difference(expected: np.ndarray, actual: np.ndarray) -> int | None:
    """Index of the first row whose bytes differ, or None if all are equal."""
    if expected.shape != actual.shape:
        return 0
    if expected.dtype.hasobject:
        for i, (a, b) in enumerate(zip(expected.reshape(len(expected), -1),
                                       actual.reshape(len(actual), -1), strict=True)):
            if any(_element_bytes(x) != _element_bytes(y) for x, y in zip(a, b, strict=True)):
                return i
        return None
    if as_bytes(expected) == as_bytes(actual):
        return None
    rows_a = np.ascontiguousarray(expected).reshape(len(expected), -1).view(np.uint8)
    rows_b = np.ascontiguousarray(actual).reshape(len(actual), -1).view(np.uint8)
    return int(np.flatnonzero((rows_a != rows_b).any(axis=1))[0])


def _element_bytes(value: object) -> bytes:
    """An element's value as bytes, through compound fields and arrays of objects."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, bytes):
        return value
    if isinstance(value, np.void) and value.dtype.names:
        return b"\x1f".join(_element_bytes(value[f]) for f in value.dtype.names)
    array = np.asarray(value)
    if array.dtype.hasobject:
        return b"\x1e".join(_element_bytes(x) for x in array.reshape(-1))
    return array.tobytes()


class OutputWindow:
    """Output rows of one dataset read ahead in one H5Dread, for a batch of small files.

    A verify unit covers consecutive files, whose rows are consecutive in
    the output: reading the output once per dataset and window (instead of
    once per file and dataset) removed most of the per-call cost that
    profiling showed for runs of thousands of small files.
    """

    def __init__(self, dsid: h5d.DatasetID, d: DatasetPlan, capacity: int, end: int) -> None:
        self.dsid, self.end = dsid, end
        self.buffer = np.empty((capacity, *d.trailing), dtype=f"V{d.element_size}")
        self.start = self.stop = 0

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Output rows ``[start, stop)`` (at most ``capacity`` of them), read if needed."""
        if not (self.start <= start and stop <= self.stop):
            count = min(len(self.buffer), self.end - start)
            read_into(self.dsid, start, self.buffer[:count])
            self.start, self.stop = start, start + count
        return self.buffer[start - self.start:stop - self.start]


def window_rows(plan: Plan, first: int, stop: int) -> dict[int, int]:
    """Rows per read of each fixed-size dataset, so that the unit holds about one block.

    Half the block goes to output windows, half to source reads, shared
    between datasets by their share of the unit's bytes. A dataset whose
    share is less than a row gets 0: :class:`Windows` reads it through a
    window of its own, held only while one file's rows are compared, so
    that many datasets of large rows cannot add up past the block.
    """
    sizes = {i: (d.offsets[stop] - d.offsets[first]) * d.row_bytes
             for i, d in enumerate(plan.datasets)}
    total = max(1, sum(sizes.values()))
    half = plan.block_bytes // 2
    return {i: min(plan.datasets[i].offsets[stop] - plan.datasets[i].offsets[first],
                   int(half * sizes[i] / total) // max(plan.datasets[i].row_bytes, 1))
            for i in sizes}


class Windows:
    """The output windows and source buffers of a verify unit's fixed-size datasets.

    Those :func:`window_rows` gives rows keep their window for the whole
    unit (read ahead across its files); the others get a window of at most
    half a block, for one file's rows, each time they are compared. Memory:
    about one block kept, plus one block (or two rows, for a row larger
    than half a block) while such a dataset is compared.
    """

    def __init__(self, plan: Plan, outputs: list[h5d.DatasetID], first: int, stop: int,
                 wanted: set[int]) -> None:
        self.plan, self.outputs, self.stop, self.wanted = plan, outputs, stop, wanted
        capacity = window_rows(plan, first, stop)
        self.kept = {i: OutputWindow(outputs[i], plan.datasets[i], capacity[i],
                                     plan.datasets[i].offsets[stop])
                     for i in wanted if capacity[i]}
        self.sources = {i: np.empty_like(w.buffer) for i, w in self.kept.items()}

    def __contains__(self, index: int) -> bool:
        return index in self.wanted

    def get(self, index: int, start: int, end: int) -> tuple[OutputWindow, np.ndarray]:
        """The window and source buffer of dataset ``index``, for output rows ``[start, end)``."""
        if index in self.kept:
            return self.kept[index], self.sources[index]
        d = self.plan.datasets[index]
        rows = max(1, min(end - start, self.plan.block_bytes // 2 // max(d.row_bytes, 1)))
        window = OutputWindow(self.outputs[index], d, rows, d.offsets[self.stop])
        return window, np.empty_like(window.buffer)


#: By file: ``(start, stop, digest, kind)`` of output rows copied from it, in row order.
#: Kind ``rows``: the SHA-256 of the rows as read from the file; kind ``stored``: the
#: file's stored chunks were moved unchanged (no digest: the chunks are compared).
Digests = dict[int, list[tuple[int, int, str, str]]]


def digests_by_dataset(copy_results: dict[int, list[list[Any]]], plan: Plan) -> dict[int, Digests]:
    """Digests taken while copying, by dataset and file, from the copy units' recorded results.

    A ``chunks`` dataset is listed only if every one of its copy units
    recorded its digests; the others are compared with their sources.
    """
    found: dict[int, Digests] = {}
    incomplete: set[int] = set()
    for number, unit in enumerate(plan.copy_units):
        index = unit.pieces[0][0]
        if unit.part is None or plan.datasets[index].mode != "chunks":
            continue
        entries = copy_results.get(number)
        if entries is None:
            incomplete.add(index)
            continue
        by_file = found.setdefault(index, {})
        for file_index, start, stop, digest, *kind in entries:
            by_file.setdefault(int(file_index), []).append(
                (int(start), int(stop), str(digest), str(kind[0]) if kind else "rows"))
    for index in incomplete:
        found.pop(index, None)
    for by_file in found.values():
        for listed in by_file.values():
            listed.sort()
    return found


def verify_files(
    plan: Plan, first: int, stop: int, digests: dict[int, Digests] | None = None,
    progress: Progress | None = None,
) -> VerifyStats:
    """Compare the output's rows from files ``[first, stop)`` with those files.

    Both sides are read through HDF5 (the copy wrote raw bytes at offsets
    of its own computing; reading through HDF5 checks those too), into
    buffers allocated once per task, and compared with ``memcmp``. A small
    file whose planning scan digested its rows (read through HDF5 then) is
    not opened again: the output's rows are digested the same way and
    compared with that digest; only on a mismatch is the file read, to name
    the first row that differs. Memory: about one block, whatever the
    number of files or rows.

    The output is the job's temporary output, opened through the run
    directory and checked to be the file the planner made; each checkpoint
    file is opened as planned (:func:`chkq.consolidation.copy_rows.open_source`).

    Raises
    ------
    OutputMismatchError
        Naming the dataset, the output row and the checkpoint file at fault.
    """
    run, out_fd, out = _open_output(plan)
    try:
        check_descriptor(plan.job.temp, out.get_vfd_handle(), plan.temp_inode)

        def opened(file_index: int) -> tuple[h5f.FileID, int | None]:
            return open_source(run, plan, file_index)

        return _compare_files(plan, first, stop, out, out_fd, opened, digests or {}, progress,
                              by_digest=True, name=plan.file_path)
    finally:
        out.close()
        os.close(out_fd)
        run.close()


def verify_opened(
    plan: Plan, first: int, stop: int, output: h5f.FileID,
    open_source: Callable[[int], h5f.FileID], progress: Progress | None = None,
    source_name: Callable[[int], str] | None = None,
) -> VerifyStats:
    """Compare the output's rows from files ``[first, stop)`` with sources the caller opens.

    The comparison of :func:`verify_files`, for an output and sources that
    are not the job's local files: a job whose run and output are store
    objects opens each with ``h5py.File(ObjectFile(store, key, pinned=version),
    "r").id`` (:class:`chkq.stores.fileobj.ObjectFile`). Every row of every
    dataset with rows from these files is read back from ``output`` and
    compared with the row read from its source: the planning scan's
    digests (``plan.file_digests``) are not used, since what the planner
    read need not be these objects, nor are the copy's digests.

    Fixed-size rows (``raw`` and ``chunks`` datasets) compare as bytes of
    the file type, as in :func:`verify_files`. Variable-length rows and
    references (``whole`` datasets) compare by value through h5py, on these
    file ids: the proof from their stored heap collections, which reads the
    files through descriptors, is not made, so such rows take longer, but
    prove the same.

    Parameters
    ----------
    plan
        The job's plan: its datasets' rows per file and block size.
    first, stop
        The files ``[first, stop)`` (indices into ``plan.files``) to verify.
    output
        The output's HDF5 file id, open for reading; the caller closes it.
    open_source
        Opens file ``i`` of the plan and returns its HDF5 file id, which is
        closed once that file's rows are compared (one source open at a time).
    progress
        Called with the rows compared so far, after each dataset of each file.
    source_name
        The name of file ``i`` in messages (the source object's URL or key);
        by default its path in the plan.

    Returns
    -------
    VerifyStats
        The rows, bytes (of the file type) and files compared.

    Raises
    ------
    OutputMismatchError
        Naming the dataset, the output row and the source at fault.

    Notes
    -----
    Memory: about one block of buffers, as in :func:`verify_files`, plus
    whatever the caller's file objects keep (an ``ObjectFile`` its block
    cache, for the output and the one open source).
    """
    def opened(file_index: int) -> tuple[h5f.FileID, int | None]:
        return open_source(file_index), None

    return _compare_files(plan, first, stop, output, None, opened, {}, progress,
                          by_digest=False, name=source_name or plan.file_path)


def _compare_files(
    plan: Plan, first: int, stop: int, out: h5f.FileID, out_fd: int | None,
    open_source: Callable[[int], tuple[h5f.FileID, int | None]], digests: dict[int, Digests],
    progress: Progress | None, *, by_digest: bool, name: Callable[[int], object],
) -> VerifyStats:
    """The comparison of :func:`verify_files` and :func:`verify_opened`, file by file.

    ``open_source(i)`` gives file ``i``'s HDF5 id and its descriptor, or
    None where it has none; both are closed here. Without descriptors (of
    the source or of the output, ``out_fd``) variable-length rows are
    compared by value only, through h5py objects over the file ids.
    """
    stats = VerifyStats()
    outputs = [h5d.open(out, d.name.encode()) for d in plan.datasets]
    plain = [not is_variable(o.get_type()) for o in outputs]
    windows = Windows(plan, outputs, first, stop,
                      {i for i, d in enumerate(plan.datasets)
                       if plain[i] and d.total and i not in digests})
    high_level: h5py.File | None = None
    by_digest = by_digest and bool(plan.file_digests) and all(
        d.mode == "raw" for d in plan.datasets)
    try:
        for file_index in range(first, stop):
            path = name(file_index)
            digest = plan.file_digests[file_index] if by_digest else ""
            if digest and file_digest(plan, file_index, windows) == digest:
                stats.files += 1
                stats.rows += plan.file_rows(file_index)
                stats.bytes += sum((d.offsets[file_index + 1] - d.offsets[file_index])
                                   * d.row_bytes for d in plan.datasets)
                if progress:
                    progress(stats.rows)
                continue
            fid, fd = open_source(file_index)
            try:
                stats.files += 1
                for i, d in enumerate(plan.datasets):
                    start, end = d.rows_of(file_index)
                    if end == start:
                        continue
                    dsid = h5d.open(fid, d.name.encode())
                    if i in digests:
                        _compare_digests(plan, d, file_index, digests[i].get(file_index, []),
                                         h5py.Dataset(outputs[i]), h5py.Dataset(dsid), path)
                    elif i in windows:
                        _compare_plain(d, dsid, *windows.get(i, start, end), start, end, path)
                    elif fd is None or out_fd is None or not _heap_rows_match(
                            plan, d, (fid, dsid, fd), (out, outputs[i], out_fd), start, end,
                            path):
                        if high_level is None:
                            high_level = (h5py.File(out) if out_fd is None
                                          else h5py.File(fd_path(out_fd), "r"))
                        _compare_objects(plan, d, h5py.Dataset(dsid), high_level[d.name],
                                         start, end, path)
                    stats.rows += end - start
                    stats.bytes += (end - start) * d.row_bytes
                    if progress:
                        progress(stats.rows)
            finally:
                fid.close()
                if fd is not None:
                    os.close(fd)
            if digest:
                raise OutputMismatchError(
                    f"the output's rows of checkpoint file {str(path)!r} do not match the "
                    "digest its planning scan took, though they match the file now: it "
                    "changed while the job ran")
    finally:
        # A File made over the caller's id is not closed: closing it would close that id.
        if high_level is not None and out_fd is not None:
            high_level.close()
    return stats


def _open_output(plan: Plan) -> tuple[RunDir, int, h5f.FileID]:
    """The run directory, the job's output (checked to be the planner's) and its HDF5 id."""
    run = plan.open_run()
    try:
        fd = open_output_fd(run, plan, READ)
        try:
            return run, fd, open_checkpoint_id(plan.job.temp, fd)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        run.close()
        raise


def file_digest(plan: Plan, file_index: int, windows: Windows) -> str:
    """The digest of the output's rows of one file, as its scan digested the file's own.

    (:attr:`chkq.consolidation.checkpoint_files.FileScan.digest`: every dataset in name order,
    :func:`chkq.consolidation.rowio.digest_rows`; the rows are read through HDF5, in the
    windows that the other files of the unit share.)
    """
    digest = hashlib.sha256()
    for i, d in sorted(enumerate(plan.datasets), key=lambda item: item[1].name):
        start, end = d.rows_of(file_index)
        if i not in windows or end == start:
            digest_rows(digest, d.name, end - start, [])
            continue
        window = windows.get(i, start, end)[0]
        step = len(window.buffer)
        digest_rows(digest, d.name, end - start,
                    (window.rows(lo, min(end, lo + step)) for lo in range(start, end, step)))
    return digest.hexdigest()


def _mismatch(d: DatasetPlan, output_row: int, source_row: int, path: object) -> None:
    raise OutputMismatchError(
        f"row {output_row} of dataset {d.name!r} in the output differs from "
        f"row {source_row} of checkpoint file {str(path)!r}"
    )


def _compare_plain(d: DatasetPlan, dsid: h5d.DatasetID, window: OutputWindow,
                   source: np.ndarray, start: int, end: int, path: object) -> None:
    """Compare output rows ``[start, end)`` with all rows of one source dataset."""
    step = len(source)
    for lo in range(start, end, step):
        hi = min(end, lo + step)
        expected = source[:hi - lo]
        read_padded(dsid, lo - start, expected, end - start)
        actual = window.rows(lo, hi)
        if not same_bytes(expected, actual):
            bad = first_difference(expected, actual) or 0
            _mismatch(d, lo + bad, lo - start + bad, path)


def _compare_digests(plan: Plan, d: DatasetPlan, file_index: int,
                     entries: list[tuple[int, int, str, str]], output: h5py.Dataset,
                     source: h5py.Dataset, path: object) -> None:
    """Check the output rows of one file against the digests taken while copying them.

    Rows whose chunks were moved unchanged (kind ``stored``) are checked
    by :func:`_compare_stored`, the others by the SHA-256 of the output's
    rows as HDF5 reads them. On a mismatch the rows are compared with the
    source directly, to name the first row that differs.
    """
    start, end = d.rows_of(file_index)
    covered = [(a, b) for a, b, _, _ in entries]
    if not covered or covered[0][0] != start or covered[-1][1] != end or any(
            x[1] != y[0] for x, y in zip(covered, covered[1:], strict=False)):
        raise OutputMismatchError(
            f"the digests of dataset {d.name!r} do not cover the rows of checkpoint file "
            f"{str(path)!r}: its copy is incomplete")
    step = block_rows(d.row_bytes, plan.block_bytes // 4)
    actual = np.empty((min(step, max(end - start, 1)), *d.trailing), dtype=f"V{d.element_size}")
    expected_rows = np.empty_like(actual)
    for a, b, expected, kind in entries:
        if kind == "stored":
            if source.shape[0] == end - start and _compare_stored(d, start, a, b, output.id,
                                                                  source.id):
                continue
        elif kind == "rows":
            digest = hashlib.sha256()
            for lo in range(a, b, step):
                rows = actual[:min(b, lo + step) - lo]
                read_into(output.id, lo, rows)
                digest.update(as_bytes(rows))
            if digest.hexdigest() == expected:
                continue
        for lo in range(a, b, step):
            hi = min(b, lo + step)
            read_padded(source.id, lo - start, expected_rows[:hi - lo], end - start)
            read_into(output.id, lo, actual[:hi - lo])
            bad = first_difference(expected_rows[:hi - lo], actual[:hi - lo])
            if bad is not None:
                _mismatch(d, lo + bad, lo - start + bad, path)
        raise OutputMismatchError(
            f"rows {a} to {b - 1} of dataset {d.name!r} in the output do not match the "
            f"{'chunks stored in' if kind == 'stored' else 'digest taken while copying'} "
            f"checkpoint file {str(path)!r}")


def _compare_stored(d: DatasetPlan, base: int, a: int, b: int, output: h5d.DatasetID,
                    source: h5d.DatasetID) -> bool:
    """Whether the output stores rows ``[a, b)`` in the very chunks the source stores them in.

    The proof that a chunk moved unchanged holds the same rows, without
    decoding it: the two datasets have the same type, chunk shape and
    filter pipeline (every filter's id, flags and parameters), and each
    chunk of those rows has the same filter mask and stored bytes in both,
    as read through each file's chunk index. ``a`` and ``base`` (the file's
    first output row) are on the chunk grid; ``b`` is too, or is the
    dataset's end in the output and the file's end.
    """
    if (a - base) % d.chunk[0] or (b % d.chunk[0] and b != d.total) or \
            not same_pipeline(source, output):
        return False
    tiles = chunk_starts(d)
    for row in range(a, b, d.chunk[0]):
        for where in tiles:
            try:
                got = output.read_direct_chunk((row, *where))
                want = source.read_direct_chunk((row - base, *where))
            except (OSError, RuntimeError, ValueError, KeyError):
                return False
            if got[0] != want[0] or got[1] != want[1]:
                return False
    return True


def _heap_rows_match(plan: Plan, d: DatasetPlan, source: tuple[h5f.FileID, h5d.DatasetID, int],
                     output: tuple[h5f.FileID, h5d.DatasetID, int], start: int, end: int,
                     path: object) -> bool:
    """Whether one file's output rows of a variable-length dataset are its rows as stored.

    Block by block, :func:`chkq.consolidation.heap_collections.same_heap_rows` (``source``
    and ``output``: file id, dataset id, descriptor); rows the file lacks
    (records of its dimension) must read as its fill value. False as soon
    as a block is not (the caller compares the rows through HDF5, which
    names the first that differs).
    """
    dsid = source[1]
    stored = min(end - start, dsid.shape[0])
    step = min(65536, block_rows(d.row_bytes, plan.block_bytes // 2))
    for lo in range(0, stored, step):
        n = min(step, stored - lo)
        if not heap_collections.same_heap_rows(*source, lo, *output, start + lo, n):
            return False
    if stored < end - start:
        _compare_string_fill(d, h5py.Dataset(output[1]), start + stored, end,
                             vlen.string_fill(dsid), step, path)
    return True


def _compare_objects(plan: Plan, d: DatasetPlan, source: h5py.Dataset, output: h5py.Dataset,
                     start: int, end: int, path: object) -> None:
    """Compare rows of variable-length data element by element, through h5py."""
    step = min(65536, block_rows(d.row_bytes, plan.block_bytes // 2))
    tid = output.id.get_type()
    stored = min(end - start, source.shape[0])
    if stored < end - start:
        _compare_string_fill(d, output, start + stored, end, vlen.string_fill(source.id), step,
                             path)
        end = start + stored
    if vlen.is_vlen_string(tid):
        for lo in range(0, end - start, step):
            hi = min(end - start, lo + step)
            bad = vlen.first_string_difference(source.id, lo, output.id, start + lo, hi - lo)
            if bad is not None:
                per_row = max(1, math.prod(d.trailing))
                _mismatch(d, start + lo + bad // per_row, lo + bad // per_row, path)
        return
    if vlen.byte_comparable(tid):
        for lo in range(0, end - start, step):
            hi = min(end - start, lo + step)
            with vlen.read_rows(source.id, lo, hi - lo, tid) as a, \
                    vlen.read_rows(output.id, start + lo, hi - lo, tid) as b:
                expected_values, actual_values = vlen.element_values(a, tid), \
                    vlen.element_values(b, tid)
            if expected_values != actual_values:
                per_row = max(1, len(expected_values) // max(hi - lo, 1))
                first = next(i for i, (x, y) in enumerate(
                    zip(expected_values, actual_values, strict=True)) if x != y) // per_row
                _mismatch(d, start + lo + first, lo + first, path)
        return
    for lo in range(0, end - start, step):
        hi = min(end - start, lo + step)
        expected = comparable(read_rows(source, lo, hi), source.file)
        actual = comparable(read_rows(output, start + lo, start + hi), output.file)
        bad = first_difference(expected, actual)
        if bad is not None:
            _mismatch(d, start + lo + bad, lo + bad, path)


def _compare_string_fill(d: DatasetPlan, output: h5py.Dataset, first: int, end: int,
                         fill: bytes, step: int, path: object) -> None:
    """Output rows ``[first, end)``, records a file's string dataset lacked: each is ``fill``."""
    tid = output.id.get_type()
    for lo in range(first, end, step):
        hi = min(end, lo + step)
        with vlen.read_rows(output.id, lo, hi - lo, tid) as rows:
            values = vlen.element_values(rows, tid)
        per_row = max(1, len(values) // max(hi - lo, 1))
        bad = next((i for i, v in enumerate(values) if v != fill), None)
        if bad is not None:
            raise OutputMismatchError(
                f"row {lo + bad // per_row} of dataset {d.name!r} in the output, a record "
                f"checkpoint file {str(path)!r} lacks, is not its fill value {fill!r}")


def comparable(rows: np.ndarray, file: h5py.File) -> np.ndarray:
    """Rows as values that compare equal across files: references become target names."""
    if rows.dtype.kind != "O" or h5py.check_ref_dtype(rows.dtype) is None:
        return rows
    result = np.empty(rows.shape, dtype=object)
    flat, target = rows.reshape(-1), result.reshape(-1)
    for i, ref in enumerate(flat):
        target[i] = _target(ref, file)
    return result


def _target(ref: Any, file: h5py.File) -> str:
    if not ref:
        return ""
    name = file[ref].name or "<anonymous>"
    if isinstance(ref, h5py.RegionReference):
        region = h5r.get_region(ref, file.id)
        return f"{name}[{region.get_select_bounds()}:{region.get_select_npoints()}]"
    return name
