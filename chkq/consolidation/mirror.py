"""A checkpoint object's metadata mirror: every byte but the raw chunks, which stay holes.

A store job spread over many nodes plans on one node and copies the rows of
raw-mode datasets server-side, from the source objects' byte ranges
(:attr:`chkq.consolidation.plan.DatasetPlan.source_chunks`). The planning
node then needs each object's metadata, not its rows: :func:`mirror_object`
writes a sparse copy of a pinned object holding every byte except the stored
chunks of the extensible datasets whose chunks the plan copies as plain
bytes. Those are the datasets :func:`chkq.consolidation.skeleton.dataset_mode`
calls ``raw`` (unfiltered, of a fixed-size type) and whose chunks
:func:`chkq.consolidation.checkpoint_files.plain_chunks` finds to hold
whole plain rows (chunked, first dimension unlimited, every chunk stored
and unfiltered); every other dataset (filtered, variable-length, fixed,
chunks that cut rows) keeps its bytes, since its rows are read through
HDF5. Planning copies a file's chunks as bytes only if they have the
template's rows per chunk: given those (``chunk_rows``, from the template's
mirror, :func:`raw_chunk_rows`), a mirror keeps the chunks of other rows
too. Records a file is padded after (netCDF records of one dimension of
different lengths) are copied through HDF5 and still left out: their copy
must read the object itself.

Planning reads none of the bytes left out, so long as its scans do not
digest rows (``digest=False``; a small file's digest hashes its rows); the
skeleton made from a mirror equals the full copy's outside the raw chunk
ranges, which the copy overwrites (see ``tests/test_mirror.py``).

The object is untrusted: it is read in place through HDF5 over pinned
ranged reads (a version that changed is refused as a fetch refuses it),
and a chunk that overlaps another stored chunk, lies outside the object or
where HDF5 reads metadata (the superblock, an object header, anything
HDF5 read while listing the file) is refused, naming the object, as is a
mirror that does not list the same chunks again when reopened.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import hdf5plugin  # noqa: F401  (filters registered, as for every scan: plain_chunks asks)
from h5py import h5a, h5d, h5f, h5o, h5s

from chkq.consolidation.checkpoint_files import chunk_index, plain_chunks, walk_objects
from chkq.consolidation.skeleton import dataset_mode
from chkq.errors import BadCheckpointError, CheckpointChangedError, CheckpointCorruptionError
from chkq.rundir import fd_path
from chkq.staging.fetching import FETCH_BYTES, changed_error
from chkq.stores.base import CheckpointStore, ObjectVersion
from chkq.stores.fileobj import ObjectFile

#: Bytes of each ranged read HDF5's listing of an object makes. The chunk index lies in
#: blocks scattered among the chunks (one every 1.5 MB of a gzip file's 26 KB chunks): with
#: reads of 1 MiB, listing a 26 MB gzip object read 19 MB of it, with 64 KiB 1.2 MB, in as
#: many requests (37); an uncompressed 257 MB one 7.7 MB in 25 requests, 1.1 MB in 34.
LIST_BLOCK_BYTES = 64 << 10
#: Bytes of those reads kept (HDF5 reads the same metadata again and again).
LIST_CACHE_BYTES = 16 << 20

__all__ = ["MirrorStats", "mirror_object", "raw_chunk_ranges", "raw_chunk_rows", "sealed_mirror"]


@dataclass(frozen=True)
class MirrorStats:
    """What :func:`mirror_object` wrote.

    Attributes
    ----------
    size
        The object's size (the mirror file has this apparent size).
    fetched
        Bytes actually fetched and written.
    skipped
        Bytes left as holes (raw chunk data).
    sha256
        The SHA-256 of the mirror's bytes fetched, in order, each run after
        its offset and length (the mirror's seal, without reading its holes).
    """

    size: int
    fetched: int
    skipped: int
    sha256: str = ""


#: A stored chunk's extent: file offset, size, and whether the mirror leaves it a hole.
_Extent = tuple[int, int, bool]


def _extents(fid: h5f.FileID, url: str, chunk_rows: Mapping[str, int] | None = None,
             every_raw: bool = False, every_fixed: bool = False
             ) -> tuple[list[_Extent], list[int]]:
    """Every stored chunk of every chunked dataset, and where object headers are.

    A chunk is a hole when its dataset is extensible along its first axis,
    ``raw`` (:func:`~chkq.consolidation.skeleton.dataset_mode`) and of plain
    chunks (:func:`~chkq.consolidation.checkpoint_files.plain_chunks`): the
    rule planning applies to fill ``source_chunks``; with ``chunk_rows``, only
    if the dataset is named there with its chunks' rows (as planning also
    requires of them: the template's). The headers' file
    offsets (the superblock's first) are places no hole may cover; each
    object's attributes are opened too, so that HDF5 reads where they are.
    With ``every_raw``, every chunk of an extensible raw dataset is a hole,
    whatever its shape or rows; with ``every_fixed``, every chunk of an
    extensible dataset of a fixed-size type, filtered or not.
    """
    base = int(fid.get_create_plist().get_userblock())
    headers = [base]
    extents: list[_Extent] = []
    root = h5o.open(fid, b"/")
    for raw, kind in [(b"/", h5o.TYPE_GROUP), *walk_objects(fid, f"checkpoint object {url!r}")]:
        obj = root if raw == b"/" else h5o.open(fid, raw)
        headers.append(base + int(h5o.get_info(obj).addr))
        for number in range(h5a.get_num_attrs(obj)):
            h5a.open(obj, index=number).get_type()
        if kind != h5o.TYPE_DATASET:
            continue
        assert isinstance(obj, h5d.DatasetID)
        dcpl = obj.get_create_plist()
        if dcpl.get_layout() != h5d.CHUNKED:
            continue
        space = obj.get_space()
        shape = tuple(space.shape)
        if not shape:
            continue
        index = chunk_index(obj, dcpl.get_chunk(), shape)
        maxdims = space.get_simple_extent_dims(True)
        name = raw.decode("utf-8", "surrogateescape")
        mode = dataset_mode(obj)
        hole = maxdims[0] == h5s.UNLIMITED and (
            (every_fixed and mode != "whole") or (mode == "raw" and (every_raw or (
                (chunk_rows is None or chunk_rows.get(name) == dcpl.get_chunk()[0])
                and plain_chunks(obj, dcpl, shape, obj.get_type().get_size(), index)
                is not None))))
        for info in index.values():
            if info.byte_offset is None or not info.size:
                continue
            extents.append((int(info.byte_offset), int(info.size), hole))
    return extents, headers


def _check_extents(extents: list[_Extent], headers: list[int], starts: set[int], size: int,
                   url: str) -> list[tuple[int, int]]:
    """The holes (merged, in order) of ``extents``; refuse a chunk that cannot be one.

    Raises
    ------
    CheckpointCorruptionError
        If a chunk lies outside the object, or a hole overlaps another
        stored chunk, an object header or a place HDF5 read metadata from.
    """
    def refuse(what: str) -> CheckpointCorruptionError:
        return CheckpointCorruptionError(
            f"checkpoint object {url!r} is damaged or forged: {what}; no mirror of it is made")

    extents.sort()
    holes: list[tuple[int, int]] = []
    end_all, end_holes = 0, 0
    for offset, length, hole in extents:
        if offset < 0 or offset + length > size:
            raise refuse(f"a chunk at byte {offset} ({length} bytes) lies outside its "
                         f"{size} bytes")
        if (hole and offset < end_all) or (not hole and offset < end_holes):
            raise refuse(f"the chunk at byte {offset} ({length} bytes) overlaps another")
        end_all = max(end_all, offset + length)
        if not hole:
            continue
        end_holes = max(end_holes, offset + length)
        if holes and holes[-1][1] == offset:
            holes[-1] = (holes[-1][0], offset + length)
        else:
            holes.append((offset, offset + length))
    starts_hole = [h[0] for h in holes]
    for point, what in [*((h, "an object header") for h in headers),
                        *((s, "metadata HDF5 reads") for s in sorted(starts))]:
        at = bisect.bisect_right(starts_hole, point) - 1
        if at >= 0 and point < holes[at][1]:
            raise refuse(f"a chunk of rows at bytes {holes[at][0]}-{holes[at][1]} covers "
                         f"{what} (byte {point})")
    return holes


def raw_chunk_ranges(path: str | os.PathLike[str], chunk_rows: Mapping[str, int] | None = None
                     ) -> list[tuple[int, int]]:
    """``(offset, end)`` of the stored raw chunks of a local HDF5 file (merged, in order):
    the ranges :func:`mirror_object` leaves as holes (with the same ``chunk_rows``)."""
    with h5py.File(path, "r") as f:
        extents, _ = _extents(f.id, str(path), chunk_rows)
    return _check_extents(extents, [], set(), os.path.getsize(path), str(path))


def raw_chunk_rows(path: str | os.PathLike[str]) -> dict[str, int]:
    """Rows per chunk of each dataset of a local file (a mirror) whose chunks a mirror leaves
    out: the template's, for :func:`mirror_object`'s ``chunk_rows``."""
    found: dict[str, int] = {}
    with h5py.File(path, "r") as f:
        for raw, kind in walk_objects(f.id, f"checkpoint file {str(path)!r}"):
            if kind != h5o.TYPE_DATASET:
                continue
            dsid = h5d.open(f.id, raw)
            dcpl = dsid.get_create_plist()
            if dcpl.get_layout() != h5d.CHUNKED or not dsid.shape:
                continue
            if (dsid.get_space().get_simple_extent_dims(True)[0] == h5s.UNLIMITED
                    and dataset_mode(dsid) == "raw"
                    and plain_chunks(dsid, dcpl, dsid.shape, dsid.get_type().get_size())
                    is not None):
                found[raw.decode("utf-8", "surrogateescape")] = int(dcpl.get_chunk()[0])
    return found


def _fetch_into(store: CheckpointStore, key: str, pinned: ObjectVersion, url: str, fd: int,
                start: int, stop: int, digest: Any) -> None:
    """Write the pinned bytes ``[start, stop)`` at the same offsets of ``fd``; hash them."""
    digest.update(f"{start}+{stop - start}:".encode())
    offset = start
    while offset < stop:
        want = min(FETCH_BYTES, stop - offset)
        piece = store.get_range_pinned(key, pinned, offset, want)
        if piece is None or len(piece) != want:
            raise changed_error(url)
        digest.update(piece)
        view = memoryview(piece)
        at = offset
        while view:
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written
        offset += want


def _open_error(url: str, exc: BaseException) -> BadCheckpointError:
    return BadCheckpointError(f"cannot read checkpoint object {url!r}: not HDF5 or "
                              f"unreadable ({exc})")


def mirror_object(store: CheckpointStore, key: str, pinned: ObjectVersion, fd: int, *,
                  chunk_rows: Mapping[str, int] | None = None,
                  every_raw: bool = False, every_fixed: bool = False) -> MirrorStats:
    """Write into ``fd`` (an empty file) a sparse copy of the pinned object: all but raw chunks.

    The object is opened in place by HDF5 over pinned ranged reads
    (:meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`), its chunk
    indexes listed, and every byte outside the raw chunks (the module's
    docstring says which) fetched at most
    :data:`~chkq.staging.fetching.FETCH_BYTES` at a time, each at its
    offset; the file is first truncated to the object's size, so the raw
    chunks are holes (zeros, no blocks). The mirror is then reopened and
    must list the same chunks as the object. Memory is bounded by one fetch,
    HDF5's block cache (16 MiB) and the list of chunk extents.

    ``chunk_rows``: the template's rows per chunk of each raw dataset
    (:func:`raw_chunk_rows` of its mirror, made first). Planning copies a
    file's chunks as bytes only when they have the template's rows
    (``source_chunks``); with it, a dataset whose chunks have other rows
    (h5py's automatic chunks, guessed from each file's own shape) keeps its
    bytes, which the copy then reads through HDF5. Without it, every plain
    chunk is left out. Records a file pads (netCDF records of different
    lengths, ``DatasetPlan.padding``) are copied through HDF5 too: those a
    mirror leaves out all the same, and the copy must read from the object.
    ``every_raw``: leave out every chunk of every extensible raw dataset,
    whatever its shape (for a job that copies rows by range from each
    file's own chunk index, never through HDF5). ``every_fixed``: leave out
    every chunk of every extensible dataset of a fixed-size type, filtered
    ones too (a spread job, whose filtered chunks the store copies as they
    are stored, and whose few chunks encoded again are fetched apart:
    :mod:`chkq.consolidation.encoded_parts`).

    Nothing is written before the object's chunks are checked; a failure
    after that leaves part of the mirror in ``fd``, which the caller removes.

    Raises
    ------
    CheckpointChangedError
        If the object is not the pinned version (any more), naming its URL.
    BadCheckpointError
        If HDF5 cannot open or list the object, naming it.
    CheckpointCorruptionError
        If a chunk overlaps another, lies outside the object or over its
        metadata, or the mirror does not list the same chunks (naming it).
    ValueError
        If ``fd`` is not an empty file.
    """
    url = f"{store.url.rstrip('/')}/{key}"
    if os.fstat(fd).st_size:
        raise ValueError(f"the mirror of {url!r} must be written into an empty file")
    source = ObjectFile(store, key, pinned=pinned, changed=changed_error,
                        block_size=LIST_BLOCK_BYTES,
                        cache_blocks=LIST_CACHE_BYTES // LIST_BLOCK_BYTES)
    try:
        try:
            with h5py.File(source, "r") as f:
                extents, headers = _extents(f.id, url, chunk_rows, every_raw, every_fixed)
        except CheckpointChangedError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            if source.failure is not None:
                raise source.failure from None
            raise _open_error(url, exc) from None
        if source.failure is not None:
            raise source.failure
    finally:
        source.close()
    holes = _check_extents(list(extents), headers, source.starts, pinned.size, url)
    os.ftruncate(fd, pinned.size)
    at = 0
    digest = hashlib.sha256()
    for start, stop in [*holes, (pinned.size, pinned.size)]:
        _fetch_into(store, key, pinned, url, fd, at, start, digest)
        at = stop
    if store.get_range_pinned(key, pinned, pinned.size, 1) != b"":
        raise changed_error(url)
    skipped = sum(stop - start for start, stop in holes)
    _check_mirror(fd, extents, url, chunk_rows, every_raw, every_fixed)
    return MirrorStats(pinned.size, pinned.size - skipped, skipped, digest.hexdigest())


def _check_mirror(fd: int, extents: list[_Extent], url: str,
                  chunk_rows: Mapping[str, int] | None, every_raw: bool,
                  every_fixed: bool = False) -> None:
    """Refuse a mirror that does not list the object's chunks (metadata lost in a hole)."""
    try:
        with h5py.File(fd_path(fd), "r", locking=False) as f:
            again, _ = _extents(f.id, url, chunk_rows, every_raw, every_fixed)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptionError(
            f"checkpoint object {url!r} is damaged or forged: its mirror cannot be read "
            f"({exc})") from None
    if sorted(again) != sorted(extents):
        raise CheckpointCorruptionError(
            f"checkpoint object {url!r} is damaged or forged: without its rows it lists "
            "other chunks than with them")


def sealed_mirror(store: CheckpointStore, key: str, pinned: ObjectVersion, fd: int
                  ) -> tuple[int, str]:
    """The mirror a spread job fetches: bytes fetched and its seal.

    Every chunk of an extensible dataset of a fixed-size type is a hole,
    raw or filtered.

    What :func:`chkq.staging.fetching.fetch_objects` takes as ``mirror``.
    """
    stats = mirror_object(store, key, pinned, fd, every_raw=True, every_fixed=True)
    return stats.fetched, stats.sha256
