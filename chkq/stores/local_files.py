"""The files a local directory store writes through: temporaries only the writer can reach.

A write's bytes go to a file with no name (``O_TMPFILE``) or in a directory of
the writer's own (mode 0700) at the store's root, and the name it then gets is
checked to be that very file (:class:`~chkq.stores.local.LocalDirectoryStore`, whose
uploads write through them too).
"""


from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat

from chkq.errors import SymlinkInStoreError
from chkq.fsutil import give_access
from chkq.rundir import CREATE, DIRECTORY, READ_NONBLOCK, fd_path
from chkq.stores.objects import FileAccess, ObjectVersion

__all__ = [
    "ANONYMOUS",
    "DEFAULT_MODE",
    "DIR_FLAGS",
    "PRIVATE_PREFIX",
    "READ_FLAGS",
    "TMP_DIR",
    "UPLOAD_SUFFIX",
    "PrivateFile",
    "remove_private",
    "reserved_name",
    "stamp_of",
]

log = logging.getLogger("chkq.stores.local")

TMP_DIR = ".chkq-tmp"
"""Top-level directory where earlier versions kept in-flight writes; never listed, never a
valid key (what is left in it is listed by :meth:`LocalDirectoryStore.stray_uploads`)."""

PRIVATE_PREFIX = ".chkq-tmp-"
"""Start of the name of a writer's own directory (mode 0700) at the root, made for one write
where the filesystem has no ``O_TMPFILE``; never listed, never a valid key."""

UPLOAD_SUFFIX = ".upload"
"""Ending of a temporary in ``.chkq-tmp`` that holds an upload's parts (earlier versions)."""

DEFAULT_MODE = 0o644
"""Mode (less the umask) of an object written without a :class:`~chkq.stores.base.FileAccess`."""

ANONYMOUS = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
"""Whether writes start as files with no name (``O_TMPFILE``, linked by descriptor), where
the filesystem has them."""

DIR_FLAGS = DIRECTORY
"""Flags a store opens its directories with (one component at a time, never through a link)."""
_TEMP_FLAGS = CREATE
READ_FLAGS = READ_NONBLOCK
"""Flags a store opens an object to read it with (never through a link, never blocking)."""




def stamp_of(found: os.stat_result) -> ObjectVersion:
    """The version of a local file as ``fstat`` gave it: its inode and modification time."""
    return ObjectVersion(found.st_size, f"ino-mtime:{found.st_ino}:{found.st_mtime_ns}")


def reserved_name(name: str) -> bool:
    """Whether a top-level name of the store is its own (temporaries), never a key."""
    return name == TMP_DIR or name.startswith(PRIVATE_PREFIX)


