"""A local directory store's uploads: parts written to a private file, linked into place.

An upload from parts (:class:`LocalUpload`, one writer) appends to a
:class:`~chkq.stores.local_files.PrivateFile` only its process reaches; a
shared upload (:class:`SharedPrivateFile`, parts written by many processes of
one user) writes each part at its offset of a file in a private directory of
that user's, copying ranges of other objects in the kernel
(``copy_file_range``). Both link the file into place on completion, so that
``linkat`` makes it create-if-absent against every other writer, and check
that the name made is that file. The uploads reach the store's directory
through its :class:`~chkq.stores.local_tree.StoreTree`, so that this module
does not import :mod:`chkq.stores.local`, which makes them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from chkq.errors import StoredBytesMismatchError
from chkq.stores.base import CheckpointStore
from chkq.stores.local_files import PRIVATE_PREFIX, PrivateFile
from chkq.stores.local_tree import StoreTree, still_pinned
from chkq.stores.objects import ObjectVersion, StrayUpload
from chkq.stores.shared_upload import (
    PIN_READ,
    PartRecord,
    SharedUpload,
    check_random_id,
    source_changed,
    validate_parts,
)
from chkq.stores.uploads import PartsUpload

__all__ = ["LocalUpload", "SharedPrivateFile"]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _sha256_of(fd: int, start: int, length: int) -> str:
    """Hex SHA-256 of the ``length`` bytes of ``fd`` from ``start`` (fewer where it ends)."""
    digest, end = hashlib.sha256(), start + length
    while start < end:
        piece = os.pread(fd, min(PIN_READ, end - start), start)
        if not piece:
            break
        digest.update(piece)
        start += len(piece)
    return digest.hexdigest()


def _copy_range(source: int, target: int, start: int, length: int, offset: int,
                changed: Exception) -> None:
    """``copy_file_range`` of ``length`` bytes from ``start`` of ``source`` to ``offset`` of
    ``target``; read and written through this process where the kernel cannot copy.

    Raises ``changed`` if the source ends first (it is shorter than its pinned size).
    """
    done = 0
    while done < length:
        try:
            copied = os.copy_file_range(source, target, length - done, start + done,
                                        offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            piece = os.pread(source, min(PIN_READ, length - done), start + done)
            copied = len(piece)
            _pwrite_all(target, piece, offset + done)
        if copied == 0:
            raise changed
        done += copied


class LocalUpload(PartsUpload):
    """Parts appended to a :class:`PrivateFile` only this process reaches, linked into place.

    The file gets the upload's :attr:`~chkq.stores.uploads.PartsUpload.access`
    before it has a name; ``linkat`` fails if the key exists, so completion
    is create-if-absent against every other writer, and the name made is
    checked to be the file written.
    """

    def __init__(self, store: CheckpointStore, tree: StoreTree, key: str) -> None:
        super().__init__(store, key)
        tree.parts(key)
        self._tree = tree
        self._temp: PrivateFile | None = tree.new_file()
        self.upload_id = self._temp.dir_name

    def _write(self, data: bytes) -> None:
        assert self._temp is not None
        self._temp.write(data)

    def _complete(self) -> bool:
        temp = self._temp
        assert temp is not None
        temp.give(self.access)
        os.fsync(temp.fd)
        with self._tree.parent(self.key, create=True) as (parent, name):
            assert parent is not None
            if self._tree.lstat(parent, name) is not None:
                return False
            if not temp.link(parent, name, self.key):
                return False
            os.fsync(parent)
        self.version = temp.version()
        self._close()
        return True

    def _close(self) -> None:
        if self._temp is not None:
            self._temp.close()
            self._temp = None

    def _abort(self) -> None:
        self._close()


class SharedPrivateFile:
    """A local directory store's shared uploads: one file that every writer writes parts into.

    The file is ``data`` in a new private directory ``.chkq-tmp-ID`` (mode
    0700) at the store's root, ``ID`` the upload's id: every writer of the
    upload must run as the user who began it (the directory is checked to be
    theirs alone), on a filesystem that reaches the store. A part is written
    at its offset and fsynced, its record carrying its SHA-256; the
    completion checks every part's, fsyncs the file and links it into place.
    """

    def __init__(self, store: CheckpointStore, tree: StoreTree) -> None:
        self.store = store
        self._tree = tree

    def begin(self, key: str) -> SharedUpload:
        self._tree.parts(key)
        temp = self._tree.new_file(named=True)
        temp.detach()
        return SharedUpload(key, temp.dir_name[len(PRIVATE_PREFIX):], secrets.token_hex(16))

    @contextmanager
    def _file(self, upload: SharedUpload) -> Iterator[PrivateFile]:
        """The upload's file, open (left in place afterwards unless the caller closes it)."""
        check_random_id(self.store.url, upload, "a local directory")
        found = self._tree.resume_file(PRIVATE_PREFIX + upload.upload_id)
        if found is None:
            raise KeyError(f"store {self.store.url}: no shared upload {upload.upload_id} of "
                           f"{upload.key} (completed or aborted)")
        try:
            yield found
        finally:
            found.detach()

    def put(self, upload: SharedUpload, number: int, data: bytes, offset: int) -> PartRecord:
        with self._file(upload) as temp:
            _pwrite_all(temp.fd, data, offset)
            os.fsync(temp.fd)
        return PartRecord(number, len(data), offset, "", hashlib.sha256(data).hexdigest())

    def copy(self, upload: SharedUpload, number: int, source: str, pinned: ObjectVersion,
             start: int, length: int, offset: int) -> PartRecord:
        """``copy_file_range`` from the source file, its version checked before and after."""
        changed = source_changed(self.store.url, source, upload, number,
                                 "replaced, rewritten or deleted")
        with self._file(upload) as temp, self._tree.pinned(source, pinned) as fd:
            if fd is None:
                raise changed
            _copy_range(fd, temp.fd, start, length, offset, changed)
            if not still_pinned(fd, pinned):
                raise changed
            os.fsync(temp.fd)
            checksum = _sha256_of(temp.fd, offset, length)
        return PartRecord(number, length, offset, "", checksum)

    def complete(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        """Each part's SHA-256 checked, the file fsynced and linked into place, create-if-absent.

        A completion asked again after one that linked the file and stopped
        before removing its directory finds the object to be the file itself:
        True.
        """
        size = validate_parts(upload, parts)
        tree = self._tree
        tree.parts(upload.key)
        with self._file(upload) as temp:
            for part in parts:
                if _sha256_of(temp.fd, part.offset, part.size) != part.checksum:
                    raise StoredBytesMismatchError(
                        f"store {self.store.url}: part {part.number} of {upload.key} "
                        f"({part.size} bytes at {part.offset}) is not the bytes its record "
                        f"says (SHA-256 {part.checksum}): it was never put, or put again with "
                        "other bytes")
            if os.fstat(temp.fd).st_size != size:
                os.ftruncate(temp.fd, size)
            os.fsync(temp.fd)
            with tree.parent(upload.key, create=True) as (parent, name):
                assert parent is not None
                created = temp.link(parent, name, upload.key)
                if not created:
                    found, mine = tree.lstat(parent, name), os.fstat(temp.fd)
                    created = found is not None and (found.st_dev, found.st_ino) == (
                        mine.st_dev, mine.st_ino)
                else:
                    tree.check_linked(parent, name, temp.fd, upload.key)
                os.fsync(parent)
            temp.close()
        return created

    def abort(self, upload: SharedUpload) -> None:
        check_random_id(self.store.url, upload, "a local directory")
        self.store.abort_upload(StrayUpload("", PRIVATE_PREFIX + upload.upload_id, 0.0))
