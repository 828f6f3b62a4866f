"""A store in a local (or shared POSIX) directory: ``file:///abs/dir``.

Whoever can write to the directory is a party of its own: a symbolic link
planted in the store, at a directory or at a temporary's name, must never
send a worker's reads, writes or deletes elsewhere. So every operation walks
from the store's root one name at a time with ``openat(O_NOFOLLOW)`` and
acts relative to the directory it reached (``*at`` system calls); a link
anywhere in the way is refused. Nor does a write ever pass through a
directory another user can write: its bytes go to a file only the writer can
reach (see :class:`LocalDirectoryStore`), and the name it gets is checked to
be that very file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from chkq.errors import (
    BadNameError,
    SymlinkInStoreError,  # noqa: F401 (re-exported)
)
from chkq.rundir import fd_path
from chkq.stores.base import (
    CheckpointStore,
    InvalidKeyError,
    ObjectVersion,
    PartsUpload,
    StrayUpload,
    validate_key,
)
from chkq.stores.local_files import (
    PRIVATE_PREFIX,
    TMP_DIR,
    UPLOAD_SUFFIX,
    PrivateFile,
    remove_private,
    stamp_of,
)
from chkq.stores.local_tree import StoreTree, still_pinned
from chkq.stores.local_upload import LocalUpload, SharedPrivateFile
from chkq.stores.shared_upload import PartRecord, SharedUpload

__all__ = ["LocalDirectoryStore", "SymlinkInStoreError"]

log = logging.getLogger(__name__)

class LocalDirectoryStore(CheckpointStore):
    """Objects as files under one directory.

    Every write goes to a file that no other user can reach: an ``O_TMPFILE``
    file of the store's filesystem (no name at all, so a killed writer leaves
    nothing), or, where the filesystem has none (NFS), a file in a new
    directory of the writer's own (``<root>/.chkq-tmp-<random>``, mode
    0700, removed afterwards). It gets its mode and owner
    (:class:`~chkq.stores.base.FileAccess`) before it has a name, is
    fsynced, and is then put into place: by ``linkat`` of its descriptor
    for :meth:`put_if_absent` and uploads (atomic create: the kernel refuses
    with EEXIST if the name exists, across processes and NFS clients alike),
    by ``renameat`` out of the private directory for :meth:`put` (atomic
    replace). The name made is then checked to be that very file (device and
    inode). The containing directory is fsynced too, so an acknowledged
    write survives a crash. Readers therefore never see a partial object, and
    no directory another user could own (a ``.chkq-tmp`` someone planted) is
    ever written through.

    Reads never write: the root is created on the first write, not when
    the store is opened or read.  Symbolic links inside the
    store are never followed (see the module docstring): an operation that
    meets one raises :class:`SymlinkInStoreError`, and listings skip them.

    Parameters
    ----------
    root
        Absolute path of the directory; resolved with ``realpath`` once, here.
    must_exist
        If True the root is never created, and every operation on a missing
        root raises FileNotFoundError naming the store (read-only commands).
        If False (default) a missing root is created on the first write and
        reads of it find nothing.
    """

    def __init__(self, root: str | os.PathLike[str], *, must_exist: bool = False) -> None:
        text = os.fspath(root)
        if "\x00" in text:
            raise BadNameError(f"LocalDirectoryStore path {text!r} contains a NUL byte")
        if not os.path.isabs(text):
            raise BadNameError(f"LocalDirectoryStore needs an absolute path, got {text!r}")
        self._root = Path(os.path.realpath(text))
        self._tree = StoreTree(self._root, self.url, must_exist)

    @property
    def root(self) -> Path:
        """The directory holding the objects (resolved: no link, no ``..``)."""
        return self._root

    @property
    def url(self) -> str:
        return self._root.as_uri()

    # writing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _temp(self, data: bytes, *, named: bool = False) -> Iterator[PrivateFile]:
        """A new fsynced file of the store holding ``data`` that only this process can reach.

        ``named``: in a private directory (a rename needs a name to move),
        even where the filesystem has ``O_TMPFILE``.
        """
        temp = self._tree.new_file(named=named)
        try:
            temp.write(data)
            os.fsync(temp.fd)
            yield temp
        finally:
            temp.close()

    def _put(self, key: str, data: bytes) -> None:
        with self._tree.parent(key, create=True) as (parent, name):
            assert parent is not None
            with self._temp(data, named=True) as temp:
                temp.replace(parent, name, key)
            os.fsync(parent)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        with self._tree.parent(key, create=True) as (parent, name):
            assert parent is not None
            if self._tree.lstat(parent, name) is not None:
                return False
            with self._temp(data) as temp:
                if not temp.link(parent, name, key):
                    return False
            os.fsync(parent)
        return True

    # reading ---------------------------------------------------------------------

    def _get(self, key: str) -> bytes:
        return self._read(key, -1)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        return self._read(key, length, start)

    def _size(self, key: str) -> int:
        with self._tree.parent(key, create=False) as (parent, name):
            found = self._tree.lstat(parent, name)
        if found is None or not stat.S_ISREG(found.st_mode):
            raise KeyError(key)
        return found.st_size

    def _read(self, key: str, size: int, offset: int = 0) -> bytes:
        """The object's ``size`` bytes from ``offset`` (all for -1)."""
        with self._tree.object_fd(key) as fd:
            if fd is None:
                raise KeyError(key)
            with open(fd, "rb", closefd=False) as fh:
                if offset:
                    fh.seek(offset)
                return fh.read(size)

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._read(key, limit + 1)

    def _version(self, key: str) -> ObjectVersion:
        with self._tree.parent(key, create=False) as (parent, name):
            found = self._tree.lstat(parent, name)
        if found is None or not stat.S_ISREG(found.st_mode):
            raise KeyError(key)
        return stamp_of(found)

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        with self._tree.pinned(key, pinned) as fd:
            if fd is None:
                return None
            data = os.pread(fd, length, start)
            return data if still_pinned(fd, pinned) else None

    @property
    def supports_links(self) -> bool:
        return True

    def link_from(self, key: str, fd: int) -> ObjectVersion | None:
        """Make the local file open as ``fd`` the object ``key`` by a hard link, create-if-absent.

        Where the store is a directory on the file's own filesystem, no byte
        is copied: the object is the file itself, with its mode and owner.
        The descriptor is linked (``/proc/self/fd``), not a name, and the
        name made is checked to be that file. ``linkat`` fails if the key
        exists, so this is create-if-absent against every other writer.

        Returns
        -------
        ObjectVersion or None
            The object's version (the file's inode and modification time), or
            None if an object already had the key.

        Raises
        ------
        OSError
            If the file cannot be linked there (another filesystem, no
            ``/proc``, or a file the kernel will not let this user link); the
            caller copies.
        StoredBytesMismatchError
            If another file took the name right after the link.
        """
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "only a regular file is linked into a store", key)
        with self._tree.parent(validate_key(key), create=True) as (parent, name):
            assert parent is not None
            if self._tree.lstat(parent, name) is not None:
                return None
            try:
                os.link(fd_path(fd), name, dst_dir_fd=parent, follow_symlinks=True)
            except FileExistsError:
                return None
            self._tree.check_linked(parent, name, fd, key)
            os.fsync(parent)
        return stamp_of(os.fstat(fd))

    def link_to(self, key: str, pinned: ObjectVersion, dir_fd: int, name: str) -> bool:
        """Hard-link the object ``key``, if it is still ``pinned``, as ``name`` in ``dir_fd``.

        A fetch from a directory on the fetcher's filesystem then copies no
        byte; the link is the pinned file itself (a later replacement of the
        object makes a new file and leaves it as it was).

        Returns
        -------
        bool
            False if the object is missing or not the pinned version (nothing is left).

        Raises
        ------
        FileExistsError
            If ``name`` exists in ``dir_fd``.
        OSError
            If the object cannot be linked there (another filesystem, or a
            file the kernel will not let this user link); the caller copies.
        """
        with self._tree.parent(validate_key(key), create=False) as (parent, source):
            if parent is None:
                return False
            try:
                os.link(source, name, src_dir_fd=parent, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return False
        found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode) or stamp_of(found) != pinned:
            os.unlink(name, dir_fd=dir_fd)
            return False
        return True

    def _exists(self, key: str) -> bool:
        with self._tree.parent(key, create=False) as (parent, name):
            found = self._tree.lstat(parent, name)
            return found is not None and stat.S_ISREG(found.st_mode)

    def _list(self, prefix: str) -> list[str]:
        return self._tree.keys(prefix)

    def _delete(self, key: str) -> None:
        with self._tree.parent(key, create=False) as (parent, name):
            if parent is None:
                return
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(name, dir_fd=parent)

    def _modified(self, key: str) -> float:
        with self._tree.parent(key, create=False) as (parent, name):
            found = self._tree.lstat(parent, name)
            if found is None or not stat.S_ISREG(found.st_mode):
                raise KeyError(key)
            return found.st_mtime

    # publishing from parts -----------------------------------------------------------

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        return LocalUpload(self, self._tree, key)

    def _stray_uploads(self, prefix: str) -> list[StrayUpload]:
        """What killed writers left: this user's private directories, old ``.chkq-tmp`` uploads.

        An ``O_TMPFILE`` write leaves nothing to list.
        """
        fd = self._tree.open_root(create=False)
        if fd is None:
            return []
        try:
            found = []
            for name in os.listdir(fd):
                seen = self._tree.lstat(fd, name)
                if (name.startswith(PRIVATE_PREFIX) and seen is not None
                        and stat.S_ISDIR(seen.st_mode) and seen.st_uid == os.geteuid()):
                    found.append(StrayUpload("", name, seen.st_mtime))
        finally:
            os.close(fd)
        tmp = self._tree.open_dir([TMP_DIR], create=False)
        if tmp is not None:
            try:
                for name in os.listdir(tmp):
                    seen = self._tree.lstat(tmp, name)
                    if name.endswith(UPLOAD_SUFFIX) and seen is not None \
                            and stat.S_ISREG(seen.st_mode):
                        found.append(StrayUpload("", name, seen.st_mtime))
            finally:
                os.close(tmp)
        return sorted(found, key=lambda stray: stray.upload_id)

    def _abort_upload(self, stray: StrayUpload) -> None:
        name = stray.upload_id
        private = name.startswith(PRIVATE_PREFIX)
        if "/" in name or not (private or name.endswith(UPLOAD_SUFFIX)) \
                or (name.startswith(".") and not private):
            raise InvalidKeyError(f"store {self.url}: {name!r} is not an upload of this store")
        fd = self._tree.open_dir([] if private else [TMP_DIR], create=False)
        if fd is None:
            return
        try:
            if private:
                remove_private(fd, name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    # shared uploads ------------------------------------------------------------------

    @property
    def copies_ranges(self) -> bool:
        return True

    @property
    def supports_shared_uploads(self) -> bool:
        return True

    @property
    def _shared(self) -> SharedPrivateFile:
        return SharedPrivateFile(self, self._tree)

    def _begin_shared_upload(self, key: str) -> SharedUpload:
        return self._shared.begin(key)

    def _put_part(self, upload: SharedUpload, number: int, data: bytes,
                  offset: int) -> PartRecord:
        return self._shared.put(upload, number, data, offset)

    def _copy_part(self, upload: SharedUpload, number: int, source_key: str,
                   pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        return self._shared.copy(upload, number, source_key, pinned, start, length, offset)

    def _complete_shared_upload(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        return self._shared.complete(upload, parts)

    def _abort_shared_upload(self, upload: SharedUpload) -> None:
        self._shared.abort(upload)
