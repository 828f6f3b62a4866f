"""What the whole-output check compares inside objects: values, attributes, padding rows.

Part of the whole-output check (:mod:`chkq.consolidation.output_check`),
and like it sharing no code with the skeleton or copy steps. Fixed
datasets are compared where data is stored, in slabs bounded by a block
(:func:`compare_values`), as stored chunks where no installed filter
decodes them; attributes one at a time, with their creation order
(:func:`compare_attributes`); rows given to a file's missing records as
the template's fill value (:func:`compare_padding`). Variable-length
values compare as Python values, references by the name of the object
they point to.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5o, h5r, h5s, h5t, h5z

from chkq.consolidation.checkpoint_files import MIN_HOLD_BYTES
from chkq.consolidation.h5types import is_variable

#: Object header flag (version 2 headers): the object tracks its attributes' creation order.
_ATTR_ORDER_TRACKED = 0x04
#: Most variable-length elements read at once (their size in memory is not known ahead).
VALUES_PER_READ = 65536


def compare_padding(name: str, ref_file: h5py.File, out_file: h5py.File,
                    ranges: list[tuple[int, int]], block_bytes: int, found: list[str]) -> None:
    """Rows given to a file's missing records of a dimension: each is the template's fill value.

    The fill value is the one h5py reports for the template's dataset
    (``Dataset.fillvalue``), and the rows are read through h5py's slicing,
    so the check shares nothing with how they were written.
    """
    want, got = ref_file[name], out_file[name]
    if want.dtype.kind == "O":  # variable-length strings: compared as Python values
        for first, count in ranges:
            values = np.asarray(got[first:first + count]).reshape(-1) \
                if first + count <= got.shape[0] else None
            if values is None or any(v != want.fillvalue for v in values):
                found.append(f"dataset {name!r}: rows {first} to {first + count - 1}, "
                             "records its file lacked, are not its fill value")
                return
        return
    fill = np.asarray(want.fillvalue, dtype=want.dtype).tobytes()
    row_elements = int(np.prod(want.shape[1:], dtype=np.int64))
    step = max(1, (block_bytes // 4) // max(1, len(fill) * row_elements))
    for first, count in ranges:
        for lo in range(first, first + count, step):
            hi = min(first + count, lo + step)
            if hi > got.shape[0] or np.asarray(got[lo:hi]).tobytes() != fill * (
                    (hi - lo) * row_elements):
                found.append(f"dataset {name!r}: rows {first} to {first + count - 1}, "
                             "records its file lacked, are not its fill value")
                return


def _decodable(dsid: h5d.DatasetID) -> bool:
    dcpl = dsid.get_create_plist()
    return all(h5z.filter_avail(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters()))


def slabs(shape: tuple[int, ...], element_bytes: int, block_bytes: int,
          start: tuple[int, ...] | None = None, stop: tuple[int, ...] | None = None
          ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Hyperslabs ``(offset, count)`` covering ``[start, stop)`` of ``shape``, each within a block.

    A slab spans whole trailing dimensions as long as they fit in
    ``block_bytes``, else it cuts the first dimension that does not (so an
    element is the smallest slab: one row larger than a block is read in
    parts). ``start`` and ``stop`` default to the whole extent.
    """
    lo = start or (0,) * len(shape)
    hi = stop or shape
    extent = [b - a for a, b in zip(lo, hi, strict=True)]
    if not shape or 0 in extent:
        return
    axis, inner = len(shape) - 1, element_bytes
    while axis > 0 and inner * extent[axis] <= block_bytes:
        inner *= extent[axis]
        axis -= 1
    step = max(1, block_bytes // max(inner, 1))
    outer = [range(lo[i], hi[i]) for i in range(axis)]
    for prefix in itertools.product(*outer):
        for first in range(lo[axis], hi[axis], step):
            count = min(step, hi[axis] - first)
            yield ((*prefix, first, *lo[axis + 1:]),
                   (*(1,) * axis, count, *extent[axis + 1:]))


def _stored_offsets(dsid: h5d.DatasetID) -> list[tuple[int, ...]]:
    """Grid offsets of a chunked dataset's stored chunks, in the chunk index's order."""
    offsets: list[tuple[int, ...]] = []
    dsid.chunk_iter(lambda info: offsets.append(tuple(info.chunk_offset)))
    return offsets


def _regions(expected: h5d.DatasetID, actual: h5d.DatasetID
             ) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | str:
    """Where a fixed dataset's values are stored, as ``(start, stop)`` boxes, on both sides.

    Only stored data is read: a chunk that is not stored (or a contiguous
    dataset never written) reads as the fill value, which the creation
    properties already compared. So the check costs what the file stores,
    whatever extent it declares. A string instead of boxes says how the
    two sides' storage differs.
    """
    shape = expected.shape
    dcpl = expected.get_create_plist()
    if dcpl.get_layout() == h5d.CHUNKED:
        mine, theirs = _stored_offsets(expected), _stored_offsets(actual)
        if sorted(mine) != sorted(theirs):
            return "its stored chunks are not those of the template"
        chunk = dcpl.get_chunk()
        return [(offset, tuple(min(o + c, n) for o, c, n in zip(offset, chunk, shape,
                                                                  strict=True)))
                for offset in mine]
    if expected.get_storage_size() == 0 and actual.get_storage_size() == 0:
        return []
    return [((0,) * len(shape), tuple(shape))]


def compare_values(name: str, expected: h5d.DatasetID, actual: h5d.DatasetID,
                   ref_file: h5py.File, out_file: h5py.File, block_bytes: int,
                   found: list[str]) -> None:
    """Fixed datasets: the same bytes (or values, for variable-length data and references).

    Read in slabs of at most half ``block_bytes`` a side (:func:`slabs`),
    where data is stored only (:func:`_regions`); variable-length values
    at most ``VALUES_PER_READ`` elements at a time.
    """
    tid = expected.get_type()
    if not _decodable(expected):
        _compare_encoded_chunks(name, expected, actual, block_bytes, found)
        return
    shape = expected.shape
    if not shape:
        if is_variable(tid):
            same = _same_values(_values(lambda: _names(ref_file[name][()], ref_file)),
                                _values(lambda: _names(out_file[name][()], out_file)))
        else:
            a, b = (np.empty((), dtype=f"V{tid.get_size()}") for _ in range(2))
            expected.read(h5s.ALL, h5s.ALL, a, mtype=tid)
            actual.read(h5s.ALL, h5s.ALL, b, mtype=tid)
            same = a.tobytes() == b.tobytes()
        if not same:
            found.append(f"dataset {name!r} holds other bytes")
        return
    regions = _regions(expected, actual)
    if isinstance(regions, str):
        found.append(f"dataset {name!r}: {regions}")
        return
    variable = is_variable(tid)
    budget = (min(block_bytes // 2, VALUES_PER_READ * tid.get_size()) if variable
              else max(1, block_bytes // 4))
    for lo, hi in regions:
        for offset, count in slabs(shape, tid.get_size(), budget, lo, hi):
            if variable:
                where = tuple(slice(o, o + c) for o, c in zip(offset, count, strict=True))
                same = _same_values(
                    _values(lambda w=where: _names(ref_file[name][w], ref_file)),  # type: ignore[misc]
                    _values(lambda w=where: _names(out_file[name][w], out_file)))  # type: ignore[misc]
            else:
                same = _slab_bytes(expected, offset, count) == _slab_bytes(actual, offset, count)
            if not same:
                found.append(f"dataset {name!r} holds other values from element {offset} on")
                return


def _slab_bytes(dsid: h5d.DatasetID, offset: tuple[int, ...], count: tuple[int, ...]) -> bytes:
    """The stored bytes (of the file type) of one hyperslab of a dataset."""
    tid = dsid.get_type()
    buf = np.empty(count, dtype=f"V{tid.get_size()}")
    fspace = dsid.get_space()
    fspace.select_hyperslab(offset, count)
    dsid.read(h5s.create_simple(count), fspace, buf, mtype=tid)
    return buf.tobytes()


def _compare_encoded_chunks(name: str, expected: h5d.DatasetID, actual: h5d.DatasetID,
                            block_bytes: int, found: list[str]) -> None:
    """A dataset no installed filter decodes: the same stored chunks, byte for byte."""
    if expected.get_create_plist().get_layout() != h5d.CHUNKED:
        return
    mine, theirs = _stored_offsets(expected), _stored_offsets(actual)
    if sorted(mine) != sorted(theirs):
        found.append(f"dataset {name!r}: its stored chunks differ")
        return
    for offset in mine:
        sizes = (expected.get_chunk_info_by_coord(offset).size,
                 actual.get_chunk_info_by_coord(offset).size)
        if sizes[0] != sizes[1] or sizes[0] > max(block_bytes, MIN_HOLD_BYTES) // 2:
            found.append(f"dataset {name!r}: its stored chunk at {offset} differs or is "
                         f"larger than a task may hold ({sizes[0]} bytes)")
            return
        if expected.read_direct_chunk(offset) != actual.read_direct_chunk(offset):
            found.append(f"dataset {name!r}: its stored chunks differ")
            return


def compare_attributes(name: str, expected: Any, actual: Any, ref_file: h5py.File,
                        out_file: h5py.File, found: list[str]) -> None:
    """Same attribute names, creation order, types, dataspaces and bytes (values for pointers).

    One attribute of each side is held at a time (an object may carry
    many large ones, and HDF5 reads an attribute only whole).
    """
    def names(obj: Any) -> dict[bytes, int]:
        return {h5a.open(obj, index=i).name: i for i in range(h5a.get_num_attrs(obj))}

    def read(obj: Any, index: int, file: h5py.File) -> tuple[Any, ...]:
        attr = h5a.open(obj, index=index)
        tid, space = attr.get_type(), attr.get_space()
        kind = space.get_simple_extent_type()
        dims = space.get_simple_extent_dims() if kind == h5s.SIMPLE else ()
        if kind == h5s.NULL:
            value: Any = None
        elif is_variable(tid):
            value = _values(lambda: _names(_read_attr_values(obj, attr.name, file), file))
        else:
            buf = np.empty(space.shape, dtype=f"V{tid.get_size()}")
            attr.read(buf, mtype=tid)
            value = buf.tobytes()
        cset = h5a.get_info(obj, index=index).cset
        return (tid.encode(), tid.committed(), kind, dims, value, cset)

    a, b = names(expected), names(actual)
    if a.keys() == b.keys():
        order = (_attribute_order(expected, a), _attribute_order(actual, b))
        if (order[0] is None) != (order[1] is None):
            found.append(f"{name!r} {'does not track' if order[1] is None else 'tracks'} the "
                         "creation order of its attributes, unlike in the template")
        elif order[0] != order[1]:
            found.append(f"the attributes of {name!r} are in another creation order: "
                         f"{order[1]}, expected {order[0]}")
    for key in sorted(a.keys() | b.keys()):
        label = key.decode("utf-8", "surrogateescape")
        if key not in b:
            found.append(f"attribute {label!r} of {name!r} is missing")
            continue
        if key not in a:
            found.append(f"unexpected attribute {label!r} on {name!r}")
            continue
        want = read(expected, a[key], ref_file)
        got = read(actual, b[key], out_file)
        if not (want[:4] == got[:4] and want[5] == got[5] and _same_values(want[4], got[4])):
            found.append(f"attribute {label!r} of {name!r} differs")


def _attribute_order(obj: Any, indexes: dict[bytes, int]) -> list[str] | None:
    """Attribute names in creation order, or None if the object does not track that order.

    ``indexes`` maps each name to its index by name. (HDF5 also numbers
    the attributes of an object that tracks no order, by their place in
    its header; no reader lists them by it, so it is not compared.)
    """
    header = h5o.get_info(obj).hdr
    if header.version < 2 or not header.flags & _ATTR_ORDER_TRACKED:
        return None
    corder = {key: h5a.get_info(obj, index=i).corder for key, i in indexes.items()}
    ranked = sorted(indexes, key=corder.__getitem__)
    return [key.decode("utf-8", "surrogateescape") for key in ranked]


def _values(read: Callable[[], Any]) -> Any:
    """``read()``, or a marker of why it failed (a type h5py cannot convert).

    Such values are in the output only as the template's own bytes (the
    output starts as a byte copy of it), so both sides fail alike.
    """
    try:
        return read()
    except (TypeError, ValueError, OSError, RuntimeError, KeyError) as exc:
        return ("unreadable", type(exc).__name__)


def _read_attr_values(obj: Any, attr_name: bytes, file: h5py.File) -> Any:
    return h5py.AttributeManager(_highlevel(obj, file))[attr_name.decode("utf-8",
                                                                         "surrogateescape")]


def _highlevel(obj: Any, file: h5py.File) -> Any:
    if isinstance(obj, h5d.DatasetID):
        return h5py.Dataset(obj)
    if isinstance(obj, h5t.TypeID):
        return h5py.Datatype(obj)
    return h5py.Group(obj)


def _names(value: Any, file: h5py.File) -> Any:
    """A value with references replaced by target names (recursively), bytes otherwise."""
    if isinstance(value, h5py.RegionReference):
        if not value:
            return ("region", "")
        region = h5r.get_region(value, file.id)
        return ("region", file[value].name, region.get_select_bounds(),
                region.get_select_npoints())
    if isinstance(value, h5py.Reference):
        return ("object", file[value].name if value else "")
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O" or value.dtype.fields:
            return [_names(v, file) for v in value.reshape(-1)] + [value.shape]
        return value.tobytes() + str(value.shape).encode()
    if isinstance(value, np.void) and value.dtype.fields:
        return [_names(value[f], file) for f in value.dtype.names or ()]
    if isinstance(value, tuple):
        return [_names(v, file) for v in value]
    if isinstance(value, np.generic):
        return value.tobytes()
    return value


def _same_values(a: Any, b: Any) -> bool:
    return bool(a == b) if not isinstance(a, np.ndarray) else bool(np.array_equal(a, b))
