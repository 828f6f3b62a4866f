"""Whether a checkpoint file is complete: written to its end and closed by its writer.

A simulation writes ``trials_completed`` on a checkpoint's root just before
it closes the file; until the file is closed its writer's HDF5 file lock is
held. Watching and following a run take a file only once both hold.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import h5py

from chkq.consolidation.checkpoint_files import COMPLETE_ATTR


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
