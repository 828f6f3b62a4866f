"""Reading a checkpoint file's skeleton and checking that a run's files agree.

Every file of a run has the same skeleton (SPEC 1): the same groups and
datasets, and each extensible dataset with the same HDF5 type and trailing
shape. Fixed datasets may differ in type or shape (only the final one is
kept). A file is complete only when its root has ``trials_completed``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (registers Blosc, Blosc2, Zstd, LZ4, BZip2... with HDF5)
import numpy as np
from h5py import h5a, h5d, h5f, h5o, h5p, h5s, h5t, h5z

from chkq.errors import CheckpointChangedError
from chkq.h5types import element_count, is_variable, type_key
from chkq.rowio import digest_rows
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
        :func:`chkq.rowio.digest_rows`), against which the output is
        verified without opening the file again; else "".
    """

    path: Path
    objects: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    plain_chunks: dict[str, list[int]] = field(default_factory=dict)
    digest: str = ""

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


def open_checkpoint_id(path: Path, fd: int | None = None) -> h5f.FileID:
    """Open a checkpoint file read-only with the low-level API (about 15x cheaper than h5py.File).

    Planning, copying and verifying open every checkpoint file; with
    thousands of small files ``h5py.File``'s set-up dominated. The caller
    closes the returned id (``fid.close()``). With ``fd``, HDF5 opens the
    file open as ``fd`` through its magic link (``/proc/self/fd/N``), and
    the file it opened is checked to be that one (device and inode): a
    name swapped meanwhile is never read; ``path`` only names the file in
    messages.

    Raises
    ------
    ValueError
        If the file is not HDF5 or cannot be read, naming it.
    """
    try:
        fid = h5f.open(os.fsencode(path if fd is None else fd_path(fd)), h5f.ACC_RDONLY)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"cannot read checkpoint file {str(path)!r}: not HDF5 or unreadable "
                         f"({exc})") from None
    if fd is not None:
        try:
            check_same_file(path, fd, fid.get_vfd_handle())
        except BaseException:
            fid.close()
            raise
    return fid


def check_same_file(path: str | Path, fd: int, opened: int) -> None:
    """Raise CheckpointChangedError unless descriptors ``fd`` and ``opened`` are one file."""
    a, b = os.fstat(fd), os.fstat(opened)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise CheckpointChangedError(
            f"{str(path)!r} was replaced by another file while HDF5 opened it")


_SIGNATURES: dict[bytes, str] = {}

#: Most a deflate-like filter can shrink data (zlib's limit is about 1032:1); a file that
#: declares more rows than its stored bytes could hold at that ratio is refused.
MAX_FILTER_RATIO = 1100

#: Most bytes of extensible rows a file may hold for its scan to digest them.
DIGEST_FILE_BYTES = 1024 * 1024

#: Bytes of rows a dataset may declare beyond what it stores (rows never written read as
#: the fill value): enough for datasets created ahead of their data, not for forged sizes.
UNWRITTEN_SLACK = 16 * 1024 * 1024


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
        raise ValueError(f"{where} is a virtual dataset (its data lives in other files): "
                         "chkq does not consolidate virtual datasets")
    if dcpl.get_external_count() > 0:
        raise ValueError(f"{where} stores its data in external files: chkq does not "
                         "consolidate external storage")


def check_storage(path: Path, name: str, dsid: h5d.DatasetID, dcpl: h5p.PropDCID,
                  tid: h5t.TypeID) -> None:
    """Refuse an extensible dataset chkq cannot copy exactly, or that declares rows it lacks.

    Besides data outside the file (:func:`refuse_outside_storage`), a filter
    without a plugin cannot be decoded, and a dataset that declares far more
    rows than its stored bytes could hold would make chkq allocate and copy
    data that does not exist. (Fixed datasets are taken from the template
    only, which the planner checks.) ``dcpl`` and ``tid`` are the dataset's
    creation properties and type.
    """
    refuse_outside_storage(path, name, dcpl)
    where = f"dataset '/{name}' of checkpoint file {str(path)!r}"
    filtered = dcpl.get_nfilters() > 0
    for index in range(dcpl.get_nfilters()):
        code, _flags, _values, label = dcpl.get_filter(index)
        if not h5z.filter_avail(code):
            text = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
            raise ValueError(f"{where} uses filter {code} ({text or 'unnamed'}), which no "
                             "installed plugin can decode")
    space = dsid.get_space()
    declared = tid.get_size() * element_count(space.shape)
    if declared == 0 or dcpl.get_layout() != h5d.CHUNKED:
        return
    chunk_bytes = tid.get_size() * element_count(dcpl.get_chunk())
    stored = dsid.get_storage_size()
    limit = (stored * MAX_FILTER_RATIO if filtered else stored) + max(chunk_bytes,
                                                                      UNWRITTEN_SLACK)
    if declared > limit:
        raise ValueError(f"{where} declares {space.shape[0]} rows ({declared} bytes) but "
                         f"stores only {stored} bytes: the file is damaged or forged")


