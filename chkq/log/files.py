"""Writing restored files without following links planted in the output directory.

Directories are walked one name at a time with ``O_NOFOLLOW``; data goes to
a randomly named temporary created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and is
then linked into place, never replacing a file (``force`` renames over it),
which acts on the name itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from chkq.errors import OutputExistsError
from chkq.fsutil import install
from chkq.log.records import checkpoint_id
from chkq.rundir import DIRECTORY, READ_NONBLOCK

__all__ = ["digest_at", "directory_at", "put_file", "write_output"]


def _open_dir_at(fd: int, name: str, *, create: bool, shown: str) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
    try:
        return os.open(name, DIRECTORY, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutputExistsError(
                f"{shown!r} is a symbolic link or not a directory; not followed") from None
        raise


@contextlib.contextmanager
def directory_at(root_fd: int, parts: list[str], root: Path) -> Iterator[int]:
    """fd of ``root/parts...``, created as needed, never through a link."""
    fd = os.dup(root_fd)
    try:
        shown = root
        for part in parts:
            shown = shown / part
            child = _open_dir_at(fd, part, create=True, shown=str(shown))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def digest_at(dir_fd: int, name: str, shown: str) -> str | None:
    """SHA-256 of the regular file ``name`` in ``dir_fd`` (None if missing); links refused."""
    try:
        fd = os.open(name, READ_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputExistsError(f"{shown!r} is a symbolic link; not overwritten") from None
        raise
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OutputExistsError(f"{shown!r} exists and is not a regular file")
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def put_file(dir_fd: int, name: str, shown: str, data: bytes, wanted: str, mode: int, *,
         force: bool = False, hint: str = "",
         refusal: type[FileExistsError] = OutputExistsError) -> bool:
    """Install ``data`` (checkpoint id ``wanted``) at ``name``; False if it was already there.

    A file already at ``name`` with the same bytes is kept; one with other
    bytes, a link or not a regular file is refused (``refusal`` naming
    ``shown``), unless ``force`` renames over it.
    """
    if not force and digest_at(dir_fd, name, shown) == wanted:
        return False
    try:
        install(dir_fd, name, data, mode=mode, replace=force)
    except FileExistsError:
        if digest_at(dir_fd, name, shown) == wanted:
            return False
        raise refusal(f"{shown!r} exists with other content; not overwritten{hint}") from None
    return True


def write_output(path: str | Path, data: bytes, *, mode: int = 0o600,
                 force: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (``chkq log pull -o``); return the path.

    The bytes go to a random ``O_EXCL|O_NOFOLLOW`` temporary next to
    ``path`` with permission bits ``mode & 0o777``, are fsynced and linked
    into place, never replacing a file: a file already there with the same
    bytes is kept, one with other bytes (or a symbolic link) is refused.
    With ``force`` the temporary is renamed over whatever is at ``path`` (a
    link is replaced, not written through).

    Raises
    ------
    FileExistsError
        If ``path`` exists with other content, or is a link or not a regular
        file, and ``force`` is not given; the message names it.
    """
    target = Path(path).absolute()
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        put_file(dir_fd, target.name, str(target), data, checkpoint_id(data), mode,
             force=force, hint=" (--force replaces it)", refusal=FileExistsError)
    finally:
        os.close(dir_fd)
    return target
