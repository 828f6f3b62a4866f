"""What the test processes of one machine share, changed by one process at a time.

Tests run side by side (pytest-xdist): a change to the machine itself (an account, a
subnet, the mode of a directory) is made under a file lock in :data:`SHARED_DIR`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: Lock and state files of the machine's test processes.
SHARED_DIR = Path(tempfile.gettempdir()) / "chkq-test-machine"


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[int]:
    """Hold ``SHARED_DIR/name`` locked (exclusive); yields its descriptor."""
    SHARED_DIR.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(SHARED_DIR / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
