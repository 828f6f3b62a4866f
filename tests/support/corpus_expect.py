"""An independent model of what a consolidated output must be, and a comparator.

Written from the "Fidelity" section of docs/consolidation.md without importing anything from
chkq: the output is the final checkpoint's first file (the *template*) with
every extensible dataset's rows replaced by the concatenation of the rows of
every source file, in the order given.

Everything is read with h5py's low-level API so that nothing is converted on
the way: attribute and dataset values whose type holds no variable-length
data and no references are read with the *file* type as the memory type and
compared as raw bytes (padding bytes, full-width NULLTERM strings and
big-endian values included). Values with variable-length parts are compared
decoded, and references by the name(s) of the object they point to in their
own file (region references also by their selection).

``compare(output, sources)`` returns the list of differences (empty when the
output is exact); allocation-time differences are reported separately, as
warnings (``CorpusWarning``), by ``compare_full``.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin  # noqa: F401  (registers Blosc, LZ4, Zstd, BZip2... with HDF5)
import numpy as np
from h5py import h5d, h5l, h5o, h5r, h5s, h5t, h5z

from chkq.consolidation.checkpoint_files import chunk_index

CHECKPOINT_DIR = re.compile(r"_chk\d{5}$")
MAX_DIFFS = 200
MAX_VALUE_BYTES = 256 << 20


class CorpusWarning(UserWarning):
    """A difference that the spec tolerates but that is worth reporting (allocation time)."""


@dataclass
class Result:
    differences: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def diff(self, text: str) -> None:
        if len(self.differences) < MAX_DIFFS:
            self.differences.append(text)


# --------------------------------------------------------------------------- #
# Which file is the template
# --------------------------------------------------------------------------- #

def template_of(sources: list[Path]) -> Path:
    """The final checkpoint's first file among ``sources`` (given in consolidation order)."""
    last = sources[-1]
    if CHECKPOINT_DIR.search(last.parent.name):
        return next(p for p in sources if p.parent == last.parent)
    return last


# --------------------------------------------------------------------------- #
# Links and objects
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Link:
    kind: str  # "hard", "soft", "external", "user-defined(N)"
    target: tuple[str, ...] = ()


@dataclass
class Tree:
    """Every link of a file (soft and external links not followed) and its objects."""

    links: dict[str, Link]
    addr: dict[str, int]  # hard-link path -> object address
    names: dict[int, list[str]]  # object address -> every hard-link path to it

    def canonical(self) -> dict[str, int]:
        """One path per object: the first (sorted) of its names."""
        return {sorted(paths)[0]: a for a, paths in self.names.items()}


def _join(prefix: str, name: str) -> str:
    return "/" + name if prefix == "/" else f"{prefix}/{name}"


def walk(f: h5py.File) -> Tree:
    links: dict[str, Link] = {"/": Link("hard")}
    root = h5o.get_info(f.id).addr
    addr: dict[str, int] = {"/": root}
    names: dict[int, list[str]] = defaultdict(list)
    names[root].append("/")
    todo = ["/"]
    visited = {root}
    while todo:
        gpath = todo.pop()
        group = f[gpath]
        member_names: list[bytes] = []
        group.id.links.iterate(lambda n, acc=member_names: acc.append(n))
        for bname in member_names:
            name = bname.decode("utf-8", "surrogateescape")
            path = _join(gpath, name)
            info = group.id.links.get_info(bname)
            if info.type == h5l.TYPE_SOFT:
                links[path] = Link("soft", (group.id.links.get_val(bname).decode(
                    "utf-8", "surrogateescape"),))
                continue
            if info.type == h5l.TYPE_EXTERNAL:
                filename, objpath = group.id.links.get_val(bname)
                links[path] = Link("external", (filename.decode("utf-8", "surrogateescape"),
                                                objpath.decode("utf-8", "surrogateescape")))
                continue
            if info.type != h5l.TYPE_HARD:
                links[path] = Link(f"user-defined({info.type})")
                continue
            links[path] = Link("hard")
            oid = h5o.open(group.id, bname)
            oinfo = h5o.get_info(oid)
            addr[path] = oinfo.addr
            names[oinfo.addr].append(path)
            if oinfo.type == h5o.TYPE_GROUP and oinfo.addr not in visited:
                visited.add(oinfo.addr)
                todo.append(path)
    for paths in names.values():
        paths.sort()
    return Tree(links, addr, dict(names))


