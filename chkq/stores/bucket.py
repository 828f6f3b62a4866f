"""What the S3 and GCS stores share: one retry layer and the write-id read-back.

Both treat transient failures and ambiguous conditional writes alike: every
operation runs under :func:`~chkq.stores.retry.retry_transient` with the
store's attempts and :class:`~chkq.stores.retry.StoreTimeouts`, and a refused
conditional create is the caller's own if the object carries its write id.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import TypeVar

from chkq.errors import StoreNotFoundError
from chkq.stores.base import CheckpointStore
from chkq.stores.retry import StoreTimeouts, retry_transient

__all__ = ["WRITE_ID_METADATA", "BucketStore", "VanishedAfterConflict"]

T = TypeVar("T")

WRITE_ID_METADATA = "chkq-write-id"
"""Object metadata name under which conditional writes stamp their write id."""


class VanishedAfterConflict(Exception):
    """A conditional create was refused for an object that was gone when read back.

    The object that made the create fail was deleted in between (by garbage
    collection, say): nothing was written and the create can be tried again,
    so the retry layer of :class:`BucketStore` treats this as transient.
    """


class BucketStore(CheckpointStore):
    """What the S3 and GCS stores share: one retry layer and the write-id read-back.

    Subclasses set ``attempts`` and ``timeouts`` and say which of their client
    library's exceptions are transient and which mean the bucket is missing.
    """

    attempts: int
    timeouts: StoreTimeouts

    @property
    @abstractmethod
    def bucket(self) -> str:
        """The bucket name."""

    @abstractmethod
    def _is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` from the client library is worth another attempt."""

    def _is_missing_bucket(self, exc: BaseException) -> bool:
        """Whether ``exc`` escaping an operation says the bucket does not exist."""
        return False

    def _retry(self, operation: Callable[[], T], what: str) -> T:
        """Run ``operation`` under :func:`retry_transient` with this store's patience.

        Raises
        ------
        StoreNotFoundError
            If the bucket does not exist, naming the store and the bucket.
        TransientStoreError
            When the attempts or the budget are spent, naming the store and ``what``.
        """
        try:
            return retry_transient(
                operation,
                is_transient=lambda exc: isinstance(exc, VanishedAfterConflict)
                or self._is_transient(exc),
                what=f"store {self.url}: {what}", attempts=self.attempts,
                budget=self.timeouts.budget,
            )
        except Exception as exc:
            if self._is_missing_bucket(exc):
                raise StoreNotFoundError(
                    f"store {self.url} does not exist (no bucket {self.bucket!r})") from None
            raise

    @staticmethod
    def _written_by(metadata: Mapping[str, str] | None, write_id: str, name: str) -> bool:
        """Whether the object a refused conditional create found is the caller's own.

        A refusal (HTTP 412) is ambiguous: the client may have resent a
        create whose first answer was lost, and the resend then fails
        against the caller's own success.  Each conditional create stamps a
        random write id in the object's metadata; the write is the caller's
        if the object found carries that id.  Contents are not compared,
        since content-addressed writers legitimately write identical bytes.

        Parameters
        ----------
        metadata
            The found object's custom metadata, or None if it is gone.
        write_id
            The id the caller's create stamped.
        name
            The object's name, for the error.

        Raises
        ------
        VanishedAfterConflict
            If the object is gone (``metadata`` is None): the create is retried.
        """
        if metadata is None:
            raise VanishedAfterConflict(name)
        return bool(metadata.get(WRITE_ID_METADATA) == write_id)
