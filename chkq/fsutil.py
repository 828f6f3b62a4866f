"""Durable file writes (no reader sees a partial file), writability checks, disk-full errors."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from chkq.errors import OutputExistsError, OutputNotWritableError, OutputWriteError
from chkq.rundir import CREATE


def write_temp(dir_fd: int, data: bytes | Iterable[bytes], mode: int = 0o600) -> str:
    """A new, randomly named, fsynced file in directory ``dir_fd`` holding ``data``; its name.

    The name (``.chkq-<random>.tmp``) is unpredictable and the file is
    created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, so a file or symbolic link
    someone planted at a temporary's name is never opened, truncated or
    written through. It is created 0600 and given ``mode & 0o777`` before any
    byte is written. ``data`` may be pieces, written as they come (a stream
    that raises is an error like any other). On any error nothing is left behind.
    """
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    for _ in range(16):
        temp = f".chkq-{secrets.token_hex(12)}.tmp"
        try:
            fd = os.open(temp, CREATE, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
        break
    else:
        raise OutputExistsError("could not create a temporary file")
    try:
        os.fchmod(fd, mode & 0o777)
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    os.close(fd)
    return temp


def install(dir_fd: int, name: str, data: bytes, *, mode: int = 0o600,
            replace: bool = False) -> None:
    """Put ``data`` at ``name`` in directory ``dir_fd`` durably: no reader sees a partial file.

    The bytes go to a temporary (:func:`write_temp`) that is then hard-linked
    to ``name`` — never replacing a file — or, with ``replace``, renamed over
    whatever is there (a link is replaced, not written through); both act on
    the name itself. The directory is fsynced, so the name survives a crash.

    Raises
    ------
    FileExistsError
        If ``name`` exists and ``replace`` is not given; nothing was changed.
    """
    temp = write_temp(dir_fd, data, mode)
    try:
        if replace:
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
    os.fsync(dir_fd)


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


def private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can enter, created (mode 0700) if missing.

    A working directory in a shared place (``/tmp``) may have been made
    beforehand by someone else, or be a link to their directory: what is
    there is used only if it is a real directory, this user's, and closed
    to others.

    Raises
    ------
    PermissionError
        If ``path`` is a link, not a directory, another user's, or open to
        group or others; the message names it.
    """
    with contextlib.suppress(FileExistsError):
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a link?)"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(info.st_mode):o}, not 700)"
    if problem is not None:
        raise PermissionError(errno.EACCES, f"scratch directory {str(path)!r} {problem}: "
                              "refused (set CHKQ_SCRATCH_DIR to a private directory)",
                              str(path))
    return path


def give_access(fd: int, mode: int, uid: int, gid: int) -> None:
    """Give the file open as ``fd`` ``mode``, owner ``uid`` and group ``gid``, as far as we may.

    The owner and group change where the writer may change them (a worker
    running as root, or as the owner); ``-1`` keeps the file's own. Where
    they cannot change, the file stays the writer's, and its group bits are
    dropped unless its group is ``gid``, so that no other group can read it.
    """
    found = os.fstat(fd)
    want_uid = uid if uid >= 0 else found.st_uid
    want_gid = gid if gid >= 0 else found.st_gid
    if (want_uid, want_gid) != (found.st_uid, found.st_gid):
        try:
            os.fchown(fd, want_uid, want_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, want_gid)
        found = os.fstat(fd)
    if gid < 0 or found.st_gid != gid:
        mode &= ~0o070
    os.fchmod(fd, mode)
