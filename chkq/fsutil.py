"""Durable file operations shared by the core: no reader ever sees a partial file."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that names created or removed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes | str, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary next to it.

    The temporary is renamed over ``path`` (replacing it), or with
    ``exclusive`` hard-linked to it (FileExistsError if ``path`` exists).
    """
    hidden = path.name if path.name.startswith(".") else f".{path.name}"
    temp = path.with_name(f"{hidden}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(temp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            os.link(temp, path)
        else:
            os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(path.parent)
