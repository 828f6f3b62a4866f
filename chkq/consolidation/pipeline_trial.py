"""Copy a dataset's pipeline into a small file image; encode and decode a chunk in it.

Run by :func:`chkq.consolidation.filter_pipelines.pipeline_image` in a process of
its own, as ``python -m chkq.consolidation.pipeline_trial SOURCE NAME
SCRATCH``: HDF5 and a filter plugin given parameters another
implementation wrote may fail on them, or corrupt the memory of the
process they run in. Writes the image to standard output and exits 0 when
a chunk of zeros comes back as zeros; else prints why and exits 1 (a crash
exits otherwise).
"""

from __future__ import annotations

import sys

import hdf5plugin  # noqa: F401  (registers the plugin filters the pipeline may use)
import numpy as np
from h5py import h5d, h5f, h5o, h5p, h5s

from chkq.consolidation.filter_pipelines import core_file
from chkq.consolidation.h5types import opaque_dtype


def empty_copy(source: str, name: str, scratch: str) -> bytes:
    """The image of a file holding ``/data``: an empty copy of ``name`` of file ``source``.

    ``H5Ocopy`` without attributes into ``scratch`` (truncated), shrunk to
    no rows there, copied again into a file held in memory.
    """
    copypl = h5p.create(h5p.OBJECT_COPY)
    copypl.set_copy_object(h5o.COPY_WITHOUT_ATTR_FLAG)
    fid = h5f.open(source.encode(), h5f.ACC_RDONLY)
    staged = h5f.create(scratch.encode(), h5f.ACC_TRUNC)
    try:
        h5o.copy(fid, name.encode("utf-8", "surrogateescape"), staged, b"data", copypl=copypl)
        dsid = h5d.open(staged, b"data")
        dsid.set_extent((0, *dsid.shape[1:]))
        dsid.close()
        small = core_file()
        try:
            h5o.copy(staged, b"data", small, b"data", copypl=copypl)
            h5f.flush(small)
            return bytes(small.get_file_image())
        finally:
            small.close()
    finally:
        staged.close()
        fid.close()


def trial(image: bytes) -> None:
    """Write a chunk's rows of zeros into ``/data`` of ``image``, read them back decoded.

    Raises
    ------
    ValueError
        If they do not come back as zeros (errors of HDF5 itself pass through).
    """
    fid = core_file(image)
    try:
        dsid = h5d.open(fid, b"data")
        tid = dsid.get_type()
        shape = (dsid.get_create_plist().get_chunk()[0], *dsid.shape[1:])
        dsid.set_extent(shape)
        zeros = np.zeros(shape, dtype=opaque_dtype(tid))
        dsid.write(h5s.ALL, h5s.ALL, zeros, mtype=tid)
        dsid.close()
        back = np.ones(shape, dtype=opaque_dtype(tid))
        h5d.open(fid, b"data").read(h5s.ALL, h5s.ALL, back, mtype=tid)
    finally:
        fid.close()
    if back.tobytes() != zeros.tobytes():
        raise ValueError("a chunk of zeros did not decode to zeros")


def main(argv: list[str]) -> int:
    source, name, scratch = argv
    try:
        image = empty_copy(source, name, scratch)
        trial(image)
    except (ValueError, RuntimeError, OSError, KeyError, TypeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(image)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
