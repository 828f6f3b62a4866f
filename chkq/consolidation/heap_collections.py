"""Variable-length rows moved and compared as stored: global heap collections and heap IDs.

Where it can (a dataset chunked without filters, in files of 8-byte
addresses), the merge moves variable-length rows as the files store them:
the global heap collections the rows point into, copied whole, and the
rows' heap IDs with their addresses moved (:class:`HeapWriter`);
verification proves such rows from the stored bytes of both files
(:func:`same_heap_rows`). HDF5 itself moves variable-length data one
element at a time, through its metadata cache. Other variable-length rows
go through HDF5 (:mod:`chkq.consolidation.vlen`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from h5py import h5d, h5f, h5s, h5t

from chkq.consolidation.h5types import hdf5_library
from chkq.consolidation.vlen import byte_comparable, is_vlen_string

#: A stored element of a variable-length type in a file with 8-byte addresses: the
#: sequence's length (bytes of a string), then the global heap ID of its data (the
#: address of the heap collection holding it, the object's index in that collection).
HEAP_ID = np.dtype({"names": ["length", "address", "index"], "formats": ["<u4", "<u8", "<u4"],
                    "offsets": [0, 4, 12], "itemsize": 16})
#: A global heap collection's signature and version, as its first bytes.
COLLECTION_MAGIC = b"GCOL\x01"
#: Bytes of a collection's header: signature, version, reserved, its size (8 bytes).
COLLECTION_HEADER = 16
#: Fewest bytes HDF5 gives a collection (and reads first when it loads one).
COLLECTION_MIN = 4096


def heap_copyable(tid: h5t.TypeID) -> bool:
    """Whether elements of ``tid`` can move as heap IDs and heap bytes (:class:`HeapWriter`).

    Variable-length strings and sequences of fixed-size elements: their
    heap objects hold their bytes and nothing that points elsewhere.
    """
    return byte_comparable(tid)


def _tiles(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Offsets along the trailing axes of each chunk of one row of chunks, row-major."""
    return [tuple(c * t for c, t in zip(coords, chunk[1:], strict=True))
            for coords in np.ndindex(*(-(-s // c) for s, c in zip(shape[1:], chunk[1:],
                                                                 strict=True)))]


def _plain_chunked(dsid: h5d.DatasetID) -> tuple[int, ...] | None:
    """The chunk shape of a chunked dataset without filters, else None."""
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() != h5d.CHUNKED or dcpl.get_nfilters():
        return None
    return tuple(dcpl.get_chunk())


def _eight_byte(fid: h5f.FileID) -> bool:
    """Whether a file's addresses and lengths are 8 bytes (the :data:`HEAP_ID` layout)."""
    return tuple(fid.get_create_plist().get_sizes()) == (8, 8)


