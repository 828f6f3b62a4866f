"""An S3 multipart upload completed with ``If-None-Match: *``: the S3 store's parts upload.

Parts go up a few at a time from a thread pool; ranges of other objects are
copied server-side; a completion whose answer was lost is asked again until the
store says what became of it. The upload is given the S3 store's clients, key
prefix and metadata read-back when it is made, and knows the store itself only
as a :class:`~chkq.stores.bucket.BucketStore` (its retry layer and timeouts),
so that this module does not import :mod:`chkq.stores.s3`, which makes it.

A shared upload (:class:`SharedMultipart`, parts sent by many processes) sends
its parts and settles its completion with the same functions
(:func:`send_part`, :func:`settle_completion`).
"""


from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from botocore.exceptions import (
    ClientError,
)

from chkq.backoff import Backoff
from chkq.errors import (
    CheckpointChangedError,
    StoredBytesMismatchError,
    TransientStoreError,
    UploadAbortedError,
)
from chkq.stores.bucket import WRITE_ID_METADATA, BucketStore
from chkq.stores.objects import ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.s3_errors import (
    BAD_DIGEST_CODES,
    NOT_SENT,
    code_and_status,
    is_not_found,
    is_precondition_failed,
)
from chkq.stores.shared_upload import (
    PartRecord,
    SharedUpload,
    composite_sha256,
    multipart_etag,
    validate_parts,
)
from chkq.stores.uploads import PartsUpload

__all__ = ["COMPLETE_BACKOFF", "MAX_COPY_PART", "MIN_PART", "PARTS_IN_FLIGHT", "MultipartUpload",
           "SharedMultipart", "send_part", "settle_completion"]

MIN_PART = 5 << 20
"""S3's smallest part but for the last."""
MAX_COPY_PART = 1 << 30
"""Largest range copied server-side in one ``UploadPartCopy`` (S3 allows 5 GiB)."""
PARTS_IN_FLIGHT = 3
"""Parts of one upload sent at once: S3 takes parts in any order, and one stream rarely
fills the link; the caller's memory holds this many parts in flight at most."""

#: Waits between asking again for a completion whose answer was lost.
COMPLETE_BACKOFF = Backoff(0.2, 5.0)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


