"""Whether a checkpoint file is complete: written to its end and closed by its writer.

A simulation writes ``trials_completed`` on a checkpoint's root just before
it closes the file; until the file is closed its writer's HDF5 file lock is
held. Watching and following a run take a file only once both hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import h5py

from chkq.consolidation.checkpoint_files import COMPLETE_ATTR
from chkq.consolidation.stamps import FileStamp
from chkq.lru import LRU


def is_complete(path: Path) -> bool:
    """True when the HDF5 file at ``path`` has ``trials_completed`` and is closed.

    The attribute can reach the disk a moment before its writer closes the
    file: until then the writer's HDF5 file lock is held (:func:`held_for_writing`)
    and the file's last metadata may not be written yet.
    """
    try:
        with h5py.File(path, "r", locking=False) as f:
            if COMPLETE_ATTR not in f.attrs:
                return False
    except (OSError, ValueError, KeyError, RuntimeError):
        return False
    return not held_for_writing(path)


def held_for_writing(path: Path) -> bool:
    """True when a process holds the file at ``path`` under an exclusive ``flock``.

    libhdf5 takes one on every file it opens for writing (unless file locking
    is turned off), so a held lock means a writer has it open now. A shared
    lock is tried and let go at once; a file that cannot be opened is not held.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


#: Checkpoint files seen complete, by path and stamp: one unchanged since is complete still.
_COMPLETE: LRU[tuple[str, FileStamp], bool] = LRU(65536)


def seen_complete(path: Path) -> bool:
    """:func:`is_complete`, opening by HDF5 only a file not seen complete as it is now.

    A follow looks at the run every fraction of a second; with
    :func:`is_complete` alone each look would open every checkpoint file of the run.
    """
    try:
        before = FileStamp.of(os.stat(path, follow_symlinks=False))
    except OSError:
        return False
    if _COMPLETE.get((str(path), before)):
        return True
    if not is_complete(path):
        return False
    with contextlib.suppress(OSError):
        if FileStamp.of(os.stat(path, follow_symlinks=False)) == before:
            _COMPLETE.put((str(path), before), True)
    return True
