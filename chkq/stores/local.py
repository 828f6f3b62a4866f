"""A store in a local (or shared POSIX) directory: ``file:///abs/dir``."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from chkq.fsutil import fsync_dir
from chkq.stores.base import CheckpointStore, InvalidKeyError

__all__ = ["LocalDirectoryStore"]

TMP_DIR = ".chkq-tmp"
"""Top-level directory holding in-flight writes; never listed, never a valid key."""


class LocalDirectoryStore(CheckpointStore):
    """Objects as files under one directory.

    Every write goes to a uniquely named file in ``<root>/.chkq-tmp/`` (same
    file system, so the final step is a metadata operation), is fsynced, and
    is then moved into place: ``os.replace`` for :meth:`put` (atomic
    replace) or ``os.link`` for :meth:`put_if_absent` (atomic create: the
    kernel refuses with EEXIST if the name exists, across processes and
    NFS clients alike).  The containing directory is fsynced too, so an
    acknowledged write survives a crash.  Readers therefore never see a
    partial object, and the temporary directory is excluded from listings.

    Parameters
    ----------
    root
        Absolute path of the directory; created if missing.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise ValueError(f"LocalDirectoryStore needs an absolute path, got {str(root)!r}")
        self._root = path
        self._tmp = path / TMP_DIR
        self._tmp.mkdir(parents=True, exist_ok=True)

    @property
    def root(self) -> Path:
        """The directory holding the objects."""
        return self._root

    @property
    def url(self) -> str:
        return self._root.as_uri()

    def _path(self, key: str) -> Path:
        if key.split("/", 1)[0] == TMP_DIR:
            raise InvalidKeyError(f"invalid store key {key!r}: {TMP_DIR!r} is reserved")
        return self._root / key

    def _write_temp(self, data: bytes) -> Path:
        tmp = self._tmp / f"{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def _put(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_temp(data)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        if target.exists():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_temp(data)
        try:
            os.link(tmp, target)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(target.parent)
        return True

    def _get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyError(key) from None

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _list(self, prefix: str) -> list[str]:
        directory, _, _ = prefix.rpartition("/")
        start = self._root / directory if directory else self._root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self._root).replace(os.sep, "/")
            if rel == ".":
                dirnames[:] = [d for d in dirnames if d != TMP_DIR]
                rel = ""
            else:
                rel += "/"
            dirnames.sort()
            keys.extend(rel + name for name in filenames if (rel + name).startswith(prefix))
        return keys

    def _delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            self._path(key).unlink()

    def _modified(self, key: str) -> float:
        try:
            return self._path(key).stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
