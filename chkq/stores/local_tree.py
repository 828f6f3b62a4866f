"""Walking a store directory one name at a time, never following a link.

Every operation of a local store starts at its root and opens each
directory of a key with ``openat(O_NOFOLLOW)`` relative to the last, so
that a symbolic link planted anywhere in the store is refused (or skipped,
in listings) instead of followed. The store and its uploads
(:mod:`chkq.stores.local_upload`) open objects, make their private files and
check the names they link through it too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from chkq.errors import StoredBytesMismatchError, SymlinkInStoreError
from chkq.stores.base import InvalidKeyError
from chkq.stores.local_files import (
    DIR_FLAGS,
    PRIVATE_PREFIX,
    READ_FLAGS,
    TMP_DIR,
    PrivateFile,
    reserved_name,
    stamp_of,
)
from chkq.stores.objects import ObjectVersion

log = logging.getLogger(__name__)

MAX_KEY_DEPTH = 32
"""Deepest key (in ``/``-separated components) a listing descends to."""


def still_pinned(fd: int, pinned: ObjectVersion) -> bool:
    """Whether the file open as ``fd`` is (still) the ``pinned`` version."""
    return stamp_of(os.fstat(fd)) == pinned


class StoreTree:
    """The directories of a store under ``root`` (resolved), as descriptors.

    Parameters
    ----------
    root
        The store's directory, already resolved (no link, no ``..``).
    url
        The store's URL, for messages.
    must_exist
        If True the root is never created and a missing root raises
        FileNotFoundError naming the store.
    """

    def __init__(self, root: Path, url: str, must_exist: bool) -> None:
        self.root, self.url, self.must_exist = root, url, must_exist


    def missing(self) -> FileNotFoundError:
        return FileNotFoundError(
            errno.ENOENT, f"store {self.url} does not exist (no directory {str(self.root)!r})")

    def refuse_link(self, where: str) -> SymlinkInStoreError:
        return SymlinkInStoreError(
            f"store {self.url}: {where!r} is a symbolic link (or not a plain directory); "
            "a store never follows links")

    def open_root(self, create: bool) -> int | None:
        """fd of the root; None if it is missing and ``create`` is False."""
        try:
            return os.open(self.root, DIR_FLAGS)
        except FileNotFoundError:
            if self.must_exist:
                raise self.missing() from None
            if not create:
                return None
        except OSError as exc:
            if exc.errno == errno.ELOOP or os.path.islink(self.root):
                raise self.refuse_link(str(self.root)) from None
            if exc.errno == errno.ENOTDIR:
                raise NotADirectoryError(
                    errno.ENOTDIR, f"store {self.url}: {str(self.root)!r} is not a directory"
                ) from None
            raise
        os.makedirs(self.root, exist_ok=True)
        return os.open(self.root, DIR_FLAGS)

    def open_dir(self, parts: Sequence[str], create: bool) -> int | None:
        """fd of ``root/parts``, each name opened with O_NOFOLLOW relative to the last.

        Missing directories are created if ``create``, else None is returned
        (a name that is a file counts as missing).

        Raises
        ------
        SymlinkInStoreError
            If a name on the way is a symbolic link.
        """
        fd = self.open_root(create)
        if fd is None:
            return None
        try:
            for depth, name in enumerate(parts):
                child = self.open_child(fd, parts, depth)
                if child is None and create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)
                    child = self.open_child(fd, parts, depth)
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

    def open_child(self, fd: int, parts: Sequence[str], depth: int) -> int | None:
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
            return os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            loop = exc.errno == errno.ELOOP
        found = self.lstat(fd, name)
        if loop or (found is not None and stat.S_ISLNK(found.st_mode)):
            raise self.refuse_link("/".join(parts[: depth + 1]))
        return None

    @contextlib.contextmanager
    def parent(self, key: str, create: bool) -> Iterator[tuple[int | None, str]]:
        """(fd of the key's directory or None if missing, the key's last name)."""
        parts = self.parts(key)
        fd = self.open_dir(parts[:-1], create)
        try:
            yield fd, parts[-1]
        finally:
            if fd is not None:
                os.close(fd)

    def parts(self, key: str) -> list[str]:
        parts = key.split("/")
        if reserved_name(parts[0]):
            raise InvalidKeyError(f"invalid store key {key!r}: {TMP_DIR!r} and names starting "
                                  f"{PRIVATE_PREFIX!r} are reserved")
        return parts

    def lstat(self, fd: int | None, name: str) -> os.stat_result | None:
        """lstat of ``name`` in directory ``fd``; None if it (or the directory) is missing."""
        if fd is None:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def new_file(self, *, named: bool = False) -> PrivateFile:
        """A new :class:`PrivateFile` of the store, the root made if missing.

        ``named``: in a private directory (a rename, or another process, needs a
        name), even where the filesystem has ``O_TMPFILE``.
        """
        root = self.open_root(create=True)
        assert root is not None
        try:
            return PrivateFile(self.url, root, named=named)
        finally:
            os.close(root)

    def resume_file(self, name: str) -> PrivateFile | None:
        """The file of the private directory ``name`` at the root (:meth:`PrivateFile.resume`);
        None if it or the root is gone."""
        root = self.open_root(create=False)
        if root is None:
            return None
        try:
            return PrivateFile.resume(self.url, root, name)
        finally:
            os.close(root)

    @contextlib.contextmanager
    def object_fd(self, key: str) -> Iterator[int | None]:
        """The object's file, open to read (None if there is no such object); closed after.

        Raises
        ------
        SymlinkInStoreError
            If the object's name is a symbolic link.
        """
        with self.parent(key, create=False) as (parent, name):
            if parent is None:
                yield None
                return
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=parent)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                yield None
                return
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self.refuse_link(key) from None
                raise
            try:
                yield fd if stat.S_ISREG(os.fstat(fd).st_mode) else None  # not a FIFO, device...
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def pinned(self, key: str, pinned: ObjectVersion) -> Iterator[int | None]:
        """The object's file, open, if it is the ``pinned`` version (else None); closed after.

        The caller checks :func:`still_pinned` once it has read what it needs.
        """
        with self.object_fd(key) as fd:
            yield fd if fd is not None and still_pinned(fd, pinned) else None

    def check_linked(self, parent: int, name: str, fd: int, key: str) -> None:
        """Make sure ``name`` in ``parent`` is the file open as ``fd`` (just linked or renamed).

        Raises
        ------
        StoredBytesMismatchError
            If it is another file: whoever can write the directory replaced
            it at once; that file is left as it is.
        """
        mine, found = os.fstat(fd), self.lstat(parent, name)
        if found is None or (found.st_dev, found.st_ino) != (mine.st_dev, mine.st_ino):
            raise StoredBytesMismatchError(
                f"store {self.url}: {key} was replaced by another file right after this "
                "write made it (someone else writes the store's directory); that file was "
                "left as found")

    def keys(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix``, links and reserved names left out."""
        directory, _, _ = prefix.rpartition("/")
        parts = directory.split("/") if directory else []
        if parts and reserved_name(parts[0]):
            return []
        fd = self.open_dir(parts, create=False)
        if fd is None:
            return []
        keys: list[str] = []
        try:
            self.walk(fd, directory + "/" if directory else "", prefix, keys)
        finally:
            os.close(fd)
        return keys

    def walk(self, fd: int, rel: str, prefix: str, keys: list[str]) -> None:
        """Append the keys under directory ``fd`` (named ``rel``) that start with ``prefix``.

        Only plain files and plain directories are seen: links are skipped.
        The walk keeps one descriptor per level and no Python recursion, and
        goes no deeper than :data:`MAX_KEY_DEPTH` components: deeper
        directories (which no key of chkq's uses, but anyone who can write to
        the store can make) are skipped with a warning naming them.
        """
        levels: list[tuple[int, str, list[str]]] = [(fd, rel, self.scan(fd, rel, prefix, keys))]
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
                    child = os.open(name, DIR_FLAGS, dir_fd=parent)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as exc:
                    if exc.errno == errno.ELOOP:  # replaced by a link since scandir
                        continue
                    raise
                try:
                    found = self.scan(child, sub, prefix, keys)
                except BaseException:
                    os.close(child)
                    raise
                levels.append((child, sub, found))
        finally:
            for parent, _, _ in levels:
                if parent != fd:
                    os.close(parent)

    @staticmethod
    def scan(fd: int, rel: str, prefix: str, keys: list[str]) -> list[str]:
        """Append the files of directory ``fd`` matching ``prefix``; return the subdirectories
        that may hold more."""
        with os.scandir(fd) as entries:
            found = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
                     for e in entries]
        subdirs = []
        for name, is_dir, is_file in found:
            key = rel + name
            if rel == "" and reserved_name(name):
                continue
            if is_file and key.startswith(prefix):
                keys.append(key)
            elif is_dir:
                sub = key + "/"
                if sub.startswith(prefix) or prefix.startswith(sub):
                    subdirs.append(name)
        subdirs.reverse()
        return subdirs