def stored_ids(dsid: h5d.DatasetID, start: int, count: int) -> np.ndarray | None:
    """Heap IDs of rows ``[start, start + count)`` as the file stores them, or None.

    Read from the dataset's stored chunks (``read_direct_chunk``): None
    if it is not chunked without filters, or a chunk of those rows is not
    stored (its rows read as the fill value) or is not a chunk of heap IDs.
    """
    chunk = _plain_chunked(dsid)
    shape = dsid.shape
    if chunk is None or start + count > shape[0]:
        return None
    out = np.empty((count, *shape[1:]), dtype=HEAP_ID)
    chunk_bytes = math.prod(chunk) * HEAP_ID.itemsize
    tiles = _tiles(shape, chunk)
    per = chunk[0]
    for k in range(start // per, -(-(start + count) // per)):
        first = k * per
        lo, hi = max(start, first), min(start + count, first + per)
        for where in tiles:
            try:
                mask, data = dsid.read_direct_chunk((first, *where))
            except (OSError, RuntimeError, ValueError, KeyError):
                return None
            if mask or len(data) != chunk_bytes:
                return None
            block = np.frombuffer(data, dtype=HEAP_ID).reshape(chunk)
            ends = [min(w + c, s) for w, c, s in zip(where, chunk[1:], shape[1:], strict=True)]
            out[(slice(lo - start, hi - start),
                 *(slice(w, e) for w, e in zip(where, ends, strict=True)))] = \
                block[(slice(lo - first, hi - first),
                       *(slice(0, e - w) for w, e in zip(where, ends, strict=True)))]
    return out


def collections(fid: h5f.FileID, fd: int, ids: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """The addresses and sizes of the heap collections ``ids`` point into, sorted, or None.

    Each is read from its header in the file HDF5 reads as ``fid``, open
    as ``fd``: None unless every one has a collection's signature and
    version, at least :data:`COLLECTION_MIN` bytes (a multiple of 8), lies
    inside the space HDF5 holds allocated (:func:`allocated_end`) and the
    file, and overlaps no other. What the objects inside hold is HDF5's to
    read: the rows are verified through HDF5, or by :func:`same_heap_rows`.
    """
    addresses = ids["address"].reshape(-1)
    addresses = np.unique(addresses[addresses != 0])
    sizes = np.empty_like(addresses)
    base = fid.get_create_plist().get_userblock()
    end = min(os.fstat(fd).st_size - base, allocated_end(fid))
    for i, address in enumerate(addresses.tolist()):
        head = os.pread(fd, COLLECTION_HEADER, base + address)
        if len(head) != COLLECTION_HEADER or not head.startswith(COLLECTION_MAGIC):
            return None
        size = int.from_bytes(head[8:16], "little")
        if size < COLLECTION_MIN or size % 8 or address + size > end:
            return None
        sizes[i] = size
    if len(addresses) > 1 and bool(np.any(addresses[:-1] + sizes[:-1] > addresses[1:])):
        return None
    return addresses, sizes


@functools.cache
def _get_eoa() -> Any:
    """``H5Fget_eoa`` of h5py's HDF5, declared once per process."""
    get_eoa = hdf5_library().H5Fget_eoa
    get_eoa.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]
    get_eoa.restype = ctypes.c_int
    return get_eoa


def allocated_end(fid: h5f.FileID) -> int:
    """The end of the space HDF5 holds allocated in an open file (its EOA, a relative address).

    HDF5 reads nothing past it: a heap collection that does not end before
    it cannot be read.
    """
    eoa = ctypes.c_uint64()
    if _get_eoa()(fid.id, ctypes.byref(eoa)) < 0:
        raise RuntimeError("HDF5 could not tell the end of a file's allocated space")
    return int(eoa.value)


def heap_rows(fid: h5f.FileID, dsid: h5d.DatasetID, fd: int, first: int, count: int,
              limit: int) -> int:
    """How many rows from ``first`` (at most ``count``, at least one) to move at once.

    Halved until the heap collections they point to hold at most ``limit``
    bytes, for rows stored as plain heap IDs (:func:`stored_ids`); ``count``
    for any other.
    """
    while count > 1:
        ids = stored_ids(dsid, first, count)
        found = None if ids is None else collections(fid, fd, ids)
        if found is None or int(found[1].sum()) <= limit:
            break
        count //= 2
    return count


def relocated(ids: np.ndarray, addresses: np.ndarray, moved_to: np.ndarray) -> np.ndarray:
    """``ids`` with each collection address ``addresses[i]`` replaced by ``moved_to[i]``."""
    out = ids.copy()
    flat = out.reshape(-1)
    where = flat["address"] != 0
    flat["address"][where] = moved_to[np.searchsorted(addresses, flat["address"][where])]
    return out


class HeapWriter:
    """Writes rows of one variable-length dataset of the output as heap IDs and heap bytes.

    HDF5 writes variable-length data one element at a time (a heap
    insertion through the metadata cache per string, which holds every
    collection until the file is closed), and reads it back the same way:
    moving a run's strings through HDF5 took most of its consolidation. A
    source's strings already sit in heap collections, whose objects hold
    their bytes and point nowhere else. So the collections a block of rows
    points to are copied whole, in the kernel, into the output, and the
    rows' heap IDs, their addresses moved, are written as the output's
    chunks (``write_direct_chunk``).

    The space is HDF5's own: one placeholder object, as large as the
    collections to copy, written to the block's first row, makes HDF5
    allocate a collection of exactly that size (:meth:`move_rows`); once
    the file is closed and HDF5 has written it, the copied collections
    replace it, byte for byte (:meth:`HeapPatch.apply`). The template's
    rows keep their IDs: its collections are in the output already, where
    the skeleton copied them (checked byte for byte). What the rows then
    read as is checked through HDF5 by the row verification, against the
    sources read through HDF5.

    For an output dataset chunked without filters in a file of 8-byte
    addresses (:meth:`for_output`); rows that cannot move so go through
    HDF5, cleared first (:meth:`clear`), so that HDF5 frees no heap object
    when it overwrites them.
    """

    def __init__(self, dsid: h5d.DatasetID, chunk: tuple[int, ...], base: int,
                 read: Callable[[int, int], bytes]) -> None:
        self.dsid, self.chunk, self.base, self.read = dsid, chunk, base, read
        self.shape = tuple(dsid.shape)
        self.tiles = _tiles(self.shape, chunk)

    @classmethod
    def for_output(cls, fid: h5f.FileID, dsid: h5d.DatasetID,
                   read: Callable[[int, int], bytes]) -> HeapWriter | None:
        """A writer for output dataset ``dsid`` of the open file ``fid``, or None.

        ``read(offset, count)`` reads the output's bytes as they stand.
        """
        chunk = _plain_chunked(dsid)
        if chunk is None or not heap_copyable(dsid.get_type()) or not _eight_byte(fid):
            return None
        return cls(dsid, chunk, fid.get_create_plist().get_userblock(), read)

    def clear(self, start: int, count: int) -> None:
        """Make output rows ``[start, start + count)`` null (heap IDs of zeros)."""
        if count:
            self.write_ids(start, np.zeros((count, *self.shape[1:]), dtype=HEAP_ID))

    def move_rows(self, fid: h5f.FileID, source: h5d.DatasetID, fd: int, first: int,
                  count: int, start: int, placed: dict[int, int],
                  in_place: bool = False) -> HeapPatch | None:
        """Write source rows ``[first, first + count)`` as output rows ``start...``.

        ``fd`` is the source file open (the file HDF5 reads as ``fid``,
        which holds ``source``). Returns what to copy into the output once
        HDF5 has closed it, or None, writing nothing, if the rows are not
        all stored as plain heap IDs of the output's type
        (:func:`stored_ids`, :func:`collections`). ``placed`` maps the
        source's collections already copied (by this piece of the merge,
        for other rows or datasets of the file) to their output addresses;
        the ones this call copies are added once its patch is applied
        (:meth:`HeapPatch.apply`), so that a collection several blocks or
        datasets point into is copied once. With ``in_place`` (the
        template), collections found unchanged at their addresses in the
        output are kept there.
        """
        tid = self.dsid.get_type()
        if not (_eight_byte(fid) and source.get_type().equal(tid)):
            return None
        ids = stored_ids(source, first, count)
        found = None if ids is None else collections(fid, fd, ids)
        if ids is None or found is None:
            return None
        base = fid.get_create_plist().get_userblock()
        addresses, sizes = found
        if in_place and base == self.base and self._unchanged(fd, base, addresses, sizes):
            self.write_ids(start, ids)
            return HeapPatch(fd, [], 0, 0, 0)
        known = np.array([a in placed for a in addresses.tolist()], dtype=bool)
        moved_to = np.array([placed.get(a, 0) for a in addresses.tolist()], dtype=np.uint64)
        new, new_sizes = addresses[~known], sizes[~known]
        if not len(new):
            self.write_ids(start, relocated(ids, addresses, moved_to))
            return HeapPatch(fd, [], 0, 0, 0)
        used = int(new_sizes.sum())
        unit = 1 if is_vlen_string(tid) else tid.get_super().get_size()
        data = -(-(used - 2 * COLLECTION_HEADER) // unit) * unit
        self.clear(start, 1)
        address = self._placeholder(start, data // unit)
        if address is None:
            return None
        new_to = (address + np.concatenate(([0], np.cumsum(new_sizes)[:-1]))).astype(np.uint64)
        moved_to[~known] = new_to
        self.write_ids(start, relocated(ids, addresses, moved_to))
        runs = [(base + int(new[lo]), self.base + int(new_to[lo]),
                 int(new[hi - 1] + new_sizes[hi - 1] - new[lo]))
                for lo, hi in _runs(new, new_sizes)]
        return HeapPatch(fd, runs, self.base + address, used, data,
                         dict(zip(new.tolist(), new_to.tolist(), strict=True)))

    def _placeholder(self, row: int, length: int) -> int | None:
        """Write one element of ``length`` characters (or base elements) at ``row``; its address.

        The address of the new collection HDF5 made for it, as a heap ID
        holds it; None if HDF5 put it into a collection it already had.
        """
        tid = self.dsid.get_type()
        string = is_vlen_string(tid)
        unit = 1 if string else tid.get_super().get_size()
        body = _blank(length * unit)
        element = np.zeros(1, dtype=f"V{tid.get_size()}")
        raw = element.view(np.uint8)
        pointer = np.frombuffer(body.ctypes.data.to_bytes(8, "little"), np.uint8)
        if string:
            raw[:8] = pointer
        else:
            raw[:8] = np.frombuffer(length.to_bytes(8, "little"), np.uint8)
            raw[8:16] = pointer
        fspace = self.dsid.get_space()
        fspace.select_hyperslab((row,) + (0,) * (len(self.shape) - 1),
                                (1,) * len(self.shape))
        self.dsid.write(h5s.create_simple((1,)), fspace, element, mtype=tid)
        placed = stored_ids(self.dsid, row, 1)
        if placed is None:
            return None
        heap_id = placed.reshape(-1)[0]
        if int(heap_id["index"]) != 1 or int(heap_id["length"]) != length:
            return None
        return int(heap_id["address"])

    def _unchanged(self, fd: int, base: int, addresses: np.ndarray, sizes: np.ndarray) -> bool:
        """Whether the output holds the source's collections, byte for byte, at their addresses."""
        for lo, hi in _runs(addresses, sizes):
            offset = base + int(addresses[lo])
            length = int(addresses[hi - 1] + sizes[hi - 1] - addresses[lo])
            for at in range(0, length, READ_PIECE):
                n = min(READ_PIECE, length - at)
                if os.pread(fd, n, offset + at) != self.read(offset + at, n):
                    return False
        return True

    def write_ids(self, start: int, ids: np.ndarray) -> None:
        """Store ``ids`` as output rows ``[start, start + len(ids))``, chunk by chunk.

        A chunk the rows cover only in part is read back and patched (rows
        past the dataset's extent are zeros).
        """
        per, stop, total = self.chunk[0], start + len(ids), self.shape[0]
        chunk_bytes = math.prod(self.chunk) * HEAP_ID.itemsize
        for k in range(start // per, -(-stop // per)):
            first = k * per
            lo, hi = max(start, first), min(stop, first + per)
            whole = lo == first and hi >= min(first + per, total)
            for where in self.tiles:
                block = np.zeros(self.chunk, dtype=HEAP_ID)
                if not whole:
                    try:
                        mask, data = self.dsid.read_direct_chunk((first, *where))
                    except (OSError, RuntimeError, ValueError, KeyError):
                        mask, data = 0, b""
                    if not mask and len(data) == chunk_bytes:
                        block[...] = np.frombuffer(data, dtype=HEAP_ID).reshape(self.chunk)
                        block[max(0, total - first):] = np.zeros((), dtype=HEAP_ID)
                ends = [min(w + c, s) for w, c, s in zip(where, self.chunk[1:], self.shape[1:],
                                                         strict=True)]
                block[(slice(lo - first, hi - first),
                       *(slice(0, e - w) for w, e in zip(where, ends, strict=True)))] = \
                    ids[(slice(lo - start, hi - start),
                         *(slice(w, e) for w, e in zip(where, ends, strict=True)))]
                self.dsid.write_direct_chunk((first, *where), block.tobytes())


@dataclass(frozen=True)
class HeapPatch:
    """Source collections to copy over a placeholder collection of the output (file offsets).

    ``runs`` holds ``(source offset, output offset, bytes)``; the
    placeholder at ``address`` has a header, one object of ``data`` bytes
    and room for the ``used`` bytes copied (the rest, if any, is zeroed);
    ``copied`` maps the collections copied, by source address, to their
    output addresses (relative to each file's superblock).
    """

    fd: int
    runs: list[tuple[int, int, int]]
    address: int
    used: int
    data: int
    copied: dict[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes of the placeholder collection: its header, its object's, the object padded."""
        return self.data + (-self.data % 8) + 2 * COLLECTION_HEADER

    def apply(self, head: Callable[[int, int], bytes],
              copy: Callable[[int, int, int, int], None],
              write: Callable[[int, bytes], None]) -> None:
        """Copy the collections in, once HDF5 closed the output (and wrote the placeholder).

        ``head(offset, count)`` gives the first bytes HDF5 wrote at
        ``offset``, ``copy(fd, offset_in, offset, count)`` copies a source's
        bytes into the output and ``write(offset, data)`` writes bytes.

        Raises
        ------
        RuntimeError
            If the placeholder is not the collection HDF5 was to make.
        """
        if not self.runs:
            return
        placed = head(self.address, 2 * COLLECTION_HEADER)
        if (placed[:5] != COLLECTION_MAGIC or int.from_bytes(placed[8:16], "little") != self.size
                or int.from_bytes(placed[16:18], "little") != 1
                or int.from_bytes(placed[24:32], "little") != self.data):
            raise RuntimeError("HDF5 did not make the heap collection chkq asked for")
        for offset_in, offset, count in self.runs:
            copy(self.fd, offset_in, offset, count)
        if self.size > self.used:
            write(self.address + self.used, bytes(self.size - self.used))


def _blank(size: int) -> np.ndarray:
    """``size`` spaces and a NUL: a placeholder's bytes (a C string of that length)."""
    body = np.full(size + 1, 0x20, dtype=np.uint8)
    body[size] = 0
    return body


#: Bytes compared at a time when checking that the template's collections are in the output.
READ_PIECE = 8 * 1024 * 1024


def _runs(addresses: np.ndarray, sizes: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` index ranges of collections that lie end to end in the file."""
    lo = 0
    for i in range(1, len(addresses) + 1):
        if i == len(addresses) or addresses[i - 1] + sizes[i - 1] != addresses[i]:
            yield lo, i
            lo = i


def same_heap_rows(source_fid: h5f.FileID, source: h5d.DatasetID, source_fd: int, first: int,
                   output_fid: h5f.FileID, output: h5d.DatasetID, output_fd: int, start: int,
                   count: int) -> bool:
    """Whether output rows ``[start, start + count)`` hold source rows ``[first, ...)`` as stored.

    The proof that rows moved as heap IDs and heap bytes
    (:class:`HeapWriter`) read the same in both files, without reading
    each element through HDF5: the datasets have the same type, both
    files 8-byte addresses and lengths; each element's stored heap ID has
    the same length and object index in both, and a null address in one
    where the other has; and each collection an output element points to
    holds, byte for byte, the collection its source element points to.
    HDF5 reads an element from its heap ID and that collection's bytes
    alone. False where any of it does not hold (rows moved through HDF5,
    or changed): the caller then compares the rows through HDF5.
    """
    if not (heap_copyable(output.get_type()) and source.get_type().equal(output.get_type())
            and _eight_byte(source_fid) and _eight_byte(output_fid)):
        return False
    a, b = stored_ids(source, first, count), stored_ids(output, start, count)
    if a is None or b is None:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    null = a["address"] == 0
    if not (np.array_equal(a["length"], b["length"]) and np.array_equal(a["index"], b["index"])
            and np.array_equal(null, b["address"] == 0)):
        return False
    found = collections(source_fid, source_fd, a)
    if found is None:
        return False
    addresses, sizes = found
    there, here = a["address"][~null], b["address"][~null]
    order = np.lexsort((here, there))
    there, here = there[order], here[order]
    new = np.ones(len(there), dtype=bool)
    new[1:] = (there[1:] != there[:-1]) | (here[1:] != here[:-1])
    pairs = np.stack([there[new], here[new]], axis=1)
    size_of = dict(zip(addresses.tolist(), sizes.tolist(), strict=True))
    output_end = allocated_end(output_fid)
    source_base = source_fid.get_create_plist().get_userblock()
    output_base = output_fid.get_create_plist().get_userblock()
    for there, here in pairs.tolist():
        size = size_of[there]
        if here + size > output_end:
            return False
        for at in range(0, size, READ_PIECE):
            n = min(READ_PIECE, size - at)
            if os.pread(source_fd, n, source_base + there + at) != \
                    os.pread(output_fd, n, output_base + here + at):
                return False
    return True
