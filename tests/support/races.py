"""Work that spawned processes race through, and the bytes they write.

multiprocessing's spawn start method pickles a function by its module's name, so what a
child runs must live in a module the child can import: a test module is not one (pytest
imports it under a name of its own).
"""

from __future__ import annotations

import multiprocessing

import numpy as np

from chkq.log import CheckpointLog
from chkq.stores import open_store


def blob(size: int, seed: int) -> bytes:
    """Deterministic incompressible bytes."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def mutate(data: bytes, fraction: float, seed: int, run: int = 32) -> bytes:
    """``data`` with ``fraction`` of its bytes rewritten in scattered ``run``-byte runs."""
    rng = np.random.default_rng(seed)
    array = np.frombuffer(data, dtype=np.uint8).copy()
    starts = rng.integers(0, len(data) - run, max(1, int(len(data) * fraction) // run))
    index = (starts[:, None] + np.arange(run)).ravel()
    array[index] ^= rng.integers(1, 256, index.size, dtype=np.uint8)
    return array.tobytes()


def commit_sequence(url: str, size: int, count: int, barrier: object) -> list[str]:
    """Commit the same ``count`` checkpoints to run ``shared`` once ``barrier`` lets all go."""
    log = CheckpointLog(open_store(url), "shared", max_chain=4)
    barrier.wait()  # type: ignore[attr-defined]
    data = blob(size, 12)
    parent = None
    ids = []
    for i in range(count):
        parent = log.commit(data, parent, step=i)
        ids.append(parent)
        data = mutate(data, 0.01, 1000 + i)
    return ids


def race_commits(url: str, writers: int, count: int, size: int = 4096) -> list[list[str]]:
    """``writers`` spawned processes run :func:`commit_sequence` at once; each one's ids."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(writers)
        with context.Pool(writers) as pool:
            return pool.starmap(commit_sequence, [(url, size, count, barrier)] * writers)


def put_if_absent_race(url: str, worker: int, keys: list[str], barrier: object) -> list[bool]:
    """``put_if_absent`` of each of ``keys`` once ``barrier`` lets all go; which ones it won."""
    store = open_store(url)
    barrier.wait()  # type: ignore[attr-defined]
    return [store.put_if_absent(key, f"writer {worker}".encode()) for key in keys]
