"""Durable file operations shared by the core: no reader ever sees a partial file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from chkq.rundir import CREATE


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that names created or removed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_temp(directory: Path, stem: str) -> tuple[int, Path]:
    """Create a new, empty temporary file in ``directory``; return (fd, path).

    The name (``<stem>.<random>.tmp``) is unpredictable and the file is
    created with O_CREAT|O_EXCL|O_NOFOLLOW, so a file or symbolic link that
    someone planted at a temporary's name is never opened, truncated or
    written through (a predictable name like ``<stem>.<pid>.tmp`` could be).
    The mode is 0o666 less the umask, as for :func:`open`.
    """
    while True:
        temp = directory / f"{stem}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(temp, CREATE, 0o666), temp
        except FileExistsError:
            continue


def write_durably(path: Path, data: bytes | str, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary next to it.

    The temporary (hidden, randomly named, created exclusively without
    following links: see :func:`create_temp`) is renamed over ``path``
    (replacing it), or with ``exclusive`` hard-linked to it (FileExistsError
    if ``path`` exists), so no reader ever sees a partial file.
    """
    hidden = path.name if path.name.startswith(".") else f".{path.name}"
    raw = data.encode() if isinstance(data, str) else data
    fd, temp = create_temp(path.parent, hidden)
    try:
        with open(fd, "wb", closefd=True) as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            os.link(temp, path, follow_symlinks=False)
        else:
            os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(path.parent)