def remove_private(root: int, name: str) -> None:
    """Remove the private directory ``name`` of the root ``root`` and its files, if it is ours."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=root)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return
        raise
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return
        for member in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(member, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=root)


def _give(fd: int, access: FileAccess | None) -> None:
    """Give the file open as ``fd`` the mode, owner and group of ``access``, as far as we may.

    As a run directory's output gets them: the owner and group change where
    the writer may change them (a worker running as root, or as the owner);
    where it may not, the file stays the writer's, without group bits unless
    its group is the one asked for, so that no other group can read it.
    Without ``access`` the file keeps the mode it was created with.
    """
    if access is not None:
        give_access(fd, access.mode & 0o777, access.uid, access.gid)


class PrivateFile:
    """A new file of the store that only this process can reach until it is put into place.

    ``O_TMPFILE`` in the root (no name: nothing to swap, nothing left if
    the process dies), or, where the filesystem has none or ``named`` is
    asked, the file ``data`` in a new directory ``.chkq-tmp-<random>`` made
    here with mode 0700 and checked to be this user's. Created with
    :data:`DEFAULT_MODE` (less the umask); :meth:`give` sets its access.
    """

    def __init__(self, url: str, root: int, *, named: bool = False) -> None:
        self.url = url
        """The store's URL, for errors."""
        self.fd = -1
        self._root = -1
        self._dir = -1
        self.dir_name = ""
        """The private directory's name at the root ("" for a file with no name)."""
        if ANONYMOUS and not named:
            try:
                self.fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, DEFAULT_MODE,
                                  dir_fd=root)
                return
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        self._private(root)

    def _private(self, root: int) -> None:
        while True:
            name = f"{PRIVATE_PREFIX}{secrets.token_hex(16)}"
            try:
                os.mkdir(name, 0o700, dir_fd=root)
                break
            except FileExistsError:
                continue
        self._root = os.dup(root)
        self.dir_name = name
        try:
            self._dir = os.open(name, DIR_FLAGS, dir_fd=root)
            found = os.fstat(self._dir)
            if found.st_uid != os.geteuid() or stat.S_IMODE(found.st_mode) & 0o077:
                raise SymlinkInStoreError(
                    f"store {self.url}: the private directory {name!r} this write made "
                    "was replaced by another user's; nothing is written through it")
            self.fd = os.open("data", _TEMP_FLAGS, DEFAULT_MODE, dir_fd=self._dir)
        except BaseException:
            self.close()
            raise

    @classmethod
    def resume(cls, url: str, root: int, name: str) -> PrivateFile | None:
        """The file of the private directory ``name`` at ``root``, made by another process of
        this user's (a shared upload's), open to read and write; None if it is gone.

        Raises
        ------
        SymlinkInStoreError
            If ``name`` is a link, or a directory that is not this user's alone.
        """
        self = cls.__new__(cls)
        self.url, self.fd, self._root, self._dir, self.dir_name = url, -1, -1, -1, name
        try:
            self._dir = os.open(name, DIR_FLAGS, dir_fd=root)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SymlinkInStoreError(
                    f"store {url}: the private directory {name!r} is a symbolic link") from None
            raise
        try:
            found = os.fstat(self._dir)
            if found.st_uid != os.geteuid() or stat.S_IMODE(found.st_mode) & 0o077:
                raise SymlinkInStoreError(
                    f"store {url}: the private directory {name!r} is not this user's alone; "
                    "nothing is written through it")
            self._root = os.dup(root)
            try:
                self.fd = os.open("data", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  dir_fd=self._dir)
            except FileNotFoundError:
                self.detach()
                return None
        except BaseException:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Close the file and leave it where it is (another process goes on with it)."""
        for name in ("fd", "_dir", "_root"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def give(self, access: FileAccess | None) -> None:
        _give(self.fd, access)

    def link(self, parent: int, name: str, key: str) -> bool:
        """Link the file as ``name`` in ``parent``, create-if-absent; False if the name exists.

        The file is this write's: a writer that replaces the name afterwards (a plain put
        of the same key) is a later writer, not a swap; a publish proves the object it
        made by its version before and after its proof.
        """
        try:
            if self._dir < 0:
                os.link(fd_path(self.fd), name, dst_dir_fd=parent, follow_symlinks=True)
            else:
                os.link("data", name, src_dir_fd=self._dir, dst_dir_fd=parent,
                        follow_symlinks=False)
        except FileExistsError:
            return False
        return True

    def replace(self, parent: int, name: str, key: str) -> None:
        """Move the file (a named one) to ``name`` in ``parent``, replacing what is there.

        The last writer of a name wins: another write of the same key may replace this
        one at once, as this one replaced what was there, so the name is not checked.
        """
        assert self._dir >= 0
        os.replace("data", name, src_dir_fd=self._dir, dst_dir_fd=parent)

    def version(self) -> ObjectVersion:
        return stamp_of(os.fstat(self.fd))

    def close(self) -> None:
        """Close the file, and remove the private directory (with the file's name there)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._dir >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("data", dir_fd=self._dir)
            os.close(self._dir)
            self._dir = -1
        if self._root >= 0:
            with contextlib.suppress(OSError):
                os.rmdir(self.dir_name, dir_fd=self._root)
            os.close(self._root)
            self._root = -1
