"""Encoding chunks through HDF5's own filters, for pipelines chkq does not encode itself.

A copy task writes a ``chunks`` dataset's rows to its part file as the
chunks the output stores: ISA-L encodes whole chunks of [shuffle,]
deflate datasets (:mod:`chkq.consolidation.chunk_encoding`); every other
chunk is encoded here, by writing its rows into a dataset held in memory
whose pipeline is the template's and reading back what HDF5 stored
(:class:`HDF5Encoder`). Edge chunks HDF5 leaves unfiltered are their
elements as they are (:func:`unfiltered_chunk`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator

import h5py
import numpy as np
from h5py import h5d, h5s, h5z

from chkq.consolidation.filter_pipelines import (
    core_file,
    create_extensible,
    open_pipeline,
    stored_filters,
)
from chkq.consolidation.h5types import chunk_options, set_chunk_options


def unfiltered_chunk(rows: np.ndarray, where: tuple[int, ...], chunk: tuple[int, ...]) -> bytes:
    """The bytes HDF5 stores for an edge chunk it does not filter: the chunk's elements as they are.

    ``rows`` holds the chunk's rows (no more than a chunk's) across the
    whole trailing shape; elements past the extent are zero, bytes no
    reader sees.
    """
    block = np.zeros(chunk, dtype=rows.dtype)
    part = rows[(slice(None), *(slice(w, w + c) for w, c in zip(where, chunk[1:], strict=True)))]
    block[tuple(slice(0, n) for n in part.shape)] = part
    return block.tobytes()


class HDF5Encoder:
    """Encodes chunks through HDF5's own filters, for pipelines chkq does not encode itself.

    Rows are written, starting on the chunk grid, into a dataset created
    like the template's in an in-memory file; each chunk's stored bytes and
    filter mask are then read back with ``read_direct_chunk``. Only the
    output's last chunk can be partial; past the rows written it holds
    whatever the in-memory dataset held there, bytes beyond the dataset's
    end that no reader sees.

    With ``image`` (:attr:`chkq.consolidation.plan.DatasetPlan.pipeline`),
    the dataset is the planned empty copy of the template's, grown to whole
    chunks of rows (so that none is an edge chunk its chunk options would
    leave unfiltered): its pipeline is the template's as stored, for
    parameters no dataset created anew gets.

    With ``skip`` (the template's lossy filters by index,
    :func:`chkq.consolidation.chunk_encoding.lossy_filters`), chunks are
    stored with those filters skipped in their filter mask, as HDF5 stores
    a chunk a filter could not encode: readers decode them to exactly the
    rows written. The other filters still apply, through a dataset whose
    pipeline is the template's without the skipped ones; where HDF5 would
    store other parameters for it, every filter is skipped (the chunk
    stored as its elements).
    """

    def __init__(self, template: h5py.Dataset, rows: int, image: str = "",
                 skip: Iterable[int] = ()) -> None:
        self.skip = sorted(skip)
        self.kept: list[int] = []
        self.chunk = tuple(template.id.get_create_plist().get_chunk())
        self.file = h5py.File(f"chkq-encode-{id(self)}", "w", driver="core",
                              backing_store=False)
        if self.skip:
            self.data = self._without_skipped(template, rows)
        elif image:
            self.file.close()
            self.file = h5py.File(core_file(base64.b64decode(image)))
            where = f"dataset {template.name!r}"
            self.data = open_pipeline(self.file.id, stored_filters(
                template.id.get_create_plist()), where)
            per_chunk = self.chunk[0]
            whole = -(-rows // per_chunk) * per_chunk
            limit = self.data.get_space().get_simple_extent_dims(True)[0]
            if limit != h5s.UNLIMITED:
                whole = min(whole, limit)
            self.data.set_extent((whole, *template.shape[1:]))
        else:
            self.data = create_extensible(self.file, "data", template, rows,
                                          filter_edges=True).id
        self.type = None if self.data is None else self.data.get_type()

    def _without_skipped(self, template: h5py.Dataset, rows: int) -> h5d.DatasetID | None:
        """A dataset with the template's pipeline but the skipped filters, or None (skip all)."""
        dcpl = template.id.get_create_plist()
        want = stored_filters(dcpl)
        self.kept = [i for i in range(len(want)) if i not in self.skip]
        if not self.kept:
            return None
        reduced = dcpl.copy()
        reduced.remove_filter(h5z.FILTER_ALL)
        for i in self.kept:
            reduced.set_filter(*want[i])
        if chunk_options(reduced):
            set_chunk_options(reduced, 0)
        maxshape = tuple(h5s.UNLIMITED if m is None else m for m in template.maxshape)
        space = h5s.create_simple((rows, *template.shape[1:]), maxshape)
        try:
            dsid = h5d.create(self.file.id, b"data", template.id.get_type(), space,
                              dcpl=reduced)
        except (ValueError, RuntimeError, OSError, KeyError, TypeError):
            return None
        if stored_filters(dsid.get_create_plist()) != [want[i] for i in self.kept]:
            return None
        return dsid

    def _mask(self, mask: int) -> int:
        """The template's filter mask of a chunk the reduced pipeline stored with ``mask``."""
        full = sum(1 << i for i in self.skip)
        if self.data is None or not self.kept:
            return full | sum(1 << i for i in self.kept)
        return full | sum(1 << index for j, index in enumerate(self.kept) if mask >> j & 1)

    def encode(self, rows: np.ndarray, tiles: list[tuple[int, ...]], per_chunk: int
               ) -> Iterator[tuple[int, tuple[int, ...], int, bytes]]:
        """``(first row, trailing offset, mask, stored bytes)`` of the chunks holding ``rows``."""
        if self.data is None:
            for first in range(0, len(rows), per_chunk):
                for where in tiles:
                    yield first, where, self._mask(0), unfiltered_chunk(
                        rows[first:first + per_chunk], where, self.chunk)
            return
        fspace = self.data.get_space()
        fspace.select_hyperslab((0,) * rows.ndim, rows.shape)
        self.data.write(h5s.create_simple(rows.shape), fspace, rows, mtype=self.type)
        for first in range(0, len(rows), per_chunk):
            for where in tiles:
                mask, data = self.data.read_direct_chunk((first, *where))
                yield first, where, self._mask(mask) if self.skip else mask, data

    def close(self) -> None:
        self.file.close()
