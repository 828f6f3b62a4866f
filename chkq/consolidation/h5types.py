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

import hashlib
import math

import numpy as np
from h5py import h5t

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
