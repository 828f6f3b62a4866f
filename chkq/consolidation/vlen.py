"""Variable-length rows moved and compared in HDF5's own memory form.

Rows that cannot move as stored heap bytes
(:mod:`chkq.consolidation.heap_collections`) go through HDF5. h5py's
conversions of variable-length data are not exact for every type
(sequences of big-endian integers come back byte-swapped; blocks of
equal-length sequences cannot be written back; sequences of ``H5T_TIME``
have no numpy type at all). So chkq reads such rows with the dataset's own
type as the memory type into a buffer of HDF5's memory descriptors
(``hvl_t`` for sequences, ``char *`` for strings), writes that buffer to
the output with the same type, and frees what HDF5 allocated with
``H5Treclaim``. Comparison reads the bytes each descriptor points to.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5s, h5t

from chkq.consolidation.h5types import hdf5_library, is_variable

H5P_DEFAULT = 0


@functools.cache
def _treclaim() -> Any:
    """``H5Treclaim`` of h5py's HDF5, declared once per process."""
    treclaim = hdf5_library().H5Treclaim
    treclaim.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    treclaim.restype = ctypes.c_int
    return treclaim


def reclaim(tid: h5t.TypeID, space: h5s.SpaceID, buffer: np.ndarray) -> None:
    """Free what HDF5 allocated for the variable-length elements read into ``buffer``."""
    if _treclaim()(tid.id, space.id, H5P_DEFAULT, buffer.ctypes.data) < 0:
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


def is_vlen_string(tid: h5t.TypeID) -> bool:
    """Whether ``tid`` is a variable-length string (netCDF-4's ``string``)."""
    return tid.get_class() == h5t.STRING and bool(tid.is_variable_str())


def string_fill(dsid: h5d.DatasetID) -> bytes:
    """The fill value of a variable-length string dataset: what its unwritten elements read as.

    netCDF-4 reads a ``string`` variable's records past its end as this
    value (its ``_FillValue``, else the empty string).

    Raises
    ------
    ValueError
        If the dataset defines no fill value or it cannot be read.
    """
    dcpl = dsid.get_create_plist()
    if dcpl.fill_value_defined() == h5d.FILL_VALUE_UNDEFINED:
        raise ValueError("it defines no fill value")
    value = np.zeros((1,), dtype=dsid.dtype)
    try:
        dcpl.get_fill_value(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"its fill value cannot be read ({exc})") from None
    item = value[0]
    return item.encode("utf-8", "surrogateescape") if isinstance(item, str) else bytes(item or b"")


def write_string_fill(dsid: h5d.DatasetID, start: int, count: int, fill: bytes) -> None:
    """Write ``count`` rows of the string ``fill`` from row ``start`` of a vlen string dataset.

    The bytes are written as they are (h5py converts ``bytes`` to the
    file's strings without encoding them).
    """
    utf8 = dsid.get_type().get_cset() == h5t.CSET_UTF8
    rows = np.empty((count, *dsid.shape[1:]),
                    dtype=h5py.string_dtype("utf-8" if utf8 else "ascii"))
    rows[...] = fill
    h5py.Dataset(dsid)[start:start + count] = rows


def strings(dsid: h5d.DatasetID, start: int, count: int) -> np.ndarray:
    """Rows ``[start, start + count)`` of a vlen string dataset as ``bytes``, flattened.

    h5py builds each element's bytes in compiled code, many times faster
    than reading them one by one through their descriptors
    (:func:`element_values`); a null string reads as ``b""`` here.
    """
    shape = (count, *dsid.shape[1:])
    out = np.empty(shape, dtype=h5py.string_dtype("ascii"))
    if count:
        fspace = dsid.get_space()
        fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
        dsid.read(h5s.create_simple(shape), fspace, out)
    return out.reshape(-1)


def first_string_difference(a: h5d.DatasetID, a_start: int, b: h5d.DatasetID, b_start: int,
                            count: int) -> int | None:
    """The first element (flat index) where ``count`` rows of two vlen string datasets differ.

    Strings compare by their bytes (:func:`strings`); where both are
    empty, whether each is a null string too (:func:`element_values`
    tells them apart), read again only for blocks holding empty strings.
    None if they are all equal.
    """
    left, right = strings(a, a_start, count), strings(b, b_start, count)
    differ = np.flatnonzero(left != right)
    if differ.size:
        return int(differ[0])
    if not (left == b"").any():
        return None
    tid = a.get_type()
    with read_rows(a, a_start, count, tid) as x, read_rows(b, b_start, count, tid) as y:
        null_x, null_y = _null_strings(x), _null_strings(y)
    differ = np.flatnonzero(null_x != null_y)
    return int(differ[0]) if differ.size else None


def _null_strings(rows: np.ndarray) -> np.ndarray:
    """Which elements of vlen string rows in memory form are null pointers, flattened."""
    flat = rows.reshape(-1)
    raw = flat.view(np.uint8).reshape(len(flat), -1)
    return np.asarray(~raw[:, :8].any(axis=1))
