"""A store in a local (or shared POSIX) directory: ``file:///abs/dir``.

Whoever can write to the directory is a party of its own: a symbolic link
planted in the store, at a directory or at a temporary's name, must never
send a worker's reads, writes or deletes elsewhere. So every operation walks
from the store's root one name at a time with ``openat(O_NOFOLLOW)`` and
acts relative to the directory it reached (``*at`` system calls); a link
anywhere in the way is refused.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from chkq.errors import (
    BadNameError,
    SymlinkInStoreError,  # noqa: F401 (re-exported)
)
from chkq.rundir import CREATE, DIRECTORY, READ_NONBLOCK
from chkq.stores.base import (
    CheckpointStore,
    InvalidKeyError,
    ObjectVersion,
    PartsUpload,
    StrayUpload,
    validate_key,
)

__all__ = ["LocalDirectoryStore", "SymlinkInStoreError"]

log = logging.getLogger(__name__)

MAX_KEY_DEPTH = 32
"""Deepest key (in ``/``-separated components) a listing descends to."""

TMP_DIR = ".chkq-tmp"
"""Top-level directory holding in-flight writes; never listed, never a valid key."""

UPLOAD_SUFFIX = ".upload"
"""Ending of a temporary in ``.chkq-tmp`` that holds an upload's parts."""

_DIR_FLAGS = DIRECTORY
_TEMP_FLAGS = CREATE
_READ_FLAGS = READ_NONBLOCK


