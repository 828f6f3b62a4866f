"""Reading rows of HDF5 datasets in bounded blocks with little per-call overhead.

h5py's slicing builds a selection per call, which dominates when a run has
thousands of small files; these helpers reuse the dataset's dataspace.
The fast paths below avoid h5py's high-level layer, Python-level byte
comparison and user-space copies, which profiling showed to dominate
(``memoryview ==`` alone took two thirds of a verify task).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable, Iterator
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5s

from chkq.errors import FileChangedError


def block_rows(row_bytes: int, block_bytes: int) -> int:
    """Rows per block so that one block holds at most ``block_bytes`` (at least one row)."""
    return max(1, block_bytes // max(row_bytes, 1))


def read_rows(dataset: h5py.Dataset, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``dataset`` as a new C-contiguous array."""
    shape = (stop - start, *dataset.shape[1:])
    out = np.empty(shape, dtype=dataset.dtype)
    if out.size == 0:
        return out
    if dataset.dtype.hasobject:
        return np.asarray(dataset[start:stop])
    fspace = dataset.id.get_space()
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    mspace = h5s.create_simple(shape)
    dataset.id.read(mspace, fspace, out)
    return out


def iter_blocks(
    dataset: h5py.Dataset, start: int, stop: int, rows_per_block: int
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first_row, rows)`` blocks covering ``[start, stop)`` of ``dataset``."""
    for first in range(start, stop, rows_per_block):
        yield first, read_rows(dataset, first, min(stop, first + rows_per_block))


def digest_rows(digest: Any, name: str, count: int, blocks: Iterable[np.ndarray]) -> None:
    """Add one dataset's ``count`` rows of one file, in ``blocks``, to that file's digest.

    ``digest`` is a ``hashlib`` object. The dataset's name and row count go
    in first, so that rows cannot shift from one dataset to the next unnoticed.
    """
    digest.update(f"{name}\0{count}\0".encode("utf-8", "surrogateescape"))
    for rows in blocks:
        digest.update(as_bytes(rows))


def as_bytes(rows: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array, for ``os.pwrite`` and comparison."""
    flat = np.ascontiguousarray(rows).reshape(-1)
    return flat.view(np.uint8).data


# --------------------------------------------------------------------------- low-level fast paths

_libc = ctypes.CDLL(None, use_errno=True)
_memcmp = _libc.memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
SYNC_FILE_RANGE_WRITE = 2
COPY_PIECE = 8 * 1024 * 1024


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two C-contiguous arrays hold the same bytes (one ``memcmp``, no copy).

    ``memoryview`` equality compares item by item (far below memory speed) and
    ``np.array_equal`` allocates a boolean array as large as the input;
    ``memcmp`` runs at memory speed and allocates nothing.
    """
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes == 0:
        return True
    if not (a.flags.c_contiguous and b.flags.c_contiguous):
        return as_bytes(a) == as_bytes(b)
    return _memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0


def read_into(dsid: h5d.DatasetID, start: int, out: np.ndarray) -> None:
    """Read rows ``[start, start + len(out))`` of ``dsid`` into ``out``, bytes unconverted.

    The memory type is the dataset's own file type, so HDF5 converts
    nothing (a NULLTERM string column is not re-padded) and the bytes read
    are the stored bytes. One selection and one H5Dread per call, without
    the high-level wrapper's per-call cost.
    """
    if out.size == 0:
        return
    shape = out.shape
    fspace = dsid.get_space()
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    mspace = h5s.create_simple(shape)
    dsid.read(mspace, fspace, out, mtype=dsid.get_type())


def fill_element(dsid: h5d.DatasetID) -> bytes:
    """The bytes (of the file type) of a dataset's fill value, the value of rows never written.

    Raises
    ------
    ValueError
        If the dataset defines no fill value, or its type has no fixed-size
        form of it that numpy holds byte for byte.
    """
    dcpl = dsid.get_create_plist()
    if dcpl.fill_value_defined() == h5d.FILL_VALUE_UNDEFINED:
        raise ValueError("it defines no fill value")
    size = dsid.get_type().get_size()
    try:
        value = np.zeros((), dtype=dsid.dtype)
        dcpl.get_fill_value(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"its fill value cannot be read ({exc})") from None
    raw = value.tobytes()
    if value.dtype.hasobject or len(raw) != size:
        raise ValueError("its type has no fixed-size fill value")
    return raw


def read_padded(dsid: h5d.DatasetID, start: int, out: np.ndarray, provides: int) -> None:
    """:func:`read_into` for a source file that provides ``provides`` rows to the output.

    A file may provide more rows of a dataset than it stores: the records
    of a dimension its longest dataset has and this one lacks, which read
    as its fill value (:func:`fill_element`). Rows at or past its extent
    are that value; any other read is :func:`read_into`'s.
    """
    stored = dsid.shape[0]
    end = start + len(out)
    if end <= stored or provides <= stored or end > provides:
        read_into(dsid, start, out)
        return
    inside = max(0, stored - start)
    read_into(dsid, start, out[:inside])
    out[inside:] = np.frombuffer(fill_element(dsid), dtype=out.dtype)[0]


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without waiting.

    The final fsync then finds most pages already on their way to the disk,
    instead of issuing the whole output's I/O at once after every copy.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


class ByteCopier:
    """Copies byte ranges between files in the kernel (``copy_file_range``), else by pread/pwrite.

    No row passes through user memory on the fast path, so a copy task's
    memory does not grow with the data; the fallback moves pieces of at
    most ``COPY_PIECE`` bytes.
    """

    def __init__(self) -> None:
        self.kernel = hasattr(os, "copy_file_range")
        self._buffer: bytearray | None = None

    def copy(self, fd_in: int, offset_in: int, fd_out: int, offset_out: int, count: int) -> None:
        """Copy ``count`` bytes from ``fd_in`` at ``offset_in`` to ``fd_out`` at ``offset_out``."""
        while count > 0 and self.kernel:
            try:
                done = os.copy_file_range(fd_in, fd_out, count, offset_in, offset_out)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                     errno.EPERM):
                    raise
                self.kernel = False
                break
            if done <= 0:
                raise FileChangedError(errno.EIO, f"short copy: source ended at offset {offset_in}")
            offset_in, offset_out, count = offset_in + done, offset_out + done, count - done
        if count > 0:
            self._copy_user(fd_in, offset_in, fd_out, offset_out, count)

    def _copy_user(self, fd_in: int, offset_in: int, fd_out: int, offset_out: int,
                   count: int) -> None:
        if self._buffer is None:
            self._buffer = bytearray(COPY_PIECE)
        view = memoryview(self._buffer)
        while count > 0:
            got = os.preadv(fd_in, [view[:min(count, COPY_PIECE)]], offset_in)
            if got <= 0:
                raise FileChangedError(errno.EIO, f"short read: source ended at offset {offset_in}")
            piece = view[:got]
            while piece:
                written = os.pwrite(fd_out, piece, offset_out)
                piece, offset_out = piece[written:], offset_out + written
            offset_in, count = offset_in + got, count - got
