"""Reaching a run's files through descriptors, never through a symbolic link.

A run directory belongs to its owner, who is not trusted: at any moment
they may replace a checkpoint directory, a checkpoint file or the job's
temporary output by a symbolic link to a file the worker may read and they
may not. Opening by path checks a link only where ``O_NOFOLLOW`` applies,
the last component. Here every file of a run is reached from a descriptor
of the run directory, one component at a time, each opened with
``O_NOFOLLOW`` (``O_DIRECTORY`` for directories): a link at any level is
refused, never followed. The run directory itself is resolved once
(symbolic links and ``..``), checked against the allowed roots, opened
component by component from ``/`` in the same way and checked to be the
directory that was resolved (device and inode), and, where the plan
recorded it, the directory the job planned.

HDF5 opens a file the caller has opened through its magic link
``/proc/self/fd/N`` (:func:`fd_path`): the kernel resolves it to the open
file itself, whatever is now at the file's name, so HDF5 reads the very
inode whose identity was checked.

Every ``open`` flag combination used on a run's files, and on the other
files chkq creates next to them, is defined here once.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from chkq.access import resolve_allowed
from chkq.errors import BadNameError, CheckpointChangedError, SymlinkInRunError

#: Open an existing file for reading; refuse a link at the name.
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Open an existing file for reading without waiting on a FIFO or device planted at the name.
READ_NONBLOCK = READ | os.O_NONBLOCK
#: Open an existing file for writing (no truncation); refuse a link at the name.
WRITE = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Open a directory; refuse a link or anything but a directory at the name.
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Create a new file; refuse anything (file or link) already at the name.
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: A directory above the run, opened only to be passed through (``O_PATH``: it needs the
#: right to search it, not to list it, like a path lookup; a link is still refused).
_TRAVERSE = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_LINK_ERRORS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


def fd_path(fd: int) -> str:
    """The name through which a library (HDF5) opens the file open as ``fd``, not its path."""
    return f"/proc/self/fd/{fd}"


def _not_followed(shown: str | Path, at: str, exc: OSError) -> SymlinkInRunError:
    return SymlinkInRunError(
        f"{str(shown)!r} cannot be opened: {at!r} is a symbolic link or not a directory "
        f"({exc.strerror}); chkq follows no link in a run directory")


def open_directory(path: str | Path) -> int:
    """Open the absolute directory ``path`` from ``/``, no component a symbolic link.

    Returns the descriptor (the caller closes it).

    Raises
    ------
    ValueError
        If ``path`` is relative or has a ``.`` or ``..`` component.
    SymlinkInRunError
        If a component is a symbolic link or not a directory.
    FileNotFoundError
        If a component does not exist.
    """
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise BadNameError(f"directory {text!r} must be an absolute path")
    parts = [p for p in text.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise BadNameError(f"directory {text!r} must not contain '.' or '..'")
    fd = os.open("/", _TRAVERSE if parts else DIRECTORY)
    try:
        for index, part in enumerate(parts):
            flags = DIRECTORY if index == len(parts) - 1 else _TRAVERSE
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in _LINK_ERRORS:
                    raise _not_followed(text, "/" + "/".join(parts[:index + 1]), exc) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class RunDir:
    """A run directory open as a descriptor, and every file below it reached through it.

    Use :meth:`open` (a context manager). Paths given to the methods are
    either absolute paths below :attr:`path` (as plans record them) or
    relative to it; each is split into components, every directory among
    them opened with ``O_NOFOLLOW|O_DIRECTORY`` relative to the one above,
    the last component acted on relative to its parent's descriptor.

    Attributes
    ----------
    path
        The directory as the caller named it (files are named below it).
    fd
        The descriptor of the directory.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._folder: tuple[tuple[str, ...], int] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], roots: Sequence[str] = (),
             identity: Sequence[int] | None = None, exact: bool = False) -> RunDir:
        """Resolve ``path`` once, check it against ``roots``, open it without following links.

        Parameters
        ----------
        path
            The run directory (absolute).
        roots
            The allowed roots (``CHKQ_ALLOWED_ROOTS``); empty: any directory.
        identity
            ``[device, inode]`` the directory must have (the one the job
            planned), or None.
        exact
            ``path`` was resolved already (a job's directory, resolved when
            its message was checked): a symbolic link in it now means a
            component was swapped since, and is refused rather than resolved.

        Raises
        ------
        PermissionError
            If the resolved directory is outside ``roots``.
        SymlinkInRunError
            If a component of the directory is a link now (``exact``) or
            became one while it was opened.
        CheckpointChangedError
            If the directory opened is not the one resolved (or not
            ``identity``).
        FileNotFoundError, NotADirectoryError
            If it does not exist or is not a directory.
        """
        real = resolve_allowed(path, roots)
        if exact and str(real) != os.path.abspath(path):
            raise SymlinkInRunError(
                f"run directory {os.fspath(path)!r} now resolves to {str(real)!r}: a component "
                "of it was replaced by a symbolic link; chkq follows no link in a run directory")
        checked = os.stat(real)
        if not stat.S_ISDIR(checked.st_mode):
            raise NotADirectoryError(f"run directory {os.fspath(path)!r} is not a directory")
        fd = open_directory(real)
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
                raise CheckpointChangedError(
                    f"run directory {os.fspath(path)!r} was replaced while it was opened")
            if identity and [opened.st_dev, opened.st_ino] != list(identity):
                raise CheckpointChangedError(
                    f"run directory {os.fspath(path)!r} is no longer the directory the job "
                    "planned (it was moved or replaced)")
        except BaseException:
            os.close(fd)
            raise
        return cls(Path(os.path.abspath(path)), fd)

    def identity(self) -> list[int]:
        """``[device, inode]`` of the directory, for :meth:`open` to check later."""
        st = os.fstat(self.fd)
        return [st.st_dev, st.st_ino]

    def close(self) -> None:
        if self._folder is not None:
            os.close(self._folder[1])
            self._folder = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def split(self, path: str | os.PathLike[str]) -> tuple[tuple[str, ...], str]:
        """The directories and the name of ``path`` below the run directory.

        Raises
        ------
        ValueError
            If ``path`` is not below the run directory, or has a ``.``,
            ``..`` or empty component.
        """
        text = os.fspath(path)
        if os.path.isabs(text):
            base = os.fspath(self.path).rstrip("/") + "/"
            if not text.startswith(base):
                raise BadNameError(f"{text!r} is not inside the run directory {str(self.path)!r}")
            text = text[len(base):]
        parts = tuple(text.split("/"))
        if any(p in ("", ".", "..") for p in parts) or "\x00" in text:
            raise BadNameError(f"{os.fspath(path)!r} is not a plain name inside the run "
                             f"directory {str(self.path)!r}")
        return parts[:-1], parts[-1]

    def parent(self, path: str | os.PathLike[str]) -> tuple[int, str]:
        """The descriptor of ``path``'s directory (owned by this object) and its name.

        The last checkpoint directory opened is kept open, so that the files
        of one directory, used in turn, cost one ``openat`` each.
        """
        folders, name = self.split(path)
        if not folders:
            return self.fd, name
        if self._folder is not None and self._folder[0] == folders:
            return self._folder[1], name
        fd = self._walk(folders, path)
        if self._folder is not None:
            os.close(self._folder[1])
        self._folder = (folders, fd)
        return fd, name

    def _walk(self, folders: tuple[str, ...], shown: str | os.PathLike[str]) -> int:
        fd = self.fd
        try:
            for index, folder in enumerate(folders):
                try:
                    child = os.open(folder, DIRECTORY, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _LINK_ERRORS:
                        raise _not_followed(os.fspath(shown),
                                            str(self.path.joinpath(*folders[:index + 1])),
                                            exc) from None
                    raise
                if fd != self.fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != self.fd:
                os.close(fd)
            raise
        return fd

    def open_file(self, path: str | os.PathLike[str], flags: int = READ,
                  mode: int = 0o600) -> int:
        """Open ``path`` with ``flags`` (one of this module's), no link followed at any level.

        Returns a descriptor the caller closes.

        Raises
        ------
        SymlinkInRunError
            If any component of ``path`` is a symbolic link (or a directory
            component is not a directory).
        FileNotFoundError, FileExistsError
            As ``open(2)``.
        """
        fd, name = self.parent(path)
        try:
            return os.open(name, flags, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno in _LINK_ERRORS:
                raise _not_followed(os.fspath(path), os.fspath(path), exc) from None
            raise

    def open_dir(self, path: str | os.PathLike[str]) -> int:
        """Open the directory ``path`` (no link at any level); the caller closes it."""
        folders, name = self.split(path)
        return self._walk((*folders, name), path)

    def lstat(self, path: str | os.PathLike[str]) -> os.stat_result:
        """``lstat`` of ``path``, its directories reached without following links."""
        fd, name = self.parent(path)
        return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether anything (a link included) is at ``path``."""
        try:
            self.lstat(path)
        except FileNotFoundError:
            return False
        return True

    def unlink(self, path: str | os.PathLike[str], missing_ok: bool = True) -> None:
        """Remove the name ``path`` (a link itself, never its target)."""
        fd, name = self.parent(path)
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rename(self, source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        """Rename ``source`` over ``target``, both in the run directory itself."""
        (s_folders, s_name), (t_folders, t_name) = self.split(source), self.split(target)
        if s_folders or t_folders:
            raise BadNameError(f"{os.fspath(source)!r} and {os.fspath(target)!r} must be in the "
                             "run directory itself")
        os.rename(s_name, t_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link_descriptor(self, fd: int, target: str | os.PathLike[str]) -> None:
        """Hard-link the file open as ``fd`` to ``target`` (FileExistsError if taken).

        Through the descriptor's magic link (``linkat`` with
        ``AT_SYMLINK_FOLLOW`` on ``/proc/self/fd/N``), so the file linked is
        the one open, whatever is at its name now.
        """
        folders, name = self.split(target)
        if folders:
            raise BadNameError(f"{os.fspath(target)!r} must be in the run directory itself")
        os.link(fd_path(fd), name, dst_dir_fd=self.fd, follow_symlinks=True)

    def listdir(self) -> list[str]:
        """The names in the run directory itself."""
        return os.listdir(self.fd)

    def fsync(self) -> None:
        """fsync the run directory, so that names created or removed in it survive a crash."""
        os.fsync(self.fd)
