"""GCS's uploads: parts staged as objects, composed 32 at a time, the last create-if-absent.

Both kinds stage their parts as objects under ``.chkq-uploads/ID/`` below the
store's prefix (:class:`Staging`, which also composes them): an upload from
parts (:class:`ComposeUpload`, one writer) stages what it is written in parts
and composes ranges that are whole objects from the objects themselves; a
shared upload (:class:`SharedCompose`, parts written by many processes)
stages each part with its CRC32C, a copied range read pinned through the
writer (:class:`PinnedRange`), since GCS has no ranged copy. Compose takes at
most :data:`MAX_COMPOSE` sources, so longer lists are composed in rounds into
staged intermediates; the object's own compose carries
``ifGenerationMatch=0`` and a write id, so that a resent compose refused with
412 is known as this upload's. The uploads are given the GCS store's client,
bucket, prefix and timeouts when they are made, and know the store itself only
as a :class:`~chkq.stores.bucket.BucketStore` (its retry layer), so that this
module does not import :mod:`chkq.stores.gcs`, which makes them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import google_crc32c
from google.api_core import exceptions as api_exceptions

from chkq.errors import InvalidKeyError, StoredBytesMismatchError
from chkq.stores.base import CheckpointStore
from chkq.stores.bucket import WRITE_ID_METADATA, BucketStore
from chkq.stores.objects import ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.shared_upload import (
    PIN_READ,
    PartRecord,
    SharedUpload,
    check_random_id,
    combined_crc32c,
    source_changed,
    validate_parts,
)
from chkq.stores.uploads import PartsUpload

__all__ = ["MAX_COMPOSE", "UPLOADS_DIR", "UPLOAD_KEY_METADATA", "ComposeUpload",
           "PinnedRange", "SharedCompose", "Staging", "check_writable"]

UPLOADS_DIR = ".chkq-uploads"
"""Top-level name under the store's prefix for the parts of uploads in flight;
never listed, never a key that can be written."""
UPLOAD_KEY_METADATA = "chkq-upload-key"
"""Metadata of a staged part naming the key its upload publishes."""
MAX_COMPOSE = 32
"""Most sources of one GCS compose request."""


def check_writable(key: str) -> None:
    """Refuse a key in the uploads' staging staging.

    Raises
    ------
    InvalidKeyError
        If ``key`` starts with :data:`UPLOADS_DIR`.
    """
    if key.split("/", 1)[0] == UPLOADS_DIR:
        raise InvalidKeyError(f"invalid store key {key!r}: {UPLOADS_DIR!r} is reserved")


class Staging:
    """The staging area of a GCS store's uploads, and the composes that publish from it.

    Parameters
    ----------
    store
        The store (its URL, its retry layer).
    client, bucket
        The store's ``google.cloud.storage`` client and bucket.
    prefix
        The store's object name prefix ("" or ending in ``/``).
    page_size
        Objects requested per listing page.
    timeout, compose_timeout
        ``(connect, read)`` of a request, and of a compose.
    stat
        The store's object of a key, or None if there is none (retried).
    """

    def __init__(self, store: BucketStore, *, client: Any, bucket: Any, prefix: str,
                 page_size: int, timeout: tuple[float, float],
                 compose_timeout: tuple[float, float], stat: Callable[[str], Any]) -> None:
        self.store = store
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.page_size = page_size
        self.timeout = timeout
        self.compose_timeout = compose_timeout
        self.stat = stat

    def place(self, upload_id: str) -> str:
        """The object name prefix of the upload ``upload_id``'s staged objects."""
        return f"{self.prefix}{UPLOADS_DIR}/{upload_id}/"

    def blob(self, upload_id: str, name: str, key: str) -> Any:
        """The staged object ``name`` of the upload ``upload_id`` of ``key`` (not yet sent)."""
        blob = self.bucket.blob(self.place(upload_id) + name)
        blob.metadata = {UPLOAD_KEY_METADATA: key}
        return blob

    def compose_rounds(self, sources: list[Any], intermediate: Callable[[], Any],
                       key: str) -> list[Any]:
        """Compose ``sources`` :data:`MAX_COMPOSE` at a time into staged intermediates
        (``intermediate()`` names each) until one compose can take them all."""
        while len(sources) > MAX_COMPOSE:
            merged = []
            for first in range(0, len(sources), MAX_COMPOSE):
                group = sources[first : first + MAX_COMPOSE]
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                destination = intermediate()
                self.store._retry(
                    functools.partial(destination.compose, group,
                                      timeout=self.compose_timeout, retry=None),
                    f"compose {len(group)} parts of {key}")
                merged.append(destination)
            sources = merged
        return sources

    def compose_if_absent(self, key: str, sources: list[Any], write_id: str) -> bool:
        """Compose ``sources`` into ``key`` with ``ifGenerationMatch=0`` and ``write_id``.

        A 412 is read back: the object is ours (a resent compose) if it carries
        the write id. True if the object is now ours, False if another's.
        """
        store, name = self.store, self.prefix + key

        def attempt() -> bool:
            destination = self.bucket.blob(name)
            destination.metadata = {WRITE_ID_METADATA: write_id}
            destination.content_type = "application/octet-stream"
            try:
                destination.compose(sources, if_generation_match=0,
                                    timeout=self.compose_timeout, retry=None)
            except api_exceptions.PreconditionFailed:
                current = self.bucket.get_blob(name, timeout=self.timeout, retry=None)
                metadata = None if current is None else dict(current.metadata or {})
                return store._written_by(metadata, write_id, name)
            return True

        return bool(store._retry(attempt, f"complete upload of {key}"))


