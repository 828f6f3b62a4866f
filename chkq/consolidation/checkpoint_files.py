"""Reading a checkpoint file's skeleton and checking that a run's files agree.

Every file of a run has the same skeleton: the same groups and
datasets, and each extensible dataset with the same HDF5 type and trailing
shape. Fixed datasets may differ in type or shape (only the final one is
kept). A file is complete only when its root has ``trials_completed``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (registers Blosc, Blosc2, Zstd, LZ4, BZip2... with HDF5)
import numpy as np
from h5py import h5a, h5d, h5f, h5g, h5l, h5o, h5p, h5s, h5t, h5z

from chkq.consolidation.h5types import element_count, is_variable, type_key
from chkq.consolidation.rowio import digest_rows
from chkq.errors import BadCheckpointError, CheckpointChangedError
from chkq.rundir import fd_path

COMPLETE_ATTR = "trials_completed"
MAX_LISTED_DIFFERENCES = 5


def is_extensible(dataset: h5py.Dataset) -> bool:
    """A dataset is extensible when any of its dimensions is unlimited."""
    return dataset.maxshape is not None and any(m is None for m in dataset.maxshape)


@dataclass
class FileScan:
    """What validation and planning need to know of one checkpoint file.

    Attributes
    ----------
    path
        The file.
    objects
        Every group and dataset by path (no leading ``/``), mapped to
        ``"group"``, ``"fixed"`` or ``"extensible <type> <trailing shape>"``.
    rows
        Row count of every extensible dataset.
    plain_chunks
        For the extensible datasets whose stored chunks hold their rows as
        plain bytes (:func:`plain_chunks`): rows per chunk, then the file
        offset of each chunk in row order.
    digest
        For a small file whose extensible datasets are all of fixed-size
        types: the SHA-256 of their rows as HDF5 reads them (in name order,
        :func:`chkq.consolidation.rowio.digest_rows`), against which the output is
        verified without opening the file again; else "".
    memory
        The largest :func:`memory_need` of the file's extensible datasets
        and that dataset's name ([0, ""] for none): the planner refuses a
        run that needs more than a task's block.
    access
        The file's permission bits, owner and group (``st_mode & 0o7777``,
        ``st_uid``, ``st_gid``), from which the output's are derived
        (:func:`chkq.consolidation.skeleton.output_access`); ``(0, -1, -1)`` if not taken.
    """

    path: Path
    objects: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    plain_chunks: dict[str, list[int]] = field(default_factory=dict)
    digest: str = ""
    memory: tuple[int, str] = (0, "")
    access: tuple[int, int, int] = (0, -1, -1)

    @property
    def extensible(self) -> list[str]:
        """Names of the extensible datasets, in the file's own order."""
        return list(self.rows)


def open_checkpoint(path: Path, fd: int | None = None) -> h5py.File:
    """Open a checkpoint file read-only, turning "not HDF5" into a ValueError naming it.

    With ``fd`` (the file opened through :class:`chkq.rundir.RunDir`), HDF5
    opens that descriptor's file (:func:`open_checkpoint_id`), not ``path``.
    """
    return h5py.File(open_checkpoint_id(path, fd))


#: What HDF5 says when a file is marked open for writing (superblock status flags, left set
#: by a writer that has not closed it) or locked by a writer.
_OPEN_FOR_WRITE = ("file is already open for write", "unable to lock file")


def open_checkpoint_id(path: Path, fd: int | None = None,
                       fapl: h5p.PropFAID | None = None) -> h5f.FileID:
    """Open a checkpoint file read-only with the low-level API (about 15x cheaper than h5py.File).

    Planning, copying and verifying open every checkpoint file; with
    thousands of small files ``h5py.File``'s set-up dominated. The caller
    closes the returned id (``fid.close()``). With ``fd``, HDF5 opens the
    file open as ``fd`` through its magic link (``/proc/self/fd/N``), and
    the file it opened is checked to be that one (device and inode): a
    name swapped meanwhile is never read; ``path`` only names the file in
    messages. ``fapl``: file access properties other than HDF5's defaults
    (the scan's :data:`SCAN_ACCESS`).

    Raises
    ------
    ValueError
        If the file is not HDF5 or cannot be read, or is still open for
        writing, naming it.
    """
    try:
        fid = h5f.open(os.fsencode(path if fd is None else fd_path(fd)), h5f.ACC_RDONLY,
                       fapl=fapl)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        if any(sign in str(exc) for sign in _OPEN_FOR_WRITE):
            raise BadCheckpointError(
                f"cannot read checkpoint file {str(path)!r}: it is still open for writing, "
                "or its writer stopped without closing it (then it may be incomplete or "
                "damaged; `h5clear -s` clears the mark once no writer is left) "
                f"({exc})") from None
        raise BadCheckpointError(f"cannot read checkpoint file {str(path)!r}: not HDF5 or "
                                 f"unreadable ({exc})") from None
    if fd is not None:
        try:
            check_same_file(path, fd, fid.get_vfd_handle())
        except BaseException:
            fid.close()
            raise
    return fid


