"""Creating the output's skeleton: the final checkpoint's first file, resized.

The output must equal the final checkpoint's first file (the *template*)
in everything but the rows of its extensible datasets: every link (hard,
soft, external), committed datatypes, references, attributes with their
exact bytes, the userblock, dataspaces and creation properties. No walk of
the file reproduces all of that, so the skeleton *is* the template: its
bytes are copied under the job's temporary name, and each extensible
dataset is resized in place to the run's total row count, keeping its
object (and so every link and reference to it) as it was.

Raw-mode datasets (uncompressed, fixed-size elements) are written by copy
tasks as bytes at chunk offsets, so all their chunks must exist before the
copy starts. HDF5 allocates them in one call when a dataset's allocation
time is EARLY; otherwise allocating costs a write of every chunk. So a
raw-mode dataset that nothing else can tell apart from a new one (a single
link, no references in the file) is recreated with EARLY allocation instead (the
*allocation time* is then the only property that differs from the
template), and any other is resized in place and allocated by writing it.
A recreated dataset is created anonymously (no staging name that could
collide with one in the file), with no rows, the old one's attributes in
their creation order and its comment, and linked in the old one's place;
in a group that tracks link creation order, the links created after it are
inserted again in order. Only then is it grown to the run's rows: the old
dataset is gone by then, and the new one's chunks take the place its rows
held (which were never copied from the template: holes in the file), so
the output holds its rows and the template's metadata, nothing more. Its
chunks are allocated without the fill value being written over them (the
copy writes every row); the fill time the template stores is then written
back into the new dataset's object header, and the parts of edge chunks
past the extent are made to read as the fill value (zeros).

Recreating a dataset is :mod:`chkq.consolidation.recreation`'s, restoring
its fill :mod:`chkq.consolidation.fill_restore`'s; datasets whose filters
store the template's parameters (part files, chunk encoding) are
:mod:`chkq.consolidation.filter_pipelines`'.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5o, h5s

from chkq.consolidation.checkpoint_files import open_checkpoint_id, stored_chunks
from chkq.consolidation.fill_restore import Unpatchable, restore_fill_time, zero_edge_chunks
from chkq.consolidation.h5types import is_variable, opaque_dtype
from chkq.consolidation.recreation import (
    holds_references,
    recreatable,
    recreate_early,
    replace_links,
)
from chkq.consolidation.rowio import ByteCopier
from chkq.fsutil import give_access
from chkq.rundir import CREATE, RunDir, fd_path

#: Rows written per H5Dwrite when a dataset's chunks are allocated by writing them.
ALLOCATE_BYTES = 16 * 1024 * 1024
#: Bytes of metadata reserved a chunk: the chunk index's share, with room.
INDEX_BYTES_PER_CHUNK = 128
#: The most metadata reserved in one block.
MAX_META_BLOCK = 8 << 20

#: The lowest library version bound that writes each superblock version: what the file's
#: writer must have asked for at least.
_SUPERBLOCK_LOW = {0: "earliest", 1: "earliest", 2: "v108", 3: "v110"}


def format_bounds(template: h5py.File, datasets: list[str]) -> tuple[str, str]:
    """The library version bounds (h5py ``libver``) under which chkq writes into the output.

    HDF5 does not store a file's bounds; it opens every file with the
    default ones (``earliest``), and objects created then get the oldest
    formats: a recreated dataset would have a version 1 object header
    where the template's has version 2 (which is where "do not track
    times" is kept, and which allows attributes over 64 KiB). The low
    bound is the one the template's writer used at least: that of its
    superblock version, raised to 1.8 when any of ``datasets`` (those chkq
    may recreate) has a version 2 header. The high bound is the library's
    latest, so that nothing the template holds is refused.
    """
    superblock = template.id.get_create_plist().get_version()[0]
    low = _SUPERBLOCK_LOW.get(superblock, "latest")
    if low == "earliest" and any(h5o.get_info(template[name].id).hdr.version >= 2
                                 for name in datasets):
        low = "v108"
    return low, "latest"


def dataset_mode(dsid: h5d.DatasetID) -> str:
    """How chkq copies an extensible dataset: ``raw``, ``chunks`` or ``whole``.

    Raw chunk bytes can be written in place only for uncompressed data of a
    fixed size; filtered data of a fixed size moves as encoded chunks;
    anything holding pointers (variable-length data, references) goes
    through HDF5, row by row.
    """
    if is_variable(dsid.get_type()):
        return "whole"
    if dsid.get_create_plist().get_nfilters() > 0:
        return "chunks"
    return "raw"


def chunk_offsets(dsid: h5d.DatasetID) -> list[int]:
    """File offset of every chunk of a dataset, in row-major chunk order (all allocated)."""
    offsets = []
    for coords, info in stored_chunks(dsid, dsid.get_create_plist().get_chunk(), dsid.shape):
        if info is None:
            raise RuntimeError(f"chunk {coords} of the output's dataset was not allocated")
        offsets.append(int(info.byte_offset))
    return offsets


def output_access(files: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The permission bits, owner and group the output gets: never more readable than its sources.

    ``files`` holds each checkpoint file's ``(permission bits, uid, gid)``.
    The bits are those every checkpoint has (no execute, setuid, setgid or
    sticky bit), plus read and write for the owner (the job writes the
    output after creating it). The owner and the group are the ones all
    checkpoints share, -1 where they differ (the output then keeps the
    worker's, and gets no group bits). The checkpoints' owner, not the run
    directory's: whoever owns a directory may have linked another user's
    files into it.
    """
    mode = 0o666
    for bits, _uid, _gid in files:
        mode &= bits
    owners = {uid for _bits, uid, _gid in files}
    groups = {gid for _bits, _uid, gid in files}
    return (mode | 0o600, owners.pop() if len(owners) == 1 else -1,
            groups.pop() if len(groups) == 1 else -1)


