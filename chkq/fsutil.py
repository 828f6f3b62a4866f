"""Durable file operations shared by the core: no reader ever sees a partial file."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from chkq.errors import OutputNotWritableError, OutputWriteError
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


#: errno values that mean "this filesystem cannot take the output": full, over quota,
#: read-only, file too large.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of ``path``, from /proc/self/mountinfo if readable."""
    real = os.path.realpath(path)
    best, kind = "/", "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if "-" not in fields:
                    continue
                point = fields[4].replace("\\040", " ")
                fstype = fields[fields.index("-") + 1]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fstype
    except OSError:
        pass
    return best, kind


def _size(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def describe_filesystem(path: Path) -> str:
    """The filesystem holding ``path``, for error messages: type, mount point, free space."""
    point, kind = _mount_of(path)
    try:
        fs = os.statvfs(path)
    except OSError:
        return f"filesystem {kind} mounted at {point!r}"
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    mode = ", read-only" if fs.f_flag & os.ST_RDONLY else ""
    return (f"filesystem {kind} mounted at {point!r}{mode}: {_size(free)} free of "
            f"{_size(total)}")


def check_writable_dir(directory: Path, what: str, *, as_this_user: bool = True) -> None:
    """Refuse a directory chkq could not write its output into, before any work starts.

    A read-only filesystem is refused whoever writes; with ``as_this_user``
    (the writer is this process's user), so is a directory this user may
    not create files in.

    Raises
    ------
    OutputNotWritableError
        Naming the directory and its filesystem.
    """
    try:
        readonly = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = False
    if readonly:
        raise OutputNotWritableError(
            f"{what} {str(directory)!r} is on a read-only file system "
            f"({describe_filesystem(directory)}): the output cannot be written there")
    if as_this_user and not os.access(directory, os.W_OK | os.X_OK):
        raise OutputNotWritableError(
            f"{what} {str(directory)!r} is not writable by this user (uid {os.geteuid()}): "
            "the output cannot be written there")


def write_failure(directory: Path, exc: OSError, file: Path | None = None) -> OutputWriteError:
    """``exc`` (a full disk, a quota, a read-only remount) restated with the file and filesystem.

    HDF5's own message names neither and spreads over several lines; its
    first sentence is kept.
    """
    named = exc.filename or file or directory
    detail = " ".join(str(exc.strerror or exc).split())
    detail = detail.split(" (file write failed")[0][:200]
    reason = os.strerror(exc.errno) if exc.errno else "write failed"
    said = "" if detail.lower() in ("", reason.lower()) else f"; {detail}"
    return OutputWriteError(
        exc.errno or errno.EIO,
        f"cannot write {str(named)!r}: {reason} ({describe_filesystem(directory)}){said}")
