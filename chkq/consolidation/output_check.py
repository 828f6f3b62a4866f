"""Checking the whole output against its template, independently of how it was written.

Row verification (``chkq.consolidation.verify_rows``) proves the rows of extensible
datasets. This module proves everything else before the output is linked:
the output must equal the template (the final checkpoint's first file) in
every link (hard, soft, external; which names share one object), the
creation order of links and attributes wherever it is tracked (as the
order, not the numbers: HDF5 numbers a link anew whenever it is inserted),
object kind, object comment, committed datatype, attribute (name, type,
dataspace, bytes), dataset type, dataspace, creation properties (each
filter's id, flags, parameters and name among them) and, for fixed
datasets, values;
extensible datasets must have the planned row count; the userblock must
match. References compare by the name of the object they point to.

The walk uses HDF5's link and object APIs directly and shares no code with
the skeleton or copy steps, so a bug there cannot hide itself here. What
objects hold (values, attributes, padding rows) is compared by
:mod:`chkq.consolidation.output_values`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5f, h5g, h5l, h5o, h5p, h5s, h5t

from chkq.consolidation.checkpoint_files import MAX_DEPTH, open_checkpoint_id
from chkq.consolidation.h5types import chunk_options, is_variable
from chkq.consolidation.output_values import compare_attributes, compare_padding, compare_values
from chkq.consolidation.plan import Plan
from chkq.consolidation.stamps import check_descriptor, check_same, open_unchanged
from chkq.errors import OutputMismatchError
from chkq.rundir import READ

MAX_LISTED = 5
#: Bytes the check may hold at once when no block size is given (a task's ``block_bytes``).
BLOCK_BYTES = 64 * 1024 * 1024


@dataclass
class FileModel:
    """Links and objects of one file, as seen through HDF5."""

    links: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    objects: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Per group (by the name it is first reached under): its link and attribute creation
    #: order flags, and its links' names in creation order where it tracks that order.
    groups: dict[str, tuple[int, int, list[str] | None]] = field(default_factory=dict)

    def aliases(self) -> set[frozenset[str]]:
        """Hard-linked names grouped by the object they name."""
        groups: dict[tuple[int, int], set[str]] = {}
        for name, identity in self.objects.items():
            groups.setdefault(identity, set()).add(name)
        return {frozenset(names) for names in groups.values()}


def _walk(fid: h5f.FileID, where: str) -> FileModel:
    """Every link reachable from the root (each group entered once) and its target.

    Depth first, links by name (so that each object's first name is the
    one ``H5Ovisit`` gives it), on an explicit stack of groups, never deeper
    than ``MAX_DEPTH`` (the planning scan refused deeper files; a file that
    grew deeper since is refused here too, without recursion).
    """
    model = FileModel()
    root = h5o.get_info(h5o.open(fid, b"/"))
    seen: set[tuple[int, int]] = {(root.fileno, _token(root))}
    stack: list[tuple[h5g.GroupID, str, list[bytes], int]] = []

    def enter(path: str) -> None:
        group = h5g.open(fid, path.encode("utf-8", "surrogateescape") if path else b"/")
        names: list[bytes] = []
        group.links.iterate(names.append)
        gcpl = group.get_create_plist()
        link_order = gcpl.get_link_creation_order()
        created = None
        if link_order & h5p.CRT_ORDER_TRACKED:
            created = [name.decode("utf-8", "surrogateescape") for name in
                       sorted(names, key=lambda name: group.links.get_info(name).corder)]
        model.groups[path or "/"] = (link_order, gcpl.get_attr_creation_order(), created)
        stack.append((group, path, names, 0))

    enter("")
    while stack:
        group, path, names, index = stack[-1]
        if index == len(names):
            stack.pop()
            continue
        stack[-1] = (group, path, names, index + 1)
        raw = names[index]
        full = f"{path}/{raw.decode('utf-8', 'surrogateescape')}"
        if len(stack) > MAX_DEPTH:
            raise OutputMismatchError(f"{where} nests groups more than {MAX_DEPTH} "
                                      f"levels deep (at {full[:120]!r})")
        info = group.links.get_info(raw)
        if info.type == h5l.TYPE_SOFT:
            model.links[full] = ("soft", group.links.get_val(raw))
        elif info.type == h5l.TYPE_EXTERNAL:
            model.links[full] = ("external", group.links.get_val(raw))
        elif info.type == h5l.TYPE_HARD:
            oinfo = h5o.get_info(group, raw)
            identity = (oinfo.fileno, _token(oinfo))
            model.links[full] = ("hard", oinfo.type, info.cset)
            model.objects[full] = identity
            if oinfo.type == h5o.TYPE_GROUP and identity not in seen:
                seen.add(identity)
                enter(full)
        else:
            model.links[full] = ("user-defined", info.type)
    return model


def _token(info: Any) -> int:
    return int(getattr(info, "addr", 0) or hash(getattr(info, "token", b"")))


def compare_output(output: Path, template: Path, rows: dict[str, int],
                   raw_datasets: set[str], block_bytes: int = BLOCK_BYTES,
                   opened: tuple[int, int] | None = None,
                   padding: dict[str, list[tuple[int, int]]] | None = None) -> list[str]:
    """Differences between ``output`` and ``template`` (empty when the output is right).

    Parameters
    ----------
    rows
        The planned total rows of each extensible dataset (names without ``/``).
    raw_datasets
        Datasets whose allocation time may differ (chkq allocates them early).
    block_bytes
        Bytes of values the check holds at once (a fixed dataset is read in
        slabs of at most a quarter of it a side; attributes, which HDF5
        reads whole, are compared one at a time).
    opened
        Descriptors of the output and the template, opened and checked by
        the caller (:func:`check_plan_output`): HDF5 then reads those files,
        and the paths only name them.
    padding
        Per extensible dataset, output rows ``(first, count)`` that must be
        its fill value (records of a dimension a file's dataset lacked).
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
        _compare_format(out_fid, ref_fid, found)
        expected = _walk(ref_fid, f"the template {str(template)!r}")
        actual = _walk(out_fid, f"the output {str(output)!r}")
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
        for name in sorted(expected.groups.keys() & actual.groups.keys()):
            _compare_group(name, expected.groups[name], actual.groups[name], found)
        ref_file, out_file = h5py.File(ref_fid), h5py.File(out_fid)
        compare_attributes("/", ref_file.id, out_file.id, ref_file, out_file, found)
        _compare_comment("/", ref_file, out_file, found)
        done: set[tuple[int, int]] = set()
        for name in sorted(expected.objects):
            identity = expected.objects[name]
            if identity in done or name not in actual.objects:
                continue
            done.add(identity)
            _compare_object(name, ref_file, out_file, rows, raw_datasets, block_bytes, found)
            if len(found) > 50:
                break
        for name, ranges in sorted((padding or {}).items()):
            compare_padding(name, ref_file, out_file, ranges, block_bytes, found)
    finally:
        out_fid.close()
        ref_fid.close()
    return found


def _open(path: Path, fd: int | None) -> h5f.FileID:
    if fd is None:
        return h5f.open(str(path).encode(), h5f.ACC_RDONLY)
    return open_checkpoint_id(path, fd)


def check_output(output: Path, template: Path, rows: dict[str, int],
                 raw_datasets: set[str], block_bytes: int = BLOCK_BYTES,
                 opened: tuple[int, int] | None = None,
                 padding: dict[str, list[tuple[int, int]]] | None = None) -> None:
    """Raise OutputMismatchError listing the first differences, if there are any."""
    found = compare_output(output, template, rows, raw_datasets, block_bytes, opened, padding)
    if found:
        more = f" (and {len(found) - MAX_LISTED} more)" if len(found) > MAX_LISTED else ""
        raise OutputMismatchError(
            f"the output differs from its template {str(template)!r}: "
            + "; ".join(found[:MAX_LISTED]) + more)


def _compare_group(name: str, want: tuple[int, int, list[str] | None],
                   got: tuple[int, int, list[str] | None], found: list[str]) -> None:
    """Same creation order flags and, where link creation order is tracked, the same order."""
    if want[:2] != got[:2]:
        found.append(f"group {name!r} has link and attribute creation order flags {got[:2]}, "
                     f"expected {want[:2]}")
    elif want[2] is not None and got[2] is not None and want[2] != got[2]:
        at = next((i for i, (a, b) in enumerate(zip(want[2], got[2], strict=False))
                   if a != b), min(len(want[2]), len(got[2])))
        found.append(f"group {name!r} lists its links in another creation order: "
                     f"{got[2][at:at + 3]} from position {at} on, expected "
                     f"{want[2][at:at + 3]}")


def _compare_comment(name: str, ref_file: h5py.File, out_file: h5py.File,
                     found: list[str]) -> None:
    """Same object comment (``H5Oset_comment``; h5py's ``h5o.get_comment`` is unreliable)."""
    raw = name.encode("utf-8", "surrogateescape")
    if ref_file.id.get_comment(raw) != out_file.id.get_comment(raw):
        found.append(f"object {name!r} has another comment")


def _compare_format(out_fid: h5f.FileID, ref_fid: h5f.FileID, found: list[str]) -> None:
    """Same superblock and file-space settings (the format a reader must understand)."""
    want, got = ref_fid.get_create_plist(), out_fid.get_create_plist()
    for label, read in (("format versions (superblock, free list, symbol table, shared "
                         "headers)", lambda p: p.get_version()),
                        ("sizes of offsets and lengths", lambda p: p.get_sizes()),
                        ("file-space strategy", lambda p: p.get_file_space_strategy()),
                        ("file-space page size", lambda p: p.get_file_space_page_size())):
        if read(want) != read(got):
            found.append(f"the file's {label} {read(got)} differ from the template's "
                         f"{read(want)}")


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
                             block_bytes=plan.block_bytes, opened=(out_fd, ref_fd),
                             padding={d.name: [(d.offsets[f + 1] - count, count)
                                               for f, count in d.padding]
                                      for d in plan.datasets if d.padding})
                check_same(template, plan.stamp(reference), os.fstat(ref_fd),
                           f"changed while job {plan.job_id} was running")
            finally:
                os.close(ref_fd)
        finally:
            os.close(out_fd)


