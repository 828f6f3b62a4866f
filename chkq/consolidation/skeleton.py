"""Creating the output's skeleton: the final checkpoint's first file, resized.

The output must equal the final checkpoint's first file (the *template*)
in everything but the rows of its extensible datasets: every link (hard,
soft, external), committed datatypes, references, attributes with their
exact bytes, the userblock, dataspaces and creation properties. No walk of
the file reproduces all of that, so the skeleton *is* the template: its
bytes are copied under the job's temporary name, and each extensible
dataset is resized in place to the run's total row count, keeping its
object (and so every link and reference to it) as it was.

Raw-mode datasets (uncompressed, fixed-size elements) are written by copy
tasks as bytes at chunk offsets, so all their chunks must exist before the
copy starts. HDF5 allocates them in one call when a dataset's allocation
time is EARLY; otherwise allocating costs a write of every chunk. So a
raw-mode dataset that nothing else can tell apart from a new one (a single
link, no references in the file) is recreated with EARLY allocation instead (the
*allocation time* is then the only property that differs from the
template, and the template's rows stay behind as unused space), and any
other is resized in place and allocated by writing it. A recreated dataset
is created anonymously (no staging name that could collide with one in the
file), with the old one's attributes in their creation order and its
comment, and linked in the old one's place; in a group that tracks link
creation order, the links created after it are inserted again in order. The rows of a
recreated dataset are not even copied from the template: they stay holes
in the file, so they cost neither time nor disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
from h5py import h5, h5a, h5d, h5f, h5g, h5o, h5p, h5s, h5t, h5z

from chkq.consolidation.checkpoint_files import open_checkpoint_id, stored_chunks, walk_objects
from chkq.consolidation.h5types import has_reference, is_variable, opaque_dtype
from chkq.consolidation.rowio import ByteCopier
from chkq.consolidation.vlen import reclaim
from chkq.errors import BadCheckpointError
from chkq.rundir import CREATE, RunDir, fd_path

#: Rows written per H5Dwrite when a dataset's chunks are allocated by writing them.
ALLOCATE_BYTES = 16 * 1024 * 1024

#: The lowest library version bound that writes each superblock version: what the file's
#: writer must have asked for at least.
_SUPERBLOCK_LOW = {0: "earliest", 1: "earliest", 2: "v108", 3: "v110"}


def format_bounds(template: h5py.File, datasets: list[str]) -> tuple[str, str]:
    """The library version bounds (h5py ``libver``) under which chkq writes into the output.

    HDF5 does not store a file's bounds; it opens every file with the
    default ones (``earliest``), and objects created then get the oldest
    formats: a recreated dataset would have a version 1 object header
    where the template's has version 2 (which is where "do not track
    times" is kept, and which allows attributes over 64 KiB). The low
    bound is the one the template's writer used at least: that of its
    superblock version, raised to 1.8 when any of ``datasets`` (those chkq
    may recreate) has a version 2 header. The high bound is the library's
    latest, so that nothing the template holds is refused.
    """
    superblock = template.id.get_create_plist().get_version()[0]
    low = _SUPERBLOCK_LOW.get(superblock, "latest")
    if low == "earliest" and any(h5o.get_info(template[name].id).hdr.version >= 2
                                 for name in datasets):
        low = "v108"
    return low, "latest"


def header_version(bounds: tuple[str, str]) -> int:
    """The object header version HDF5 gives objects created under ``bounds``."""
    return 1 if bounds[0] == "earliest" else 2


def dataset_mode(dsid: h5d.DatasetID) -> str:
    """How chkq copies an extensible dataset: ``raw``, ``chunks`` or ``whole``.

    Raw chunk bytes can be written in place only for uncompressed data of a
    fixed size; filtered data of a fixed size moves as encoded chunks;
    anything holding pointers (variable-length data, references) goes
    through HDF5, row by row.
    """
    if is_variable(dsid.get_type()):
        return "whole"
    if dsid.get_create_plist().get_nfilters() > 0:
        return "chunks"
    return "raw"


def copy_attributes(source: h5py.HLObject, target: h5py.HLObject) -> None:
    """Copy every attribute of ``source`` to ``target``: same name, type, space and value.

    Values move in HDF5's memory form of the attribute's own type, so nothing
    is converted (fixed-size data as its bytes; variable-length strings and
    sequences through HDF5's descriptors, freed after). Attributes are
    created in the source's creation order when it tracks one.
    """
    order = (h5.INDEX_CRT_ORDER if source.id.get_create_plist().get_attr_creation_order()
             else h5.INDEX_NAME)
    for index in range(h5a.get_num_attrs(source.id)):
        attr = h5a.open(source.id, index=index, index_type=order)
        space = attr.get_space()
        tid = attr.get_type()
        new = h5a.create(target.id, attr.name, tid, space)
        if space.get_simple_extent_type() == h5s.NULL:
            continue
        value = np.zeros(space.shape, dtype=opaque_dtype(tid))
        attr.read(value, mtype=tid)
        try:
            new.write(value, mtype=tid)
        finally:
            if is_variable(tid):
                reclaim(tid, space, value)


Filter = tuple[int, int, tuple[int, ...]]

#: The caller's parameters of filters whose "set local" step rewrites them, from the
#: stored ones: bitshuffle and SZ/SZ3 put what they derive (versions, element size, rank
#: and chunk shape) before them; SPERR keeps the first, packs the second (its mode for
#: missing values) into a word of its own (bits 6 to 9) and adds the chunk shape. Tried first,
#: so that :func:`recreation_plist` needs no failing attempt for these.
_CALLER_PARAMETERS: dict[int, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    32008: lambda values: values[3:],                                    # bitshuffle
    32017: lambda values: values[2 + values[0]:] if values else values,  # SZ
    32024: lambda values: values[2 + values[0]:] if values else values,  # SZ3
    32028: lambda values: ((values[1], values[0] >> 6 & 0xF) if len(values) > 1  # SPERR
                           else values),
}


def stored_filters(dcpl: h5p.PropDCID) -> list[Filter]:
    """Each filter of a pipeline as stored: its id, flags and parameters (``cd_values``)."""
    return [(int(code), int(flags), tuple(int(v) for v in values))
            for code, flags, values, _name in (dcpl.get_filter(i)
                                               for i in range(dcpl.get_nfilters()))]


def _with_filters(dcpl: h5p.PropDCID, filters: list[Filter]) -> h5p.PropDCID:
    """A copy of ``dcpl`` whose pipeline is ``filters``, in order, as the caller's parameters."""
    copy = dcpl.copy()
    copy.remove_filter(h5z.FILTER_ALL)
    for code, flags, values in filters:
        copy.set_filter(code, flags, values)
    return copy


def _created_filters(fid: h5f.FileID, tid: h5t.TypeID, space: h5s.SpaceID,
                     dcpl: h5p.PropDCID) -> list[Filter] | None:
    """The pipeline HDF5 stores for a dataset created with ``dcpl`` (None if it refuses it)."""
    try:
        dsid = h5d.create(fid, None, tid, space, dcpl=dcpl)
    except (ValueError, RuntimeError, OSError, KeyError, TypeError):
        return None
    try:
        return stored_filters(dsid.get_create_plist())
    finally:
        dsid.close()


def _local_rest(code: int, values: tuple[int, ...]) -> tuple[int, ...]:
    """The caller's part of a filter's stored parameters, where its set-local step is known."""
    known = _CALLER_PARAMETERS.get(code)
    return values if known is None else tuple(known(values))


def _candidates(code: int, values: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Parameters that may give ``values`` once a filter's "set local" step has run on them.

    The caller's part where the filter is known, then the stored values
    themselves (most filters leave their parameters as they are), then
    every other suffix and prefix of them (a set-local step adds what it
    derives before or after the caller's parameters), each also followed by
    a 0 (an option it leaves at its default and does not store).
    """
    found = [_local_rest(code, values), values]
    found += [values[k:] for k in range(1, len(values) + 1)]
    found += [values[:k] for k in range(len(values) - 1, -1, -1)]
    found += [(*part, 0) for part in found]
    return list(dict.fromkeys(found))


def recreation_plist(source: h5d.DatasetID, where: str) -> h5p.PropDCID:
    """Creation properties under which HDF5 creates a dataset whose filters are ``source``'s.

    A dataset created with ``source``'s own creation properties gets its
    filters' parameters through each filter's "set local" step again; some
    (bitshuffle, SZ, SZ3) rewrite them there (adding versions, the element
    size, the chunk shape before the caller's parameters), so the parameters
    would be applied twice and chunks written under them would not decode
    with ``source``'s. For each filter, in order, parameters are sought
    whose "set local" result is ``source``'s stored ones, by creating
    datasets in a file held in memory and reading back what HDF5 stored
    (the library's own step decides, not a model of it).

    Raises
    ------
    BadCheckpointError
        If no such parameters are found, naming ``where`` (the dataset) and the filter.
    """
    dcpl = source.get_create_plist()
    want = stored_filters(dcpl)
    if not want:
        return dcpl
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fapl_core(backing_store=False)
    scratch = h5f.create(f"chkq-filters-{secrets.token_hex(8)}".encode(), h5f.ACC_EXCL,
                         fapl=fapl)
    try:
        tid = source.get_type()
        extent = source.get_space()
        space = h5s.create_simple((0, *extent.shape[1:]), extent.get_simple_extent_dims(True))
        chosen = [(code, flags, _local_rest(code, values)) for code, flags, values in want]
        if chosen == want and _created_filters(scratch, tid, space, dcpl) == want:
            return dcpl
        # One filter's parameters may make HDF5 refuse the whole pipeline, hiding whether
        # another's are right: each pass fixes what it can, until nothing changes.
        for _ in want:
            for index, (code, flags, values) in enumerate(want):
                got = _created_filters(scratch, tid, space, _with_filters(dcpl, chosen))
                if got is not None and len(got) == len(want) and got[index] == want[index]:
                    continue
                for candidate in _candidates(code, values):
                    trial = [*chosen[:index], (code, flags, candidate), *chosen[index + 1:]]
                    got = _created_filters(scratch, tid, space, _with_filters(dcpl, trial))
                    if got is not None and len(got) == len(want) and got[index] == want[index]:
                        chosen = trial
                        break
            result = _with_filters(dcpl, chosen)
            got = _created_filters(scratch, tid, space, result)
            if got == want:
                return result
        wrong = next((i for i in range(len(want)) if got is None or len(got) != len(want)
                      or got[i] != want[i]), 0)
        raise BadCheckpointError(
            f"{where} uses filter {want[wrong][0]} ({filter_label(dcpl, wrong)}) with "
            f"parameters {list(want[wrong][2])} that the installed plugin's set-local step "
            "does not produce (another version of the plugin wrote them, or they were set "
            "without it): chkq cannot write chunks that decode like the template's")
    finally:
        scratch.close()


def filter_label(dcpl: h5p.PropDCID, index: int) -> str:
    """The name a pipeline gives its filter ``index`` ("unnamed" if none)."""
    label = dcpl.get_filter(index)[3]
    text = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
    return text or "unnamed"


def create_extensible(group: h5py.Group, name: str, source: h5py.Dataset,
                      rows: int) -> h5py.Dataset:
    """Create ``name`` in ``group`` like ``source`` (type, creation properties), ``rows`` long.

    Used for part files, whose chunks the merge step moves into the output
    as they are stored: so the new dataset's filters must store exactly
    ``source``'s parameters (:func:`recreation_plist`), which is checked.

    Raises
    ------
    BadCheckpointError
        If the filters' parameters cannot be made ``source``'s.
    """
    where = f"dataset {source.name!r}"
    dcpl = recreation_plist(source.id, where)
    maxshape = tuple(h5s.UNLIMITED if m is None else m for m in source.maxshape)
    space = h5s.create_simple((rows, *source.shape[1:]), maxshape)
    dsid = h5d.create(group.id, name.encode(), source.id.get_type(), space, dcpl=dcpl)
    got = stored_filters(dsid.get_create_plist())
    want = stored_filters(source.id.get_create_plist())
    if got != want:
        raise BadCheckpointError(f"{where}: HDF5 stored the filters {got} for a copy of it, "
                                 f"not its own {want}")
    return h5py.Dataset(dsid)


def chunk_offsets(dsid: h5d.DatasetID) -> list[int]:
    """File offset of every chunk of a dataset, in row-major chunk order (all allocated)."""
    offsets = []
    for coords, info in stored_chunks(dsid, dsid.get_create_plist().get_chunk(), dsid.shape):
        if info is None:
            raise RuntimeError(f"chunk {coords} of the output's dataset was not allocated")
        offsets.append(int(info.byte_offset))
    return offsets


def output_access(files: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The permission bits, owner and group the output gets: never more readable than its sources.

    ``files`` holds each checkpoint file's ``(permission bits, uid, gid)``.
    The bits are those every checkpoint has (no execute, setuid, setgid or
    sticky bit), plus read and write for the owner (the job writes the
    output after creating it). The owner and the group are the ones all
    checkpoints share, -1 where they differ (the output then keeps the
    worker's, and gets no group bits). The checkpoints' owner, not the run
    directory's: whoever owns a directory may have linked another user's
    files into it.
    """
    mode = 0o666
    for bits, _uid, _gid in files:
        mode &= bits
    owners = {uid for _bits, uid, _gid in files}
    groups = {gid for _bits, _uid, gid in files}
    return (mode | 0o600, owners.pop() if len(owners) == 1 else -1,
            groups.pop() if len(groups) == 1 else -1)


def _apply_access(fd: int, access: tuple[int, int, int]) -> None:
    """Give the new output ``access`` (:func:`output_access`) as far as the worker may.

    The owner and group change where the worker may change them (a worker
    running as root or as the checkpoints' owner); where it may not, the output
    stays the worker's, and group bits are dropped when its group is not
    the checkpoints' own, so that no other group can read it.
    """
    mode, uid, gid = access
    st = os.fstat(fd)
    want_uid = uid if uid >= 0 else st.st_uid
    want_gid = gid if gid >= 0 else st.st_gid
    if (want_uid, want_gid) != (st.st_uid, st.st_gid):
        try:
            os.fchown(fd, want_uid, want_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, want_gid)
        st = os.fstat(fd)
    if gid < 0 or st.st_gid != gid:
        mode &= ~0o070
    os.fchmod(fd, mode)


def copy_template(src: int, out: int, skip: list[tuple[int, int]] | None = None) -> None:
    """Copy the bytes of the file open as ``src`` to the new, empty file open as ``out``.

    Byte ranges ``(offset, size)`` in ``skip`` (rows that will be replaced)
    are not copied: they stay holes.
    """
    size = os.fstat(src).st_size
    copier, at = ByteCopier(), 0
    for offset, length in sorted(skip or []):
        if offset > at:
            copier.copy(src, at, out, at, offset - at)
        at = max(at, offset + length)
    if size > at:
        copier.copy(src, at, out, at, size - at)
    os.ftruncate(out, size)


_libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE = 1


def reserve_space(fd: int, path: Path, size: int) -> None:
    """Reserve ``size`` bytes of disk for the file open as ``fd``, so that a full disk fails now.

    Without it, a disk that fills up while HDF5 writes (allocating the
    output) fails inside the library, which then cannot close the file; the
    reservation turns that into a clear ENOSPC before anything is written.
    Filesystems that cannot reserve space are skipped silently. ``path``
    names the file in the message.
    """
    fallocate = getattr(_libc, "fallocate", None)
    if fallocate is None:
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0:
        return
    error = ctypes.get_errno()
    if error == errno.ENOSPC:
        raise OSError(errno.ENOSPC, f"no space left for the output ({size} bytes) next to "
                      f"{str(path)!r}")


def _stored_ranges(dsid: h5d.DatasetID) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored chunk of a chunked dataset."""
    ranges: list[tuple[int, int]] = []
    dsid.chunk_iter(lambda info: ranges.append((int(info.byte_offset), int(info.size))))
    return ranges


def _holds_references(out: h5py.File) -> bool:
    """Whether any attribute or dataset of the file holds references (to any object).

    The root's own attributes count too.
    """
    for name, kind in [(b".", h5o.TYPE_GROUP), *walk_objects(out.id, repr(out.filename))]:
        obj = h5o.open(out.id, name)
        for index in range(h5a.get_num_attrs(obj)):
            if has_reference(h5a.open(obj, index=index).get_type()):
                return True
        if kind == h5o.TYPE_DATASET and has_reference(obj.get_type()):
            return True
    return False


def _recreatable(dataset: h5py.Dataset, file_has_references: bool,
                 bounds: tuple[str, str]) -> bool:
    """Whether recreating ``dataset`` changes nothing a reader sees but its allocation time.

    (Its modification time changes too, as it would by resizing it in place.)
    A dataset whose object header has another version than the ones
    ``bounds`` create is kept (a file may mix both).
    """
    info = h5o.get_info(dataset.id)
    if file_has_references or info.rc != 1 or info.hdr.version != header_version(bounds):
        return False
    dcpl = dataset.id.get_create_plist()
    fills = dcpl.get_fill_time() == h5d.FILL_TIME_ALLOC or (
        dcpl.get_fill_time() == h5d.FILL_TIME_IFSET
        and dcpl.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED)
    if fills:
        return False  # allocating writes every chunk anyway: keep the allocation time
    # Attribute names are created ASCII-encoded (h5py cannot set their encoding).
    return all(h5a.get_info(dataset.id, index=i).cset == h5t.CSET_ASCII
               for i in range(h5a.get_num_attrs(dataset.id)))


def _recreate_early(out: h5py.File, name: str, rows: int) -> h5d.DatasetID:
    """A new, unlinked dataset identical to ``name`` but ``rows`` long, every chunk allocated.

    Its attributes (in their creation order) and comment are the old
    one's; :func:`_replace_links` links it in place of the old one.
    """
    old = out[name]
    dcpl = old.id.get_create_plist()
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    tid = old.id.get_type()
    maxdims = old.id.get_space().get_simple_extent_dims(True)
    space = h5s.create_simple((rows, *old.shape[1:]), maxdims)
    dsid = h5d.create(out.id, None, tid, space, dcpl=dcpl)
    copy_attributes(old, h5py.Dataset(dsid))
    comment = out.id.get_comment(name.encode())
    if comment:
        h5o.set_comment(dsid, comment)
    return dsid


def _absent_name(group: h5g.GroupID) -> bytes:
    """A link name ``group`` does not hold (the skeleton is private: it stays absent)."""
    while True:
        name = f".chkq-staging-{secrets.token_hex(8)}".encode()
        if not group.links.exists(name):
            return name


def _creation_order(group: h5g.GroupID) -> list[bytes] | None:
    """The names of ``group``'s links in creation order, or None if it tracks none."""
    if not group.get_create_plist().get_link_creation_order() & h5p.CRT_ORDER_TRACKED:
        return None
    names: list[bytes] = []
    group.links.iterate(names.append)
    return sorted(names, key=lambda name: group.links.get_info(name).corder)


def _replace_links(group: h5g.GroupID, new: dict[bytes, h5d.DatasetID]) -> None:
    """Point each link of ``group`` that ``new`` names at its new dataset, in the same place.

    HDF5 gives a link the next creation order number whenever it is
    inserted (created, or moved, even back to its own name), so in a group
    that tracks creation order every link created after the first one
    replaced is inserted again, in the original order: readers that list
    the group by creation order (h5py does) see the template's order. Each
    link keeps its name's character set.
    """
    order = _creation_order(group)
    if order is None:
        later = list(new)
    else:
        first = min(i for i, name in enumerate(order) if name in new)
        later = order[first:]
    staging: bytes | None = None
    for name in later:
        lcpl = h5p.create(h5p.LINK_CREATE)
        lcpl.set_char_encoding(group.links.get_info(name).cset)
        if name in new:
            group.unlink(name)
            h5o.link(new[name], group, name, lcpl=lcpl)
        else:
            staging = staging or _absent_name(group)
            group.links.move(name, group, staging, lcpl=lcpl)
            group.links.move(staging, group, name, lcpl=lcpl)


def _allocate_by_writing(dsid: h5d.DatasetID) -> None:
    """Make HDF5 allocate every chunk of a dataset by writing zero bytes over all its rows."""
    shape = dsid.shape
    tid = dsid.get_type()
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, ALLOCATE_BYTES // max(1, row_elems * tid.get_size()))
    block = np.zeros((min(step, max(shape[0], 1)), *shape[1:]),
                     dtype=opaque_dtype(tid))
    for start in range(0, shape[0], step):
        count = min(step, shape[0] - start)
        fspace = dsid.get_space()
        fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))
        dsid.write(h5s.create_simple((count, *shape[1:])), fspace, block[:count], mtype=tid)


def create_skeleton(temp: Path, reference: Path, rows: dict[str, int], raw: set[str],
                    access: tuple[int, int, int] = (0o600, -1, -1), *, run: RunDir,
                    template: int) -> tuple[dict[str, list[int]], int, tuple[str, str]]:
    """Write the output skeleton to ``temp``: ``reference``'s bytes, datasets resized.

    ``template`` is ``reference`` opened (and checked) by the caller: HDF5
    and the byte copy read that descriptor, never the name. ``temp`` is
    created through ``run`` with O_EXCL|O_NOFOLLOW (a file or symbolic link
    already there, planted by whoever can write the run directory, is never
    followed or overwritten), and HDF5 writes the created file through its
    descriptor.

    Parameters
    ----------
    rows
        Total rows of every extensible dataset.
    raw
        The raw-mode datasets, whose chunks must all be allocated.
    access
        The output's permission bits, owner and group (:func:`output_access`).

    Returns
    -------
    For each raw-mode dataset, the file offset of every chunk; the inode of
    the temporary output; and the format bounds (:func:`format_bounds`)
    under which it was written, and must be whenever it is written again.

    Raises
    ------
    FileExistsError
        If ``temp`` exists (or is a symbolic link).
    """
    with h5py.File(open_checkpoint_id(reference, template)) as source:
        has_references = _holds_references(source) if raw else False
        bounds = format_bounds(source, sorted(raw))
        recreated = {name for name in raw
                     if _recreatable(source[name], has_references, bounds)}
        skip = [r for name in recreated for r in _stored_ranges(source[name].id)]
        row_bytes = {name: source[name].id.get_type().get_size()
                     * int(np.prod(source[name].shape[1:], dtype=np.int64)) for name in rows}
    fd = run.open_file(temp, CREATE, 0o600)
    try:
        _apply_access(fd, access)
        copy_template(template, fd, skip)
        inode = os.fstat(fd).st_ino
        reserve_space(fd, temp, os.fstat(template).st_size
                      + sum(total * row_bytes[name] for name, total in rows.items()))
        layout = _resize(fd, rows, raw, recreated, bounds)
    finally:
        os.close(fd)
    return layout, inode, bounds


def _resize(fd: int, rows: dict[str, int], raw: set[str], recreated: set[str],
            bounds: tuple[str, str]) -> dict[str, list[int]]:
    """Resize (or recreate) the extensible datasets of the skeleton open as ``fd``."""
    layout: dict[str, list[int]] = {}
    with h5py.File(fd_path(fd), "r+", libver=bounds) as out:
        replaced: dict[str, dict[bytes, h5d.DatasetID]] = {}
        for name, total in rows.items():
            dataset = out[name]
            if name in recreated:
                dsid = _recreate_early(out, name, total)
                parent, _, leaf = name.rpartition("/")
                replaced.setdefault(parent or "/", {})[leaf.encode()] = dsid
            else:
                dsid = dataset.id
                dataset.resize(total, axis=0)
                early = dsid.get_create_plist().get_alloc_time() == h5d.ALLOC_TIME_EARLY
                if name in raw and not early:
                    _allocate_by_writing(dsid)
            if name in raw:
                layout[name] = chunk_offsets(dsid)
        for parent, new in replaced.items():
            _replace_links(out[parent].id, new)
    return layout