#: How the scan opens a file: HDF5's defaults without a raw-data chunk cache. The scan reads
#: each stored chunk at most once (the digest), so a cache would keep nothing worth keeping,
#: while setting one up for every dataset it opens (521 slots, cleared) was about 4% of the
#: scan's instructions for a small file.
SCAN_ACCESS = h5p.create(h5p.FILE_ACCESS)
SCAN_ACCESS.set_cache(0, 1, 0, 0.75)


def check_same_file(path: str | Path, fd: int, opened: int) -> None:
    """Raise CheckpointChangedError unless descriptors ``fd`` and ``opened`` are one file."""
    a, b = os.fstat(fd), os.fstat(opened)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise CheckpointChangedError(
            f"{str(path)!r} was replaced by another file while HDF5 opened it")


_SIGNATURES: dict[bytes, str] = {}

#: Default of the most bytes a run's filtered extensible datasets may decode to, all files
#: together (``CHKQ_MAX_DECODED_BYTES``): what a job may cost in decoding whatever its files
#: store, since zstd, bzip2, Blosc and LZ4 shrink constant data by far more than any fixed
#: ratio.
DEFAULT_MAX_DECODED_BYTES = 1 << 40

#: Bytes a task may always hold at once for one row, element, attribute or chunk, however
#: small ``CHKQ_BLOCK_BYTES`` is (a small block paces the work; it does not make a 1 MiB
#: row unreadable). What is refused is what needs more than the larger of the two.
MIN_HOLD_BYTES = 16 * 1024 * 1024

#: Most bytes of extensible rows a file may hold for its scan to digest them.
DIGEST_FILE_BYTES = 1024 * 1024

#: Bytes of extensible rows a file may declare in chunks it does not store (rows never
#: written read as the fill value), all its datasets together: enough for datasets created
#: ahead of their data, not for forged sizes. An output is thus at most its sources'
#: bytes (decoded) plus this much per file.
UNWRITTEN_SLACK = 16 * 1024 * 1024

#: Chunks of extensible datasets a checkpoint file may declare but not store, all its
#: datasets together. Each costs the output a chunk (allocated, indexed, written, checked)
#: whatever its bytes, so :data:`UNWRITTEN_SLACK` alone would let 16 Mi one-byte chunks
#: through; honest files with chunks of 256 bytes or more reach the byte bound first.
UNWRITTEN_CHUNKS = 65536


#: Deepest object chkq walks to, in groups from the root (the root's members are at 1). HDF5's own
#: visit recurses once per level and crashes the process on deep enough files, so every
#: walk in chkq is iterative and refuses a file nested deeper before reading anything.
MAX_DEPTH = 64


def object_key(info: h5o._ObjInfo) -> tuple[int, int]:
    """What identifies an object within an open file: its file number and address."""
    return int(info.fileno), int(getattr(info, "addr", 0) or hash(getattr(info, "token", b"")))


def too_deep(where: str, name: bytes) -> ValueError:
    """The refusal of an object nested deeper than :data:`MAX_DEPTH` groups."""
    shown = name.decode("utf-8", "surrogateescape")
    if len(shown) > 120:
        shown = shown[:60] + "..." + shown[-40:]
    return ValueError(f"{where} nests groups more than {MAX_DEPTH} levels deep (at "
                      f"'/{shown}'): chkq refuses files nested deeper")