def _apply_access(fd: int, access: tuple[int, int, int]) -> None:
    """Give the new output ``access`` (:func:`output_access`) as far as the worker may.

    The owner and group change where the worker may change them (a worker
    running as root or as the checkpoints' owner); where it may not, the output
    stays the worker's, and group bits are dropped when its group is not
    the checkpoints' own, so that no other group can read it.
    """
    give_access(fd, *access)


def copy_template(src: int, out: int, skip: list[tuple[int, int]] | None = None) -> None:
    """Copy the bytes of the file open as ``src`` to the new, empty file open as ``out``.

    Byte ranges ``(offset, size)`` in ``skip`` (rows that will be replaced)
    are not copied: they stay holes.
    """
    size = os.fstat(src).st_size
    copier, at = ByteCopier(), 0
    for offset, length in sorted(skip or []):
        if offset > at:
            copier.copy(src, at, out, at, offset - at)
        at = max(at, offset + length)
    if size > at:
        copier.copy(src, at, out, at, size - at)
    os.ftruncate(out, size)


_libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE = 1


def reserve_space(fd: int, path: Path, size: int) -> None:
    """Reserve ``size`` bytes of disk for the file open as ``fd``, so that a full disk fails now.

    Without it, a disk that fills up while HDF5 writes (allocating the
    output) fails inside the library, which then cannot close the file; the
    reservation turns that into a clear ENOSPC before anything is written.
    Filesystems that cannot reserve space are skipped silently. ``path``
    names the file in the message.
    """
    fallocate = getattr(_libc, "fallocate", None)
    if fallocate is None:
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0:
        return
    error = ctypes.get_errno()
    if error == errno.ENOSPC:
        raise OSError(errno.ENOSPC, f"no space left for the output ({size} bytes) next to "
                      f"{str(path)!r}")


