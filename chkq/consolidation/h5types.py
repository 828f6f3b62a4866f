"""HDF5 datatypes as chkq moves them: bytes of the file type, never numpy conversions.

Real files hold types numpy cannot express exactly (``H5T_TIME``, 128-bit
integers and floats, NULLTERM strings whose text fills their size,
compounds with padding bytes or members stored out of order). chkq moves
every fixed-size element as the bytes of its *file* type, read and written
with the file type as the memory type so HDF5 converts nothing, into numpy
buffers of opaque ``V<size>`` elements. Only data that holds pointers in
memory (variable-length strings and sequences, references) goes through
h5py's conversions, and is compared by value.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os

import numpy as np
from h5py import h5d, h5p, h5t

_CLASS_NAMES = {
    h5t.INTEGER: "integer", h5t.FLOAT: "float", h5t.TIME: "time", h5t.STRING: "string",
    h5t.BITFIELD: "bitfield", h5t.OPAQUE: "opaque", h5t.COMPOUND: "compound",
    h5t.REFERENCE: "reference", h5t.ENUM: "enum", h5t.VLEN: "vlen", h5t.ARRAY: "array",
}


def is_variable(tid: h5t.TypeID) -> bool:
    """Whether elements of ``tid`` hold pointers in memory (vlen, vlen string, reference).

    Such elements are not their own bytes: they cannot be copied or
    compared as raw bytes and must go through HDF5's conversions.
    """
    cls = tid.get_class()
    if cls in (h5t.VLEN, h5t.REFERENCE):
        return True
    if cls == h5t.STRING:
        return bool(tid.is_variable_str())
    if cls == h5t.COMPOUND:
        return any(is_variable(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    if cls in (h5t.ARRAY, h5t.ENUM):
        return is_variable(tid.get_super())
    return False


def has_reference(tid: h5t.TypeID) -> bool:
    """Whether ``tid`` holds object or region references anywhere inside it."""
    cls = tid.get_class()
    if cls == h5t.REFERENCE:
        return True
    if cls == h5t.COMPOUND:
        return any(has_reference(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    if cls in (h5t.ARRAY, h5t.VLEN):
        return has_reference(tid.get_super())
    return False


def opaque_dtype(tid: h5t.TypeID) -> np.dtype:
    """A numpy dtype of ``tid``'s element size that numpy will never reinterpret."""
    return np.dtype(f"V{tid.get_size()}")


def describe_type(tid: h5t.TypeID) -> str:
    """A short readable name of an HDF5 type, for error messages."""
    cls = tid.get_class()
    name = _CLASS_NAMES.get(cls, f"class {cls}")
    if cls == h5t.STRING and tid.is_variable_str():
        return "variable-length string"
    return f"{tid.get_size() * 8}-bit {name}"


def type_key(tid: h5t.TypeID) -> str:
    """A string equal for two types exactly when HDF5 encodes them alike.

    The readable part names the type; the digest of ``H5Tencode`` makes two
    types that differ in anything stored (padding, charset, byte order,
    member offsets) compare unequal, which numpy dtypes would not.
    """
    digest = hashlib.sha1(tid.encode()).hexdigest()[:12]
    try:
        readable = str(tid.dtype)
    except (TypeError, ValueError):
        readable = describe_type(tid)
    return f"{readable}#{digest}"


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    """Elements in an array of ``shape`` (1 for a scalar)."""
    return int(math.prod(shape))


#: ``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``: a dataset's edge chunks (those reaching past its
#: extent on some axis) are stored without its filters (``H5Pset_chunk_opts``).
DONT_FILTER_PARTIAL_CHUNKS = 0x2


@functools.cache
def _loaded_hdf5() -> tuple[str, ...]:
    """Paths of the HDF5 libraries loaded in this process (h5py loads its own first)."""
    found: list[str] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            name = os.path.basename(path)
            if name.startswith("libhdf5") and not name.startswith("libhdf5_hl") \
                    and path not in found:
                found.append(path)
    return tuple(found)


#: Chunk dimensions no dataset of chkq's uses: a creation property list h5py sets to them
#: tells h5py's HDF5 library from another copy in the same process.
_PROBE_CHUNK = (7919, 104729)


@functools.cache
def hdf5_library() -> ctypes.CDLL:
    """The HDF5 library h5py runs on, for the calls h5py does not wrap.

    Another copy of HDF5 may be loaded too (netCDF4's, or a filter plugin's), and an
    identifier is only a number that another copy may know as one of its own: h5py's
    library is the one that reads back the chunk dimensions h5py set on a property list.
    """
    loaded = _loaded_hdf5()
    if len(loaded) == 1:
        return ctypes.CDLL(loaded[0])
    probe = h5p.create(h5p.DATASET_CREATE)
    probe.set_chunk(_PROBE_CHUNK)
    for path in loaded:
        library = ctypes.CDLL(path)
        if library.H5Iis_valid(ctypes.c_int64(probe.id)) <= 0:
            continue
        library.H5Eset_auto2(ctypes.c_int64(0), None, None)
        dims = (ctypes.c_uint64 * 2)()
        if library.H5Pget_chunk(ctypes.c_int64(probe.id), 2, dims) == 2 \
                and tuple(dims) == _PROBE_CHUNK:
            return library
    raise RuntimeError("h5py's HDF5 library is not among those loaded in this process")


def chunk_options(dcpl: h5p.PropDCID) -> int:
    """A chunked dataset's chunk options (``H5Pget_chunk_opts``; 0 for other layouts)."""
    if dcpl.get_layout() != h5d.CHUNKED:
        return 0
    options = ctypes.c_uint(0)
    if hdf5_library().H5Pget_chunk_opts(ctypes.c_int64(dcpl.id),
                                               ctypes.byref(options)) < 0:
        raise RuntimeError("H5Pget_chunk_opts failed")
    return int(options.value)


def set_chunk_options(dcpl: h5p.PropDCID, options: int) -> None:
    """Set a chunked creation property list's chunk options (``H5Pset_chunk_opts``)."""
    if hdf5_library().H5Pset_chunk_opts(ctypes.c_int64(dcpl.id),
                                               ctypes.c_uint(options)) < 0:
        raise RuntimeError("H5Pset_chunk_opts failed")


def unfiltered_edges(dcpl: h5p.PropDCID) -> bool:
    """Whether a dataset stores its partial edge chunks without its filters."""
    return dcpl.get_nfilters() > 0 and bool(chunk_options(dcpl) & DONT_FILTER_PARTIAL_CHUNKS)