def walk_objects(fid: h5f.FileID, where: str) -> list[tuple[bytes, int]]:
    """Every object reachable from the root by hard links, once each, with its kind.

    The order and names are ``H5Ovisit``'s (depth first, links by name,
    each object under the first name that reaches it), but the walk is a
    loop over an explicit stack, one group's links at a time, so its depth
    costs no native or Python stack. ``where`` names the file in errors.

    Raises
    ------
    ValueError
        If a group is nested deeper than :data:`MAX_DEPTH` (naming it).
    """
    found: list[tuple[bytes, int]] = []
    root = h5g.open(fid, b"/")
    seen = {object_key(h5o.get_info(root))}
    stack: list[tuple[h5g.GroupID, bytes, list[bytes], int]] = [(root, b"", _hard_links(root), 0)]
    while stack:
        group, prefix, names, index = stack[-1]
        if index == len(names):
            stack.pop()
            continue
        stack[-1] = (group, prefix, names, index + 1)
        raw = names[index]
        info = h5o.get_info(group, raw)
        key = object_key(info)
        if key in seen:
            continue
        seen.add(key)
        full = prefix + raw
        if len(stack) > MAX_DEPTH:
            raise too_deep(where, full)
        found.append((full, info.type))
        if info.type == h5o.TYPE_GROUP:
            child = h5g.open(group, raw)
            stack.append((child, full + b"/", _hard_links(child), 0))
    return found


def _hard_links(group: h5g.GroupID) -> list[bytes]:
    """The names of a group's hard links, in name order.

    One pass over the group's links with their info: the link type comes
    with each name, not from a query per link.
    """
    names: list[bytes] = []

    def keep(name: bytes, info: h5l.LinkInfo) -> None:
        if info.type == h5l.TYPE_HARD:
            names.append(name)

    group.links.iterate(keep, info=True)
    return names


def _signature_of(tid: h5t.TypeID) -> str:
    """``type_key`` cached by the type's binary encoding (equal encoding, equal type)."""
    key = tid.encode()
    found = _SIGNATURES.get(key)
    if found is None:
        found = _SIGNATURES[key] = type_key(tid)
    return found


def refuse_outside_storage(path: Path, name: str, dcpl: h5p.PropDCID) -> None:
    """Refuse a virtual or external-storage dataset: its data lives in other files.

    (Possibly outside the run: chkq neither reads nor links such data.)
    """
    where = f"dataset '/{name}' of checkpoint file {str(path)!r}"
    if dcpl.get_layout() == h5d.VIRTUAL:
        raise BadCheckpointError(f"{where} is a virtual dataset (its data lives in other files): "
                         "chkq does not consolidate virtual datasets")
    if dcpl.get_external_count() > 0:
        raise BadCheckpointError(f"{where} stores its data in external files: chkq does not "
                         "consolidate external storage")


def check_filters(path: Path, name: str, dcpl: h5p.PropDCID) -> None:
    """Refuse a dataset whose filters no installed plugin decodes (naming the filter)."""
    for index in range(dcpl.get_nfilters()):
        code, _flags, _values, label = dcpl.get_filter(index)
        if not h5z.filter_avail(code):
            text = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
            raise BadCheckpointError(
                f"dataset '/{name}' of checkpoint file {str(path)!r} uses filter "
                f"{code} ({text or 'unnamed'}), which no installed plugin can "
                             "decode")


def check_storage(path: Path, name: str, dsid: h5d.DatasetID, dcpl: h5p.PropDCID,
                  tid: h5t.TypeID) -> None:
    """Refuse an extensible dataset chkq cannot copy exactly (data outside, filter missing).

    Besides data outside the file (:func:`refuse_outside_storage`), a filter
    without a plugin cannot be decoded. What its rows cost is checked by
    :func:`declared_bytes`. ``dcpl`` and ``tid`` are the dataset's creation
    properties and type.
    """
    refuse_outside_storage(path, name, dcpl)
    check_filters(path, name, dcpl)