# --------------------------------------------------------------------------- #
# Types and values
# --------------------------------------------------------------------------- #

def needs_decoding(t: h5t.TypeID) -> bool:
    """True if values of ``t`` hold variable-length parts or references."""
    cls = t.get_class()
    if cls in (h5t.VLEN, h5t.REFERENCE):
        return True
    if cls == h5t.STRING:
        return bool(t.is_variable_str())
    if cls == h5t.COMPOUND:
        return any(needs_decoding(t.get_member_type(i)) for i in range(t.get_nmembers()))
    if cls == h5t.ARRAY:
        return needs_decoding(t.get_super())
    return False


def type_text(t: h5t.TypeID) -> str:
    """A readable description of a file type, for messages."""
    cls = t.get_class()
    names = {h5t.INTEGER: "int", h5t.FLOAT: "float", h5t.STRING: "string", h5t.COMPOUND:
             "compound", h5t.VLEN: "vlen", h5t.REFERENCE: "reference", h5t.ARRAY: "array",
             h5t.ENUM: "enum", h5t.OPAQUE: "opaque", h5t.BITFIELD: "bitfield",
             h5t.TIME: "time"}
    text = f"{names.get(cls, cls)}{t.get_size()}"
    if cls == h5t.STRING:
        pad = {h5t.STR_NULLTERM: "NULLTERM", h5t.STR_NULLPAD: "NULLPAD",
               h5t.STR_SPACEPAD: "SPACEPAD"}.get(t.get_strpad(), "?")
        text = "vlen-string" if t.is_variable_str() else f"string{t.get_size()}-{pad}"
    if t.committed():
        text += "(committed)"
    return text


def member_layout(t: h5t.TypeID) -> Any:
    """Member names and offsets in stored order, recursively (H5Tequal ignores the order)."""
    cls = t.get_class()
    if cls == h5t.COMPOUND:
        return tuple((t.get_member_name(i), t.get_member_offset(i),
                      member_layout(t.get_member_type(i))) for i in range(t.get_nmembers()))
    if cls in (h5t.ARRAY, h5t.VLEN):
        return (cls, member_layout(t.get_super()))
    return cls


def types_equal(a: h5t.TypeID, b: h5t.TypeID) -> bool:
    try:
        return bool(a == b) and member_layout(a) == member_layout(b)
    except Exception:  # noqa: BLE001  (H5Tequal refuses some pairs: not equal then)
        return False


def _raw_dtype(t: h5t.TypeID) -> np.dtype[Any]:
    return np.dtype(f"V{max(t.get_size(), 1)}")


def space_of(space: h5s.SpaceID) -> tuple[Any, ...]:
    kind = space.get_simple_extent_type()
    if kind == h5s.NULL:
        return ("null",)
    if kind == h5s.SCALAR:
        return ("scalar",)
    return ("simple", space.shape, space.get_simple_extent_dims(maxdims=True))


def _shape(space: h5s.SpaceID) -> tuple[int, ...] | None:
    kind = space.get_simple_extent_type()
    if kind == h5s.NULL:
        return None
    if kind == h5s.SCALAR:
        return ()
    return tuple(space.shape)


def describe_ref(f: h5py.File, tree: Tree, ref: Any) -> Any:
    """The object a reference points to, by its names in its own file (+ region)."""
    if ref is None:
        return "NULL"
    try:
        if not ref:
            return "NULL"
    except Exception:  # noqa: BLE001
        return "NULL"
    try:
        target = f[ref]
    except Exception as e:  # noqa: BLE001
        return f"<unresolvable: {type(e).__name__}>"
    try:
        names = tuple(tree.names.get(h5o.get_info(target.id).addr, [target.name or "?"]))
    except Exception:  # noqa: BLE001
        names = (str(target.name),)
    if isinstance(ref, h5py.RegionReference):
        try:
            space = h5r.get_region(ref, f.id)
            sel = space.get_select_type()
            if sel == h5s.SEL_POINTS:
                detail: Any = ("points", _nested(space.get_select_elem_pointlist()))
            elif sel == h5s.SEL_HYPERSLABS:
                detail = ("blocks", _nested(space.get_select_hyper_blocklist()))
            elif sel == h5s.SEL_ALL:
                detail = ("all",)
            else:
                detail = ("none",)
            return ("region", names, detail)
        except Exception as e:  # noqa: BLE001
            return ("region", names, f"<selection unreadable: {type(e).__name__}>")
    return ("object", names)


