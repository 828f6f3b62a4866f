"""Google Cloud Storage stores: ``gs://bucket/prefix``."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import itertools
import re
import uuid
from collections.abc import Callable
from typing import Any

import google_crc32c
import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud import storage

from chkq import environment
from chkq.errors import (
    BadMessageError,
    BadNameError,
    CheckpointChangedError,
    InvalidKeyError,
    StoreAccessError,
    StoredBytesMismatchError,
)
from chkq.stores.base import ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.bucket import WRITE_ID_METADATA, BucketStore
from chkq.stores.keys import bucket_prefix
from chkq.stores.retry import StoreTimeouts
from chkq.stores.shared_upload import (
    PIN_READ,
    PartRecord,
    SharedUpload,
    combined_crc32c,
    validate_parts,
)
from chkq.stores.uploads import PartsUpload

__all__ = ["GCSStore"]

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    api_exceptions.TooManyRequests,
    api_exceptions.InternalServerError,
    api_exceptions.BadGateway,
    api_exceptions.ServiceUnavailable,
    api_exceptions.GatewayTimeout,
    api_exceptions.RetryError,
    ConnectionError,
    TimeoutError,
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.Timeout,
    http.client.HTTPException,
    auth_exceptions.TransportError,
)


UPLOADS_DIR = ".chkq-uploads"
"""Top-level name under the store's prefix for the parts of uploads in flight;
never listed, never a key that can be written."""
UPLOAD_KEY_METADATA = "chkq-upload-key"
"""Metadata of a staged part naming the key its upload publishes."""
MAX_COMPOSE = 32
"""Most sources of one GCS compose request."""
MiB = 1 << 20


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


#: Where google-auth finds the credentials it sends, as the user sets them.
CREDENTIAL_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS (a service account's key file), or "
                        "gcloud auth application-default login")


def _make_client(project: str | None, url: str = "") -> storage.Client:
    if environment.gcs_emulator():
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "test", credentials=AnonymousCredentials())
    try:
        return storage.Client(project=project)
    except auth_exceptions.DefaultCredentialsError:
        raise StoreAccessError(
            f"store {url}: no Google Cloud credentials found: set {CREDENTIAL_VARIABLES} "
            "for the user running chkq (on a cluster, for the workers too)") from None


class GCSStore(BucketStore):
    """Objects in a Google Cloud Storage bucket under an optional prefix.

    Credentials and project come from the environment (Application Default
    Credentials).  With ``STORAGE_EMULATOR_HOST`` set, the client talks to
    that emulator anonymously with project ``test``.

    ``put_if_absent`` uploads with ``if_generation_match=0``.  Like S3, a
    412 may answer the caller's own write when google-cloud-storage retried
    an upload whose response was lost, so each conditional write carries a
    random write id in the object's custom metadata (``chkq-write-id``) and
    a 412 is read back and compared: the write is ours — True — if the id
    matches (:meth:`~chkq.stores.bucket.BucketStore._written_by`).

    Waits are bounded (:class:`~chkq.stores.base.StoreTimeouts`): every
    call passes ``timeout=(connect, read)`` (a compose, which assembles an
    object, ``(connect, complete)``) and ``retry=None`` (the client's
    own retries, up to 120 s each by default, are off), and the one retry
    layer, :func:`chkq.stores.base.retry_transient`, stops when the
    operation's budget is spent, with an error naming the store and key.
    A missing bucket raises :class:`~chkq.stores.base.StoreNotFoundError`.

    Parameters
    ----------
    bucket
        Bucket name.
    prefix
        Object name prefix inside the bucket (no leading or trailing ``/``).
    client
        A ``google.cloud.storage.Client`` to use instead of building one.
    project
        Project for a client built here.
    page_size
        Objects requested per listing page.
    part_size
        Bytes per staged part of an upload from parts.
    attempts
        Most attempts of one operation on transient errors.
    timeouts
        Connect/read timeouts and retry budget (default: from the
        ``CHKQ_STORE_*`` variables).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: storage.Client | None = None,
        project: str | None = None,
        page_size: int = 1000,
        part_size: int = 16 * MiB,
        attempts: int = 8,
        timeouts: StoreTimeouts | None = None,
    ) -> None:
        if not bucket:
            raise BadNameError("GCSStore needs a bucket name")
        self.timeouts = timeouts if timeouts is not None else StoreTimeouts.from_env()
        self._timeout = (self.timeouts.connect, self.timeouts.read)
        self._compose_timeout = (self.timeouts.connect, self.timeouts.complete)
        self._bucket_name = bucket
        self._prefix = bucket_prefix(prefix)
        self.page_size = page_size
        self.part_size = part_size
        self.attempts = attempts
        self._client = (client if client is not None
                        else _make_client(project, f"gs://{bucket}/{prefix}".rstrip("/")))
        self._bucket = self._client.bucket(bucket)

    @property
    def url(self) -> str:
        return f"gs://{self._bucket_name}/{self._prefix.rstrip('/')}".rstrip("/")

    @property
    def client(self) -> storage.Client:
        """The google-cloud-storage client (exposed for tests and tools)."""
        return self._client

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket_name

    def _is_transient(self, exc: BaseException) -> bool:
        return _is_transient(exc)

    def _is_missing_bucket(self, exc: BaseException) -> bool:
        return isinstance(exc, api_exceptions.NotFound)

    def _retry(self, operation: Any, what: str) -> Any:
        """:meth:`BucketStore._retry`, refused credentials said as a user fixes them.

        Raises
        ------
        StoreAccessError
            If the store refused the credentials sent (401, 403) or they could not
            be refreshed, naming the store and the variables to set.
        """
        try:
            return super()._retry(operation, what)
        except (api_exceptions.Unauthorized, api_exceptions.Forbidden,
                auth_exceptions.RefreshError) as exc:
            raise StoreAccessError(
                f"store {self.url}: {what}: the store refused the credentials sent "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                f"check {CREDENTIAL_VARIABLES}, and that they may use bucket "
                f"{self._bucket_name!r}") from None

    def _available(self) -> bool:
        return bool(self._retry(
            lambda: self._bucket.exists(timeout=self._timeout, retry=None), "bucket exists"))

    def _writable(self, key: str) -> str:
        """The object name of ``key``, refused if it is in the uploads' staging area."""
        if key.split("/", 1)[0] == UPLOADS_DIR:
            raise InvalidKeyError(f"invalid store key {key!r}: {UPLOADS_DIR!r} is reserved")
        return self._prefix + key

    def _put(self, key: str, data: bytes) -> None:
        self._writable(key)
        blob = self._bucket.blob(self._prefix + key)
        self._retry(
            lambda: blob.upload_from_string(data, content_type="application/octet-stream",
                                            timeout=self._timeout, retry=None),
            f"put {key}",
        )

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        name = self._writable(key)
        write_id = uuid.uuid4().hex

        def attempt() -> bool:
            blob = self._bucket.blob(name)
            blob.metadata = {WRITE_ID_METADATA: write_id}
            try:
                blob.upload_from_string(
                    data, content_type="application/octet-stream", if_generation_match=0,
                    timeout=self._timeout, retry=None,
                )
            except api_exceptions.PreconditionFailed:
                current = self._bucket.get_blob(name, timeout=self._timeout, retry=None)
                metadata = None if current is None else dict(current.metadata or {})
                return self._written_by(metadata, write_id, name)
            return True

        return self._retry(attempt, f"put_if_absent {key}")

    def _get(self, key: str) -> bytes:
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> bytes:
            try:
                return bytes(blob.download_as_bytes(timeout=self._timeout, retry=None))
            except api_exceptions.NotFound:
                raise KeyError(key) from None

        return self._retry(attempt, f"get {key}")

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._get_range(key, 0, limit + 1)

    def _size(self, key: str) -> int:
        blob = self._stat(key)
        if blob is None:
            raise KeyError(key)
        return int(blob.size)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        if length == 0:
            self._size(key)
            return b""
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> bytes:
            try:
                return bytes(blob.download_as_bytes(start=start, end=start + length - 1,
                                                    timeout=self._timeout, retry=None))
            except api_exceptions.NotFound:
                raise KeyError(key) from None
            except api_exceptions.RequestRangeNotSatisfiable:
                if self._stat(key) is None:
                    raise KeyError(key) from None
                return b""

        return self._retry(attempt, f"get {key}")

    def _stat(self, key: str) -> Any:
        return self._retry(
            lambda: self._bucket.get_blob(self._prefix + key, timeout=self._timeout, retry=None),
            f"stat {key}",
        )

    def _exists(self, key: str) -> bool:
        return self._stat(key) is not None

    def _version(self, key: str) -> ObjectVersion:
        blob = self._stat(key)
        if blob is None:
            raise KeyError(key)
        return ObjectVersion(int(blob.size), f"generation:{blob.generation}")

    def _versions(self, prefix: str) -> dict[str, ObjectVersion]:
        def attempt() -> dict[str, ObjectVersion]:
            blobs = self._client.list_blobs(
                self._bucket_name, prefix=self._prefix + prefix, page_size=self.page_size,
                timeout=self._timeout, retry=None,
            )
            staging = self._prefix + UPLOADS_DIR + "/"
            return {blob.name[len(self._prefix):]: ObjectVersion(
                        int(blob.size), f"generation:{blob.generation}")
                    for blob in blobs if not blob.name.startswith(staging)}

        return self._retry(attempt, f"list {prefix!r}")

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        generation = pinned.version.removeprefix("generation:")
        if not generation.isdigit():
            return None
        if length == 0 or start >= pinned.size:
            try:
                return b"" if self._version(key) == pinned else None
            except KeyError:
                return None
        # The generation itself is read: its bytes or none (404 once it is replaced in a
        # bucket that keeps no old versions); fake-gcs-server ignores ifGenerationMatch here.
        blob = self._bucket.blob(self._prefix + key, generation=int(generation))

        def attempt() -> bytes | None:
            try:
                return bytes(blob.download_as_bytes(
                    start=start, end=start + length - 1, timeout=self._timeout, retry=None))
            except (api_exceptions.NotFound, api_exceptions.PreconditionFailed):
                return None

        return self._retry(attempt, f"get {key}")

    def _modified(self, key: str) -> float:
        blob = self._stat(key)
        if blob is None:
            raise KeyError(key)
        stamp = blob.time_created or blob.updated
        return float(stamp.timestamp())

    def _list(self, prefix: str) -> list[str]:
        def attempt() -> list[str]:
            blobs = self._client.list_blobs(
                self._bucket_name, prefix=self._prefix + prefix, page_size=self.page_size,
                timeout=self._timeout, retry=None,
            )
            staging = self._prefix + UPLOADS_DIR + "/"
            return [blob.name[len(self._prefix) :] for blob in blobs
                    if not blob.name.startswith(staging)]

        return self._retry(attempt, f"list {prefix!r}")

    def _delete(self, key: str) -> None:
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> None:
            with contextlib.suppress(api_exceptions.NotFound):
                blob.delete(timeout=self._timeout, retry=None)

        self._retry(attempt, f"delete {key}")

    # publishing from parts -----------------------------------------------------------

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        self._writable(key)
        return _ComposeUpload(self, key, part_size=part_size or self.part_size,
                              checksum=checksum)

    def upload_part_size(self, requested: int | None = None) -> int | None:
        super().upload_part_size(requested)
        return max(requested or self.part_size, 1)

    def _checksums(self, key: str) -> ObjectChecksums:
        """Size and the CRC32C GCS keeps of every object, composed ones too."""
        blob = self._stat(key)
        if blob is None:
            raise KeyError(key)
        crc32c = None
        if blob.crc32c:
            crc32c = int.from_bytes(base64.b64decode(blob.crc32c), "big")
        return ObjectChecksums(size=int(blob.size), crc32c=crc32c)

    def _stray_uploads(self, prefix: str) -> list[StrayUpload]:
        staging = self._prefix + UPLOADS_DIR + "/"

        def attempt() -> list[StrayUpload]:
            uploads: dict[str, StrayUpload] = {}
            for blob in self._client.list_blobs(self._bucket_name, prefix=staging,
                                                page_size=self.page_size,
                                                timeout=self._timeout, retry=None):
                upload_id = blob.name[len(staging):].split("/", 1)[0]
                key = str((blob.metadata or {}).get(UPLOAD_KEY_METADATA, ""))
                started = float((blob.time_created or blob.updated).timestamp())
                known = uploads.get(upload_id)
                if known is None or started < known.started:
                    uploads[upload_id] = StrayUpload(key or (known.key if known else ""),
                                                     upload_id, started)
            return sorted((u for u in uploads.values() if u.key.startswith(prefix)),
                          key=lambda u: u.upload_id)

        return self._retry(attempt, f"list uploads {prefix!r}")

    def _abort_upload(self, stray: StrayUpload) -> None:
        if not stray.upload_id or "/" in stray.upload_id:
            raise InvalidKeyError(f"store {self.url}: {stray.upload_id!r} is not an upload")
        staging = f"{self._prefix}{UPLOADS_DIR}/{stray.upload_id}/"

        def attempt() -> None:
            for blob in self._client.list_blobs(self._bucket_name, prefix=staging,
                                                timeout=self._timeout, retry=None):
                with contextlib.suppress(api_exceptions.NotFound):
                    blob.delete(timeout=self._timeout, retry=None)

        self._retry(attempt, f"abort upload {stray.upload_id} of {stray.key}")

    # composing staged parts (uploads and shared uploads) ------------------------------

    def _compose_rounds(self, sources: list[Any], intermediate: Callable[[], Any],
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
                self._retry(
                    lambda destination=destination, group=group: destination.compose(
                        group, timeout=self._compose_timeout, retry=None),
                    f"compose {len(group)} parts of {key}")
                merged.append(destination)
            sources = merged
        return sources

    def _compose_if_absent(self, key: str, sources: list[Any], write_id: str) -> bool:
        """Compose ``sources`` into ``key`` with ``ifGenerationMatch=0`` and ``write_id``.

        A 412 is read back: the object is ours (a resent compose) if it carries
        the write id. True if the object is now ours, False if another's.
        """
        name = self._prefix + key

        def attempt() -> bool:
            destination = self._bucket.blob(name)
            destination.metadata = {WRITE_ID_METADATA: write_id}
            destination.content_type = "application/octet-stream"
            try:
                destination.compose(sources, if_generation_match=0,
                                    timeout=self._compose_timeout, retry=None)
            except api_exceptions.PreconditionFailed:
                current = self._bucket.get_blob(name, timeout=self._timeout, retry=None)
                metadata = None if current is None else dict(current.metadata or {})
                return self._written_by(metadata, write_id, name)
            return True

        return bool(self._retry(attempt, f"complete upload of {key}"))

    # shared uploads ----------------------------------------------------------------------

    @property
    def supports_shared_uploads(self) -> bool:
        return True

    def _staging(self, upload: SharedUpload) -> str:
        """The staging place of a shared upload: ``.chkq-uploads/ID/`` under the prefix."""
        if not re.fullmatch(r"[0-9a-f]{32}", upload.upload_id):
            raise BadMessageError(f"store {self.url}: {upload.upload_id!r} is no shared "
                                  "upload of a GCS store (32 hex digits)")
        self._writable(upload.key)
        return f"{self._prefix}{UPLOADS_DIR}/{upload.upload_id}/"

    def _stage_shared(self, upload: SharedUpload, name: str, what: str,
                      send: Callable[[Any], None]) -> Any:
        """Upload a staged object ``name`` of ``upload`` with ``send(blob)``; the blob made."""
        full = self._staging(upload) + name

        def attempt() -> Any:
            blob = self._bucket.blob(full)
            blob.metadata = {UPLOAD_KEY_METADATA: upload.key}
            send(blob)
            return blob

        return self._retry(attempt, what)

    def _begin_shared_upload(self, key: str) -> SharedUpload:
        """A random staging place, marked with an empty ``begun`` object (so that
        :meth:`stray_uploads` lists it before any part is staged)."""
        self._writable(key)
        upload = SharedUpload(key, uuid.uuid4().hex, uuid.uuid4().hex)
        self._stage_shared(upload, "begun", f"start shared upload of {key}",
                           lambda blob: blob.upload_from_string(
                               b"", timeout=self._timeout, retry=None))
        return upload

    def _part_record(self, upload: SharedUpload, number: int, offset: int, blob: Any,
                     size: int, crc32c: int) -> PartRecord:
        sent = base64.b64encode(crc32c.to_bytes(4, "big")).decode("ascii")
        if blob.crc32c != sent or int(blob.size) != size:
            raise StoredBytesMismatchError(
                f"store {self.url}: part {number} of {upload.key}: the store kept "
                f"{blob.size} bytes with CRC32C {blob.crc32c}, not the {size} with {sent} sent")
        return PartRecord(number, size, offset, str(blob.generation), sent)

    def _put_part(self, upload: SharedUpload, number: int, data: bytes,
                  offset: int) -> PartRecord:
        blob = self._stage_shared(
            upload, f"p{number:05d}", f"stage part {number} of {upload.key}",
            lambda blob: blob.upload_from_string(
                data, content_type="application/octet-stream", checksum="crc32c",
                timeout=self._timeout, retry=None))
        return self._part_record(upload, number, offset, blob, len(data),
                                 int(google_crc32c.value(data)))

    def _copy_part(self, upload: SharedUpload, number: int, source_key: str,
                   pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        """GCS has no ranged copy: the range is read pinned (:meth:`get_range_pinned`,
        32 MiB at a time) and uploaded as the staged part, its bytes passing through
        this process (32 MiB of them held at a time)."""
        changed = CheckpointChangedError(
            f"store {self.url}: {source_key} changed since it was pinned (replaced or "
            f"deleted): part {number} of {upload.key} was not copied from it")
        readers: list[_PinnedRange] = []

        def send(blob: Any) -> None:
            reader = _PinnedRange(self, source_key, pinned, start, length, changed)
            readers.append(reader)
            blob.chunk_size = PIN_READ
            blob.upload_from_file(io.BufferedReader(reader, PIN_READ), size=length,
                                  content_type="application/octet-stream",
                                  checksum="crc32c", timeout=self._timeout, retry=None)

        blob = self._stage_shared(upload, f"p{number:05d}",
                                  f"stage part {number} of {upload.key} from {source_key}",
                                  send)
        return self._part_record(upload, number, offset, blob, length, readers[-1].crc32c)

    def _complete_shared_upload(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        validate_parts(upload, parts)
        staging = self._staging(upload)
        current = self._stat(upload.key)
        if current is not None:  # another's (or ours, completed before an answer was lost)
            ours = dict(current.metadata or {}).get(WRITE_ID_METADATA) == upload.write_id
            self._abort_shared_upload(upload)
            return ours
        staged = {blob.name: blob for blob in self._retry(
            lambda: list(self._client.list_blobs(self._bucket_name, prefix=staging,
                                                 page_size=self.page_size,
                                                 timeout=self._timeout, retry=None)),
            f"list parts of {upload.key}")}
        sources = []
        for part in parts:
            blob = staged.get(f"{staging}p{part.number:05d}")
            if blob is None:
                raise ValueError(f"store {self.url}: part {part.number} of {upload.key} is "
                                 f"not staged (never put, or the upload was aborted)")
            if int(blob.size) != part.size or blob.crc32c != part.checksum:
                raise StoredBytesMismatchError(
                    f"store {self.url}: part {part.number} of {upload.key} is staged with "
                    f"{blob.size} bytes and CRC32C {blob.crc32c}, not the {part.size} "
                    f"with {part.checksum} recorded (put again with other bytes?)")
            sources.append(self._bucket.blob(blob.name, generation=blob.generation))
        made = itertools.count()

        def intermediate() -> Any:
            blob = self._bucket.blob(f"{staging}c{next(made):05d}")
            blob.metadata = {UPLOAD_KEY_METADATA: upload.key}
            return blob

        try:
            sources = self._compose_rounds(sources, intermediate, upload.key)
            created = self._compose_if_absent(upload.key, sources, upload.write_id)
        except BaseException:
            with contextlib.suppress(Exception):  # intermediates only: the parts stay
                for index in range(next(made)):
                    self._bucket.blob(f"{staging}c{index:05d}").delete(
                        timeout=self._timeout, retry=None)
            raise
        self._abort_shared_upload(upload)
        return created

    def _abort_shared_upload(self, upload: SharedUpload) -> None:
        self._staging(upload)
        self._abort_upload(StrayUpload(upload.key, upload.upload_id, 0.0))

    def shared_upload_checksums(self, parts: list[PartRecord]) -> ObjectChecksums:
        """The size and the CRC32C combined from the parts' (GCS's, base64)."""
        return ObjectChecksums(size=sum(part.size for part in parts),
                               crc32c=combined_crc32c(parts))


class _ComposeUpload(PartsUpload):
    """Parts staged as objects under ``.chkq-uploads/ID/``, composed with ``ifGenerationMatch=0``.

    A copied range that is a whole source object is composed from the
    source itself, server-side; other ranges pass through the client.
    Compose takes at most 32 sources, so longer lists are composed in
    rounds into staged intermediates. The destination carries a write id,
    so that a resent compose refused with 412 is recognised as this
    upload's own. The staged parts are deleted once published or aborted.
    """

    store: GCSStore

    def __init__(self, store: GCSStore, key: str, *, part_size: int,
                 checksum: bool = False) -> None:
        super().__init__(store, key)
        self.upload_id = uuid.uuid4().hex
        self._write_id = uuid.uuid4().hex
        self._staged: list[Any] = []
        self._sources: list[Any] = []
        self._buffer = bytearray()
        self.part_size = max(part_size, 1)
        self._checksum: str | None = "crc32c" if checksum else None

    def _stage(self, data: bytes) -> Any:
        store = self.store
        name = f"{store._prefix}{UPLOADS_DIR}/{self.upload_id}/{len(self._staged):05d}"
        blob = store._bucket.blob(name)
        blob.metadata = {UPLOAD_KEY_METADATA: self.key}
        self._staged.append(blob)
        store._retry(
            lambda: blob.upload_from_string(data, content_type="application/octet-stream",
                                            checksum=self._checksum, timeout=store._timeout,
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
            self._sources.append(self.store._bucket.blob(self.store._prefix + source))
        else:
            super()._copy(source, start, length)

    def _complete(self) -> bool:
        self._flush(final=True)
        store = self.store
        if not self._sources:
            self._sources.append(self._stage(b""))
        sources = store._compose_rounds(self._sources, self._intermediate, self.key)
        created = store._compose_if_absent(self.key, sources, self._write_id)
        if created:
            self._abort()
        return created

    def _intermediate(self) -> Any:
        store = self.store
        name = f"{store._prefix}{UPLOADS_DIR}/{self.upload_id}/{len(self._staged):05d}"
        intermediate = store._bucket.blob(name)
        intermediate.metadata = {UPLOAD_KEY_METADATA: self.key}
        self._staged.append(intermediate)
        return intermediate

    def _abort(self) -> None:
        store = self.store
        while self._staged:
            store._retry(self._delete_last_staged, f"delete staged part of {self.key}")

    def _delete_last_staged(self) -> None:
        with contextlib.suppress(api_exceptions.NotFound):
            self._staged[-1].delete(timeout=self.store._timeout, retry=None)
        self._staged.pop()


class _PinnedRange(io.RawIOBase):
    """``length`` bytes of one pinned object from ``start``, read as a file (for an upload).

    Each read is a :meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`
    of at most :data:`~chkq.stores.shared_upload.PIN_READ` bytes; a read the
    pin refuses raises ``changed``. The CRC32C of the bytes read is kept.
    """

    def __init__(self, store: GCSStore, key: str, pinned: ObjectVersion, start: int,
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