def declared_bytes(path: Path, name: str, dsid: h5d.DatasetID, dcpl: h5p.PropDCID,
                   tid: h5t.TypeID, index: ChunkIndex | None = None) -> int:
    """Bytes a chunked dataset declares in chunks it does not store; refuse a forged one.

    Each stored chunk holds its share of the dataset's extent (clipped at
    the edges); the rest of the extent lies in chunks that are not stored,
    which read as the fill value without costing a byte of the file. Those
    are what the caller bounds (:data:`UNWRITTEN_SLACK` per file). Unfiltered
    stored chunks must hold their share in their size. Filtered ones may
    decode to any multiple of it (a chunk of zeros is a few dozen bytes in
    Blosc): what they decode to is bounded per run instead
    (:func:`chkq.consolidation.memory_bounds.check_decoded`), and per task by
    the chunk's size (:func:`memory_need`). The walk visits
    stored chunks only, so it costs what the file holds, whatever it
    declares. Not chunked: 0 (contiguous and compact data is read only
    where it is stored). ``index``: the dataset's :func:`chunk_index`, if
    the caller read it already (the scan reads it once per dataset).

    Raises
    ------
    ValueError
        If unfiltered stored chunks declare more than their bytes hold.
    """
    shape = dsid.shape
    if dcpl.get_layout() != h5d.CHUNKED or not shape or 0 in shape:
        return 0
    chunk = dcpl.get_chunk()
    size = tid.get_size()
    held, stored = 0, 0
    for info in (chunk_index(dsid, chunk, shape) if index is None else index).values():
        held += size * element_count([min(c, extent - o) for o, c, extent
                                      in zip(info.chunk_offset, chunk, shape, strict=True)])
        stored += int(info.size)
    if not dcpl.get_nfilters() and held > stored:
        raise BadCheckpointError(f"dataset '/{name}' of checkpoint file {str(path)!r} declares "
                         f"{held} bytes in chunks that store only {stored} bytes: the file "
                         "is damaged or forged")
    return size * element_count(shape) - held