def stored_chunks(dsid: h5d.DatasetID, chunk: tuple[int, ...], shape: tuple[int, ...]
                  ) -> list[tuple[tuple[int, ...], h5d.StoreInfo | None]]:
    """Every chunk of a dataset in row-major order: its grid coordinates and storage info.

    One pass over HDF5's chunk index; the info is None for a chunk not stored.
    """
    grid = [-(-size // c) for size, c in zip(shape, chunk, strict=True)]
    found: dict[tuple[int, ...], h5d.StoreInfo] = {}

    def record(info: h5d.StoreInfo) -> None:
        found[tuple(o // c for o, c in zip(info.chunk_offset, chunk, strict=True))] = info

    if all(grid):
        dsid.chunk_iter(record)
    return [(coords, found.get(coords)) for coords in np.ndindex(*grid)]


def plain_chunks(dsid: h5d.DatasetID, dcpl: h5p.PropDCID, shape: tuple[int, ...],
                 element_size: int) -> list[int] | None:
    """Rows per chunk, then each chunk's file offset in row order, if chunks hold plain rows.

    True of a chunked, unfiltered dataset whose chunks span whole rows and
    are all stored: its rows can then be copied byte for byte from these
    offsets without opening the file through HDF5 (the verify step reads
    them back through HDF5, which checks the offsets). None otherwise.
    ``dcpl``, ``shape`` and ``element_size`` are the dataset's.
    """
    if dcpl.get_layout() != h5d.CHUNKED or dcpl.get_nfilters() != 0:
        return None
    chunk = dcpl.get_chunk()
    if tuple(chunk[1:]) != tuple(shape[1:]):
        return None
    chunk_bytes = element_size * element_count(chunk)
    offsets = [int(chunk[0])]
    for _, info in stored_chunks(dsid, chunk, shape):
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
    Uses the low-level API (``H5Fopen``, ``H5Ovisit``, ``H5Dopen``): the
    high-level ``visititems`` built an h5py object per member and took
    ~1.6 ms a file, which dominated planning a run of thousands of files.

    Raises
    ------
    ValueError
        If the file is not HDF5, unreadable, or incomplete (no
        ``trials_completed`` root attribute).
    """
    scan = FileScan(path)
    fid = open_checkpoint_id(path, fd)
    try:
        if not h5a.exists(fid, COMPLETE_ATTR.encode()):
            raise ValueError(
                f"checkpoint file {str(path)!r} is incomplete: its root has no "
                f"{COMPLETE_ATTR!r} attribute (still being written, or left by a crash)"
            )
        members: list[tuple[bytes, int]] = []
        extensible_types: dict[str, tuple[h5d.DatasetID, h5t.TypeID, tuple[int, ...]]] = {}

        def visit(name: bytes, info: h5o._ObjInfo) -> None:
            members.append((name, info.type))

        try:
            h5o.visit(fid, visit, info=True)
            for raw, kind in members:
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
                        raise ValueError(
                            f"dataset '/{name}' of checkpoint file {str(path)!r} is "
                            "unlimited along another axis than the first: chkq "
                            "concatenates rows along the first axis only")
                    if extensible:
                        dcpl, tid = dsid.get_create_plist(), dsid.get_type()
                        extensible_types[name] = (dsid, tid, space.shape)
                        check_storage(path, name, dsid, dcpl, tid)
                        trailing = tuple(space.shape[1:])
                        signature = _signature_of(tid)
                        scan.objects[name] = f"extensible {signature} {trailing}"
                        scan.rows[name] = int(space.shape[0])
                        found = plain_chunks(dsid, dcpl, space.shape, tid.get_size())
                        if found is not None:
                            scan.plain_chunks[name] = found
                    else:
                        scan.objects[name] = "fixed"
            scan.digest = _small_file_digest(extensible_types) if digest else ""
        except (OSError, RuntimeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read checkpoint file {str(path)!r}: {exc}") from None
    finally:
        fid.close()
    return scan


def describe(kind: str) -> str:
    """Human wording of an ``objects`` entry."""
    if kind.startswith("extensible "):
        return "extensible dataset"
    return "group" if kind == "group" else "fixed dataset"


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
            found.append(
                f"extensible dataset {name!r} has type/trailing shape "
                f"{theirs.removeprefix('extensible ')!r}, expected "
                f"{kind.removeprefix('extensible ')!r}"
            )
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
            raise ValueError(
                f"checkpoint file {str(scan.path)!r} differs in structure from "
                f"{str(reference.path)!r}: {shown}{tail}"
            )
