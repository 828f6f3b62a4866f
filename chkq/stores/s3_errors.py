"""What S3's answers mean to chkq: which errors are worth another attempt, which say "no such".

The S3 store and its multipart upload classify botocore's exceptions the same
way; they share these codes and tests instead of importing each other.
"""

from __future__ import annotations

from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

__all__ = [
    "BAD_DIGEST_CODES",
    "DENIED_CODES",
    "NOT_FOUND_CODES",
    "NOT_SENT",
    "NO_BUCKET_CODES",
    "TRANSIENT_CODES",
    "code_and_status",
    "is_denied",
    "is_not_found",
    "is_precondition_failed",
    "is_transient",
]

TRANSIENT_CODES = frozenset(
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
"""Error codes of answers worth another attempt (besides any 5xx and 429)."""
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
"""Error codes saying the object does not exist."""
NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
"""Error codes saying the bucket does not exist."""
NOT_SENT = (EndpointConnectionError, ConnectTimeoutError)
"""Failures of a request that never reached the store (no connection was made)."""
BAD_DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"})
"""Error codes saying the bytes received are not those whose checksum was sent."""
DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                          "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "403"})
"""Answers that refuse the credentials sent (a HEAD request's 403 has no code but its status)."""


def code_and_status(exc: ClientError) -> tuple[str, int]:
    """The error code and HTTP status of an S3 answer (``""`` and 0 where it gives none)."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` from botocore is worth another attempt (a cut connection, 5xx, 429...)."""
    if isinstance(exc, HTTPClientError | BotoConnectionError | IncompleteReadError):
        return True
    if isinstance(exc, ClientError):
        code, status = code_and_status(exc)
        return code in TRANSIENT_CODES or status >= 500 or status == 429
    return False


def is_denied(exc: BaseException) -> bool:
    """Whether ``exc`` is S3 refusing the credentials sent."""
    if not isinstance(exc, ClientError):
        return False
    code, status = code_and_status(exc)
    return code in DENIED_CODES or status in (401, 403)


def is_not_found(exc: ClientError) -> bool:
    """Whether the answer says the object does not exist."""
    code, status = code_and_status(exc)
    return code in NOT_FOUND_CODES or status == 404


def is_precondition_failed(exc: ClientError) -> bool:
    """Whether the answer refuses a conditional request (412: ``If-None-Match``, ``If-Match``)."""
    code, status = code_and_status(exc)
    return code == "PreconditionFailed" or status == 412
