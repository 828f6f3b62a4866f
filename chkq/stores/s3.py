"""Amazon S3 and S3-compatible stores: ``s3://bucket/prefix``."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from chkq.errors import BadNameError, StoredBytesMismatchError
from chkq.stores.base import (
    WRITE_ID_METADATA,
    BucketStore,
    ObjectChecksums,
    ObjectVersion,
    PartsUpload,
    StoreTimeouts,
    StrayUpload,
    TransientStoreError,
    bucket_prefix,
)

__all__ = ["S3Store"]

MiB = 1 << 20
MIN_PART = 5 * MiB
"""S3's smallest part but for the last."""
MAX_COPY_PART = 1 << 30
#: Parts of one upload sent at once: S3 takes parts in any order, and one stream rarely
#: fills the link; the caller's memory holds this many parts in flight at most.
PARTS_IN_FLIGHT = 3
"""Largest range copied server-side in one ``UploadPartCopy`` (S3 allows 5 GiB)."""

_TRANSIENT_CODES = frozenset(
    {
        "ConditionalRequestConflict",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
_BAD_DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"})


def _error(exc: ClientError) -> tuple[str, int]:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, HTTPClientError | BotoConnectionError | IncompleteReadError):
        return True
    if isinstance(exc, ClientError):
        code, status = _error(exc)
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    return False


def _is_not_found(exc: ClientError) -> bool:
    code, status = _error(exc)
    return code in _NOT_FOUND_CODES or status == 404


def _is_precondition_failed(exc: ClientError) -> bool:
    code, status = _error(exc)
    return code == "PreconditionFailed" or status == 412


class S3Store(BucketStore):
    """Objects in an S3 bucket under an optional key prefix.

    Endpoint, region and credentials come from the usual AWS variables
    (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``,
    ``AWS_ACCESS_KEY_ID``, profiles, instance roles...) unless given.

    ``put_if_absent`` is a conditional PUT (``If-None-Match: *``), as a
    single request or, above ``multipart_threshold``, as a multipart upload
    whose *completion* carries the condition (the upload is aborted if
    anything fails).  A 412 answer is ambiguous: botocore retries a request
    whose response was lost, and the retry then fails against the caller's
    own, successful first attempt.  Each conditional write is therefore
    stamped with a random write id in the object metadata
    (``x-amz-meta-chkq-write-id``); on 412 the object is read back
    (``HeadObject``) and the write counts as ours — True — if the id
    matches (:meth:`~chkq.stores.base.BucketStore._written_by`).  409 ConditionalRequestConflict
    (a concurrent write in flight) and other transient errors are retried
    with backoff by :func:`chkq.stores.base.retry_transient`.

    Waits are bounded (:class:`~chkq.stores.base.StoreTimeouts`): each
    request has connect and read timeouts, botocore's own retries are off
    (``total_max_attempts=1``), and the one retry layer stops when the
    operation's budget is spent, with an error naming the store and key.
    A missing bucket raises :class:`~chkq.stores.base.StoreNotFoundError`.

    Parameters
    ----------
    bucket
        Bucket name.
    prefix
        Key prefix inside the bucket (no leading or trailing ``/``).
    client
        A boto3 S3 client to use instead of building one (its own timeouts
        and retries then apply to each attempt).
    endpoint_url, region_name
        Overrides for the AWS variables.
    multipart_threshold
        Objects at least this large are uploaded in parts.
    part_size
        Size of each part (S3 requires at least 5 MiB but for the last).
    page_size
        Keys requested per ``ListObjectsV2`` page (at most 1000).
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
        client: Any = None,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        page_size: int = 1000,
        attempts: int = 8,
        timeouts: StoreTimeouts | None = None,
    ) -> None:
        if not bucket:
            raise BadNameError("S3Store needs a bucket name")
        self.timeouts = timeouts if timeouts is not None else StoreTimeouts.from_env()
        self._bucket = bucket
        self._prefix = bucket_prefix(prefix)
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.page_size = page_size
        self.attempts = attempts
        if client is None:
            config = Config(
                retries={"mode": "standard", "total_max_attempts": 1},
                connect_timeout=self.timeouts.connect,
                read_timeout=self.timeouts.read,
            )
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url or None,
                region_name=region_name
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION"),
                config=config,
            )
        self._client = client

    @property
    def url(self) -> str:
        return f"s3://{self._bucket}/{self._prefix.rstrip('/')}".rstrip("/")

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def client(self) -> Any:
        """The boto3 S3 client (exposed for tests and tools)."""
        return self._client

    def _is_transient(self, exc: BaseException) -> bool:
        return _is_transient(exc)

    def _is_missing_bucket(self, exc: BaseException) -> bool:
        return isinstance(exc, ClientError) and _error(exc)[0] in _NO_BUCKET_CODES

    def _available(self) -> bool:
        def attempt() -> bool:
            try:
                self._client.head_bucket(Bucket=self._bucket)
            except ClientError as exc:
                if _is_not_found(exc) or _error(exc)[0] in _NO_BUCKET_CODES:
                    return False
                raise
            return True

        return self._retry(attempt, "head bucket")

    def _put(self, key: str, data: bytes) -> None:
        name = self._prefix + key

        def attempt() -> None:
            if len(data) >= self.multipart_threshold:
                self._multipart(name, data, {}, conditional=False)
            else:
                self._client.put_object(Bucket=self._bucket, Key=name, Body=data)

        self._retry(attempt, f"put {key}")

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        name = self._prefix + key
        write_id = uuid.uuid4().hex
        metadata = {WRITE_ID_METADATA: write_id}

        def attempt() -> bool:
            try:
                if len(data) >= self.multipart_threshold:
                    self._multipart(name, data, metadata, conditional=True)
                else:
                    self._client.put_object(
                        Bucket=self._bucket, Key=name, Body=data, IfNoneMatch="*",
                        Metadata=metadata,
                    )
            except ClientError as exc:
                code, _ = _error(exc)
                if _is_precondition_failed(exc) or code == "NoSuchUpload":
                    return self._written_by(self._metadata(name), write_id, name)
                raise
            return True

        return self._retry(attempt, f"put_if_absent {key}")

    def _metadata(self, name: str) -> dict[str, str] | None:
        """The custom metadata of the object ``name``, or None if there is none."""
        try:
            head = self._client.head_object(Bucket=self._bucket, Key=name)
        except ClientError as exc:
            if _is_not_found(exc):
                return None
            raise
        return dict(head.get("Metadata", {}))

    def _multipart(
        self, name: str, data: bytes, metadata: dict[str, str], *, conditional: bool
    ) -> None:
        upload = self._client.create_multipart_upload(
            Bucket=self._bucket, Key=name, Metadata=metadata
        )
        upload_id = upload["UploadId"]
        try:
            parts = []
            step = max(self.part_size, 1)
            for number, offset in enumerate(range(0, len(data), step), start=1):
                answer = self._client.upload_part(
                    Bucket=self._bucket, Key=name, UploadId=upload_id, PartNumber=number,
                    Body=data[offset : offset + step],
                )
                parts.append({"ETag": answer["ETag"], "PartNumber": number})
            extra = {"IfNoneMatch": "*"} if conditional else {}
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **extra,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=name, UploadId=upload_id
                )
            raise

    def _get(self, key: str) -> bytes:
        return self._read(key, None)

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._read(key, limit + 1)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        if length == 0:
            if self._head(key) is None:
                raise KeyError(key)
            return b""
        return self._read(key, length, start)

    def _size(self, key: str) -> int:
        head = self._head(key)
        if head is None:
            raise KeyError(key)
        return int(head["ContentLength"])

    def _read(self, key: str, amount: int | None, start: int = 0) -> bytes:
        """The object at ``key``: ``amount`` bytes from ``start``, or all of it (``None``)."""
        name = self._prefix + key
        ranged = {"Range": f"bytes={start}-{start + amount - 1}"} if start and amount else {}

        def attempt() -> bytes:
            try:
                answer = self._client.get_object(Bucket=self._bucket, Key=name, **ranged)
            except ClientError as exc:
                if _is_not_found(exc):
                    raise KeyError(key) from None
                if _error(exc)[0] == "InvalidRange":
                    return b""
                raise
            body = answer["Body"]
            try:
                return bytes(body.read(amount))
            finally:
                body.close()

        return self._retry(attempt, f"get {key}")

    def _head(self, key: str) -> dict[str, Any] | None:
        def attempt() -> dict[str, Any] | None:
            try:
                return dict(
                    self._client.head_object(Bucket=self._bucket, Key=self._prefix + key)
                )
            except ClientError as exc:
                if _is_not_found(exc):
                    return None
                raise

        return self._retry(attempt, f"head {key}")

    def _exists(self, key: str) -> bool:
        return self._head(key) is not None

    def _version(self, key: str) -> ObjectVersion:
        head = self._head(key)
        if head is None:
            raise KeyError(key)
        return ObjectVersion(int(head["ContentLength"]), f"etag:{head['ETag']}")

    def _versions(self, prefix: str) -> dict[str, ObjectVersion]:
        def attempt() -> dict[str, ObjectVersion]:
            paginator = self._client.get_paginator("list_objects_v2")
            found: dict[str, ObjectVersion] = {}
            pages = paginator.paginate(
                Bucket=self._bucket, Prefix=self._prefix + prefix,
                PaginationConfig={"PageSize": self.page_size},
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    found[obj["Key"][len(self._prefix):]] = ObjectVersion(
                        int(obj["Size"]), f"etag:{obj['ETag']}")
            return found

        return self._retry(attempt, f"list {prefix!r}")

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        etag = pinned.version.removeprefix("etag:")
        if length == 0 or start >= pinned.size:
            current = self._head(key)
            if current is None or f"etag:{current['ETag']}" != pinned.version:
                return None
            return b""
        name = self._prefix + key

        def attempt() -> bytes | None:
            try:
                answer = self._client.get_object(
                    Bucket=self._bucket, Key=name, IfMatch=etag,
                    Range=f"bytes={start}-{start + length - 1}")
            except ClientError as exc:
                if _is_not_found(exc) or _is_precondition_failed(exc):
                    return None
                raise
            body = answer["Body"]
            try:
                return bytes(body.read(length))
            finally:
                body.close()

        return self._retry(attempt, f"get {key}")

    def _modified(self, key: str) -> float:
        head = self._head(key)
        if head is None:
            raise KeyError(key)
        return float(head["LastModified"].timestamp())

    def _list(self, prefix: str) -> list[str]:
        def attempt() -> list[str]:
            paginator = self._client.get_paginator("list_objects_v2")
            keys: list[str] = []
            pages = paginator.paginate(
                Bucket=self._bucket,
                Prefix=self._prefix + prefix,
                PaginationConfig={"PageSize": self.page_size},
            )
            for page in pages:
                keys.extend(obj["Key"][len(self._prefix) :] for obj in page.get("Contents", []))
            return keys

        return self._retry(attempt, f"list {prefix!r}")

    def _delete(self, key: str) -> None:
        name = self._prefix + key
        self._retry(
            lambda: self._client.delete_object(Bucket=self._bucket, Key=name), f"delete {key}"
        )

    # publishing from parts -----------------------------------------------------------

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        return _MultipartUpload(self, key, part_size=part_size or self.part_size,
                                checksum=checksum)

    def upload_part_size(self, requested: int | None = None) -> int | None:
        super().upload_part_size(requested)
        return max(requested or self.part_size, MIN_PART)

    def _checksums(self, key: str) -> ObjectChecksums:
        """Size and ``ChecksumSHA256`` from a ``HeadObject`` with ``ChecksumMode=ENABLED``.

        S3 gives a composite checksum as ``BASE64-N``; moto gives it without
        the suffix on ``HeadObject`` (and ``-N`` on ``GetObject``).
        """
        name = self._prefix + key

        def attempt() -> dict[str, Any] | None:
            try:
                return dict(self._client.head_object(Bucket=self._bucket, Key=name,
                                                     ChecksumMode="ENABLED"))
            except ClientError as exc:
                if _is_not_found(exc):
                    return None
                raise

        head = self._retry(attempt, f"checksums of {key}")
        if head is None:
            raise KeyError(key)
        value, parts = head.get("ChecksumSHA256"), None
        if isinstance(value, str) and "-" in value:
            value, _, count = value.partition("-")
            parts = int(count) if count.isdigit() else None
        return ObjectChecksums(size=int(head["ContentLength"]),
                               sha256=value if isinstance(value, str) and value else None,
                               sha256_parts=parts)

    def _stray_uploads(self, prefix: str) -> list[StrayUpload]:
        def attempt() -> list[StrayUpload]:
            paginator = self._client.get_paginator("list_multipart_uploads")
            found = []
            for page in paginator.paginate(Bucket=self._bucket, Prefix=self._prefix + prefix):
                for upload in page.get("Uploads", []):
                    found.append(StrayUpload(upload["Key"][len(self._prefix):],
                                             upload["UploadId"],
                                             float(upload["Initiated"].timestamp())))
            return found

        return self._retry(attempt, f"list uploads {prefix!r}")

    def _abort_upload(self, stray: StrayUpload) -> None:
        def attempt() -> None:
            try:
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=self._prefix + stray.key, UploadId=stray.upload_id)
            except ClientError as exc:
                if _error(exc)[0] != "NoSuchUpload":
                    raise

        self._retry(attempt, f"abort upload {stray.upload_id} of {stray.key}")


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


class _MultipartUpload(PartsUpload):
    """A multipart upload completed with ``If-None-Match: *``.

    Written bytes are buffered into parts of ``part_size``; a copied range
    of at least :data:`MIN_PART` bytes goes server-side (``UploadPartCopy``)
    once the buffer is flushed, so that every part but the last is at least
    5 MiB. A write of a whole part at a part boundary is sent as it is, not
    buffered. The completion carries a write id, so that a completion whose
    answer was lost and that is resent is recognised as this upload's own
    (the resend fails with 412 or NoSuchUpload).

    With ``checksum`` the upload is created with ``ChecksumAlgorithm=SHA256``:
    each part goes with its SHA-256 (the caller's, or computed here), which
    S3 checks against the bytes it received (``BadDigest`` if they differ);
    the digest S3 answers must be the one sent, the completion lists every
    part's, and the object keeps the composite SHA-256 of its parts.
    """

    store: S3Store

    def __init__(self, store: S3Store, key: str, *, part_size: int,
                 checksum: bool = False) -> None:
        super().__init__(store, key)
        self._name = store._prefix + key
        self._write_id = uuid.uuid4().hex
        self._parts: list[dict[str, Any]] = []
        self._next_part = 1
        self._sending: list[Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
        self._pool: ThreadPoolExecutor | None = None
        self._buffer = bytearray()
        self._buffer_sha256: bytes | None = None
        self.part_size = max(part_size, MIN_PART)
        self._checksum = checksum
        client = store.client
        extra = {"ChecksumAlgorithm": "SHA256"} if checksum else {}
        answer = store._retry(
            lambda: client.create_multipart_upload(
                Bucket=store.bucket, Key=self._name,
                Metadata={WRITE_ID_METADATA: self._write_id}, **extra),
            f"start upload of {key}")
        self.upload_id: str = answer["UploadId"]

    def _flush(self, final: bool = False) -> None:
        size = self.part_size
        assert size is not None
        while len(self._buffer) >= size or (final and self._buffer):
            sha256 = self._buffer_sha256 if len(self._buffer) <= size else None
            piece = bytes(self._buffer[:size])
            del self._buffer[:size]
            self._buffer_sha256 = None
            self._send(piece, sha256)

    def _number(self) -> int:
        number, self._next_part = self._next_part, self._next_part + 1
        return number

    def _send(self, piece: bytes, sha256: bytes | None = None) -> None:
        """Send a part in the background, at most :data:`PARTS_IN_FLIGHT` at once.

        A part that failed fails the next write or the completion; the
        store's retries and their budget (a context variable) go with it.
        """
        self._raise_failed()
        number = self._number()
        self._slots.acquire()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="chkq-s3-part")
        context = contextvars.copy_context()
        try:
            future = self._pool.submit(context.run, self._send_part, number, piece, sha256)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._sending.append(future)

    def _raise_failed(self) -> None:
        for future in self._sending:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _sent(self) -> None:
        """Wait for every part in flight; their entries join the upload's parts."""
        sending, self._sending = self._sending, []
        try:
            for future in sending:
                self._parts.append(future.result())
        finally:
            for future in sending:
                future.cancel()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        self._parts.sort(key=lambda part: int(part["PartNumber"]))

    def _send_part(self, number: int, piece: bytes, sha256: bytes | None) -> dict[str, Any]:
        store = self.store
        extra: dict[str, str] = {}
        if self._checksum:
            sent = _b64(sha256 if sha256 is not None else hashlib.sha256(piece).digest())
            extra = {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": sent}
        try:
            answer = store._retry(
                lambda: store.client.upload_part(
                    Bucket=store.bucket, Key=self._name, UploadId=self.upload_id,
                    PartNumber=number, Body=piece, **extra),
                f"upload part {number} of {self.key}")
        except ClientError as exc:
            if extra and _error(exc)[0] in _BAD_DIGEST_CODES:
                raise StoredBytesMismatchError(
                    f"store {store.url}: part {number} of {self.key}: the store received "
                    f"bytes whose SHA-256 is not the {extra['ChecksumSHA256']} sent "
                    f"({_error(exc)[0]})") from exc
            raise
        part = {"ETag": answer["ETag"], "PartNumber": number}
        if extra:
            received = answer.get("ChecksumSHA256")
            if received is not None and received != extra["ChecksumSHA256"]:
                raise StoredBytesMismatchError(
                    f"store {store.url}: part {number} of {self.key}: the store received "
                    f"bytes with SHA-256 {received}, not the {extra['ChecksumSHA256']} sent")
            part["ChecksumSHA256"] = extra["ChecksumSHA256"]
        return part

    def _write(self, data: bytes) -> None:
        self._buffer += data
        self._buffer_sha256 = None
        self._flush()

    def _write_hashed(self, data: bytes, sha256: bytes) -> None:
        if self._buffer:
            self._write(data)
        elif len(data) == self.part_size:
            self._send(data, sha256)
        else:
            self._buffer += data
            self._buffer_sha256 = sha256
            self._flush()

    def _copy(self, source: str, start: int, length: int) -> None:
        end = start + length
        size = self.part_size
        assert size is not None
        if self._buffer:
            fill = min(size - len(self._buffer), length)
            self._write(self.store.get_range(source, start, fill))
            start += fill
        while end - start >= MIN_PART and not self._buffer:
            chunk = min(MAX_COPY_PART, end - start)
            self._copy_part(source, start, chunk)
            start += chunk
        if start < end:
            super()._copy(source, start, end - start)

    def _copy_part(self, source: str, start: int, size: int) -> None:
        store, number = self.store, self._number()
        answer = store._retry(
            lambda: store.client.upload_part_copy(
                Bucket=store.bucket, Key=self._name, UploadId=self.upload_id,
                PartNumber=number,
                CopySource={"Bucket": store.bucket, "Key": store._prefix + source},
                CopySourceRange=f"bytes={start}-{start + size - 1}"),
            f"copy part {number} of {self.key} from {source}")
        result = answer["CopyPartResult"]
        part = {"ETag": result["ETag"], "PartNumber": number}
        if self._checksum and result.get("ChecksumSHA256"):
            part["ChecksumSHA256"] = result["ChecksumSHA256"]
        self._parts.append(part)

    def _complete(self) -> bool:
        self._flush(final=True)
        store = self.store
        if self._next_part == 1:
            self._send(b"")
        self._sent()

        def attempt() -> bool:
            try:
                store.client.complete_multipart_upload(
                    Bucket=store.bucket, Key=self._name, UploadId=self.upload_id,
                    MultipartUpload={"Parts": self._parts}, IfNoneMatch="*")
            except ClientError as exc:
                code, status = _error(exc)
                if _is_precondition_failed(exc) or code == "NoSuchUpload":
                    return store._written_by(store._metadata(self._name), self._write_id,
                                             self._name)
                if code == "ConditionalRequestConflict" or status == 409:
                    raise TransientStoreError(
                        f"store {store.url}: upload of {self.key}: a concurrent conditional "
                        "write conflicted with its completion; start the upload again") from exc
                raise
            return True

        return store._retry(attempt, f"complete upload of {self.key}")

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            self._sent()
        self.store._abort_upload(StrayUpload(self.key, self.upload_id, 0.0))
