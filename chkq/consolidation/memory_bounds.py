"""Refusing a run whose work a task could not do within its memory, or a job within its decoding.

What a file declares bounds what a task holds: a row (or a filtered
chunk's rows) must fit in a block (:func:`check_memory`); every attribute,
an element and a filtered chunk of the template's fixed data must fit in
one for the whole-output check (:func:`check_template_memory`); and the
run's filtered rows may decode to no more than the worker allows
(:func:`check_decoded`). Each refusal names what is at fault and the
setting that would allow it, before anything is written.
"""

from __future__ import annotations

from pathlib import Path

from h5py import h5a, h5d, h5f, h5o

from chkq.consolidation.checkpoint_files import MIN_HOLD_BYTES, FileScan, walk_objects
from chkq.consolidation.h5types import element_count, is_variable
from chkq.consolidation.plan import DatasetPlan
from chkq.errors import BadCheckpointError

#: What one element of a variable-length attribute costs the whole-output check, which
#: compares such attributes as Python values, the template's and the output's at once: a
#: sequence of one integer becomes a numpy array of about 180 bytes at its peak, a string a
#: bytes object of 33 bytes and more, each side. Its size in the file (16 bytes) is far less.
VARIABLE_ELEMENT_BYTES = 400


def check_decoded(datasets: list[DatasetPlan], paths: list[Path], max_decoded_bytes: int
                  ) -> None:
    """Refuse a run whose filtered rows decode to more than ``max_decoded_bytes``, all together.

    Filtered chunks may declare any multiple of their stored size (zstd,
    bzip2, Blosc and LZ4 store a chunk of zeros in a few dozen bytes), so
    what a file stores does not bound what decoding it costs. Each task
    decodes one chunk at a time (bounded by :func:`check_memory`) and about
    ``task_bytes`` of rows in all; this bounds the job, a forged file
    included, at what the worker's ``CHKQ_MAX_DECODED_BYTES`` allows.

    Raises
    ------
    BadCheckpointError
        Naming the run's total, the dataset and the file that declare most.
    """
    filtered = [d for d in datasets if d.mode == "chunks"]
    total = sum(d.total * d.row_bytes for d in filtered)
    if total <= max_decoded_bytes:
        return
    d = max(filtered, key=lambda d: d.total * d.row_bytes)
    index = max(range(len(paths)), key=lambda i: d.offsets[i + 1] - d.offsets[i])
    start, stop = d.rows_of(index)
    raise BadCheckpointError(
        f"the run's filtered datasets decode to {total} bytes, more than a job may decode "
        f"(CHKQ_MAX_DECODED_BYTES={max_decoded_bytes}); most of them in dataset '/{d.name}' "
        f"({d.total * d.row_bytes} bytes), of which checkpoint file {str(paths[index])!r} "
        f"declares {(stop - start) * d.row_bytes}: raise CHKQ_MAX_DECODED_BYTES if the run "
        "is meant to be this large; nothing was written")


def check_memory(scans: list[FileScan], block_bytes: int) -> None:
    """Refuse a run whose rows a task could not move within ``block_bytes`` at once.

    (Or within :data:`chkq.consolidation.checkpoint_files.MIN_HOLD_BYTES`, if that is larger.)

    Raises
    ------
    ValueError
        Naming the file, the dataset and the bytes it needs (:func:`memory_need`).
    """
    hold = max(block_bytes, MIN_HOLD_BYTES)
    for scan in scans:
        need, name = scan.memory
        if need > hold:
            raise BadCheckpointError(
                f"dataset '/{name}' of checkpoint file {str(scan.path)!r} needs {need} bytes "
                f"in memory at once (one row, or one chunk's rows when filtered), more than "
                f"a task may hold (CHKQ_BLOCK_BYTES={block_bytes}): raise CHKQ_BLOCK_BYTES "
                "or store smaller rows or chunks")


def check_template_memory(fid: h5f.FileID, reference: Path, block_bytes: int) -> None:
    """Refuse a template whose fixed data or attributes cannot be checked within a block.

    The whole-output check reads every attribute at once (HDF5 reads no
    part of one), an element at least, and a whole chunk of a filtered
    dataset (HDF5 decodes whole chunks); each must fit in ``block_bytes`` (or in
    :data:`chkq.consolidation.checkpoint_files.MIN_HOLD_BYTES`, if that is larger).

    Raises
    ------
    ValueError
        Naming the object and the bytes it needs.
    """
    where = f"checkpoint file {str(reference)!r}"
    hold = max(block_bytes, MIN_HOLD_BYTES)
    for raw, kind in [(b".", h5o.TYPE_GROUP), *walk_objects(fid, where)]:
        name = "" if raw == b"." else raw.decode("utf-8", "surrogateescape")
        obj = h5o.open(fid, raw)
        for index in range(h5a.get_num_attrs(obj)):
            attr = h5a.open(obj, index=index)
            tid, count = attr.get_type(), attr.get_space().get_simple_extent_npoints()
            need = count * (VARIABLE_ELEMENT_BYTES if is_variable(tid) else tid.get_size())
            if need > hold:
                label = attr.name.decode("utf-8", "surrogateescape")
                held = (f"{count} variable-length elements, {need} bytes as the Python objects "
                        "the whole-output check builds for them" if is_variable(tid)
                        else f"{need} bytes")
                raise BadCheckpointError(
                    f"attribute {label!r} of '/{name}' in {where} holds {held}, more than a "
                    f"task may hold (CHKQ_BLOCK_BYTES={block_bytes})")
        if kind != h5o.TYPE_DATASET:
            continue
        assert isinstance(obj, h5d.DatasetID)
        dcpl, size = obj.get_create_plist(), obj.get_type().get_size()
        need = size
        if dcpl.get_layout() == h5d.CHUNKED and dcpl.get_nfilters():
            need = size * element_count(dcpl.get_chunk())
        if need > hold:
            raise BadCheckpointError(
                f"dataset '/{name}' of {where} needs {need} bytes in memory at "
                "once (one element, or one chunk when filtered), more than a task "
                             f"may hold (CHKQ_BLOCK_BYTES={block_bytes})")
