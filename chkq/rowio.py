"""Reading rows of HDF5 datasets in bounded blocks with little per-call overhead.

h5py's slicing builds a selection per call, which dominates when a run has
thousands of small files; these helpers reuse the dataset's dataspace.
"""

from __future__ import annotations

from collections.abc import Iterator

import h5py
import numpy as np
from h5py import h5s


def block_rows(row_bytes: int, block_bytes: int) -> int:
    """Rows per block so that one block holds at most ``block_bytes`` (at least one row)."""
    return max(1, block_bytes // max(row_bytes, 1))


def read_rows(dataset: h5py.Dataset, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``dataset`` as a new C-contiguous array."""
    shape = (stop - start, *dataset.shape[1:])
    out = np.empty(shape, dtype=dataset.dtype)
    if out.size == 0:
        return out
    if dataset.dtype.hasobject:
        return np.asarray(dataset[start:stop])
    fspace = dataset.id.get_space()
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    mspace = h5s.create_simple(shape)
    dataset.id.read(mspace, fspace, out)
    return out


def iter_blocks(
    dataset: h5py.Dataset, start: int, stop: int, rows_per_block: int
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first_row, rows)`` blocks covering ``[start, stop)`` of ``dataset``."""
    for first in range(start, stop, rows_per_block):
        yield first, read_rows(dataset, first, min(stop, first + rows_per_block))


def as_bytes(rows: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array, for ``os.pwrite`` and comparison."""
    flat = np.ascontiguousarray(rows).reshape(-1)
    return flat.view(np.uint8).data