def canonical(value: Any, f: h5py.File, tree: Tree) -> Any:
    """A value read by h5py, made comparable across files (references -> names)."""
    if isinstance(value, (h5py.Reference, h5py.RegionReference)):
        return describe_ref(f, tree, value)
    if isinstance(value, np.void) and value.dtype.names:
        return tuple(canonical(value[n], f, tree) for n in value.dtype.names)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.names:
            if value.shape == ():
                return canonical(value[()], f, tree)
            return ("array", value.shape, tuple(canonical(v, f, tree) for v in value.ravel()))
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return (value.dtype.str, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v, f, tree) for v in value)
    if isinstance(value, str):
        return ("str", value)
    return value


def read_attr(f: h5py.File, tree: Tree, obj: Any, name: bytes) -> Any:
    """An attribute's value: raw bytes (read with the file type) or decoded."""
    aid = h5py.h5a.open(obj.id, name)
    t = aid.get_type()
    shape = _shape(aid.get_space())
    if shape is None:
        return ("null-dataspace",)
    if not needs_decoding(t):
        buf = np.empty(shape, dtype=_raw_dtype(t))
        if buf.size:
            aid.read(buf, mtype=t)
        return ("raw", buf.tobytes())
    try:
        value = obj.attrs[name.decode("utf-8", "surrogateescape")]
    except Exception as e:  # noqa: BLE001
        return (f"<unreadable: {type(e).__name__}: {e}>",)
    return ("decoded", canonical(value, f, tree))


def filters_available(dcpl: Any) -> bool:
    return all(h5z.filter_avail(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters()))


def read_dataset(f: h5py.File, tree: Tree, ds: h5py.Dataset) -> Any:
    """A dataset's whole value: raw bytes with the file type, or decoded values."""
    dsid = ds.id
    t = dsid.get_type()
    shape = _shape(dsid.get_space())
    if shape is None:
        return ("null-dataspace",)
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() == h5d.VIRTUAL:
        # Values come from the source files, found relative to the reading file:
        # the mappings (compared with the creation properties) are the content.
        return ("virtual",)
    nbytes = int(np.prod(shape, dtype=np.float64)) * t.get_size()
    if nbytes > MAX_VALUE_BYTES:
        if dsid.get_storage_size() == 0 and dcpl.get_layout() != h5d.VIRTUAL:
            return ("unallocated", shape)
        return (f"<too large to compare: {nbytes} bytes>",)
    if not needs_decoding(t):
        buf = np.empty(shape, dtype=_raw_dtype(t))
        try:
            if buf.size:
                dsid.read(h5s.ALL, h5s.ALL, buf, mtype=t)
        except OSError:
            if filters_available(dcpl):
                raise
            return ("raw-chunks (no filter decodes them)", raw_chunks(ds))
        return ("raw", buf.tobytes())
    try:
        value = ds[()]
    except Exception as e:  # noqa: BLE001
        sequences = _vlen_sequences(dsid, t, shape)
        if sequences is None:
            return (f"<unreadable: {type(e).__name__}: {e}>",)
        return ("decoded", ("array", shape, sequences))
    return ("decoded", canonical(value, f, tree))