class LocalDirectoryStore(CheckpointStore):
    """Objects as files under one directory.

    Every write goes to a randomly named file in ``<root>/.chkq-tmp/``,
    created with O_CREAT|O_EXCL|O_NOFOLLOW (same file system, so the final
    step is a metadata operation), is fsynced, and is then moved into place:
    ``renameat`` for :meth:`put` (atomic replace) or ``linkat`` for
    :meth:`put_if_absent` (atomic create: the kernel refuses with EEXIST if
    the name exists, across processes and NFS clients alike).  The containing
    directory is fsynced too, so an acknowledged write survives a crash.
    Readers therefore never see a partial object, and the temporary
    directory is excluded from listings.

    Reads never write: the root and ``.chkq-tmp`` are created on the first
    write, not when the store is opened or read.  Symbolic links inside the
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
        self._must_exist = must_exist

    @property
    def root(self) -> Path:
        """The directory holding the objects (resolved: no link, no ``..``)."""
        return self._root

    @property
    def url(self) -> str:
        return self._root.as_uri()

    # walking without following links ------------------------------------------

    def _missing(self) -> FileNotFoundError:
        return FileNotFoundError(
            errno.ENOENT, f"store {self.url} does not exist (no directory {str(self._root)!r})")

    def _refuse_link(self, where: str) -> SymlinkInStoreError:
        return SymlinkInStoreError(
            f"store {self.url}: {where!r} is a symbolic link (or not a plain directory); "
            "a store never follows links")

    def _open_root(self, create: bool) -> int | None:
        """fd of the root; None if it is missing and ``create`` is False."""
        try:
            return os.open(self._root, _DIR_FLAGS)
        except FileNotFoundError:
            if self._must_exist:
                raise self._missing() from None
            if not create:
                return None
        except OSError as exc:
            if exc.errno == errno.ELOOP or os.path.islink(self._root):
                raise self._refuse_link(str(self._root)) from None
            if exc.errno == errno.ENOTDIR:
                raise NotADirectoryError(
                    errno.ENOTDIR, f"store {self.url}: {str(self._root)!r} is not a directory"
                ) from None
            raise
        os.makedirs(self._root, exist_ok=True)
        return os.open(self._root, _DIR_FLAGS)

    def _open_dir(self, parts: Sequence[str], create: bool) -> int | None:
        """fd of ``root/parts``, each name opened with O_NOFOLLOW relative to the last.

        Missing directories are created if ``create``, else None is returned
        (a name that is a file counts as missing).

        Raises
        ------
        SymlinkInStoreError
            If a name on the way is a symbolic link.
        """
        fd = self._open_root(create)
        if fd is None:
            return None
        try:
            for depth, name in enumerate(parts):
                child = self._open_child(fd, parts, depth)
                if child is None and create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)
                    child = self._open_child(fd, parts, depth)
                if child is None:
                    if create:
                        raise FileNotFoundError(
                            errno.ENOENT, f"store {self.url}: cannot create directory",
                            "/".join(parts[: depth + 1]))
                    os.close(fd)
                    return None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_child(self, fd: int, parts: Sequence[str], depth: int) -> int | None:
        """Open directory ``parts[depth]`` in ``fd`` without following a link.

        Returns None if the name is missing or is a file (a key's prefix
        that is not a directory holds no keys).

        Raises
        ------
        SymlinkInStoreError
            If the name is a symbolic link (Linux answers ELOOP or ENOTDIR).
        """
        name = parts[depth]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            loop = exc.errno == errno.ELOOP
        found = self._lstat(fd, name)
        if loop or (found is not None and stat.S_ISLNK(found.st_mode)):
            raise self._refuse_link("/".join(parts[: depth + 1]))
        return None

    @contextlib.contextmanager
    def _parent(self, key: str, create: bool) -> Iterator[tuple[int | None, str]]:
        """(fd of the key's directory or None if missing, the key's last name)."""
        parts = self._parts(key)
        fd = self._open_dir(parts[:-1], create)
        try:
            yield fd, parts[-1]
        finally:
            if fd is not None:
                os.close(fd)

    def _parts(self, key: str) -> list[str]:
        parts = key.split("/")
        if parts[0] == TMP_DIR:
            raise InvalidKeyError(f"invalid store key {key!r}: {TMP_DIR!r} is reserved")
        return parts

    def _lstat(self, fd: int | None, name: str) -> os.stat_result | None:
        """lstat of ``name`` in directory ``fd``; None if it (or the directory) is missing."""
        if fd is None:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    # writing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _tmp_dir(self) -> Iterator[int]:
        """fd of ``.chkq-tmp`` (created on the first write; a link there is refused).

        Opened before anything else of a write, so that a refused write
        creates nothing.
        """
        fd = self._open_dir([TMP_DIR], create=True)
        assert fd is not None
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _temp(self, tmp_fd: int, data: bytes) -> Iterator[str]:
        """The name, in directory ``tmp_fd``, of a new fsynced file holding ``data``.

        The name is random and the file is created with O_EXCL|O_NOFOLLOW, so
        a link planted at any name can never be written through; the
        temporary is removed on the way out unless it was moved away.
        """
        while True:
            name = f"{secrets.token_hex(16)}.tmp"
            try:
                fd = os.open(name, _TEMP_FLAGS, 0o644, dir_fd=tmp_fd)
                break
            except FileExistsError:
                continue
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            yield name
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=tmp_fd)

    def _put(self, key: str, data: bytes) -> None:
        with self._tmp_dir() as tmp, self._parent(key, create=True) as (parent, name):
            assert parent is not None
            with self._temp(tmp, data) as temp:
                os.replace(temp, name, src_dir_fd=tmp, dst_dir_fd=parent)
            os.fsync(parent)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        with self._tmp_dir() as tmp, self._parent(key, create=True) as (parent, name):
            assert parent is not None
            if self._lstat(parent, name) is not None:
                return False
            with self._temp(tmp, data) as temp:
                try:
                    os.link(temp, name, src_dir_fd=tmp, dst_dir_fd=parent,
                            follow_symlinks=False)
                except FileExistsError:
                    return False
            os.fsync(parent)
        return True

    # reading ---------------------------------------------------------------------

    def _get(self, key: str) -> bytes:
        return self._read(key, -1)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        return self._read(key, length, start)

    def _size(self, key: str) -> int:
        with self._parent(key, create=False) as (parent, name):
            found = self._lstat(parent, name)
        if found is None or not stat.S_ISREG(found.st_mode):
            raise KeyError(key)
        return found.st_size

    def _read(self, key: str, size: int, offset: int = 0) -> bytes:
        """The object's ``size`` bytes from ``offset`` (all for -1)."""
        with self._parent(key, create=False) as (parent, name):
            if parent is None:
                raise KeyError(key)
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=parent)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise KeyError(key) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refuse_link(key) from None
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, FIFO, device...
                os.close(fd)
                raise KeyError(key)
            with open(fd, "rb", closefd=True) as fh:
                if offset:
                    fh.seek(offset)
                return fh.read(size)

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._read(key, limit + 1)

    @staticmethod
    def _stamp(found: os.stat_result) -> ObjectVersion:
        return ObjectVersion(found.st_size, f"ino-mtime:{found.st_ino}:{found.st_mtime_ns}")

    def _version(self, key: str) -> ObjectVersion:
        with self._parent(key, create=False) as (parent, name):
            found = self._lstat(parent, name)
        if found is None or not stat.S_ISREG(found.st_mode):
            raise KeyError(key)
        return self._stamp(found)

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        with self._parent(key, create=False) as (parent, name):
            if parent is None:
                return None
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=parent)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refuse_link(key) from None
                raise
            try:
                before = os.fstat(fd)
                if not stat.S_ISREG(before.st_mode) or self._stamp(before) != pinned:
                    return None
                data = os.pread(fd, length, start)
                if self._stamp(os.fstat(fd)) != pinned:
                    return None
                return data
            finally:
                os.close(fd)

    def link_from(self, key: str, path: str | os.PathLike[str]) -> bool:
        """Make the local file ``path`` the object ``key`` by a hard link, create-if-absent.

        Where the store is a directory on the file's own filesystem, no byte
        is copied: the object is the file itself. ``linkat`` fails if the key
        exists, so this is create-if-absent against every other writer.

        Returns
        -------
        bool
            True if the object was made, False if an object already had the key.

        Raises
        ------
        OSError
            If the file cannot be linked there (another filesystem, or a
            file the kernel will not let this user link); the caller copies.
        """
        with self._parent(validate_key(key), create=True) as (parent, name):
            assert parent is not None
            if self._lstat(parent, name) is not None:
                return False
            try:
                os.link(path, name, dst_dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                return False
            os.fsync(parent)
        return True

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
        with self._parent(validate_key(key), create=False) as (parent, source):
            if parent is None:
                return False
            try:
                os.link(source, name, src_dir_fd=parent, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return False
        found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode) or self._stamp(found) != pinned:
            os.unlink(name, dir_fd=dir_fd)
            return False
        return True

    def _exists(self, key: str) -> bool:
        with self._parent(key, create=False) as (parent, name):
            found = self._lstat(parent, name)
            return found is not None and stat.S_ISREG(found.st_mode)

    def _list(self, prefix: str) -> list[str]:
        directory, _, _ = prefix.rpartition("/")
        parts = directory.split("/") if directory else []
        if parts and parts[0] == TMP_DIR:
            return []
        fd = self._open_dir(parts, create=False)
        if fd is None:
            return []
        keys: list[str] = []
        try:
            self._walk(fd, directory + "/" if directory else "", prefix, keys)
        finally:
            os.close(fd)
        return keys

    def _walk(self, fd: int, rel: str, prefix: str, keys: list[str]) -> None:
        """Append the keys under directory ``fd`` (named ``rel``) that start with ``prefix``.

        Only plain files and plain directories are seen: links are skipped.
        The walk keeps one descriptor per level and no Python recursion, and
        goes no deeper than :data:`MAX_KEY_DEPTH` components: deeper
        directories (which no key of chkq's uses, but anyone who can write to
        the store can make) are skipped with a warning naming them.
        """
        levels: list[tuple[int, str, list[str]]] = [(fd, rel, self._scan(fd, rel, prefix, keys))]
        try:
            while levels:
                parent, parent_rel, subdirs = levels[-1]
                if not subdirs:
                    levels.pop()
                    if parent != fd:
                        os.close(parent)
                    continue
                name = subdirs.pop()
                sub = parent_rel + name + "/"
                if sub.count("/") >= MAX_KEY_DEPTH:
                    log.warning("store %s: %r is more than %d directories deep; not listed",
                                self.url, sub, MAX_KEY_DEPTH)
                    continue
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=parent)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as exc:
                    if exc.errno == errno.ELOOP:  # replaced by a link since scandir
                        continue
                    raise
                try:
                    found = self._scan(child, sub, prefix, keys)
                except BaseException:
                    os.close(child)
                    raise
                levels.append((child, sub, found))
        finally:
            for parent, _, _ in levels:
                if parent != fd:
                    os.close(parent)

    @staticmethod
    def _scan(fd: int, rel: str, prefix: str, keys: list[str]) -> list[str]:
        """Append the files of directory ``fd`` matching ``prefix``; return the subdirectories
        that may hold more."""
        with os.scandir(fd) as entries:
            found = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
                     for e in entries]
        subdirs = []
        for name, is_dir, is_file in found:
            key = rel + name
            if is_file and key.startswith(prefix):
                keys.append(key)
            elif is_dir and not (rel == "" and name == TMP_DIR):
                sub = key + "/"
                if sub.startswith(prefix) or prefix.startswith(sub):
                    subdirs.append(name)
        subdirs.reverse()
        return subdirs

    def _delete(self, key: str) -> None:
        with self._parent(key, create=False) as (parent, name):
            if parent is None:
                return
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(name, dir_fd=parent)

    def _modified(self, key: str) -> float:
        with self._parent(key, create=False) as (parent, name):
            found = self._lstat(parent, name)
            if found is None or not stat.S_ISREG(found.st_mode):
                raise KeyError(key)
            return found.st_mtime

    # publishing from parts -----------------------------------------------------------

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        return _LocalUpload(self, key)

    def _stray_uploads(self, prefix: str) -> list[StrayUpload]:
        fd = self._open_dir([TMP_DIR], create=False)
        if fd is None:
            return []
        try:
            found = []
            for name in os.listdir(fd):
                if not name.endswith(UPLOAD_SUFFIX):
                    continue
                found_stat = self._lstat(fd, name)
                if found_stat is not None and stat.S_ISREG(found_stat.st_mode):
                    found.append(StrayUpload("", name, found_stat.st_mtime))
            return sorted(found, key=lambda stray: stray.upload_id)
        finally:
            os.close(fd)

    def _abort_upload(self, stray: StrayUpload) -> None:
        name = stray.upload_id
        if "/" in name or not name.endswith(UPLOAD_SUFFIX) or name.startswith("."):
            raise InvalidKeyError(f"store {self.url}: {name!r} is not an upload of this store")
        fd = self._open_dir([TMP_DIR], create=False)
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)