class ComposeUpload(PartsUpload):
    """Parts staged as objects under ``.chkq-uploads/ID/``, composed with ``ifGenerationMatch=0``.

    A copied range that is a whole source object is composed from the
    source itself, server-side; other ranges pass through the client.
    Compose takes at most 32 sources, so longer lists are composed in
    rounds into staged intermediates. The destination carries a write id,
    so that a resent compose refused with 412 is recognised as this
    upload's own. The staged parts are deleted once published or aborted.
    """

    def __init__(self, store: CheckpointStore, staging: Staging, key: str, *, part_size: int,
                 checksum: bool = False) -> None:
        super().__init__(store, key)
        self._staging = staging
        self.upload_id = uuid.uuid4().hex
        self._write_id = uuid.uuid4().hex
        self._staged: list[Any] = []
        self._sources: list[Any] = []
        self._buffer = bytearray()
        self.part_size = max(part_size, 1)
        self._checksum: str | None = "crc32c" if checksum else None

    def _next_staged(self) -> Any:
        blob = self._staging.blob(self.upload_id, f"{len(self._staged):05d}", self.key)
        self._staged.append(blob)
        return blob

    def _stage(self, data: bytes) -> Any:
        staging = self._staging
        blob = self._next_staged()
        staging.store._retry(
            lambda: blob.upload_from_string(data, content_type="application/octet-stream",
                                            checksum=self._checksum, timeout=staging.timeout,
                                            retry=None),
            f"stage part {len(self._staged)} of {self.key}")
        return blob

    def _flush(self, final: bool = False) -> None:
        size = self.part_size
        assert size is not None
        while len(self._buffer) >= size or (final and self._buffer):
            piece = bytes(self._buffer[:size])
            del self._buffer[:size]
            self._sources.append(self._stage(piece))

    def _write(self, data: bytes) -> None:
        if not self._buffer and len(data) == self.part_size:
            self._sources.append(self._stage(data))
            return
        self._buffer += data
        self._flush()

    def _copy(self, source: str, start: int, length: int) -> None:
        if start == 0 and length == self.store.size(source):
            self._flush(final=True)
            self._sources.append(self._staging.bucket.blob(self._staging.prefix + source))
        else:
            super()._copy(source, start, length)

    def _complete(self) -> bool:
        self._flush(final=True)
        staging = self._staging
        if not self._sources:
            self._sources.append(self._stage(b""))
        sources = staging.compose_rounds(self._sources, self._next_staged, self.key)
        created = staging.compose_if_absent(self.key, sources, self._write_id)
        if created:
            self._abort()
        return created

    def _abort(self) -> None:
        while self._staged:
            self._staging.store._retry(self._delete_last_staged,
                                    f"delete staged part of {self.key}")

    def _delete_last_staged(self) -> None:
        with contextlib.suppress(api_exceptions.NotFound):
            self._staged[-1].delete(timeout=self._staging.timeout, retry=None)
        self._staged.pop()


