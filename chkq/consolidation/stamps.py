"""Identity of the files a job reads and writes, checked at every use.

A run directory is writable by its owner, who is not trusted: between
planning and copying, a checkpoint could be rewritten in place (same size
and inode, mtime restored) or replaced by a symbolic link to a file the
worker may read and the owner may not. Each file a job uses is recorded when
the job plans (size, mtime, ctime, inode, device), from the descriptor the
scan reads (opened through :mod:`chkq.rundir`, no link followed at any
level), and every later open checks the *opened* descriptor against that
record, so a swap between check and open is caught too.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from chkq.errors import BadCheckpointError, CheckpointChangedError
from chkq.rundir import RunDir


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of one file: size, times (ns), inode and device."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def as_list(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ctime_ns, self.inode, self.device]


def stamp_of(path: str | Path, st: os.stat_result) -> FileStamp:
    """The stamp of a regular file from its ``fstat`` (or ``lstat``), refusing anything else.

    Raises
    ------
    ValueError
        If ``st`` is of a symbolic link or not of a regular file.
    """
    if stat.S_ISLNK(st.st_mode):
        raise BadCheckpointError(f"{str(path)!r} is a symbolic link: chkq does not follow links "
                         "in a run directory")
    if not stat.S_ISREG(st.st_mode):
        raise BadCheckpointError(f"{str(path)!r} is not a regular file")
    return FileStamp.of(st)


def check_same(path: str | Path, expected: FileStamp, st: os.stat_result, why: str) -> None:
    """Raise CheckpointChangedError naming ``path`` unless ``st`` matches ``expected``."""
    if not stat.S_ISREG(st.st_mode) or FileStamp.of(st) != expected:
        raise CheckpointChangedError(f"file {str(path)!r} {why}")


def _disappeared(path: str | Path, job: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"checkpoint file {str(path)!r} disappeared while job {job} was running")


def open_unchanged(run: RunDir, path: str | Path, expected: FileStamp, job: str) -> int:
    """Open ``path`` read-only through ``run``, no link followed, if it is still ``expected``.

    The identity compared is the opened descriptor's (``fstat``), so a swap
    of any component between a check and the open is caught. Returns the
    descriptor; the caller closes it.
    """
    try:
        fd = run.open_file(path)
    except FileNotFoundError:
        raise _disappeared(path, job) from None
    except CheckpointChangedError:
        raise
    except OSError as exc:
        raise CheckpointChangedError(
            f"checkpoint file {str(path)!r} cannot be opened as it was planned ({exc})") from None
    try:
        check_same(path, expected, os.fstat(fd), f"changed while job {job} was running")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_descriptor(path: str | Path, fd: int, inode: int) -> None:
    """Raise CheckpointChangedError unless descriptor ``fd`` is the file of inode ``inode``."""
    if os.fstat(fd).st_ino != inode:
        raise CheckpointChangedError(
            f"{str(path)!r} was replaced by another file while the job was using it")