def _stored_ranges(dsid: h5d.DatasetID) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored chunk of a chunked dataset."""
    ranges: list[tuple[int, int]] = []
    dsid.chunk_iter(lambda info: ranges.append((int(info.byte_offset), int(info.size))))
    return ranges


def _allocate_by_writing(dsid: h5d.DatasetID) -> None:
    """Make HDF5 allocate every chunk of a dataset by writing zero bytes over all its rows."""
    shape = dsid.shape
    tid = dsid.get_type()
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, ALLOCATE_BYTES // max(1, row_elems * tid.get_size()))
    block = np.zeros((min(step, max(shape[0], 1)), *shape[1:]),
                     dtype=opaque_dtype(tid))
    for start in range(0, shape[0], step):
        count = min(step, shape[0] - start)
        fspace = dsid.get_space()
        fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))
        dsid.write(h5s.create_simple((count, *shape[1:])), fspace, block[:count], mtype=tid)


def create_skeleton(temp: Path, reference: Path, rows: dict[str, int], raw: set[str],
                    access: tuple[int, int, int] = (0o600, -1, -1), *, run: RunDir,
                    template: int, reserve: bool = True
                    ) -> tuple[dict[str, list[int]], int, tuple[str, str]]:
    """Write the output skeleton to ``temp``: ``reference``'s bytes, datasets resized.

    ``template`` is ``reference`` opened (and checked) by the caller: HDF5
    and the byte copy read that descriptor, never the name. ``temp`` is
    created through ``run`` with O_EXCL|O_NOFOLLOW (a file or symbolic link
    already there, planted by whoever can write the run directory, is never
    followed or overwritten), and HDF5 writes the created file through its
    descriptor.

    Parameters
    ----------
    rows
        Total rows of every extensible dataset.
    raw
        The raw-mode datasets, whose chunks must all be allocated.
    access
        The output's permission bits, owner and group (:func:`output_access`).
    reserve
        Whether the output's full size is reserved on disk first
        (:func:`reserve_space`). Without it the skeleton holds blocks only
        where something was written (its metadata, and chunks HDF5 fills):
        a sparse skeleton, planned on a node that copies no row, for an
        output assembled from parts. Such a skeleton's new metadata (the
        chunk indexes) is taken from one block (:func:`meta_block_bytes`),
        so that the raw chunks lie in unbroken runs that a store copies as
        whole ranges, rather than around index nodes placed among them.

    Returns
    -------
    For each raw-mode dataset, the file offset of every chunk; the inode of
    the temporary output; and the format bounds (:func:`format_bounds`)
    under which it was written, and must be whenever it is written again.

    Raises
    ------
    FileExistsError
        If ``temp`` exists (or is a symbolic link).
    """
    with h5py.File(open_checkpoint_id(reference, template)) as source:
        has_references = holds_references(source) if raw else False
        bounds = format_bounds(source, sorted(raw))
        recreated = {name for name in raw
                     if recreatable(source[name], has_references, bounds)}
        # A sparse skeleton (planned on metadata mirrors) leaves out the template's filtered
        # chunks too: holes in the mirror, rewritten by the layout of a spread job.
        encoded = set() if reserve else {name for name in rows if name not in raw
                                         and dataset_mode(source[name].id) == "chunks"}
        skip = [r for name in recreated | encoded for r in _stored_ranges(source[name].id)]
        row_bytes = {name: source[name].id.get_type().get_size()
                     * int(np.prod(source[name].shape[1:], dtype=np.int64)) for name in rows}
        meta_block = None if reserve else meta_block_bytes(
            [((rows[name], *source[name].shape[1:]), source[name].chunks) for name in raw])
    fd = run.open_file(temp, CREATE, 0o600)
    try:
        _apply_access(fd, access)
        copy_template(template, fd, skip)
        inode = os.fstat(fd).st_ino
        if reserve:
            reserve_space(fd, temp, os.fstat(template).st_size
                          + sum(total * row_bytes[name] for name, total in rows.items()))
        layout = _resize(fd, rows, raw, recreated, bounds, meta_block)
    finally:
        os.close(fd)
    return layout, inode, bounds


def meta_block_bytes(datasets: list[tuple[tuple[int, ...], tuple[int, ...] | None]]) -> int:
    """Bytes of one metadata block that holds the chunk indexes of ``datasets``.

    ``datasets`` are the ``(shape, chunk shape)`` the raw datasets have in
    the output. At least HDF5's default block (2 KiB), at most
    :data:`MAX_META_BLOCK`: an index larger than that takes more blocks.
    """
    chunks = sum(math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True))
                 for shape, chunk in datasets if chunk)
    return min(MAX_META_BLOCK, max(2048, chunks * INDEX_BYTES_PER_CHUNK))


def _resize(fd: int, rows: dict[str, int], raw: set[str], recreated: set[str],
            bounds: tuple[str, str], meta_block: int | None = None) -> dict[str, list[int]]:
    """Resize (or recreate) the extensible datasets of the skeleton open as ``fd``.

    Recreated datasets whose template writes the fill value when their
    chunks are allocated (at most the default fill of zeros:
    :func:`chkq.consolidation.recreation.recreatable`) are allocated
    without it, their fill time then restored in their object headers
    (:func:`chkq.consolidation.fill_restore.restore_fill_time`); their rows
    are all written by the copy, and the rest reads as zeros
    (:func:`chkq.consolidation.fill_restore.zero_edge_chunks`). Should a
    header not allow that, the dataset is recreated again, allocated with
    the fill written.
    """
    layout: dict[str, list[int]] = {}
    restore: dict[str, int] = {}
    edges: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
    options = {} if meta_block is None else {"meta_block_size": meta_block}
    with h5py.File(fd_path(fd), "r+", libver=bounds, **options) as out:
        base = out.userblock_size
        sizes = out.id.get_create_plist().get_sizes()
        replaced: dict[str, dict[bytes, h5d.DatasetID]] = {}
        grown: dict[str, tuple[h5d.DatasetID, int]] = {}
        for name, total in rows.items():
            if name in recreated:
                fill_time = out[name].id.get_create_plist().get_fill_time()
                dsid = recreate_early(out, name, 0, h5d.FILL_TIME_NEVER)
                if fill_time != h5d.FILL_TIME_NEVER:
                    restore[name] = fill_time
                parent, _, leaf = name.rpartition("/")
                replaced.setdefault(parent or "/", {})[leaf.encode()] = dsid
                grown[name] = (dsid, total)
                continue
            dsid = out[name].id
            h5py.Dataset(dsid).resize(total, axis=0)
            early = dsid.get_create_plist().get_alloc_time() == h5d.ALLOC_TIME_EARLY
            if name in raw and not early:
                _allocate_by_writing(dsid)
            if name in raw:
                layout[name] = chunk_offsets(dsid)
        for parent, new in replaced.items():
            replace_links(out[parent].id, new)
        # The old datasets are gone, their chunks free: the new ones' chunks take their place.
        for name, (dsid, total) in grown.items():
            dsid.set_extent((total, *dsid.shape[1:]))
            layout[name] = chunk_offsets(dsid)
            if name in restore:
                chunk = dsid.get_create_plist().get_chunk()
                edges[name] = (chunk, dsid.shape, dsid.get_type().get_size()
                               * int(np.prod(chunk, dtype=np.int64)))
        addresses = {name: h5o.get_info(out[name].id).addr for name in restore}
    refused: dict[str, int] = {}
    if restore:
        readable = os.open(fd_path(fd), os.O_RDWR | os.O_CLOEXEC)  # ``fd`` is write-only
        try:
            for name, fill_time in restore.items():
                try:
                    restore_fill_time(readable, base, addresses[name], sizes, fill_time)
                except Unpatchable:
                    refused[name] = fill_time
        finally:
            os.close(readable)
    if refused:
        _recreate_filled(fd, refused, bounds, layout)
    for name, (chunk, shape, size) in edges.items():
        if name not in refused:
            zero_edge_chunks(fd, chunk, shape, size, layout[name])
    return layout


def _recreate_filled(fd: int, fill_times: dict[str, int], bounds: tuple[str, str],
                     layout: dict[str, list[int]]) -> None:
    """Recreate each dataset ``fill_times`` names with that fill time, HDF5 writing the fill."""
    with h5py.File(fd_path(fd), "r+", libver=bounds) as out:
        replaced: dict[str, dict[bytes, h5d.DatasetID]] = {}
        for name, fill_time in fill_times.items():
            dsid = recreate_early(out, name, out[name].shape[0], fill_time)
            parent, _, leaf = name.rpartition("/")
            replaced.setdefault(parent or "/", {})[leaf.encode()] = dsid
            layout[name] = chunk_offsets(dsid)
        for parent, new in replaced.items():
            replace_links(out[parent].id, new)