def _compare_object(name: str, ref_file: h5py.File, out_file: h5py.File, rows: dict[str, int],
                    raw_datasets: set[str], block_bytes: int, found: list[str]) -> None:
    raw = name.encode("utf-8", "surrogateescape")
    expected, actual = h5o.open(ref_file.id, raw), h5o.open(out_file.id, raw)
    versions = (h5o.get_info(expected).hdr.version, h5o.get_info(actual).hdr.version)
    if versions[0] != versions[1]:
        found.append(f"object {name!r} has an object header of version {versions[1]}, "
                     f"expected {versions[0]}")
    compare_attributes(name, expected, actual, ref_file, out_file, found)
    _compare_comment(name, ref_file, out_file, found)
    if isinstance(expected, h5t.TypeID):
        if not isinstance(actual, h5t.TypeID) or expected.encode() != actual.encode():
            found.append(f"committed datatype {name!r} differs")
    elif isinstance(expected, h5d.DatasetID):
        assert isinstance(actual, h5d.DatasetID)
        _compare_dataset(name, expected, actual, ref_file, out_file, rows.get(name.lstrip("/")),
                         name.lstrip("/") in raw_datasets, block_bytes, found)


def _compare_dataset(name: str, expected: h5d.DatasetID, actual: h5d.DatasetID,
                     ref_file: h5py.File, out_file: h5py.File, total: int | None,
                     early_allowed: bool, block_bytes: int, found: list[str]) -> None:
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
        compare_values(name, expected, actual, ref_file, out_file, block_bytes, found)


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
        # Whether edge chunks are stored unfiltered.
        "chunk_options": chunk_options(dcpl),
        # Each filter's id, flags, parameters (what its chunks decode under) and name.
        "filters": [(code, flags, tuple(values), bytes(name))
                    for code, flags, values, name in (dcpl.get_filter(i)
                                                      for i in range(dcpl.get_nfilters()))],
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


