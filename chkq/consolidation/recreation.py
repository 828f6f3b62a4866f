"""Recreating a dataset of the skeleton in its old one's place, alike in all a reader sees.

A raw-mode dataset whose chunks must all exist before the copy is
recreated with EARLY allocation where nothing can tell it from the
template's but its allocation time (:func:`recreatable`): a single link,
no references in the file, an object header of the version the output's
bounds create. The new dataset gets the old one's creation properties,
attributes in their creation order and comment (:func:`recreate_early`)
and takes the old one's link (:func:`replace_links`), the group's later
links inserted again so that its creation order is the template's.
"""

from __future__ import annotations

import secrets

import h5py
import numpy as np
from h5py import h5, h5a, h5d, h5g, h5o, h5p, h5s, h5t

from chkq.consolidation.checkpoint_files import walk_objects
from chkq.consolidation.h5types import has_reference, is_variable, opaque_dtype
from chkq.consolidation.vlen import reclaim


def header_version(bounds: tuple[str, str]) -> int:
    """The object header version HDF5 gives objects created under ``bounds``."""
    return 1 if bounds[0] == "earliest" else 2


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


def holds_references(out: h5py.File) -> bool:
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


def recreatable(dataset: h5py.Dataset, file_has_references: bool,
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


def recreate_early(out: h5py.File, name: str, rows: int, fill_time: int) -> h5d.DatasetID:
    """A new, unlinked dataset identical to ``name`` but ``rows`` long, every chunk allocated.

    It is created with ``fill_time`` (the caller restores the template's
    afterwards when that is not the template's,
    :func:`chkq.consolidation.fill_restore.restore_fill_time`).
    Its attributes (in their creation order) and comment are the old one's;
    :func:`replace_links` links it in place of the old one.
    """
    old = out[name]
    dcpl = old.id.get_create_plist()
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(fill_time)
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


def replace_links(group: h5g.GroupID, new: dict[bytes, h5d.DatasetID]) -> None:
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
