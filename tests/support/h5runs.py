"""Runs whose checkpoints are written by an h5py builder, and the check of a refused job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5a, h5d, h5f, h5s, h5t

from chkq.consolidation.checkpoint_files import chunk_index
from chkq.workers.client import submit_consolidation
from support.helpers import snapshot

TIMEOUT = 180


Builder = Callable[[h5py.File, int], None]


def mark_complete(path: Path) -> None:
    fid = h5f.open(str(path).encode(), h5f.ACC_RDWR)
    try:
        attr = h5a.create(fid, b"trials_completed", h5t.STD_U64LE, h5s.create(h5s.SCALAR))
        attr.write(np.array(1, dtype="<u8"))
    finally:
        fid.close()


def make_run(run: Path, build: Builder, checkpoints: int = 2, **options: object) -> list[Path]:
    """Checkpoints ``run_chkNNNNN.h5`` written by ``build(file, n)`` with h5py ``options``."""
    run.mkdir(exist_ok=True)
    files = []
    for n in range(1, checkpoints + 1):
        path = run / f"run_chk{n:05d}.h5"
        with h5py.File(path, "w", **options) as f:  # type: ignore[arg-type]
            build(f, n)
        mark_complete(path)
        files.append(path)
    return files


def refused(run: Path, pattern: str) -> str:
    """Consolidate ``run``; assert a ValueError matching ``pattern``, no output, nothing changed."""
    before = snapshot(run)
    with pytest.raises(ValueError, match=pattern) as caught:
        submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert snapshot(run) == before, "a refused job left or changed files"
    return str(caught.value)


def chunk_infos(dsid: h5d.DatasetID) -> list[h5d.StoreInfo]:
    """Every stored chunk of a chunked dataset, in HDF5's index order (one pass)."""
    return list(chunk_index(dsid, dsid.get_create_plist().get_chunk(), dsid.shape).values())
