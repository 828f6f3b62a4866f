"""Checking the whole output against its template, independently of how it was written.

Row verification (``chkq.verify_rows``) proves the rows of extensible
datasets. This module proves everything else before the output is linked:
the output must equal the template (the final checkpoint's first file) in
every link (hard, soft, external; which names share one object), object
kind, committed datatype, attribute (name, type, dataspace, bytes), dataset
type, dataspace, creation properties and, for fixed datasets, values;
extensible datasets must have the planned row count; the userblock must
match. References compare by the name of the object they point to.

The walk uses HDF5's link and object APIs directly and shares no code with
the skeleton or copy steps, so a bug there cannot hide itself here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5f, h5g, h5l, h5o, h5r, h5s, h5t, h5z

from chkq.errors import OutputMismatchError
from chkq.h5types import is_variable
from chkq.plan import Plan
from chkq.rundir import READ
from chkq.stamps import check_descriptor, check_same, open_unchanged
from chkq.structure import open_checkpoint_id

MAX_LISTED = 5
BLOCK_BYTES = 32 * 1024 * 1024


@dataclass
class FileModel:
    """Links and objects of one file, as seen through HDF5."""

    links: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    objects: dict[str, tuple[int, int]] = field(default_factory=dict)

    def aliases(self) -> set[frozenset[str]]:
        """Hard-linked names grouped by the object they name."""
        groups: dict[tuple[int, int], set[str]] = {}
        for name, identity in self.objects.items():
            groups.setdefault(identity, set()).add(name)
        return {frozenset(names) for names in groups.values()}


def _walk(fid: h5f.FileID) -> FileModel:
    """Every link reachable from the root (each group entered once) and its target."""
    model = FileModel()
    seen: set[tuple[int, int]] = set()

    def enter(path: str) -> None:
        group = h5g.open(fid, path.encode() if path else b"/")
        names: list[bytes] = []
        group.links.iterate(lambda n: names.append(n))
        for raw in names:
            full = f"{path}/{raw.decode('utf-8', 'surrogateescape')}"
            info = group.links.get_info(raw)
            if info.type == h5l.TYPE_SOFT:
                model.links[full] = ("soft", group.links.get_val(raw))
            elif info.type == h5l.TYPE_EXTERNAL:
                model.links[full] = ("external", group.links.get_val(raw))
            elif info.type == h5l.TYPE_HARD:
                obj = h5o.open(group, raw)
                oinfo = h5o.get_info(obj)
                identity = (oinfo.fileno, _token(oinfo))
                model.links[full] = ("hard", oinfo.type, info.cset)
                model.objects[full] = identity
                if oinfo.type == h5o.TYPE_GROUP and identity not in seen:
                    seen.add(identity)
                    enter(full)
            else:
                model.links[full] = ("user-defined", info.type)

    root = h5o.get_info(h5o.open(fid, b"/"))
    seen.add((root.fileno, _token(root)))
    enter("")
    return model


def _token(info: Any) -> int:
    return int(getattr(info, "addr", 0) or hash(getattr(info, "token", b"")))


def compare_output(output: Path, template: Path, rows: dict[str, int],
                   raw_datasets: set[str], opened: tuple[int, int] | None = None) -> list[str]:
    """Differences between ``output`` and ``template`` (empty when the output is right).

    Parameters
    ----------
    rows
        The planned total rows of each extensible dataset (names without ``/``).
    raw_datasets
        Datasets whose allocation time may differ (chkq allocates them early).
    opened
        Descriptors of the output and the template, opened and checked by
        the caller (:func:`check_plan_output`): HDF5 then reads those files,
        and the paths only name them.
    """
    found: list[str] = []
    out_fd, ref_fd = opened or (None, None)
    out_fid = _open(output, out_fd)
    try:
        ref_fid = _open(template, ref_fd)
    except BaseException:
        out_fid.close()
        raise
    try:
        _compare_userblock(out_fid, ref_fid, (output, out_fd), (template, ref_fd), found)
        expected, actual = _walk(ref_fid), _walk(out_fid)
        for name in expected.links.keys() - actual.links.keys():
            found.append(f"link {name!r} is missing")
        for name in actual.links.keys() - expected.links.keys():
            found.append(f"unexpected link {name!r}")
        for name in sorted(expected.links.keys() & actual.links.keys()):
            if expected.links[name] != actual.links[name]:
                found.append(f"link {name!r} is {actual.links[name]}, expected "
                             f"{expected.links[name]}")
        if expected.aliases() != actual.aliases():
            found.append("hard links name other objects than in the template: "
                         f"{sorted(map(sorted, expected.aliases() ^ actual.aliases()))[:3]}")
        ref_file, out_file = h5py.File(ref_fid), h5py.File(out_fid)
        _compare_attributes("/", ref_file.id, out_file.id, ref_file, out_file, found)
        done: set[tuple[int, int]] = set()
        for name in sorted(expected.objects):
            identity = expected.objects[name]
            if identity in done or name not in actual.objects:
                continue
            done.add(identity)
            _compare_object(name, ref_file, out_file, rows, raw_datasets, found)
            if len(found) > 50:
                break
    finally:
        out_fid.close()
        ref_fid.close()
    return found


def _open(path: Path, fd: int | None) -> h5f.FileID:
    if fd is None:
        return h5f.open(str(path).encode(), h5f.ACC_RDONLY)
    return open_checkpoint_id(path, fd)


def check_output(output: Path, template: Path, rows: dict[str, int],
                 raw_datasets: set[str], opened: tuple[int, int] | None = None) -> None:
    """Raise OutputMismatchError listing the first differences, if there are any."""
    found = compare_output(output, template, rows, raw_datasets, opened)
    if found:
        more = f" (and {len(found) - MAX_LISTED} more)" if len(found) > MAX_LISTED else ""
        raise OutputMismatchError(
            f"the output differs from its template {str(template)!r}: "
            + "; ".join(found[:MAX_LISTED]) + more)


def _compare_userblock(out_fid: h5f.FileID, ref_fid: h5f.FileID,
                       output: tuple[Path, int | None], template: tuple[Path, int | None],
                       found: list[str]) -> None:
    size = ref_fid.get_create_plist().get_userblock()
    if out_fid.get_create_plist().get_userblock() != size:
        found.append("the userblock size differs")
        return
    if size and _head(*output, size) != _head(*template, size):
        found.append("the userblock bytes differ")


def _head(path: Path, fd: int | None, size: int) -> bytes:
    """The first ``size`` bytes of the file open as ``fd`` (else at ``path``)."""
    if fd is not None:
        return os.pread(fd, size, 0)
    with open(path, "rb") as file:
        return file.read(size)


def check_plan_output(plan: Plan) -> None:
    """The whole-output check of a job: its output against its template, as planned.

    Both files are opened through the run directory's descriptor (no link
    followed at any level), the output checked to be the file the planner
    made and the template to be the file the planner scanned, before and
    after the comparison (so a template rewritten meanwhile is caught).

    Raises
    ------
    OutputMismatchError
        Listing the first differences.
    CheckpointChangedError
        If the template changed or was replaced, or the output was replaced.
    """
    reference = plan.reference_index()
    template = Path(plan.reference_file)
    with plan.open_run() as run:
        out_fd = run.open_file(plan.job.temp, READ)
        try:
            check_descriptor(plan.job.temp, out_fd, plan.temp_inode)
            ref_fd = open_unchanged(run, template, plan.stamp(reference), plan.job_id)
            try:
                check_output(plan.job.temp, template,
                             rows={d.name: d.total for d in plan.datasets},
                             raw_datasets={d.name for d in plan.datasets if d.mode == "raw"},
                             opened=(out_fd, ref_fd))
                check_same(template, plan.stamp(reference), os.fstat(ref_fd),
                           f"changed while job {plan.job_id} was running")
            finally:
                os.close(ref_fd)
        finally:
            os.close(out_fd)


def _compare_object(name: str, ref_file: h5py.File, out_file: h5py.File, rows: dict[str, int],
                    raw_datasets: set[str], found: list[str]) -> None:
    raw = name.encode("utf-8", "surrogateescape")
    expected, actual = h5o.open(ref_file.id, raw), h5o.open(out_file.id, raw)
    _compare_attributes(name, expected, actual, ref_file, out_file, found)
    if isinstance(expected, h5t.TypeID):
        if not isinstance(actual, h5t.TypeID) or expected.encode() != actual.encode():
            found.append(f"committed datatype {name!r} differs")
    elif isinstance(expected, h5d.DatasetID):
        assert isinstance(actual, h5d.DatasetID)
        _compare_dataset(name, expected, actual, ref_file, out_file, rows.get(name.lstrip("/")),
                         name.lstrip("/") in raw_datasets, found)


def _compare_dataset(name: str, expected: h5d.DatasetID, actual: h5d.DatasetID,
                     ref_file: h5py.File, out_file: h5py.File, total: int | None,
                     early_allowed: bool, found: list[str]) -> None:
    et, at = expected.get_type(), actual.get_type()
    if et.encode() != at.encode() or et.committed() != at.committed():
        found.append(f"dataset {name!r} has another type")
        return
    espace, aspace = expected.get_space(), actual.get_space()
    if espace.get_simple_extent_type() != aspace.get_simple_extent_type():
        found.append(f"dataset {name!r} has another kind of dataspace")
        return
    if espace.get_simple_extent_type() == h5s.SIMPLE:
        dims = list(espace.get_simple_extent_dims())
        if total is not None:
            dims[0] = total
        if (list(aspace.get_simple_extent_dims()) != dims
                or espace.get_simple_extent_dims(True) != aspace.get_simple_extent_dims(True)):
            found.append(f"dataset {name!r} has shape {aspace.get_simple_extent_dims()}, "
                         f"expected {tuple(dims)}")
            return
    want, got = _dcpl_signature(expected), _dcpl_signature(actual)
    if early_allowed and got["alloc_time"] == h5d.ALLOC_TIME_EARLY:
        want["alloc_time"] = h5d.ALLOC_TIME_EARLY
    if want != got:
        differ = sorted(k for k in want if want[k] != got[k])
        found.append(f"dataset {name!r} has other creation properties: "
                     + ", ".join(f"{k} {got[k]!r} instead of {want[k]!r}" for k in differ))
        return
    if total is None and espace.get_simple_extent_type() != h5s.NULL:
        _compare_values(name, expected, actual, ref_file, out_file, found)


def _dcpl_signature(dsid: h5d.DatasetID) -> dict[str, Any]:
    """Every creation property a reader can see, as plain values.

    (``H5Pequal`` would compare a variable-length fill value by its
    in-memory pointer, so the properties are compared one by one.)
    """
    dcpl = dsid.get_create_plist()
    layout = dcpl.get_layout()
    signature: dict[str, Any] = {
        "layout": layout,
        "chunk": dcpl.get_chunk() if layout == h5d.CHUNKED else None,
        "filters": [tuple(dcpl.get_filter(i)[:3]) for i in range(dcpl.get_nfilters())],
        "alloc_time": dcpl.get_alloc_time(),
        "fill_time": dcpl.get_fill_time(),
        "fill_defined": dcpl.fill_value_defined(),
        "external": dcpl.get_external_count(),
        "attr_order": dcpl.get_attr_creation_order(),
        "attr_phase": dcpl.get_attr_phase_change(),
        "track_times": dcpl.get_obj_track_times(),
        "fill_value": None,
    }
    if not is_variable(dsid.get_type()):
        try:
            value = np.zeros((), dtype=dsid.dtype)
            dcpl.get_fill_value(value)
            signature["fill_value"] = value.tobytes()
        except (TypeError, ValueError, RuntimeError):
            pass
    return signature


def _decodable(dsid: h5d.DatasetID) -> bool:
    dcpl = dsid.get_create_plist()
    return all(h5z.filter_avail(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters()))


def _compare_values(name: str, expected: h5d.DatasetID, actual: h5d.DatasetID,
                    ref_file: h5py.File, out_file: h5py.File, found: list[str]) -> None:
    """Fixed datasets: the same bytes (or values, for variable-length data and references)."""
    tid = expected.get_type()
    if not _decodable(expected):
        if _stored_chunks(expected) != _stored_chunks(actual):
            found.append(f"dataset {name!r}: its stored chunks differ")
        return
    if is_variable(tid):
        a = _values(lambda: _names(ref_file[name][()], ref_file))
        b = _values(lambda: _names(out_file[name][()], out_file))
        if not _same_values(a, b):
            found.append(f"dataset {name!r} holds other values")
        return
    shape = expected.shape
    if not shape:
        a, b = (np.empty((), dtype=f"V{tid.get_size()}") for _ in range(2))
        expected.read(h5s.ALL, h5s.ALL, a, mtype=tid)
        actual.read(h5s.ALL, h5s.ALL, b, mtype=tid)
        if a.tobytes() != b.tobytes():
            found.append(f"dataset {name!r} holds other bytes")
        return
    row = tid.get_size() * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, BLOCK_BYTES // max(row, 1))
    for start in range(0, shape[0], step):
        count = min(step, shape[0] - start)
        blocks = []
        for dsid in (expected, actual):
            buf = np.empty((count, *shape[1:]), dtype=f"V{tid.get_size()}")
            fspace = dsid.get_space()
            fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))
            dsid.read(h5s.create_simple((count, *shape[1:])), fspace, buf, mtype=tid)
            blocks.append(buf)
        if blocks[0].tobytes() != blocks[1].tobytes():
            found.append(f"dataset {name!r} holds other bytes from row {start} on")
            return


def _stored_chunks(dsid: h5d.DatasetID) -> list[tuple[Any, ...]]:
    chunks: list[tuple[Any, ...]] = []
    if dsid.get_create_plist().get_layout() != h5d.CHUNKED:
        return chunks
    offsets: list[tuple[int, ...]] = []
    dsid.chunk_iter(lambda info: offsets.append(info.chunk_offset))
    for offset in offsets:
        chunks.append((offset, *dsid.read_direct_chunk(offset)))
    return chunks


def _compare_attributes(name: str, expected: Any, actual: Any, ref_file: h5py.File,
                        out_file: h5py.File, found: list[str]) -> None:
    """Same attribute names, types, dataspaces and bytes (values for pointer types)."""
    def read_all(obj: Any, file: h5py.File) -> dict[bytes, tuple[Any, ...]]:
        result: dict[bytes, tuple[Any, ...]] = {}
        for index in range(h5a.get_num_attrs(obj)):
            attr = h5a.open(obj, index=index)
            tid, space = attr.get_type(), attr.get_space()
            kind = space.get_simple_extent_type()
            dims = space.get_simple_extent_dims() if kind == h5s.SIMPLE else ()
            if kind == h5s.NULL:
                value: Any = None
            elif is_variable(tid):
                value = _values(lambda name=attr.name: _names(  # type: ignore[misc]
                    _read_attr_values(obj, name, file), file))
            else:
                buf = np.empty(space.shape, dtype=f"V{tid.get_size()}")
                attr.read(buf, mtype=tid)
                value = buf.tobytes()
            cset = h5a.get_info(obj, index=index).cset
            result[attr.name] = (tid.encode(), tid.committed(), kind, dims, value, cset)
        return result

    a, b = read_all(expected, ref_file), read_all(actual, out_file)
    for key in a.keys() | b.keys():
        label = key.decode("utf-8", "surrogateescape")
        if key not in b:
            found.append(f"attribute {label!r} of {name!r} is missing")
        elif key not in a:
            found.append(f"unexpected attribute {label!r} on {name!r}")
        elif not (a[key][:4] == b[key][:4] and a[key][5] == b[key][5]
                  and _same_values(a[key][4], b[key][4])):
            found.append(f"attribute {label!r} of {name!r} differs")


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
