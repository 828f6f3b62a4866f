"""Objects published from parts: the upload every store gives, and the buffered default.

An upload knows its store only as an :class:`UploadTarget` (what it reads and
writes through), so that this module and :mod:`chkq.stores.base`, whose
stores make uploads, do not import each other.
"""

from __future__ import annotations

import errno
import tempfile
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Protocol

from chkq.stores.keys import validate_key
from chkq.stores.objects import FileAccess, ObjectVersion

__all__ = ["BufferedUpload", "PartsUpload", "UploadTarget"]


class UploadTarget(Protocol):
    """What an upload uses of its store (every :class:`~chkq.stores.base.CheckpointStore` has it).

    Ranges of other objects are read to copy them, their sizes checked, the
    store's URL named in errors; the buffered default publishes with one
    create-if-absent.
    """

    @property
    def url(self) -> str: ...

    def size(self, key: str) -> int: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def put_if_absent(self, key: str, data: bytes) -> bool: ...


class PartsUpload(ABC):
    """One object being published from parts, in order; create-if-absent on completion.

    Use it as a context manager: leaving the block without
    :meth:`complete` (an exception, or a forgotten call) aborts it, so
    nothing is published and the parts are removed.
    """

    copy_chunk = 8 << 20
    """Bytes read at a time where a range is copied through the client."""

    def __init__(self, store: UploadTarget, key: str) -> None:
        self.store = store
        self.key = key
        self.size = 0
        """Bytes added so far."""
        self.part_size: int | None = None
        """Bytes per part sent (the last may be shorter); None where the store sends no parts."""
        self.access: FileAccess | None = None
        """Mode and owner the object gets where the store keeps files (see ``upload``)."""
        self.version: ObjectVersion | None = None
        """After :meth:`complete`: the version of the object this upload made, where the store
        tells it (a local directory: the file's inode); None elsewhere."""
        self._finished = False

    @abstractmethod
    def _write(self, data: bytes) -> None: ...

    def _write_hashed(self, data: bytes, sha256: bytes) -> None:
        """Append ``data`` whose SHA-256 digest the caller computed (default: as ``_write``)."""
        self._write(data)

    @abstractmethod
    def _complete(self) -> bool:
        """Publish; True if created, False if an object already had the key."""

    @abstractmethod
    def _abort(self) -> None: ...

    def _copy(self, source: str, start: int, length: int) -> None:
        end = start + length
        while start < end:
            piece = self.store.get_range(source, start, min(self.copy_chunk, end - start))
            if not piece:
                break
            self._write(piece)
            start += len(piece)

    def write(self, data: bytes, *, sha256: bytes | None = None) -> None:
        """Append ``data`` to the object.

        Parameters
        ----------
        data
            The bytes.
        sha256
            Their SHA-256 digest, where the caller has computed it: an
            upload with ``checksum`` whose part is exactly ``data`` (a write
            of :attr:`part_size` bytes at a part boundary, or the last)
            sends it as the part's checksum instead of hashing the part
            again, and the store checks the bytes it received against it.
        """
        self._check_open()
        data = bytes(data)
        if data:
            if sha256 is None:
                self._write(data)
            else:
                self._write_hashed(data, sha256)
            self.size += len(data)

    def copy(self, source: str, start: int, length: int) -> None:
        """Append ``length`` bytes of the object ``source`` from offset ``start``.

        Server-side where the store can (S3 ``UploadPartCopy`` for ranges of
        at least one part). The source must have that many bytes.

        Raises
        ------
        KeyError
            If ``source`` does not exist.
        ValueError
            If the range reaches past the source's end.
        """
        self._check_open()
        validate_key(source)
        if start < 0 or length < 0:
            raise ValueError(f"start and length must be >= 0, got {start} and {length}")
        available = self.store.size(source)
        if start + length > available:
            raise ValueError(f"store {self.store.url}: range {start}+{length} reaches past the "
                             f"end of {source} ({available} bytes)")
        if length:
            self._copy(source, start, length)
            self.size += length

    def complete(self) -> None:
        """Publish the object under its key if no object has that key.

        Raises
        ------
        FileExistsError
            If an object already has the key (left untouched; this upload is
            aborted); the error names the store and key.
        """
        self._check_open()
        try:
            created = self._complete()
        except BaseException:
            self.abort()
            raise
        if not created:
            self.abort()
            raise FileExistsError(errno.EEXIST, f"store {self.store.url}: {self.key} exists",
                                  self.key)
        self._finished = True

    def abort(self) -> None:
        """Drop the upload and its parts; nothing is published. A no-op once finished."""
        if self._finished:
            return
        self._finished = True
        self._abort()

    def _check_open(self) -> None:
        if self._finished:
            raise ValueError(f"upload of {self.key} to {self.store.url} is already finished")

    def __enter__(self) -> PartsUpload:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.abort()


class BufferedUpload(PartsUpload):
    """Parts kept in a temporary file, published with one ``put_if_absent``."""

    def __init__(self, store: UploadTarget, key: str) -> None:
        super().__init__(store, key)
        self._buffer = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 (closed by complete or abort)

    def _write(self, data: bytes) -> None:
        self._buffer.write(data)

    def _complete(self) -> bool:
        self._buffer.seek(0)
        return self.store.put_if_absent(self.key, self._buffer.read())

    def _abort(self) -> None:
        self._buffer.close()

    def complete(self) -> None:
        try:
            super().complete()
        finally:
            self._buffer.close()
