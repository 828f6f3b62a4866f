"""Google Cloud Storage stores: ``gs://bucket/prefix``."""

from __future__ import annotations

import base64
import contextlib
import http.client
import uuid
from typing import Any

import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud import storage

from chkq import environment
from chkq.errors import (
    BadNameError,
    InvalidKeyError,
    StoreAccessError,
)
from chkq.stores.base import ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.bucket import WRITE_ID_METADATA, BucketStore
from chkq.stores.gcs_upload import (
    UPLOAD_KEY_METADATA,
    UPLOADS_DIR,
    ComposeUpload,
    SharedCompose,
    Staging,
    check_writable,
)
from chkq.stores.keys import bucket_prefix
from chkq.stores.retry import StoreTimeouts
from chkq.stores.shared_upload import PartRecord, SharedUpload
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
        check_writable(key)
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
        return ComposeUpload(self, self._staging, key, part_size=part_size or self.part_size,
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

    # shared uploads ----------------------------------------------------------------------

    @property
    def supports_shared_uploads(self) -> bool:
        return True

    @property
    def _staging(self) -> Staging:
        return Staging(self, client=self._client, bucket=self._bucket, prefix=self._prefix,
                       page_size=self.page_size, timeout=self._timeout,
                       compose_timeout=self._compose_timeout, stat=self._stat)

    @property
    def _shared(self) -> SharedCompose:
        return SharedCompose(self._staging)

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

    def shared_upload_checksums(self, parts: list[PartRecord]) -> ObjectChecksums:
        """The size and the CRC32C combined from the parts' (GCS's, base64)."""
        return self._shared.checksums(parts)