def _vlen_sequences(dsid: Any, t: h5t.TypeID, shape: tuple[int, ...]) -> tuple[bytes, ...] | None:
    """Bytes of each sequence of a vlen dataset numpy has no type for (e.g. of H5T_TIME).

    Read in HDF5's memory form (``hvl_t``: length, pointer), with HDF5 itself
    through ctypes, and freed with ``H5Treclaim``.
    """
    if t.get_class() != h5t.VLEN or needs_decoding(t.get_super()):
        return None
    import ctypes
    import glob
    import os

    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs",
                                  "libhdf5-*.so*"))
    lib = ctypes.CDLL(libs[0] if libs else "libhdf5.so")
    buf = np.zeros(shape, dtype="V16")
    if not buf.size:
        return ()
    dsid.read(h5s.ALL, h5s.ALL, buf, mtype=t)
    base = t.get_super().get_size()
    raw = buf.reshape(-1).view(np.uint8).reshape(-1, 16)
    lengths = raw[:, :8].copy().view(np.uint64).reshape(-1)
    pointers = raw[:, 8:].copy().view(np.uint64).reshape(-1)
    found = tuple(ctypes.string_at(int(p), int(n) * base) if n else b""
                  for n, p in zip(lengths, pointers, strict=True))
    lib.H5Treclaim.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.H5Treclaim(t.id, h5s.create_simple(shape).id, 0, buf.ctypes.data)
    return found


def raw_chunks(ds: h5py.Dataset) -> tuple[Any, ...]:
    """Stored chunks as (logical offset, filter mask, bytes): for data no filter decodes."""
    dsid = ds.id
    found = []
    for info in chunk_index(dsid, dsid.get_create_plist().get_chunk(), dsid.shape).values():
        mask, data = dsid.read_direct_chunk(info.chunk_offset)
        found.append((tuple(info.chunk_offset), mask, bytes(data)))
    return tuple(sorted(found))


def rows(f: h5py.File, tree: Tree, ds: h5py.Dataset) -> tuple[str, Any]:
    """The rows of an extensible dataset, as raw bytes or as a list of decoded rows."""
    value = read_dataset(f, tree, ds)
    if value[0] == "raw":
        return "raw", value[1]
    if value[0] == "decoded":
        decoded = value[1]
        if isinstance(decoded, tuple) and decoded and decoded[0] == "array":
            n = ds.shape[0] if ds.shape else 0
            items = decoded[2]
            per = len(items) // n if n else 0
            return "decoded", [items[i * per:(i + 1) * per] for i in range(n)]
        return "decoded", [decoded]
    return str(value[0]), value


# --------------------------------------------------------------------------- #
# Properties
# --------------------------------------------------------------------------- #

def is_extensible(ds: h5py.Dataset) -> bool:
    space = ds.id.get_space()
    if space.get_simple_extent_type() != h5s.SIMPLE:
        return False
    return any(m == h5s.UNLIMITED for m in space.get_simple_extent_dims(maxdims=True))


def _chunk_opts(dcpl: Any) -> int:
    """``H5Pget_chunk_opts`` (h5py does not wrap it), through the library h5py loaded."""
    import ctypes
    import glob
    import os

    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs",
                                  "libhdf5-*.so*"))
    lib = ctypes.CDLL(libs[0] if libs else "libhdf5.so")
    value = ctypes.c_uint(0)
    if lib.H5Pget_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.byref(value)) < 0:
        raise RuntimeError("H5Pget_chunk_opts failed")
    return int(value.value)


def dataset_props(ds: h5py.Dataset) -> dict[str, Any]:
    """Creation properties (allocation time separately, in ``alloc_time``)."""
    dcpl = ds.id.get_create_plist()
    layout = dcpl.get_layout()
    props: dict[str, Any] = {"layout": layout}
    if layout == h5d.CHUNKED:
        props["chunk"] = dcpl.get_chunk()
        props["chunk_opts"] = _chunk_opts(dcpl)
    props["filters"] = [
        (code, flags, tuple(values), name)
        for code, flags, values, name in (dcpl.get_filter(i) for i in range(dcpl.get_nfilters()))
    ]
    props["fill_value_defined"] = dcpl.fill_value_defined()
    props["fill_time"] = dcpl.get_fill_time()
    if dcpl.fill_value_defined() != h5d.FILL_VALUE_UNDEFINED:
        try:
            fill = np.asarray(ds.fillvalue)
            if fill.dtype.hasobject:
                props["fill_value"] = ("object", tuple(_fill_item(v) for v in fill.ravel()))
            else:
                props["fill_value"] = (fill.dtype.str, fill.tobytes())
        except Exception as e:  # noqa: BLE001
            props["fill_value"] = f"<unreadable: {type(e).__name__}>"
    props["external"] = [dcpl.get_external(i) for i in range(dcpl.get_external_count())]
    if layout == h5d.VIRTUAL:
        mappings = []
        for i in range(dcpl.get_virtual_count()):
            vspace = dcpl.get_virtual_vspace(i)
            sspace = dcpl.get_virtual_srcspace(i)
            mappings.append((dcpl.get_virtual_filename(i), dcpl.get_virtual_dsetname(i),
                             _selection(vspace), _selection(sspace)))
        props["virtual"] = mappings
    props["attr_creation_order"] = dcpl.get_attr_creation_order()
    props["attr_phase_change"] = dcpl.get_attr_phase_change()
    return props