class MultipartUpload(PartsUpload):
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

    Parameters
    ----------
    store
        The S3 store: its retry layer, timeouts, bucket and reads.
    key
        The object to publish.
    client
        The boto3 S3 client parts and copies are sent with.
    completer
        The client the completion is sent with (its read timeout is the
        store's ``timeouts.complete``).
    prefix
        The store's key prefix in the bucket.
    metadata
        The custom metadata of the object of a full S3 name, or None if there
        is none (the store's read-back of a write id).
    part_size
        Bytes per part (at least :data:`MIN_PART`).
    checksum
        Send each part's SHA-256.
    """

    store: BucketStore

    def __init__(self, store: BucketStore, key: str, *, client: Any, completer: Any,
                 prefix: str, metadata: Callable[[str], dict[str, str] | None],
                 part_size: int, checksum: bool = False) -> None:
        super().__init__(store, key)
        self._client = client
        self._completer = completer
        self._prefix = prefix
        self._metadata = metadata
        self._name = prefix + key
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
        checksum = None
        if self._checksum:
            checksum = _b64(sha256 if sha256 is not None else hashlib.sha256(piece).digest())
        return send_part(self.store, self._client, name=self._name, key=self.key,
                         upload_id=self.upload_id, number=number, piece=piece,
                         checksum=checksum)

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
            lambda: self._client.upload_part_copy(
                Bucket=store.bucket, Key=self._name, UploadId=self.upload_id,
                PartNumber=number,
                CopySource={"Bucket": store.bucket, "Key": self._prefix + source},
                CopySourceRange=f"bytes={start}-{start + size - 1}"),
            f"copy part {number} of {self.key} from {source}")
        result = answer["CopyPartResult"]
        part = {"ETag": result["ETag"], "PartNumber": number}
        if self._checksum and result.get("ChecksumSHA256"):
            part["ChecksumSHA256"] = result["ChecksumSHA256"]
        self._parts.append(part)

    def _complete(self) -> bool:
        """Send what is left, then complete the upload as :func:`settle_completion` does."""
        self._flush(final=True)
        if self._next_part == 1:
            self._send(b"")
        self._sent()
        return settle_completion(self.store, self._completer, self._metadata, name=self._name,
                                 key=self.key, upload_id=self.upload_id,
                                 write_id=self._write_id, parts=self._parts)

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            self._sent()
        self.store._abort_upload(StrayUpload(self.key, self.upload_id, 0.0))


def send_part(store: BucketStore, client: Any, *, name: str, key: str, upload_id: str,
              number: int, piece: bytes, checksum: str | None,
              alive: Callable[[], None] | None = None) -> dict[str, Any]:
    """``UploadPart`` of ``piece`` as part ``number``; its entry of the completion's part list.

    With ``checksum`` (the part's SHA-256, base64) S3 checks the bytes it
    received against it, and the digest it answers must be it.

    Raises
    ------
    StoredBytesMismatchError
        If the store received other bytes than those sent.
    """
    extra = {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": checksum} if checksum else {}

    def attempt() -> Any:
        try:
            return client.upload_part(Bucket=store.bucket, Key=name, UploadId=upload_id,
                                      PartNumber=number, Body=piece, **extra)
        except ClientError as exc:
            code, status = code_and_status(exc)
            if alive is not None and (code == "NoSuchUpload" or status >= 500):
                alive()  # an upload aborted meanwhile ends the retries
            raise

    try:
        answer = store._retry(attempt, f"upload part {number} of {key}")
    except ClientError as exc:
        if extra and code_and_status(exc)[0] in BAD_DIGEST_CODES:
            raise StoredBytesMismatchError(
                f"store {store.url}: part {number} of {key}: the store received "
                f"bytes whose SHA-256 is not the {checksum} sent "
                f"({code_and_status(exc)[0]})") from exc
        raise
    part = {"ETag": answer["ETag"], "PartNumber": number}
    if checksum:
        received = answer.get("ChecksumSHA256")
        if received is not None and received != checksum:
            raise StoredBytesMismatchError(
                f"store {store.url}: part {number} of {key}: the store received "
                f"bytes with SHA-256 {received}, not the {checksum} sent")
        part["ChecksumSHA256"] = checksum
    return part


def settle_completion(store: BucketStore, completer: Any,
                      metadata: Callable[[str], dict[str, str] | None], *, name: str,
                      key: str, upload_id: str, write_id: str,
                      parts: list[dict[str, Any]]) -> bool:
    """Complete an upload and settle what became of it: ours, another's, or nothing.

    The request waits up to ``timeouts.complete`` for its answer (S3
    assembles a large object for a long time). An answer lost or
    refused for a transient cause (a timeout, a cut connection, 5xx) is
    no outcome: the completion is asked again, for up to twice that
    long, until the store says (completed; 412 or NoSuchUpload with
    the upload's write id on the object, or another's). Only then, or
    when that time is spent, does the caller abort it, so a first
    completion still being assembled is never taken for a failure.

    Returns
    -------
    bool
        True if the object at the key is the upload's, False if another's.

    Raises
    ------
    TransientStoreError
        If the store never told: the upload is aborted, and the error
        names the write id an object that still appears would carry.
    """
    start = time.monotonic()
    reached = False
    last = ""

    def is_ours() -> bool | None:
        found = metadata(name)
        return None if found is None else found.get(WRITE_ID_METADATA) == write_id

    def once() -> bool | None:
        try:
            completer.complete_multipart_upload(
                Bucket=store.bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ClientError as exc:
            code, status = code_and_status(exc)
            if is_precondition_failed(exc) or code == "NoSuchUpload":
                return is_ours()
            if code == "ConditionalRequestConflict" or status == 409:
                return None
            raise
        return True

    for tried in itertools.count():
        delay = COMPLETE_BACKOFF.wait(tried)
        try:
            outcome = once()
        except Exception as exc:
            if not store._is_transient(exc):
                raise
            outcome, last = None, " ".join(str(exc).split())
            reached = reached or not isinstance(exc, NOT_SENT)
        if outcome is not None:
            return outcome
        # A completion that never reached the store cannot land later: the usual budget.
        patience = 2 * store.timeouts.complete if reached else store.timeouts.budget
        if time.monotonic() + delay > start + patience:
            break
        time.sleep(delay)
    with contextlib.suppress(Exception):
        store._abort_upload(StrayUpload(key, upload_id, 0.0))
    with contextlib.suppress(Exception):
        if is_ours() is True:
            return True
    raise TransientStoreError(
        f"store {store.url}: the completion of the upload of {key} had no outcome in "
        f"{time.monotonic() - start:.0f} s (last: {last or 'nothing at the key yet'}); "
        f"the upload was aborted. An object that still appears at {key} with metadata "
        f"{WRITE_ID_METADATA}={write_id} is this upload's")


class SharedMultipart:
    """The S3 store's shared uploads: a multipart upload whose parts any process sends.

    Begun with ``ChecksumAlgorithm=SHA256`` and the token's write id in the
    object's metadata; each part goes with its SHA-256; a copied range goes
    server-side with ``CopySourceIfMatch``, and the source's ETag is checked
    again after the copy (for S3-compatible stores that ignore the condition);
    where the copy's answer has no SHA-256 (moto) the range is read pinned to
    compute it. The completion is :func:`settle_completion`'s, as an upload's.
    """

    def __init__(self, store: BucketStore, *, client: Any, completer: Any, prefix: str,
                 metadata: Callable[[str], dict[str, str] | None],
                 head: Callable[[str], dict[str, Any] | None]) -> None:
        self.store = store
        self._client = client
        self._completer = completer
        self._prefix = prefix
        self._metadata = metadata
        self._head = head

    def begin(self, key: str) -> SharedUpload:
        store, write_id = self.store, uuid.uuid4().hex
        answer = store._retry(
            lambda: self._client.create_multipart_upload(
                Bucket=store.bucket, Key=self._prefix + key, ChecksumAlgorithm="SHA256",
                Metadata={WRITE_ID_METADATA: write_id}),
            f"start shared upload of {key}")
        return SharedUpload(key, str(answer["UploadId"]), write_id)

    def _alive(self, upload: SharedUpload) -> None:
        """Refuse an upload that was aborted: S3 answers its parts with 404 (moto with 500,
        which would be retried as a passing fault).

        Asked of the bucket's list of unfinished uploads of the key, not of the
        upload's parts (moto computes a part's ETag when it is listed, racing
        with the part's writer).

        Raises
        ------
        UploadAbortedError
            If S3 no longer lists the upload.
        """
        store, name = self.store, self._prefix + upload.key

        def attempt() -> bool:
            paginator = self._client.get_paginator("list_multipart_uploads")
            return any(found["UploadId"] == upload.upload_id and found["Key"] == name
                       for page in paginator.paginate(Bucket=store.bucket, Prefix=name)
                       for found in page.get("Uploads", []))

        if not store._retry(attempt, f"look up the upload of {upload.key}"):
            raise UploadAbortedError(
                f"store {store.url}: the upload of {upload.key} was aborted (by `chkq gc`, or "
                "a lifecycle rule of the bucket) while its parts were sent: nothing was "
                "published")

    def put(self, upload: SharedUpload, number: int, data: bytes, offset: int) -> PartRecord:
        self._alive(upload)
        checksum = _b64(hashlib.sha256(data).digest())
        part = send_part(self.store, self._client, name=self._prefix + upload.key,
                         key=upload.key, upload_id=upload.upload_id, number=number,
                         piece=data, checksum=checksum, alive=lambda: self._alive(upload))
        return PartRecord(number, len(data), offset, str(part["ETag"]), checksum)

    def copy(self, upload: SharedUpload, number: int, source: str, pinned: ObjectVersion,
             start: int, length: int, offset: int) -> PartRecord:
        store = self.store
        etag = pinned.version.removeprefix("etag:")

        def changed() -> CheckpointChangedError:
            return CheckpointChangedError(
                f"store {store.url}: {source} changed since it was pinned (replaced or "
                f"deleted): part {number} of {upload.key} was not copied from it")

        self._alive(upload)

        def attempt() -> dict[str, Any] | None:
            try:
                answer = self._client.upload_part_copy(
                    Bucket=store.bucket, Key=self._prefix + upload.key,
                    UploadId=upload.upload_id, PartNumber=number,
                    CopySource={"Bucket": store.bucket, "Key": self._prefix + source},
                    CopySourceRange=f"bytes={start}-{start + length - 1}",
                    CopySourceIfMatch=etag)
            except ClientError as exc:
                code, status = code_and_status(exc)
                if code == "NoSuchUpload" or status >= 500:
                    self._alive(upload)  # an upload aborted meanwhile ends the retries
                if is_precondition_failed(exc) or is_not_found(exc) \
                        or code in ("NoSuchKey", "InvalidRange"):
                    return None
                raise
            return dict(answer["CopyPartResult"])

        result = store._retry(attempt, f"copy part {number} of {upload.key} from {source}")
        current = self._head(source)
        if result is None or current is None or f"etag:{current['ETag']}" != pinned.version:
            raise changed()
        return PartRecord(number, length, offset, str(result["ETag"]),
                          str(result.get("ChecksumSHA256") or ""))

    def complete(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        validate_parts(upload, parts, min_part=MIN_PART)
        if self._head(upload.key) is None:
            self._alive(upload)
        entries = [{"ETag": part.etag, "PartNumber": part.number,
                    **({"ChecksumSHA256": part.checksum} if part.checksum else {})}
                   for part in parts]
        created = settle_completion(self.store, self._completer, self._metadata,
                                    name=self._prefix + upload.key, key=upload.key,
                                    upload_id=upload.upload_id, write_id=upload.write_id,
                                    parts=entries)
        if not created:
            self.abort(upload)
        return created

    def abort(self, upload: SharedUpload) -> None:
        self.store._abort_upload(StrayUpload(upload.key, upload.upload_id, 0.0))

    @staticmethod
    def checksums(parts: list[PartRecord]) -> ObjectChecksums:
        """What S3 must say of the object: its ETag from the parts' MD5s, and the composite
        SHA-256 where every part has one (a copied part's is S3's own; moto gives none)."""
        whole = all(part.checksum for part in parts)
        return ObjectChecksums(size=sum(part.size for part in parts),
                               sha256=composite_sha256(parts) if whole else None,
                               sha256_parts=len(parts) if whole else None,
                               etag=multipart_etag(parts))
