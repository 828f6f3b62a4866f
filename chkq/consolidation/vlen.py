"""Variable-length rows moved and compared in HDF5's own memory form.

h5py's conversions of variable-length data are not exact for every type
(sequences of big-endian integers come back byte-swapped; blocks of
equal-length sequences cannot be written back; sequences of ``H5T_TIME``
have no numpy type at all). So chkq reads such rows with the dataset's own
type as the memory type into a buffer of HDF5's memory descriptors
(``hvl_t`` for sequences, ``char *`` for strings), writes that buffer to the
output with the same type, and frees what HDF5 allocated with
``H5Treclaim``. Comparison reads the bytes each descriptor points to.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager

import h5py
import numpy as np
from h5py import h5d, h5s, h5t

from chkq.consolidation.h5types import is_variable


def _library() -> ctypes.CDLL:
    """The libhdf5 h5py itself uses (same process-wide state, so ids are valid)."""
    here = os.path.dirname(h5py.__file__)
    found = sorted(glob.glob(os.path.join(here, os.pardir, "h5py.libs", "libhdf5-*.so*")))
    lib = ctypes.CDLL(found[0] if found else "libhdf5.so", mode=ctypes.RTLD_GLOBAL)
    lib.H5Treclaim.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.H5Treclaim.restype = ctypes.c_int
    return lib


_LIB: ctypes.CDLL | None = None
H5P_DEFAULT = 0


def reclaim(tid: h5t.TypeID, space: h5s.SpaceID, buffer: np.ndarray) -> None:
    """Free what HDF5 allocated for the variable-length elements read into ``buffer``."""
    global _LIB  # noqa: PLW0603 - loaded once, on first use
    if _LIB is None:
        _LIB = _library()
    if _LIB.H5Treclaim(tid.id, space.id, H5P_DEFAULT, buffer.ctypes.data) < 0:
        raise RuntimeError("H5Treclaim failed")


@contextmanager
def read_rows(dsid: h5d.DatasetID, start: int, count: int,
              tid: h5t.TypeID | None = None) -> Iterator[np.ndarray]:
    """Rows ``[start, start + count)`` in HDF5's memory form of ``tid``, freed on exit."""
    tid = tid or dsid.get_type()
    shape = (count, *dsid.shape[1:])
    buffer = np.zeros(shape, dtype=f"V{tid.get_size()}")
    mspace = h5s.create_simple(shape)
    if count:
        fspace = dsid.get_space()
        fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
        dsid.read(mspace, fspace, buffer, mtype=tid)
    try:
        yield buffer
    finally:
        if count:
            reclaim(tid, mspace, buffer)


def write_rows(dsid: h5d.DatasetID, start: int, rows: np.ndarray, tid: h5t.TypeID) -> None:
    """Write rows in memory form (as read by :func:`read_rows` with type ``tid``)."""
    if not len(rows):
        return
    shape = rows.shape
    fspace = dsid.get_space()
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    dsid.write(h5s.create_simple(shape), fspace, rows, mtype=tid)


def element_values(rows: np.ndarray, tid: h5t.TypeID) -> list[bytes | None]:
    """What each element of ``rows`` (memory form) holds, as bytes, for comparison.

    Supported: sequences of fixed-size elements and variable-length
    strings; anything else raises TypeError (callers compare it otherwise).
    """
    flat = rows.reshape(-1)
    raw = flat.view(np.uint8).reshape(len(flat), -1)
    if tid.get_class() == h5t.STRING and tid.is_variable_str():
        pointers = raw[:, :8].copy().view(np.uint64).reshape(-1)
        return [None if not p else ctypes.string_at(int(p)) for p in pointers]
    if tid.get_class() == h5t.VLEN and not is_variable(tid.get_super()):
        base = tid.get_super().get_size()
        lengths = raw[:, :8].copy().view(np.uint64).reshape(-1)
        pointers = raw[:, 8:16].copy().view(np.uint64).reshape(-1)
        return [ctypes.string_at(int(p), int(n) * base) if n else b""
                for n, p in zip(lengths, pointers, strict=True)]
    raise TypeError("no byte form for this variable-length type")


def byte_comparable(tid: h5t.TypeID) -> bool:
    """Whether :func:`element_values` can describe elements of ``tid``."""
    if tid.get_class() == h5t.STRING:
        return bool(tid.is_variable_str())
    return tid.get_class() == h5t.VLEN and not is_variable(tid.get_super())