def _fill_item(value: Any) -> Any:
    if isinstance(value, (h5py.Reference, h5py.RegionReference)):
        return "ref" if value else "NULL"
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tobytes())
    return repr(value)


def _nested(value: Any) -> Any:
    return _tuples(np.asarray(value).tolist())


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _selection(space: h5s.SpaceID) -> Any:
    sel = space.get_select_type()
    if sel == h5s.SEL_HYPERSLABS:
        try:
            if space.is_regular_hyperslab():
                return ("regular", _nested(space.get_regular_hyperslab()), space.shape)
        except Exception:  # noqa: BLE001
            pass
        return ("blocks", space.get_select_hyper_nblocks(), space.shape)
    return (sel, space.shape)


def group_props(g: h5py.Group) -> dict[str, Any]:
    gcpl = g.id.get_create_plist()
    return {"link_creation_order": gcpl.get_link_creation_order(),
            "attr_creation_order": gcpl.get_attr_creation_order()}


def userblock(path: Path) -> bytes:
    with h5py.File(path, "r") as f:
        size = f.userblock_size
    with open(path, "rb") as fh:
        return fh.read(size)


# --------------------------------------------------------------------------- #
# The comparator
# --------------------------------------------------------------------------- #

def _attr_names(obj: Any) -> list[bytes]:
    found: list[bytes] = []
    h5py.h5a.iterate(obj.id, lambda name, *_: found.append(name))
    return sorted(found)


def _committed_names(tree: Tree, t: h5t.TypeID) -> tuple[str, ...] | None:
    if not t.committed():
        return None
    try:
        return tuple(tree.names.get(h5o.get_info(t).addr, ["<unnamed>"]))
    except Exception:  # noqa: BLE001
        return ("<committed, unidentified>",)


def _compare_attrs(res: Result, path: str, tf: h5py.File, tt: Tree, tobj: Any,
                   of: h5py.File, ot: Tree, oobj: Any) -> None:
    tnames, onames = _attr_names(tobj), _attr_names(oobj)
    for name in sorted(set(tnames) - set(onames)):
        res.diff(f"{path}: attribute {name!r} missing in the output")
    for name in sorted(set(onames) - set(tnames)):
        res.diff(f"{path}: unexpected attribute {name!r} in the output")
    for name in sorted(set(tnames) & set(onames)):
        ta, oa = h5py.h5a.open(tobj.id, name), h5py.h5a.open(oobj.id, name)
        tty, oty = ta.get_type(), oa.get_type()
        if not types_equal(tty, oty):
            res.diff(f"{path}: attribute {name!r} type {type_text(oty)} != template "
                     f"{type_text(tty)}")
            continue
        tc, oc = _committed_names(tt, tty), _committed_names(ot, oty)
        if tc != oc:
            res.diff(f"{path}: attribute {name!r} committed type {oc} != template {tc}")
        if space_of(ta.get_space()) != space_of(oa.get_space()):
            res.diff(f"{path}: attribute {name!r} dataspace {space_of(oa.get_space())} != "
                     f"template {space_of(ta.get_space())}")
            continue
        tv, ov = read_attr(tf, tt, tobj, name), read_attr(of, ot, oobj, name)
        if _unverifiable(ov):
            res.diff(f"{path}: attribute {name!r}: the comparator cannot verify it: {ov[0]}")
        elif tv != ov:
            res.diff(f"{path}: attribute {name!r} value {_short(ov)} != template {_short(tv)}")


