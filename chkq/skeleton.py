"""Creating the output file's skeleton, keeping every HDF5 type exactly.

Attributes and fixed datasets come from the final checkpoint's first file.
Extensible datasets are created with the source's own HDF5 type (string
padding included) and dataset creation properties (chunk shape, filters,
fill value), via the low-level API, because h5py's high-level calls would
substitute types of their own (NULLPAD for NULLTERM strings, say).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
from h5py import h5a, h5d, h5o, h5p, h5s


def copy_attributes(source: h5py.HLObject, target: h5py.HLObject) -> None:
    """Copy every attribute of ``source`` to ``target`` with its exact type and shape."""
    for index in range(h5a.get_num_attrs(source.id)):
        attr = h5a.open(source.id, index=index)
        space = attr.get_space()
        new = h5a.create(target.id, attr.name, attr.get_type(), space)
        if space.get_simple_extent_type() == h5s.NULL:
            continue
        value = np.empty(space.shape, dtype=attr.dtype)
        attr.read(value)
        new.write(value)


def dataset_mode(dataset: h5py.Dataset) -> str:
    """How chkq copies an extensible dataset: ``raw``, ``chunks`` or ``whole``.

    Raw chunk bytes can be written in place only for uncompressed data of a
    fixed size whose in-memory layout is its on-disk layout; filtered data
    of a fixed size moves as encoded chunks; anything of variable length
    (heap references, not bytes) goes through HDF5 whole.
    """
    dtype = dataset.dtype
    variable = dtype.hasobject or h5py.check_vlen_dtype(dtype) is not None
    if variable or dataset.id.get_type().get_size() != dtype.itemsize:
        return "whole"
    if dataset.id.get_create_plist().get_nfilters() > 0:
        return "chunks"
    return "raw"


def create_extensible(
    group: h5py.Group, name: str, source: h5py.Dataset, rows: int, *, early: bool
) -> h5py.Dataset:
    """Create ``name`` in ``group`` like ``source``, with ``rows`` rows.

    With ``early``, every chunk is allocated now (so its file offset is
    known) and never filled: chkq writes all of them.
    """
    dcpl = source.id.get_create_plist()
    if early:
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    maxshape = tuple(h5s.UNLIMITED if m is None else m for m in source.maxshape)
    space = h5s.create_simple((rows, *source.shape[1:]), maxshape)
    dsid = h5d.create(group.id, name.encode(), source.id.get_type(), space, dcpl=dcpl)
    dataset = h5py.Dataset(dsid)
    copy_attributes(source, dataset)
    return dataset


def chunk_offsets(dataset: h5py.Dataset) -> list[int]:
    """File offset of every allocated chunk of ``dataset``, in row-major chunk order."""
    chunks = dataset.chunks
    assert chunks is not None
    grid = [-(-size // c) for size, c in zip(dataset.shape, chunks, strict=True)]
    found: dict[tuple[int, ...], int] = {}

    def record(info: h5d.StoreInfo) -> None:
        coords = tuple(o // c for o, c in zip(info.chunk_offset, chunks, strict=True))
        found[coords] = int(info.byte_offset)

    dataset.id.chunk_iter(record)
    offsets = []
    for coords in np.ndindex(*grid):
        if coords not in found:
            raise RuntimeError(f"chunk {coords} of {dataset.name} was not allocated")
        offsets.append(found[coords])
    return offsets


def fill_bytes(dataset: h5py.Dataset) -> bytes:
    """The fill value of ``dataset`` as raw bytes of one element."""
    value = np.zeros((), dtype=dataset.dtype)
    dataset.id.get_create_plist().get_fill_value(value)
    return value.tobytes()


def create_skeleton(
    temp: Path, reference: Path, modes: dict[str, str], rows: dict[str, int]
) -> dict[str, tuple[list[int], bytes]]:
    """Write the output skeleton to ``temp`` from ``reference``.

    Groups, attributes and fixed datasets are copied; raw-mode extensible
    datasets are created with all their chunks allocated; the others are
    left to the merge step. Returns, for each raw dataset, its chunk
    offsets and fill bytes.

    Raises
    ------
    FileExistsError
        If ``temp`` exists.
    """
    layout: dict[str, tuple[list[int], bytes]] = {}
    with h5py.File(reference, "r") as src, h5py.File(temp, "w-") as out:
        copy_attributes(src, out)
        names: list[str] = []
        src.visit(names.append)
        for name in names:
            obj = src[name]
            if isinstance(obj, h5py.Group):
                copy_attributes(obj, out.create_group(name))
            elif name in modes:
                if modes[name] == "raw":
                    dataset = create_extensible(out, name, obj, rows[name], early=True)
                    layout[name] = (chunk_offsets(dataset), fill_bytes(dataset))
            elif isinstance(obj, h5py.Dataset):
                h5o.copy(src.id, name.encode(), out.id, name.encode(),
                         lcpl=_lcpl())
    return layout


def _lcpl() -> h5p.PropLCID:
    lcpl = h5p.create(h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    return lcpl
