"""Verifying the written output against the checkpoint files, bit for bit.

Every row of every extensible dataset is read back from the output file
and compared with the row read from its checkpoint file. Rows compare as
raw bytes, so NaNs in the same places (with the same bits) are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import h5py
import numpy as np

from chkq.copy_rows import check_unchanged
from chkq.errors import OutputMismatchError
from chkq.plan import DatasetPlan, Plan
from chkq.rowio import as_bytes, block_rows, read_rows
from chkq.structure import open_checkpoint

Progress = Callable[[int], None]


@dataclass
class VerifyStats:
    """What a verify task checked, for its log line and result."""

    rows: int = 0
    bytes: int = 0
    files: int = 0


def first_difference(expected: np.ndarray, actual: np.ndarray) -> int | None:
    """Index of the first row whose bytes differ, or None if all are equal."""
    if expected.shape != actual.shape:
        return 0
    if expected.dtype.hasobject:
        for i, (a, b) in enumerate(zip(expected.reshape(len(expected), -1),
                                       actual.reshape(len(actual), -1), strict=True)):
            if any(_element_bytes(x) != _element_bytes(y) for x, y in zip(a, b, strict=True)):
                return i
        return None
    if as_bytes(expected) == as_bytes(actual):
        return None
    rows_a = np.ascontiguousarray(expected).reshape(len(expected), -1).view(np.uint8)
    rows_b = np.ascontiguousarray(actual).reshape(len(actual), -1).view(np.uint8)
    return int(np.flatnonzero((rows_a != rows_b).any(axis=1))[0])


def _element_bytes(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, bytes):
        return value
    return np.asarray(value).tobytes()


def verify_files(
    plan: Plan, first: int, stop: int, progress: Progress | None = None
) -> VerifyStats:
    """Compare the output's rows from files ``[first, stop)`` with those files.

    Raises
    ------
    OutputMismatchError
        Naming the dataset, the output row and the checkpoint file at fault.
    """
    stats = VerifyStats()
    with h5py.File(plan.job.temp, "r") as out:
        for file_index in range(first, stop):
            path = check_unchanged(plan, file_index)
            with open_checkpoint(path) as src:
                stats.files += 1
                for d in plan.datasets:
                    _verify_dataset(plan, d, file_index, src, out, stats, progress)
    return stats


def _verify_dataset(
    plan: Plan,
    d: DatasetPlan,
    file_index: int,
    src: h5py.File,
    out: h5py.File,
    stats: VerifyStats,
    progress: Progress | None,
) -> None:
    start, stop = d.rows_of(file_index)
    if stop == start:
        return
    source, output = src[d.name], out[d.name]
    step = block_rows(d.row_bytes, plan.block_bytes // 2)
    for lo in range(0, stop - start, step):
        hi = min(stop - start, lo + step)
        expected = read_rows(source, lo, hi)
        actual = read_rows(output, start + lo, start + hi)
        bad = first_difference(expected, actual)
        if bad is not None:
            raise OutputMismatchError(
                f"row {start + lo + bad} of dataset {d.name!r} in the output differs from "
                f"row {lo + bad} of checkpoint file {src.filename!r}"
            )
        stats.rows += hi - lo
        stats.bytes += expected.nbytes
        if progress:
            progress(stats.rows)
