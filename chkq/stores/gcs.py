"""Google Cloud Storage stores: ``gs://bucket/prefix``."""

from __future__ import annotations

import contextlib
import http.client
import os
import uuid
from typing import Any

import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud import storage

from chkq.errors import BadNameError
from chkq.stores.base import (
    WRITE_ID_METADATA,
    BucketStore,
    StoreTimeouts,
    bucket_prefix,
)

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


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


def _make_client(project: str | None) -> storage.Client:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "test", credentials=AnonymousCredentials())
    return storage.Client(project=project)


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
    matches (:meth:`~chkq.stores.base.BucketStore._written_by`).

    Waits are bounded (:class:`~chkq.stores.base.StoreTimeouts`): every
    call passes ``timeout=(connect, read)`` and ``retry=None`` (the client's
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
        attempts: int = 8,
        timeouts: StoreTimeouts | None = None,
    ) -> None:
        if not bucket:
            raise BadNameError("GCSStore needs a bucket name")
        self.timeouts = timeouts if timeouts is not None else StoreTimeouts.from_env()
        self._timeout = (self.timeouts.connect, self.timeouts.read)
        self._bucket_name = bucket
        self._prefix = bucket_prefix(prefix)
        self.page_size = page_size
        self.attempts = attempts
        self._client = client if client is not None else _make_client(project)
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

    def _available(self) -> bool:
        return bool(self._retry(
            lambda: self._bucket.exists(timeout=self._timeout, retry=None), "bucket exists"))

    def _put(self, key: str, data: bytes) -> None:
        blob = self._bucket.blob(self._prefix + key)
        self._retry(
            lambda: blob.upload_from_string(data, content_type="application/octet-stream",
                                            timeout=self._timeout, retry=None),
            f"put {key}",
        )

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        name = self._prefix + key
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
            return [blob.name[len(self._prefix) :] for blob in blobs]

        return self._retry(attempt, f"list {prefix!r}")

    def _delete(self, key: str) -> None:
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> None:
            with contextlib.suppress(api_exceptions.NotFound):
                blob.delete(timeout=self._timeout, retry=None)

        self._retry(attempt, f"delete {key}")