class _LocalUpload(PartsUpload):
    """Parts appended to a temporary in ``.chkq-tmp``, fsynced and linked into place.

    ``linkat`` fails if the key exists, so completion is create-if-absent
    against every other writer; the temporary is named at random and
    created with O_EXCL|O_NOFOLLOW, as every write of the store's.
    """

    store: LocalDirectoryStore

    def __init__(self, store: LocalDirectoryStore, key: str) -> None:
        super().__init__(store, key)
        store._parts(key)
        tmp = store._open_dir([TMP_DIR], create=True)
        assert tmp is not None
        self._tmp = tmp
        while True:
            self.upload_id = f"{secrets.token_hex(16)}{UPLOAD_SUFFIX}"
            try:
                self._fd = os.open(self.upload_id, _TEMP_FLAGS, 0o644, dir_fd=tmp)
                break
            except FileExistsError:
                continue

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _complete(self) -> bool:
        os.fsync(self._fd)
        with self.store._parent(self.key, create=True) as (parent, name):
            assert parent is not None
            if self.store._lstat(parent, name) is not None:
                return False
            try:
                os.link(self.upload_id, name, src_dir_fd=self._tmp, dst_dir_fd=parent,
                        follow_symlinks=False)
            except FileExistsError:
                return False
            os.fsync(parent)
        self._close(unlink=True)
        return True

    def _close(self, unlink: bool) -> None:
        """Close the temporary (removing it if ``unlink``) and the directory, once."""
        if self._tmp < 0:
            return
        os.close(self._fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.upload_id, dir_fd=self._tmp)
        os.close(self._tmp)
        self._fd = self._tmp = -1

    def _abort(self) -> None:
        self._close(unlink=True)