def grid_chunks(chunk: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """How many chunks of shape ``chunk`` cover a dataset of ``shape``, stored or not."""
    count = 1
    for c, n in zip(chunk, shape, strict=True):
        count *= -(-n // c)
    return count


def memory_need(dcpl: h5p.PropDCID, tid: h5t.TypeID, shape: tuple[int, ...]) -> int:
    """Bytes one task must hold at once to move an extensible dataset's rows.

    One row; for a filtered dataset, one chunk's rows across the whole row
    (HDF5 decodes whole chunks, and chkq encodes whole chunks of rows).
    """
    row = tid.get_size() * element_count(shape[1:])
    if dcpl.get_layout() == h5d.CHUNKED and dcpl.get_nfilters():
        return row * int(dcpl.get_chunk()[0])
    return row


#: A dataset's stored chunks by grid coordinates (:func:`chunk_index`).
ChunkIndex = dict[tuple[int, ...], h5d.StoreInfo]


def chunk_index(dsid: h5d.DatasetID, chunk: tuple[int, ...], shape: tuple[int, ...]
                ) -> ChunkIndex:
    """Every stored chunk of a dataset by its grid coordinates: one pass over HDF5's index.

    Empty for a dataset with no element (its grid has no chunk).
    """
    found: ChunkIndex = {}

    def record(info: h5d.StoreInfo) -> None:
        found[tuple(o // c for o, c in zip(info.chunk_offset, chunk, strict=True))] = info

    if shape and all(shape):
        dsid.chunk_iter(record)
    return found


def stored_chunks(dsid: h5d.DatasetID, chunk: tuple[int, ...], shape: tuple[int, ...],
                  index: ChunkIndex | None = None
                  ) -> list[tuple[tuple[int, ...], h5d.StoreInfo | None]]:
    """Every chunk of a dataset in row-major order: its grid coordinates and storage info.

    One pass over HDF5's chunk index (none if ``index``, the dataset's
    :func:`chunk_index`, is given); the info is None for a chunk not stored.
    """
    grid = [-(-size // c) for size, c in zip(shape, chunk, strict=True)]
    found = chunk_index(dsid, chunk, shape) if index is None else index
    return ([(coords, found.get(coords)) for coords in itertools.product(*map(range, grid))]
            if all(grid) else [])


def plain_chunks(dsid: h5d.DatasetID, dcpl: h5p.PropDCID, shape: tuple[int, ...],
                 element_size: int, index: ChunkIndex | None = None) -> list[int] | None:
    """Rows per chunk, then each chunk's file offset in row order, if chunks hold plain rows.

    True of a chunked, unfiltered dataset whose chunks span whole rows and
    are all stored: its rows can then be copied byte for byte from these
    offsets without opening the file through HDF5 (the verify step reads
    them back through HDF5, which checks the offsets). None otherwise.
    ``dcpl``, ``shape`` and ``element_size`` are the dataset's; ``index``
    its :func:`chunk_index`, if read already.
    """
    if dcpl.get_layout() != h5d.CHUNKED or dcpl.get_nfilters() != 0:
        return None
    chunk = dcpl.get_chunk()
    if tuple(chunk[1:]) != tuple(shape[1:]):
        return None
    chunk_bytes = element_size * element_count(chunk)
    stored = dsid.get_num_chunks() if index is None else len(index)
    if stored != element_count([-(-n // c) for n, c in zip(shape, chunk, strict=True)]):
        return None  # some chunk is not stored (the grid itself is not walked)
    offsets = [int(chunk[0])]
    for _, info in stored_chunks(dsid, chunk, shape, index):
        if (info is None or info.byte_offset is None or info.size != chunk_bytes
                or info.filter_mask):
            return None
        offsets.append(int(info.byte_offset))
    return offsets


def _small_file_digest(
        datasets: dict[str, tuple[h5d.DatasetID, h5t.TypeID, tuple[int, ...]]]) -> str:
    """The digest of a small file's extensible rows (:attr:`FileScan.digest`), or ""."""
    if any(is_variable(tid) for _, tid, _ in datasets.values()):
        return ""
    if sum(tid.get_size() * element_count(shape)
           for _, tid, shape in datasets.values()) > DIGEST_FILE_BYTES:
        return ""
    digest = hashlib.sha256()
    for name in sorted(datasets):
        dsid, tid, shape = datasets[name]
        rows = np.empty(shape, dtype=f"V{tid.get_size()}")
        if rows.size:
            dsid.read(h5s.ALL, h5s.ALL, rows, mtype=tid)
        digest_rows(digest, name, len(rows), [rows])
    return digest.hexdigest()


def scan_file(path: Path, digest: bool = True, fd: int | None = None) -> FileScan:
    """Open ``path`` once and record its skeleton, row counts, plain chunks and digest.

    ``digest``: whether to digest a small file's rows (:attr:`FileScan.digest`);
    ``fd``: the file already opened, to be read instead of ``path``
    (:func:`open_checkpoint_id`).
    Uses the low-level API (``H5Fopen``, :func:`walk_objects`, ``H5Dopen``): the
    high-level ``visititems`` builds an h5py object per member, which dominated
    planning a run of thousands of files.

    Raises
    ------
    ValueError
        If the file is not HDF5, unreadable, or incomplete (no
        ``trials_completed`` root attribute).
    """
    scan = FileScan(path)
    fid = open_checkpoint_id(path, fd, SCAN_ACCESS)
    try:
        if not h5a.exists(fid, COMPLETE_ATTR.encode()):
            raise BadCheckpointError(
                f"checkpoint file {str(path)!r} is incomplete: its root has no "
                f"{COMPLETE_ATTR!r} attribute (still being written, or left by a crash)"
            )
        extensible_types: dict[str, tuple[h5d.DatasetID, h5t.TypeID, tuple[int, ...]]] = {}
        unwritten, worst = 0, (0, "", 0)
        missing, most = 0, (0, "")
        try:
            for raw, kind in walk_objects(fid, f"checkpoint file {str(path)!r}"):
                name = raw.decode("utf-8", "surrogateescape")
                if kind == h5o.TYPE_GROUP:
                    scan.objects[name] = "group"
                elif kind == h5o.TYPE_DATASET:
                    dsid = h5d.open(fid, raw)
                    space = dsid.get_space()
                    maxdims: tuple[int, ...] = (
                        space.get_simple_extent_dims(True) if space.shape else ())
                    extensible = any(m == h5s.UNLIMITED for m in maxdims)
                    if extensible and maxdims[0] != h5s.UNLIMITED:
                        raise BadCheckpointError(
                            f"dataset '/{name}' of checkpoint file {str(path)!r} is "
                            "unlimited along another axis than the first: chkq "
                            "concatenates rows along the first axis only")
                    if extensible:
                        dcpl, tid = dsid.get_create_plist(), dsid.get_type()
                        extensible_types[name] = (dsid, tid, space.shape)
                        check_storage(path, name, dsid, dcpl, tid)
                        # One walk of the chunk index serves both checks below.
                        index = (chunk_index(dsid, dcpl.get_chunk(), space.shape)
                                 if dcpl.get_layout() == h5d.CHUNKED else None)
                        unstored = declared_bytes(path, name, dsid, dcpl, tid, index)
                        if index is not None:
                            absent = max(0, grid_chunks(dcpl.get_chunk(), space.shape)
                                         - len(index))
                            missing += absent
                            if absent > most[0]:
                                most = (absent, name)
                        unwritten += unstored
                        if unstored > worst[0]:
                            worst = (unstored, name, int(space.shape[0]))
                        need = memory_need(dcpl, tid, space.shape)
                        if need > scan.memory[0]:
                            scan.memory = (need, name)
                        trailing = tuple(space.shape[1:])
                        signature = _signature_of(tid)
                        scan.objects[name] = f"extensible {signature} {trailing}"
                        scan.rows[name] = int(space.shape[0])
                        found = plain_chunks(dsid, dcpl, space.shape, tid.get_size(), index)
                        if found is not None:
                            scan.plain_chunks[name] = found
                    else:
                        scan.objects[name] = "fixed"
            if unwritten > UNWRITTEN_SLACK:
                raise BadCheckpointError(
                    f"dataset '/{worst[1]}' of checkpoint file {str(path)!r} declares "
                    f"{worst[2]} rows, {worst[0]} bytes of them in chunks the file does not "
                    f"store (at most {UNWRITTEN_SLACK} bytes of rows may be unwritten in a "
                    "file, all datasets together): the file is damaged or forged")
            if missing > UNWRITTEN_CHUNKS:
                raise BadCheckpointError(
                    f"dataset '/{most[1]}' of checkpoint file {str(path)!r} declares {most[0]} "
                    f"chunks the file does not store (at most {UNWRITTEN_CHUNKS} chunks may be "
                    "unwritten in a file, all datasets together): the file is damaged or "
                    "forged")
            scan.digest = _small_file_digest(extensible_types) if digest else ""
        except (OSError, RuntimeError, KeyError, TypeError) as exc:
            raise BadCheckpointError(f"cannot read checkpoint file {str(path)!r}: {exc}") from None
    finally:
        fid.close()
    return scan


def describe(kind: str) -> str:
    """Human wording of an ``objects`` entry."""
    if kind.startswith("extensible "):
        return "extensible dataset"
    return "group" if kind == "group" else "fixed dataset"


_TYPE_DIGEST = re.compile(r"#[0-9a-f]{12}\b")


def readable_kind(kind: str) -> str:
    """An extensible dataset's type and row shape as people read them, e.g. ``float64 (16,)``.

    The digest that makes types compare exactly (see ``type_key``) is left out.
    """
    return _TYPE_DIGEST.sub("", kind.removeprefix("extensible "))


def differences(reference: FileScan, other: FileScan) -> list[str]:
    """How ``other``'s skeleton differs from ``reference``'s, in readable phrases."""
    found = []
    for name, kind in reference.objects.items():
        if name not in other.objects:
            found.append(f"missing {describe(kind)} {name!r}")
            continue
        theirs = other.objects[name]
        if kind == theirs or (kind == "fixed" and theirs == "fixed"):
            continue
        if kind.startswith("extensible ") and theirs.startswith("extensible "):
            mine, other_kind = readable_kind(kind), readable_kind(theirs)
            if mine == other_kind:
                found.append(
                    f"extensible dataset {name!r} has type and row shape {other_kind} as "
                    "expected, but another HDF5 encoding of that type (byte order, padding, "
                    "string padding or character set)")
            else:
                found.append(f"extensible dataset {name!r} has type and row shape "
                             f"{other_kind}, expected {mine}")
        else:
            found.append(f"{name!r} is a {describe(theirs)}, expected a {describe(kind)}")
    for name, kind in other.objects.items():
        if name not in reference.objects:
            found.append(f"unexpected {describe(kind)} {name!r}")
    return found


def check_same_structure(scans: list[FileScan]) -> None:
    """Raise ValueError naming the first file whose skeleton differs from the first file's."""
    reference = scans[0]
    for scan in scans[1:]:
        found = differences(reference, scan)
        if found:
            shown = "; ".join(found[:MAX_LISTED_DIFFERENCES])
            more = len(found) - MAX_LISTED_DIFFERENCES
            tail = f" (and {more} more)" if more > 0 else ""
            raise BadCheckpointError(
                f"checkpoint file {str(scan.path)!r} differs in structure from "
                f"{str(reference.path)!r}: {shown}{tail}"
            )
