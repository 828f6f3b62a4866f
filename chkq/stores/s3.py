"""Amazon S3 and S3-compatible stores: ``s3://bucket/prefix``."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from chkq import environment
from chkq.errors import (
    BadNameError,
    StoreAccessError,
)
from chkq.stores.base import ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.bucket import WRITE_ID_METADATA, BucketStore
from chkq.stores.keys import bucket_prefix
from chkq.stores.retry import StoreTimeouts
from chkq.stores.s3_errors import (
    NO_BUCKET_CODES,
    code_and_status,
    is_denied,
    is_not_found,
    is_precondition_failed,
    is_transient,
)
from chkq.stores.s3_upload import (  # noqa: F401 (the part limits re-exported)
    MAX_COPY_PART,
    MIN_PART,
    PARTS_IN_FLIGHT,
    MultipartUpload,
    SharedMultipart,
)
from chkq.stores.shared_upload import PartRecord, SharedUpload
from chkq.stores.uploads import PartsUpload

__all__ = ["S3Store"]

MiB = 1 << 20

#: Where boto3 finds the credentials it sends, as the user sets them.
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN "
                        "for temporary ones), or AWS_PROFILE with a credentials file")


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
    matches (:meth:`~chkq.stores.bucket.BucketStore._written_by`).  409 ConditionalRequestConflict
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
            session = boto3.session.Session()
            where = {"endpoint_url": endpoint_url or None,
                     "region_name": region_name or environment.aws_region()}
            client = session.client("s3", config=config, **where)
            completer = session.client(
                "s3", config=config.merge(Config(read_timeout=self.timeouts.complete)), **where)
        else:
            completer = client
        self._client = client
        self._completer = completer

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
        return is_transient(exc)

    def _is_missing_bucket(self, exc: BaseException) -> bool:
        return isinstance(exc, ClientError) and code_and_status(exc)[0] in NO_BUCKET_CODES

    def _retry(self, operation: Any, what: str) -> Any:
        """:meth:`BucketStore._retry`, missing or refused credentials said as a user fixes them.

        Raises
        ------
        StoreAccessError
            If boto3 found no credentials, or the store refused the ones sent
            (403: unknown key, wrong secret, no permission), naming the store,
            its endpoint, the credentials' source and the variables to set.
        """
        try:
            return super()._retry(operation, what)
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StoreAccessError(
                f"store {self.url}: {what}: no AWS credentials ({exc}): set "
                f"{CREDENTIAL_VARIABLES} for the user running chkq (on a cluster, for the "
                "workers too)") from None
        except ClientError as exc:
            if not is_denied(exc):
                raise
            code, status = code_and_status(exc)
            raise StoreAccessError(
                f"store {self.url}: {what}: the store at {self._endpoint()} refused the "
                f"credentials sent ({self._credentials_source()}): {status or '?'} "
                f"{'Forbidden' if code == '403' else code}: check {CREDENTIAL_VARIABLES}, "
                "and that they may use bucket "
                f"{self._bucket!r} (AWS_ENDPOINT_URL names the store's endpoint)") from None

    def _endpoint(self) -> str:
        return str(getattr(self._client.meta, "endpoint_url", "") or "?")

    def _credentials_source(self) -> str:
        """``access key AKIA… from env``: which credentials were sent, never the secret."""
        try:
            found = self._client._request_signer._credentials
            key = str(found.access_key or "")
            method = str(getattr(found, "method", "") or "?")
        except AttributeError:
            return "source unknown"
        return f"access key {key[:4]}… from {method}"

    def _available(self) -> bool:
        def attempt() -> bool:
            try:
                self._client.head_bucket(Bucket=self._bucket)
            except ClientError as exc:
                if is_not_found(exc) or code_and_status(exc)[0] in NO_BUCKET_CODES:
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
                code, _ = code_and_status(exc)
                if is_precondition_failed(exc) or code == "NoSuchUpload":
                    return self._written_by(self._metadata(name), write_id, name)
                raise
            return True

        return self._retry(attempt, f"put_if_absent {key}")

    def _metadata(self, name: str) -> dict[str, str] | None:
        """The custom metadata of the object ``name``, or None if there is none."""
        try:
            head = self._client.head_object(Bucket=self._bucket, Key=name)
        except ClientError as exc:
            if is_not_found(exc):
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
            self._completer.complete_multipart_upload(
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
                if is_not_found(exc):
                    raise KeyError(key) from None
                if code_and_status(exc)[0] == "InvalidRange":
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
                if is_not_found(exc):
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
                if is_not_found(exc) or is_precondition_failed(exc):
                    return None
                raise
            body = answer["Body"]
            try:
                return bytes(body.read(length))
            finally:
                body.close()

        return self._retry(attempt, f"get {key}")

    def _read_pinned(self, key: str, pinned: ObjectVersion, piece: int
                     ) -> Iterator[bytes | None]:
        if pinned.size == 0:
            yield from super()._read_pinned(key, pinned, piece)
            return
        etag = pinned.version.removeprefix("etag:")
        name = self._prefix + key
        offset = 0
        body: Any = None

        def next_piece() -> bytes | None:
            """The next piece, from the open answer or, after a break, one opened at ``offset``."""
            nonlocal body
            if body is None:
                try:
                    body = self._client.get_object(
                        Bucket=self._bucket, Key=name, IfMatch=etag,
                        Range=f"bytes={offset}-{pinned.size - 1}")["Body"]
                except ClientError as exc:
                    if is_not_found(exc) or is_precondition_failed(exc):
                        return None
                    raise
            want = min(piece, pinned.size - offset)
            try:
                data = bytes(body.read(want))
                if len(data) != want:
                    raise IncompleteReadError(actual_bytes=offset + len(data),
                                              expected_bytes=pinned.size)
            except BaseException:
                body.close()
                body = None
                raise
            return data

        try:
            while offset < pinned.size:
                data = self._retry(next_piece, f"get {key}")
                if data is None:
                    yield None
                    return
                yield data
                offset += len(data)
        finally:
            if body is not None:
                body.close()

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
        return MultipartUpload(self, key, client=self._client, completer=self._completer,
                               prefix=self._prefix, metadata=self._metadata,
                               part_size=part_size or self.part_size, checksum=checksum)

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
                if is_not_found(exc):
                    return None
                raise

        head = self._retry(attempt, f"checksums of {key}")
        if head is None:
            raise KeyError(key)
        value, parts = head.get("ChecksumSHA256"), None
        if isinstance(value, str) and "-" in value:
            value, _, count = value.partition("-")
            parts = int(count) if count.isdigit() else None
        etag = head.get("ETag")
        return ObjectChecksums(size=int(head["ContentLength"]),
                               sha256=value if isinstance(value, str) and value else None,
                               sha256_parts=parts,
                               etag=etag.strip('"') if isinstance(etag, str) else None)

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
                if code_and_status(exc)[0] != "NoSuchUpload":
                    raise

        self._retry(attempt, f"abort upload {stray.upload_id} of {stray.key}")

    # shared uploads --------------------------------------------------------------------

    @property
    def copies_ranges(self) -> bool:
        return True

    @property
    def supports_shared_uploads(self) -> bool:
        return True

    @property
    def _shared(self) -> SharedMultipart:
        return SharedMultipart(self, client=self._client, completer=self._completer,
                               prefix=self._prefix, metadata=self._metadata, head=self._head)

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
        """The size and composite SHA-256 of the parts' checksums (S3's, base64)."""
        return self._shared.checksums(parts)