def _unverifiable(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and str(value[0]).startswith("<")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _compare_dataset(res: Result, path: str, tf: h5py.File, tt: Tree, tds: h5py.Dataset,
                     of: h5py.File, ot: Tree, ods: h5py.Dataset,
                     sources: list[tuple[h5py.File, Tree]]) -> None:
    tty, oty = tds.id.get_type(), ods.id.get_type()
    if not types_equal(tty, oty):
        res.diff(f"{path}: dtype {type_text(oty)} != template {type_text(tty)}")
        return
    tc, oc = _committed_names(tt, tty), _committed_names(ot, oty)
    if tc != oc:
        res.diff(f"{path}: committed type {oc} != template {tc}")
    tprops, oprops = dataset_props(tds), dataset_props(ods)
    for key in sorted(set(tprops) | set(oprops)):
        if tprops.get(key) != oprops.get(key):
            res.diff(f"{path}: {key} {oprops.get(key)!r} != template {tprops.get(key)!r}")
    talloc = tds.id.get_create_plist().get_alloc_time()
    oalloc = ods.id.get_create_plist().get_alloc_time()
    if talloc != oalloc:
        res.warnings.append(f"{path}: alloc_time {oalloc} != template {talloc}")
    tspace, ospace = space_of(tds.id.get_space()), space_of(ods.id.get_space())
    if not is_extensible(tds):
        if tspace != ospace:
            res.diff(f"{path}: dataspace {ospace} != template {tspace}")
            return
        tv, ov = read_dataset(tf, tt, tds), read_dataset(of, ot, ods)
        if _unverifiable(ov):
            res.diff(f"{path}: the comparator cannot verify this value: {ov[0]}")
        elif tv != ov:
            res.diff(f"{path}: fixed dataset value {_short(ov)} != template {_short(tv)}")
        return
    # Extensible: trailing dims and maxshape from the template, rows concatenated.
    expected_rows = 0
    for sf, _ in sources:
        sds = sf.get(path)
        if isinstance(sds, h5py.Dataset):
            expected_rows += sds.shape[0] if sds.shape else 0
    if tds.maxshape[0] is not None:
        res.diff(f"{path}: axis 0 is bounded ({tds.maxshape}) but the dataset was consolidated")
    expected_space = ("simple", (expected_rows, *tds.shape[1:]), tspace[2])
    if ospace != expected_space:
        res.diff(f"{path}: dataspace {ospace} != expected {expected_space}")
        return
    kind, got = rows(of, ot, ods)
    if kind not in ("raw", "decoded"):
        res.diff(f"{path}: extensible rows cannot be verified: {kind}")
        return
    if kind == "raw":
        parts = []
        for sf, st in sources:
            skind, sv = rows(sf, st, sf[path])
            parts.append(sv if skind == "raw" else b"")
        expected_bytes = b"".join(parts)
        if got != expected_bytes:
            res.diff(f"{path}: rows differ from the concatenation of the sources "
                     f"({_first_difference(got, expected_bytes, tty.get_size(), tds.shape)})")
        return
    expected_list: list[Any] = []
    for sf, st in sources:
        _, sv = rows(sf, st, sf[path])
        expected_list.extend(sv)
    if got != expected_list:
        idx = next((i for i, (a, b) in enumerate(zip(got, expected_list, strict=False))
                    if a != b),
                   min(len(got), len(expected_list)))
        a = got[idx] if idx < len(got) else "<none>"
        b = expected_list[idx] if idx < len(expected_list) else "<none>"
        res.diff(f"{path}: rows differ from the concatenation of the sources at row {idx}: "
                 f"{_short(a)} != expected {_short(b)}")


def _first_difference(got: bytes, expected: bytes, item: int, shape: tuple[int, ...]) -> str:
    row = item * int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else item
    n = min(len(got), len(expected))
    for i in range(n):
        if got[i] != expected[i]:
            r = i // row if row else 0
            return (f"first at byte {i}, row {r}: {got[r * row:(r + 1) * row]!r} != "
                    f"{expected[r * row:(r + 1) * row]!r}")
    return f"lengths {len(got)} != {len(expected)}"


def _objects(tree: Tree) -> Iterator[tuple[str, int]]:
    yield from sorted(tree.canonical().items())


def compare_full(output: Path, sources: list[Path]) -> Result:
    """Every difference between ``output`` and the expectation built from ``sources``."""
    res = Result()
    template = template_of(sources)
    if userblock(template) != userblock(output):
        res.diff(f"userblock {userblock(output)[:16]!r}... ({len(userblock(output))} bytes) != "
                 f"template's ({len(userblock(template))} bytes)")
    with h5py.File(template, "r") as tf, h5py.File(output, "r") as of:
        opened = [h5py.File(p, "r") for p in sources]
        try:
            tt, ot = walk(tf), walk(of)
            trees = [(sf, walk(sf)) for sf in opened]
            _compare_trees(res, tf, tt, of, ot, trees)
        finally:
            for sf in opened:
                sf.close()
    return res


def _compare_trees(res: Result, tf: h5py.File, tt: Tree, of: h5py.File, ot: Tree,
                   sources: list[tuple[h5py.File, Tree]]) -> None:
    for path in sorted(set(tt.links) - set(ot.links)):
        res.diff(f"{path}: {tt.links[path].kind} link missing in the output")
    for path in sorted(set(ot.links) - set(tt.links)):
        res.diff(f"{path}: unexpected {ot.links[path].kind} link in the output")
    for path in sorted(set(tt.links) & set(ot.links)):
        if tt.links[path] != ot.links[path]:
            res.diff(f"{path}: link {ot.links[path]} != template {tt.links[path]}")
    # Aliasing: the partition of hard-link names into objects must be the same.
    tparts = {frozenset(p) for p in tt.names.values()}
    oparts = {frozenset(p) for p in ot.names.values()}
    for part in sorted(tparts - oparts, key=sorted):
        names = sorted(part)
        found = sorted({tuple(ot.names[ot.addr[n]]) for n in names if n in ot.addr})
        res.diff(f"{names[0]}: hard-link names {names} are one object in the template, "
                 f"in the output {found}")
    for part in sorted(oparts - tparts, key=sorted):
        if len(part) > 1 and all(n in tt.addr for n in part):
            res.diff(f"{sorted(part)[0]}: names {sorted(part)} are one object in the output "
                     "but not in the template")
    for path, taddr in _objects(tt):
        if path not in ot.addr:
            continue
        tobj = h5o.get_info(tf[path].id) if path != "/" else h5o.get_info(tf.id)
        oobj_info = h5o.get_info(of[path].id) if path != "/" else h5o.get_info(of.id)
        if tobj.type != oobj_info.type:
            res.diff(f"{path}: object type {oobj_info.type} != template {tobj.type}")
            continue
        tnode, onode = tf[path], of[path]
        _compare_attrs(res, path, tf, tt, tnode, of, ot, onode)
        if isinstance(tnode, h5py.Group):
            if group_props(tnode) != group_props(onode):
                res.diff(f"{path}: group properties {group_props(onode)} != template "
                         f"{group_props(tnode)}")
        elif isinstance(tnode, h5py.Datatype):
            if not types_equal(tnode.id, onode.id):
                res.diff(f"{path}: named datatype {type_text(onode.id)} != template "
                         f"{type_text(tnode.id)}")
        elif isinstance(tnode, h5py.Dataset):
            _compare_dataset(res, path, tf, tt, tnode, of, ot, onode, sources)
        del taddr


def compare(output: Path, sources: list[Path]) -> list[str]:
    """Differences between ``output`` and the expected consolidation of ``sources`` ([] if exact).

    Allocation-time differences are not differences: they are issued as
    ``CorpusWarning`` warnings.
    """
    res = compare_full(output, sources)
    for text in res.warnings:
        warnings.warn(text, CorpusWarning, stacklevel=2)
    return res.differences
