"""A new version of a consolidated output: the previous one, with more checkpoints' rows.

A version starts as a clone of the previous one (shared extents where the
filesystem can share them, else a copy inside the kernel), so that a reader
holding the previous version keeps reading it unharmed. Every extensible
dataset grows and gets the new checkpoints' rows (encoded chunks moved
unchanged where a checkpoint starts on the output's chunk grid, through
HDF5 where not); attributes and fixed datasets are taken from the newest
checkpoint, as a one-shot consolidation takes them from its template.

Before it is published a version is proven: the new rows against their
checkpoints, the rows of the previous version that share a chunk with new
rows against the previous version, every other chunk of the previous version
at the same address with the same size and filter mask (so its bytes are the
previous version's own, proven when that was published), and the whole file
against its template as for a one-shot output.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
from h5py import h5a, h5d, h5o, h5s

from chkq.consolidation import vlen
from chkq.consolidation.checkpoint_files import (
    check_same_file,
    chunk_index,
    open_checkpoint,
    walk_objects,
)
from chkq.consolidation.copy_rows import same_pipeline
from chkq.consolidation.h5types import has_reference, is_variable, opaque_dtype
from chkq.consolidation.output_check import check_output
from chkq.consolidation.prepare import SurveyedRun
from chkq.consolidation.recreation import copy_attributes
from chkq.consolidation.rowio import block_rows, fill_element, read_into, same_bytes
from chkq.consolidation.stamps import open_unchanged
from chkq.errors import FollowError, OutputMismatchError
from chkq.rundir import fd_path

#: ``ioctl`` request that makes a file share all of another's extents (XFS, btrfs, ...).
FICLONE = 0x40049409
#: Bytes ``copy_file_range`` is asked to copy at once.
COPY_STEP = 256 * 1024 * 1024


@dataclass
class ExtendStats:
    """What making one version cost: how its base was cloned and what was written."""

    clone: str = ""
    chunks_moved: int = 0
    bytes_moved: int = 0
    rows_encoded: int = 0
    rows_checked: int = 0
    chunks_kept: int = 0
    datasets: dict[str, int] = field(default_factory=dict)


def clone_file(src: int, dst: int) -> str:
    """Make file ``dst`` (empty) a copy of ``src``: ``"reflink"`` if extents are shared.

    Returns ``"reflink"`` (``FICLONE``: no data written) or ``"copy"``
    (``copy_file_range``: the kernel copies, or shares where the filesystem
    offers it, without the bytes passing through this process).
    """
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return "reflink"
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL,
                             errno.ENOSYS, errno.EPERM):
            raise
    size = os.fstat(src).st_size
    done = 0
    while done < size:
        moved = os.copy_file_range(src, dst, min(COPY_STEP, size - done), done, done)
        if moved == 0:
            raise OSError(errno.EIO, f"the previous version ended at {done} of {size} bytes")
        done += moved
    return "copy"


def file_ends(survey: SurveyedRun) -> list[int]:
    """The index (in the run's file order) one past the last file of each checkpoint."""
    ends, at = [], 0
    for checkpoint in survey.checkpoints:
        at += len(checkpoint.files)
        ends.append(at)
    return ends


def included_files(output: h5py.File, survey: SurveyedRun, shown: Path) -> int:
    """How many of the run's files (in order) ``output`` holds the rows of.

    The fewest checkpoints whose row totals match every extensible dataset's
    length in ``output``; none matching means the file is not a version of
    this run (or the run was rewritten): :class:`FollowError`.
    """
    for end in file_ends(survey):
        if all(name in output and output[name].shape[0] == d.offsets[end]
               for d in survey.datasets for name in [d.name]):
            return end
    rows = {d.name: output[d.name].shape[0] for d in survey.datasets if d.name in output}
    raise FollowError(
        f"{str(shown)!r} holds rows ({rows}) that no prefix of the run's checkpoints "
        "adds up to: it is not a version of this run, or the run was rewritten")


def refuse_unfollowable(output: h5py.File, shown: Path) -> None:
    """Refuse an output the follow cannot extend in place: one that holds references."""
    for name, kind in [(b".", h5o.TYPE_GROUP), *walk_objects(output.id, repr(str(shown)))]:
        obj = h5o.open(output.id, name)
        found = any(has_reference(h5a.open(obj, index=i).get_type())
                    for i in range(h5a.get_num_attrs(obj)))
        if found or (kind == h5o.TYPE_DATASET and has_reference(obj.get_type())):
            raise FollowError(
                f"{name.decode(errors='replace')!r} in {str(shown)!r} holds references, "
                "which a new version would have to point again: consolidate the run once it "
                "has ended")


# ----------------------------------------------------------------------------- building


def extend_output(out: h5py.File, template: h5py.File, survey: SurveyedRun, first: int,
                  block_bytes: int) -> ExtendStats:
    """Add the rows of files ``first..`` of ``survey`` to ``out`` (the previous version's clone).

    Attributes and fixed datasets become ``template``'s (the newest checkpoint's).
    """
    stats = ExtendStats()
    for d in survey.datasets:
        out[d.name].resize(d.total, axis=0)
        stats.datasets[d.name] = d.total - d.offsets[first]
    for index in range(first, len(survey.scanned)):
        with _source(survey, index) as source:
            for d in survey.datasets:
                _add_file_rows(d.name, source[d.name], out[d.name], d.offsets[index],
                               d.offsets[index + 1], block_bytes, stats)
    _take_template(template, out, {d.name for d in survey.datasets}, block_bytes)
    return stats


@contextmanager
def _source(survey: SurveyedRun, index: int) -> Iterator[h5py.File]:
    """Checkpoint file ``index`` of ``survey``, open and checked to be the file scanned."""
    scanned = survey.scanned[index]
    fd = open_unchanged(survey.rundir, scanned.scan.path, scanned.stamp, survey.job.job_id)
    try:
        source = open_checkpoint(scanned.scan.path, fd)
    finally:
        os.close(fd)
    with source:
        yield source


def check_file_rows(survey: SurveyedRun, index: int, out: h5py.File, block_bytes: int) -> int:
    """Every extensible dataset's rows of file ``index`` in ``out``, as that file holds them.

    Returns how many rows were compared. Raises OutputMismatchError naming the first
    rows that differ.
    """
    checked = 0
    with _source(survey, index) as source:
        for d in survey.datasets:
            stored = min(source[d.name].shape[0], d.offsets[index + 1] - d.offsets[index])
            same_rows(d.name, source[d.name].id, 0, out[d.name].id, d.offsets[index], stored,
                      repr(str(survey.scanned[index].scan.path)), block_bytes)
            checked += stored
    return checked


def _add_file_rows(name: str, source: h5py.Dataset, target: h5py.Dataset, start: int,
                   stop: int, block_bytes: int, stats: ExtendStats) -> None:
    """Rows of one file's dataset into output rows ``[start, stop)`` (the rest: its fill)."""
    stored = min(source.shape[0], stop - start)
    moved = _move_chunks(source, target, start, stored, stats) if stored else 0
    _copy_rows(source.id, moved, target.id, start + moved, stored - moved, block_bytes)
    stats.rows_encoded += stored - moved
    if stop - start > stored:
        _write_fill(name, target.id, start + stored, stop - start - stored)


def _move_chunks(source: h5py.Dataset, target: h5py.Dataset, start: int, rows: int,
                 stats: ExtendStats) -> int:
    """Move ``source``'s stored chunks unchanged, when its grid lands on the output's.

    Returns how many leading rows were moved (0, or all ``rows`` rounded
    down to whole chunks and then up to the last, partial one when the file
    ends there). Rows past a moved edge chunk's last row are overwritten by
    the next file's rows through HDF5, or lie past the output's extent.
    """
    chunk = source.chunks
    if (chunk is None or chunk != target.chunks or source.shape[1:] != target.shape[1:]
            or start % chunk[0] or is_variable(source.id.get_type())
            or not same_pipeline(source.id, target.id)):
        return 0
    index = chunk_index(source.id, chunk, source.shape)
    for coords, info in index.items():
        if coords[0] * chunk[0] >= rows:
            continue
        mask, data = source.id.read_direct_chunk(info.chunk_offset)
        where = (start + info.chunk_offset[0], *info.chunk_offset[1:])
        target.id.write_direct_chunk(where, data, mask)
        stats.chunks_moved += 1
        stats.bytes_moved += len(data)
    return rows


def _copy_rows(source: h5d.DatasetID, first: int, target: h5d.DatasetID, at: int, count: int,
               block_bytes: int) -> None:
    """Rows ``[first, first + count)`` of ``source`` to rows from ``at`` of ``target``."""
    tid = source.get_type()
    step = block_rows(_row_bytes(source), block_bytes)
    for offset in range(0, count, step):
        n = min(step, count - offset)
        with vlen.read_rows(source, first + offset, n, tid) as rows:
            vlen.write_rows(target, at + offset, rows, tid)


def _row_bytes(dsid: h5d.DatasetID) -> int:
    return dsid.get_type().get_size() * int(np.prod(dsid.shape[1:], dtype=np.int64))


def _write_fill(name: str, target: h5d.DatasetID, at: int, count: int) -> None:
    """Rows a file lacks (a short record variable): the dataset's fill value, as one-shot."""
    tid = target.get_type()
    shape = (count, *target.shape[1:])
    if vlen.is_vlen_string(tid):
        vlen.write_string_fill(target, at, count, vlen.string_fill(target))
        return
    try:
        element = fill_element(target)
    except ValueError as exc:
        raise FollowError(f"dataset /{name} lacks rows and {exc}") from None
    rows = np.frombuffer(element * int(np.prod(shape, dtype=np.int64)),
                         dtype=f"V{tid.get_size()}").reshape(shape)
    space = target.get_space()
    space.select_hyperslab((at,) + (0,) * (len(shape) - 1), shape)
    target.write(h5s.create_simple(shape), space, rows, mtype=tid)


def _take_template(template: h5py.File, out: h5py.File, extensible: set[str],
                   block_bytes: int) -> None:
    """Every object's attributes, and every fixed dataset's values, from ``template``."""
    objects = [(b".", h5o.TYPE_GROUP), *walk_objects(template.id, repr(template.filename))]
    for name, kind in objects:
        shown = name.decode(errors="replace")
        if name != b"." and name not in out:
            raise FollowError(f"the newest checkpoint {template.filename!r} has {shown!r}, "
                              "which the published version lacks")
        source, target = template[name], out[name]
        for attr in list(target.attrs):
            del target.attrs[attr]
        copy_attributes(source, target)
        if kind == h5o.TYPE_DATASET and shown.lstrip("/") not in extensible:
            _take_values(shown, source, target, block_bytes)


def _take_values(name: str, source: h5py.Dataset, target: h5py.Dataset,
                 block_bytes: int) -> None:
    """A fixed dataset's values from the newest checkpoint (same shape and type only)."""
    if source.shape != target.shape or source.id.get_type() != target.id.get_type():
        raise FollowError(
            f"fixed dataset {name!r} changed shape or type in the newest checkpoint "
            f"({target.shape} -> {source.shape}): a version cannot take it in place; "
            "consolidate the run once it has ended")
    space = source.id.get_space()
    if space.get_simple_extent_type() == h5s.NULL:
        return
    if not source.shape:
        tid = source.id.get_type()
        value = np.zeros((), dtype=opaque_dtype(tid))
        source.id.read(h5s.create(h5s.SCALAR), space, value, mtype=tid)
        try:
            target.id.write(h5s.create(h5s.SCALAR), target.id.get_space(), value, mtype=tid)
        finally:
            if is_variable(tid):
                vlen.reclaim(tid, h5s.create(h5s.SCALAR), value)
        return
    _copy_rows(source.id, 0, target.id, 0, source.shape[0], block_bytes)


# ----------------------------------------------------------------------------- proving


def prove_version(out_path: Path, out: h5py.File, previous: h5py.File, template_path: Path,
                  survey: SurveyedRun, first: int, block_bytes: int, stats: ExtendStats,
                  opened: tuple[int, int]) -> None:
    """Prove the new version ``out`` before it is published (see the module's docstring).

    Raises
    ------
    OutputMismatchError
        Naming the first row, chunk or object that is not as it must be.
    """
    for d in survey.datasets:
        new, old = out[d.name], previous[d.name]
        kept = d.offsets[first]
        boundary = _chunk_start(new, kept)
        stats.chunks_kept += _same_chunks(d.name, old, new, boundary)
        if boundary < kept:
            same_rows(d.name, old.id, boundary, new.id, boundary, kept - boundary,
                       "the previous version", block_bytes)
            stats.rows_checked += kept - boundary
    for index in range(first, len(survey.scanned)):
        stats.rows_checked += check_file_rows(survey, index, out, block_bytes)
    out.flush()
    check_output(out_path, template_path, rows={d.name: d.total for d in survey.datasets},
                 raw_datasets={d.name for d in survey.datasets if d.mode == "raw"},
                 block_bytes=block_bytes, opened=opened,
                 padding={d.name: [(d.offsets[f + 1] - count, count) for f, count in d.padding]
                          for d in survey.datasets if d.padding})


def _chunk_start(dataset: h5py.Dataset, row: int) -> int:
    """The first row of the chunk that holds ``row`` (``row`` itself if not chunked)."""
    rows = dataset.chunks[0] if dataset.chunks else 1
    return row - row % rows


def _same_chunks(name: str, old: h5py.Dataset, new: h5py.Dataset, boundary: int) -> int:
    """Every stored chunk of ``old`` before row ``boundary``: in ``new`` where it was, as it was."""
    if old.chunks is None:
        return 0
    before = chunk_index(old.id, old.chunks, old.shape)
    after = chunk_index(new.id, new.chunks, new.shape)
    kept = 0
    for coords, info in before.items():
        if info.chunk_offset[0] + old.chunks[0] > boundary:
            continue
        now = after.get(coords)
        if now is None or (now.byte_offset, now.size, now.filter_mask) != (
                info.byte_offset, info.size, info.filter_mask):
            raise OutputMismatchError(
                f"dataset /{name}: the chunk at {info.chunk_offset} of the previous version "
                f"moved or changed in the new one ({info.byte_offset}+{info.size} -> "
                f"{None if now is None else (now.byte_offset, now.size)})")
        kept += 1
    return kept


def same_rows(name: str, expected: h5d.DatasetID, e_start: int, actual: h5d.DatasetID,
               a_start: int, count: int, source: str, block_bytes: int) -> None:
    """Rows of ``actual`` from ``a_start`` equal rows of ``expected`` from ``e_start``."""
    tid = expected.get_type()
    step = block_rows(_row_bytes(expected), block_bytes)
    variable = is_variable(tid)
    for offset in range(0, count, step):
        n = min(step, count - offset)
        if variable:
            with vlen.read_rows(expected, e_start + offset, n, tid) as a, \
                    vlen.read_rows(actual, a_start + offset, n, tid) as b:
                same = vlen.element_values(a, tid) == vlen.element_values(b, tid)
        else:
            shape = (n, *expected.shape[1:])
            a = np.empty(shape, dtype=f"V{tid.get_size()}")
            b = np.empty(shape, dtype=f"V{tid.get_size()}")
            read_into(expected, e_start + offset, a)
            read_into(actual, a_start + offset, b)
            same = same_bytes(a, b)
        if not same:
            raise OutputMismatchError(
                f"dataset /{name}: output rows {a_start + offset}..{a_start + offset + n - 1} "
                f"differ from rows {e_start + offset}.. of {source}")


@contextmanager
def opened_version(path: Path, fd: int, libver: tuple[str, str], mode: str = "r+"
                   ) -> Iterator[h5py.File]:
    """The version open as ``fd`` (being built: ``r+``; the previous one: ``r``), by HDF5.

    Opened through the descriptor's magic link and checked to be that file,
    as checkpoints are; ``path`` names it in messages.
    """
    # A version being built is this process's alone (HDF5's lock would only be in the way);
    # one opened to read is opened as every check opens files, which HDF5 requires of two
    # opens of one file in a process.
    options = {"locking": False} if mode == "r+" else {}
    out = h5py.File(fd_path(fd), mode, libver=libver, **options)
    try:
        check_same_file(path, fd, out.id.get_vfd_handle())
        yield out
    finally:
        out.close()
