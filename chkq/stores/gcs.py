"""Google Cloud Storage stores: ``gs://bucket/prefix``."""

from __future__ import annotations

import contextlib
import http.client
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud import storage

from chkq.errors import BadNameError
from chkq.stores.base import (
    WRITE_ID_METADATA,
    CheckpointStore,
    StoreNotFoundError,
    StoreTimeouts,
    bucket_prefix,
    retry_transient,
)

__all__ = ["GCSStore"]

T = TypeVar("T")

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


class _VanishedAfterConflict(Exception):
    """A 412 named an object that was gone when read back: retry the write."""


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (*_TRANSIENT_TYPES, _VanishedAfterConflict)):
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


def _make_client(project: str | None) -> storage.Client:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "test", credentials=AnonymousCredentials())
    return storage.Client(project=project)


class GCSStore(CheckpointStore):
    """Objects in a Google Cloud Storage bucket under an optional prefix.

    Credentials and project come from the environment (Application Default
    Credentials).  With ``STORAGE_EMULATOR_HOST`` set, the client talks to
    that emulator anonymously with project ``test``.

    ``put_if_absent`` uploads with ``if_generation_match=0``.  Like S3, a
    412 may answer the caller's own write when google-cloud-storage retried
    an upload whose response was lost, so each conditional write carries a
    random write id in the object's custom metadata (``chkq-write-id``) and
    a 412 is read back and compared: the write is ours — True — if the id
    matches (contents are not compared, since content-addressed writers
    write identical bytes).

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

    def _retry(self, operation: Callable[[], T], what: str) -> T:
        return retry_transient(
            operation, is_transient=_is_transient, what=f"store {self.url}: {what}",
            attempts=self.attempts, budget=self.timeouts.budget,
        )

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
                if current is None:
                    raise _VanishedAfterConflict(name) from None
                return bool((current.metadata or {}).get(WRITE_ID_METADATA) == write_id)
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
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> bytes:
            try:
                return bytes(blob.download_as_bytes(start=0, end=limit, timeout=self._timeout,
                                                    retry=None))
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
            try:
                return [blob.name[len(self._prefix) :] for blob in blobs]
            except api_exceptions.NotFound:
                raise StoreNotFoundError(
                    f"store {self.url} does not exist (no bucket {self._bucket_name!r})"
                ) from None

        return self._retry(attempt, f"list {prefix!r}")

    def _delete(self, key: str) -> None:
        blob = self._bucket.blob(self._prefix + key)

        def attempt() -> None:
            with contextlib.suppress(api_exceptions.NotFound):
                blob.delete(timeout=self._timeout, retry=None)

        self._retry(attempt, f"delete {key}")