class SharedCompose:
    """The GCS store's shared uploads: parts any process stages, composed by the completer.

    Begun as a random staging place marked with an empty ``begun`` object (so
    that :meth:`~chkq.stores.base.CheckpointStore.stray_uploads` lists it before
    any part is staged); each part is staged as ``pNNNNN`` with its CRC32C,
    which GCS checks; the completion checks each staged part's size and
    CRC32C against its record, composes them (in rounds, into intermediates
    ``cNNNNN``) and removes the staging place.
    """

    def __init__(self, staging: Staging) -> None:
        self._staging = staging
        self.store = staging.store

    def _place(self, upload: SharedUpload) -> str:
        """The staging place of a shared upload: ``.chkq-uploads/ID/`` under the prefix."""
        check_random_id(self.store.url, upload, "a GCS store")
        check_writable(upload.key)
        return self._staging.place(upload.upload_id)

    def _stage(self, upload: SharedUpload, name: str, what: str,
               send: Callable[[Any], None]) -> Any:
        """Upload a staged object ``name`` of ``upload`` with ``send(blob)``; the blob made."""
        self._place(upload)

        def attempt() -> Any:
            blob = self._staging.blob(upload.upload_id, name, upload.key)
            send(blob)
            return blob

        return self.store._retry(attempt, what)

    def begin(self, key: str) -> SharedUpload:
        check_writable(key)
        upload = SharedUpload(key, uuid.uuid4().hex, uuid.uuid4().hex)
        self._stage(upload, "begun", f"start shared upload of {key}",
                    lambda blob: blob.upload_from_string(
                        b"", timeout=self._staging.timeout, retry=None))
        return upload

    def _record(self, upload: SharedUpload, number: int, offset: int, blob: Any, size: int,
                crc32c: int) -> PartRecord:
        sent = base64.b64encode(crc32c.to_bytes(4, "big")).decode("ascii")
        if blob.crc32c != sent or int(blob.size) != size:
            raise StoredBytesMismatchError(
                f"store {self.store.url}: part {number} of {upload.key}: the store kept "
                f"{blob.size} bytes with CRC32C {blob.crc32c}, not the {size} with {sent} sent")
        return PartRecord(number, size, offset, str(blob.generation), sent)

    def put(self, upload: SharedUpload, number: int, data: bytes, offset: int) -> PartRecord:
        timeout = self._staging.timeout
        blob = self._stage(
            upload, f"p{number:05d}", f"stage part {number} of {upload.key}",
            lambda blob: blob.upload_from_string(
                data, content_type="application/octet-stream", checksum="crc32c",
                timeout=timeout, retry=None))
        return self._record(upload, number, offset, blob, len(data),
                            int(google_crc32c.value(data)))

    def copy(self, upload: SharedUpload, number: int, source: str, pinned: ObjectVersion,
             start: int, length: int, offset: int) -> PartRecord:
        """GCS has no ranged copy: the range is read pinned
        (:meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`, 32 MiB at a time) and
        uploaded as the staged part, its bytes passing through this process (32 MiB of them
        held at a time)."""
        changed = source_changed(self.store.url, source, upload, number)
        readers: list[PinnedRange] = []
        timeout = self._staging.timeout

        def send(blob: Any) -> None:
            reader = PinnedRange(self.store, source, pinned, start, length, changed)
            readers.append(reader)
            blob.chunk_size = PIN_READ
            blob.upload_from_file(io.BufferedReader(reader, PIN_READ), size=length,
                                  content_type="application/octet-stream",
                                  checksum="crc32c", timeout=timeout, retry=None)

        blob = self._stage(upload, f"p{number:05d}",
                           f"stage part {number} of {upload.key} from {source}", send)
        return self._record(upload, number, offset, blob, length, readers[-1].crc32c)

    def complete(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        validate_parts(upload, parts)
        staging, url = self._staging, self.store.url
        place = self._place(upload)
        current = staging.stat(upload.key)
        if current is not None:  # another's (or ours, completed before an answer was lost)
            ours = dict(current.metadata or {}).get(WRITE_ID_METADATA) == upload.write_id
            self.abort(upload)
            return ours
        staged = {blob.name: blob for blob in self.store._retry(
            lambda: list(staging.client.list_blobs(staging.bucket.name, prefix=place,
                                                page_size=staging.page_size,
                                                timeout=staging.timeout, retry=None)),
            f"list parts of {upload.key}")}
        sources = []
        for part in parts:
            blob = staged.get(f"{place}p{part.number:05d}")
            if blob is None:
                raise ValueError(f"store {url}: part {part.number} of {upload.key} is "
                                 f"not staged (never put, or the upload was aborted)")
            if int(blob.size) != part.size or blob.crc32c != part.checksum:
                raise StoredBytesMismatchError(
                    f"store {url}: part {part.number} of {upload.key} is staged with "
                    f"{blob.size} bytes and CRC32C {blob.crc32c}, not the {part.size} "
                    f"with {part.checksum} recorded (put again with other bytes?)")
            sources.append(staging.bucket.blob(blob.name, generation=blob.generation))
        made = itertools.count()

        def intermediate() -> Any:
            return staging.blob(upload.upload_id, f"c{next(made):05d}", upload.key)

        try:
            sources = staging.compose_rounds(sources, intermediate, upload.key)
            created = staging.compose_if_absent(upload.key, sources, upload.write_id)
        except BaseException:
            with contextlib.suppress(Exception):  # intermediates only: the parts stay
                for index in range(next(made)):
                    staging.bucket.blob(f"{place}c{index:05d}").delete(
                        timeout=staging.timeout, retry=None)
            raise
        self.abort(upload)
        return created

    def abort(self, upload: SharedUpload) -> None:
        self._place(upload)
        self.store.abort_upload(StrayUpload(upload.key, upload.upload_id, 0.0))

    @staticmethod
    def checksums(parts: list[PartRecord]) -> ObjectChecksums:
        """The size and the CRC32C combined from the parts' (GCS's, base64)."""
        return ObjectChecksums(size=sum(part.size for part in parts),
                               crc32c=combined_crc32c(parts))


class PinnedRange(io.RawIOBase):
    """``length`` bytes of one pinned object from ``start``, read as a file (for an upload).

    Each read is a :meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`
    of at most :data:`~chkq.stores.shared_upload.PIN_READ` bytes; a read the
    pin refuses raises ``changed``. The CRC32C of the bytes read is kept.
    """

    def __init__(self, store: CheckpointStore, key: str, pinned: ObjectVersion, start: int,
                 length: int, changed: Exception) -> None:
        super().__init__()
        self._store, self._key, self._pinned = store, key, pinned
        self._start, self._length, self._changed = start, length, changed
        self._position = 0
        self.crc32c = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        position = base + offset
        if position != self._position:
            if position != 0:
                raise io.UnsupportedOperation("a pinned range is read once, from its start")
            self.crc32c = 0
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        amount = min(len(buffer), self._length - self._position, PIN_READ)
        if amount <= 0:
            return 0
        piece = self._store.get_range_pinned(self._key, self._pinned,
                                             self._start + self._position, amount)
        if piece is None or len(piece) != amount:
            raise self._changed
        buffer[:amount] = piece
        self.crc32c = int(google_crc32c.extend(self.crc32c, piece))
        self._position += amount
        return amount
