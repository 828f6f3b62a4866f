"""The abstract object-store interface shared by every checkpoint store.

The interface is deliberately minimal (modelled on zarr-python v3's
``zarr/abc/store.py``): a store maps ``/``-separated relative keys to
immutable byte strings and offers exactly the operations a write-once,
lock-free log needs — atomic replace, atomic create-if-absent, read,
existence, complete sorted listing and idempotent delete.  Concrete stores
implement the underscore-prefixed hooks; the public methods validate keys
once, here, so that no backend can be handed a key that escapes its root.

The module also holds what the network stores (S3 and GCS) share, so that
both treat transient failures and ambiguous conditional writes alike:
:class:`BucketStore` (the one retry layer and the write-id read-back), the
retry-with-backoff helper, and their bounded waits (:class:`StoreTimeouts`): every request has a
connect and a read timeout, the client libraries' own retries are off, and
one retry budget in seconds covers each whole operation, so that a store
that stops answering fails with an error naming the store and the key in
well under a minute instead of hanging a client for many (library retries
nested inside chkq's).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import errno
import logging
import os
import random
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from chkq.errors import ConfigurationError, InvalidKeyError, StoreNotFoundError, TransientStoreError  # noqa: F401 (re-exported)

__all__ = [
    "BucketStore",
    "CheckpointStore",
    "InvalidKeyError",
    "ObjectChecksums",
    "ObjectVersion",
    "PartsUpload",
    "StoreNotFoundError",
    "StrayUpload",
    "StoreTimeouts",
    "TransientStoreError",
    "VanishedAfterConflict",
    "overall_budget",
    "retry_transient",
    "validate_key",
    "validate_prefix",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

WRITE_ID_METADATA = "chkq-write-id"
"""Object metadata name under which conditional writes stamp their write id."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigurationError(f"{name} must be positive, got {raw!r}")
    return value


@dataclass(frozen=True)
class StoreTimeouts:
    """How long a network store waits, per request and per operation.

    Attributes
    ----------
    connect
        Seconds to establish a connection (``CHKQ_STORE_CONNECT_TIMEOUT``,
        default 5).
    read
        Seconds to wait for any byte of an answer
        (``CHKQ_STORE_READ_TIMEOUT``, default 15); a transfer that keeps
        moving is never cut.
    budget
        Seconds one store operation may spend on retries of transient
        failures (``CHKQ_STORE_RETRY_SECONDS``, default 20): no attempt
        starts after it is spent, so an operation fails after at most
        ``budget + connect + read`` seconds (40 by default).
    """

    connect: float = 5.0
    read: float = 15.0
    budget: float = 20.0

    @classmethod
    def from_env(cls) -> StoreTimeouts:
        """Read the ``CHKQ_STORE_*`` variables (defaults for those unset).

        Raises
        ------
        ValueError
            If one is not a positive number.
        """
        return cls(
            connect=_env_seconds("CHKQ_STORE_CONNECT_TIMEOUT", cls.connect),
            read=_env_seconds("CHKQ_STORE_READ_TIMEOUT", cls.read),
            budget=_env_seconds("CHKQ_STORE_RETRY_SECONDS", cls.budget),
        )

    @property
    def worst_case(self) -> float:
        """Longest an operation can take before it fails: the budget plus one attempt."""
        return self.budget + self.connect + self.read


def _key_problem(key: str) -> str | None:
    if not isinstance(key, str):
        return "not a string"
    if not key:
        return "empty key"
    if "\x00" in key:
        return "contains NUL"
    if "\\" in key:
        return "contains a backslash"
    if key.startswith("/"):
        return "leading '/'"
    for part in key.split("/"):
        if part == "":
            return "empty path component"
        if part in (".", ".."):
            return f"{part!r} path component"
    return None


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid store key.

    Parameters
    ----------
    key
        A ``/``-separated relative name such as ``runs/r1/records/abc.json``.

    Returns
    -------
    str
        The same key.

    Raises
    ------
    InvalidKeyError
        If the key is empty, has empty components, ``.`` or ``..``
        components, a leading ``/``, a backslash or a NUL character; the
        message names the key, because a bad key is almost always a caller
        bug that must be traceable.
    """
    problem = _key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"invalid store key {key!r}: {problem}")
    return key


def bucket_prefix(prefix: str) -> str:
    """A bucket store's key prefix as given in its URL, as ``"a/b/"`` (or ``""``).

    Raises
    ------
    InvalidKeyError
        Under the key rules, for the prefix without its surrounding ``/``.
    """
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    return prefix + "/" if prefix else ""


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` unchanged if it is a valid listing prefix.

    A prefix is either empty or a key, optionally with a trailing ``/``
    (``runs/r1/``) or a partial last component (``runs/r1/rec``).

    Raises
    ------
    InvalidKeyError
        Under the same rules as :func:`validate_key`, applied to the prefix
        without its trailing ``/``.
    """
    if prefix == "":
        return prefix
    trimmed = prefix[:-1] if prefix.endswith("/") else prefix
    problem = _key_problem(trimmed)
    if problem is not None:
        raise InvalidKeyError(f"invalid store prefix {prefix!r}: {problem}")
    return prefix


#: Monotonic time after which no store operation starts a retry (see :func:`overall_budget`).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "chkq_store_deadline", default=None)


@contextlib.contextmanager
def overall_budget(seconds: float) -> Iterator[None]:
    """Make every store operation inside the block share one retry budget of ``seconds``.

    Each operation otherwise has a budget of its own, and a command of many
    operations against a store that keeps failing would wait for their sum.
    Inside the block an operation retries only until the block's deadline;
    past it, it makes its one attempt and fails on a transient error. A
    block nested in another ends no later than the outer one.
    """
    deadline = time.monotonic() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def retry_transient(
    operation: Callable[[], T],
    *,
    is_transient: Callable[[BaseException], bool],
    what: str,
    attempts: int = 8,
    budget: float | None = None,
    initial_delay: float = 0.1,
    max_delay: float = 4.0,
) -> T:
    """Call ``operation`` and retry it with exponential backoff on transient errors.

    This is the only retry layer: the stores turn the client libraries' own
    retries off, so the patience of one operation is bounded here, by both
    a number of attempts and a time budget, and a store that is briefly
    unreachable, throttling or answering 409 ConditionalRequestConflict does
    not fail a commit while one that stopped answering fails in bounded
    time.  Every store operation is idempotent or a conditional create that
    recognises its own earlier success, so re-running it is safe.

    Parameters
    ----------
    operation
        A zero-argument callable performing one attempt (whose requests
        have their own connect and read timeouts).
    is_transient
        Classifies an exception: True means "retry", False means "re-raise now".
    what
        Human-readable description (store, operation and key) for messages.
    attempts
        Maximum number of calls.
    budget
        Seconds after the first call within which a retry may start (None:
        no time bound); the wait before a retry never runs past it, nor past
        the deadline of an enclosing :func:`overall_budget`.
    initial_delay, max_delay
        Backoff bounds in seconds; each wait is drawn with jitter from
        ``[delay / 2, delay]`` and ``delay`` doubles up to ``max_delay``.

    Raises
    ------
    TransientStoreError
        When every attempt failed transiently, or the budget is spent
        (chained to the last error); the message says what, how many
        attempts and how long.
    """
    delay = initial_delay
    start = time.monotonic()
    deadline = _DEADLINE.get()
    if deadline is not None:
        remaining = max(0.0, deadline - start)
        budget = remaining if budget is None else min(budget, remaining)
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            wait = random.uniform(delay / 2, delay)
            out_of_time = budget is not None and elapsed + wait >= budget
            if attempt == attempts or out_of_time:
                limit = f"retry budget {budget:.3g} s" if out_of_time else f"{attempts} attempts"
                raise TransientStoreError(
                    f"{what}: no success after {attempt} attempt(s) in {elapsed:.1f} s "
                    f"({limit}): {_one_line(exc)}"
                ) from exc
            log.info("%s: transient error (attempt %d/%d): %s", what, attempt, attempts, exc)
            time.sleep(wait)
            delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ObjectVersion:
    """What pins one stored object: its size and the store's name for this version of it.

    ``version`` changes whenever the object is written again: an S3 ETag, a
    GCS generation, a local file's inode and modification time in
    nanoseconds; stores with none of these use the size and modification
    time. Reads pinned to a version (:meth:`CheckpointStore.get_range_pinned`)
    give bytes of that version only.
    """

    size: int
    version: str


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


class CheckpointStore(ABC):
    """A minimal key/value object store with atomic writes.

    Every implementation guarantees:

    * ``put`` replaces an object atomically: readers see the old or the new
      bytes, never a mixture or a truncated object;
    * ``put_if_absent`` creates an object only if no object has the key,
      atomically with respect to every other writer, on any machine, and
      reports a retried-after-lost-response write of the caller's own as a
      success (True), never as "exists";
    * ``list`` is sorted and complete (not truncated at one page), and never
      shows temporaries;
    * ``get`` raises ``KeyError`` naming the key when it is missing, and
      ``delete`` of a missing key is a no-op.
    """

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL naming this store (accepted by :func:`chkq.stores.open_store`)."""

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, atomically replacing any previous object."""
        self._put(validate_key(key), bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists.

        Returns
        -------
        bool
            True if this call created the object, False if an object already
            had the key (its content is left untouched).
        """
        return self._put_if_absent(validate_key(key), bytes(data))

    def get(self, key: str) -> bytes:
        """Return the bytes stored under ``key``.

        Raises
        ------
        KeyError
            If there is no such object; the exception's argument is the key.
        """
        return self._get(validate_key(key))

    def get_at_most(self, key: str, limit: int) -> bytes:
        """Return at most ``limit + 1`` bytes of the object under ``key``, from its start.

        For store content whose size is known or bounded (a record, a
        payload its record sizes): more than ``limit`` bytes back means the
        object is too large, found without reading it whole. Local, S3 and
        GCS stores read no more than that; the default reads the object.

        Raises
        ------
        KeyError
            If there is no such object.
        """
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return self._get_at_most(validate_key(key), limit)

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._get(key)[: limit + 1]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Return ``length`` bytes of the object under ``key`` from offset ``start``.

        Fewer bytes come back where the object ends (none from its end on),
        as a file's ``pread`` would. Local, S3 and GCS stores read only the
        range; the default reads the object.

        Raises
        ------
        KeyError
            If there is no such object.
        ValueError
            If ``start`` or ``length`` is negative.
        """
        if start < 0 or length < 0:
            raise ValueError(f"start and length must be >= 0, got {start} and {length}")
        return self._get_range(validate_key(key), start, length)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        return self._get(key)[start : start + length]

    def size(self, key: str) -> int:
        """Return the size in bytes of the object under ``key``.

        Raises
        ------
        KeyError
            If there is no such object.
        """
        return self._size(validate_key(key))

    def _size(self, key: str) -> int:
        return len(self._get(key))

    def version(self, key: str) -> ObjectVersion:
        """Return the size and version of the object under ``key``.

        Raises
        ------
        KeyError
            If there is no such object.
        """
        return self._version(validate_key(key))

    def _version(self, key: str) -> ObjectVersion:
        size = self._size(key)
        return ObjectVersion(size, f"size-mtime:{size}:{self._modified(key)!r}")

    def versions(self, prefix: str = "") -> dict[str, ObjectVersion]:
        """Every key starting with ``prefix`` with its size and version, in key order.

        S3 and GCS take both from the listing itself; the default asks for
        each key's. A key that vanishes while listed is left out.
        """
        found = self._versions(validate_prefix(prefix))
        return dict(sorted(found.items()))

    def _versions(self, prefix: str) -> dict[str, ObjectVersion]:
        found = {}
        for key in self._list(prefix):
            try:
                found[key] = self.version(key)
            except (KeyError, InvalidKeyError):
                continue
        return found

    def get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                         length: int) -> bytes | None:
        """``length`` bytes from ``start`` of the object under ``key`` if it is still ``pinned``.

        For reading one object in ranges with every range from the same
        version: S3 sends ``If-Match`` with the ETag, GCS reads that
        generation, a local store checks the open file's inode and
        modification time before and after reading; the default reads and
        then compares the version. A range from ``pinned.size`` on is
        ``b""`` only if the object is still that version, so one such read
        after the others tells that the object did not change meanwhile.

        Returns
        -------
        bytes or None
            The version's bytes (fewer where the object ends), or None if
            the object is gone or is no longer that version (a GCS bucket
            that keeps old generations may still give the pinned one's bytes).
        """
        if start < 0 or length < 0:
            raise ValueError(f"start and length must be >= 0, got {start} and {length}")
        return self._get_range_pinned(validate_key(key), pinned, start, length)

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        try:
            data = self._get_range(key, start, length)
            current = self._version(key)
        except KeyError:
            return None
        return data if current == pinned else None

    def upload(self, key: str, *, part_size: int | None = None,
               checksum: bool = False) -> PartsUpload:
        """Start publishing one object under ``key`` from parts, create-if-absent.

        Nothing is visible at ``key`` until :meth:`PartsUpload.complete`
        succeeds, which never replaces an existing object; a failed or
        abandoned upload leaves nothing but what :meth:`stray_uploads` lists
        until it is aborted. S3 uses a multipart upload completed with
        ``If-None-Match: *`` (ranges of other objects copied server-side),
        GCS a compose of staged parts with ``ifGenerationMatch=0``, a local
        directory a temporary file linked into place; the default buffers
        the parts and makes one :meth:`put_if_absent`.

        Parameters
        ----------
        key
            The object to publish.
        part_size
            Bytes per part, where the store sends parts (the store's own
            size if None); :meth:`upload_part_size` tells what the store
            makes of it.
        checksum
            Have the store compute checksums of the bytes it receives, so
            that :meth:`checksums` can prove the object afterwards: S3 then
            sends each part's SHA-256 (``ChecksumAlgorithm=SHA256``) and
            keeps the object's composite SHA-256, GCS sends each staged
            part's CRC32C. No effect on other stores.
        """
        return self._upload(validate_key(key), part_size=self.upload_part_size(part_size),
                            checksum=checksum)

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        return _BufferedUpload(self, key)

    def upload_part_size(self, requested: int | None = None) -> int | None:
        """Bytes per part that an upload asked for ``requested`` bytes per part sends.

        None where the store sends no parts (a local directory, the
        default). S3 raises a request below 5 MiB to that (its smallest
        part but the last).

        Raises
        ------
        ValueError
            If ``requested`` is not positive.
        """
        if requested is not None and requested < 1:
            raise ValueError(f"part size must be positive, got {requested}")
        return None

    def checksums(self, key: str) -> ObjectChecksums:
        """What the store itself computed of the bytes of the object under ``key``.

        For proving an object without reading it back. Only network stores
        compute checksums; the default gives the size alone.

        Raises
        ------
        KeyError
            If there is no such object.
        """
        return self._checksums(validate_key(key))

    def _checksums(self, key: str) -> ObjectChecksums:
        return ObjectChecksums(size=self.size(key))

    def stray_uploads(self, prefix: str = "") -> builtins.list[StrayUpload]:
        """Uploads started and neither completed nor aborted, for keys under ``prefix``.

        What a killed publisher leaves; :meth:`abort_upload` removes one.
        A store that does not record an upload's key (a local directory)
        lists every upload, with key ``""``, whatever the prefix. The
        default store keeps no state across processes and has none.
        """
        return self._stray_uploads(validate_prefix(prefix))

    def _stray_uploads(self, prefix: str) -> builtins.list[StrayUpload]:
        return []

    def abort_upload(self, stray: StrayUpload) -> None:
        """Remove what the stray upload left (its parts); aborting twice is a no-op."""
        self._abort_upload(stray)

    def _abort_upload(self, stray: StrayUpload) -> None:
        return None

    def exists(self, key: str) -> bool:
        """Return whether an object is stored under ``key``."""
        return self._exists(validate_key(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Return every key starting with ``prefix``, sorted, across all pages."""
        return sorted(self._list(validate_prefix(prefix)))

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""
        self._delete(validate_key(key))

    def modified(self, key: str) -> float:
        """Return when the object under ``key`` was written (POSIX seconds).

        Used by garbage collection to leave young objects alone: a payload
        without a record may belong to a commit still in flight.

        Raises
        ------
        KeyError
            If there is no such object.
        """
        return self._modified(validate_key(key))

    def check_available(self) -> None:
        """Make sure the store itself (bucket, directory) exists; never writes.

        Raises
        ------
        StoreNotFoundError
            If it does not, naming the store.
        """
        if not self._available():
            raise StoreNotFoundError(f"store {self.url} does not exist")

    def _available(self) -> bool:
        """Whether the store itself exists (default: a ``root`` directory, if any)."""
        root = getattr(self, "root", None)
        return not isinstance(root, os.PathLike) or os.path.isdir(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _put_if_absent(self, key: str, data: bytes) -> bool: ...

    @abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _list(self, prefix: str) -> builtins.list[str]: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _modified(self, key: str) -> float: ...


@dataclass(frozen=True)
class StrayUpload:
    """An upload that was started and neither completed nor aborted.

    Attributes
    ----------
    key
        The key it was to publish ("" where the store does not record it).
    upload_id
        The store's name for it.
    started
        When it was started (POSIX seconds).
    """

    key: str
    upload_id: str
    started: float


@dataclass(frozen=True)
class ObjectChecksums:
    """Checksums a store computed itself of one object's bytes (:meth:`CheckpointStore.checksums`).

    Attributes
    ----------
    size
        The object's size in bytes.
    sha256
        S3's ``ChecksumSHA256`` (base64), without a ``-N`` suffix: for an
        object uploaded in parts the SHA-256 of its parts' SHA-256 digests
        one after the other (a composite checksum), else of the whole
        object; None if the store keeps none.
    sha256_parts
        How many parts the composite ``sha256`` is of, where the store says.
    crc32c
        GCS's CRC32C of the whole object (composed objects have one), or None.
    """

    size: int
    sha256: str | None = None
    sha256_parts: int | None = None
    crc32c: int | None = None


class PartsUpload(ABC):
    """One object being published from parts, in order; create-if-absent on completion.

    Use it as a context manager: leaving the block without
    :meth:`complete` (an exception, or a forgotten call) aborts it, so
    nothing is published and the parts are removed.
    """

    copy_chunk = 8 << 20
    """Bytes read at a time where a range is copied through the client."""

    def __init__(self, store: CheckpointStore, key: str) -> None:
        self.store = store
        self.key = key
        self.size = 0
        """Bytes added so far."""
        self.part_size: int | None = None
        """Bytes per part sent (the last may be shorter); None where the store sends no parts."""
        self._finished = False

    @abstractmethod
    def _write(self, data: bytes) -> None: ...

    def _write_hashed(self, data: bytes, sha256: bytes) -> None:
        """Append ``data`` whose SHA-256 digest the caller computed (default: as ``_write``)."""
        self._write(data)

    @abstractmethod
    def _complete(self) -> bool:
        """Publish; True if created, False if an object already had the key."""

    @abstractmethod
    def _abort(self) -> None: ...

    def _copy(self, source: str, start: int, length: int) -> None:
        end = start + length
        while start < end:
            piece = self.store.get_range(source, start, min(self.copy_chunk, end - start))
            if not piece:
                break
            self._write(piece)
            start += len(piece)

    def write(self, data: bytes, *, sha256: bytes | None = None) -> None:
        """Append ``data`` to the object.

        Parameters
        ----------
        data
            The bytes.
        sha256
            Their SHA-256 digest, where the caller has computed it: an
            upload with ``checksum`` whose part is exactly ``data`` (a write
            of :attr:`part_size` bytes at a part boundary, or the last)
            sends it as the part's checksum instead of hashing the part
            again, and the store checks the bytes it received against it.
        """
        self._check_open()
        data = bytes(data)
        if data:
            if sha256 is None:
                self._write(data)
            else:
                self._write_hashed(data, sha256)
            self.size += len(data)

    def copy(self, source: str, start: int, length: int) -> None:
        """Append ``length`` bytes of the object ``source`` from offset ``start``.

        Server-side where the store can (S3 ``UploadPartCopy`` for ranges of
        at least one part). The source must have that many bytes.

        Raises
        ------
        KeyError
            If ``source`` does not exist.
        ValueError
            If the range reaches past the source's end.
        """
        self._check_open()
        validate_key(source)
        if start < 0 or length < 0:
            raise ValueError(f"start and length must be >= 0, got {start} and {length}")
        available = self.store.size(source)
        if start + length > available:
            raise ValueError(f"store {self.store.url}: range {start}+{length} reaches past the "
                             f"end of {source} ({available} bytes)")
        if length:
            self._copy(source, start, length)
            self.size += length

    def complete(self) -> None:
        """Publish the object under its key if no object has that key.

        Raises
        ------
        FileExistsError
            If an object already has the key (left untouched; this upload is
            aborted); the error names the store and key.
        """
        self._check_open()
        try:
            created = self._complete()
        except BaseException:
            self.abort()
            raise
        if not created:
            self.abort()
            raise FileExistsError(errno.EEXIST, f"store {self.store.url}: {self.key} exists",
                                  self.key)
        self._finished = True

    def abort(self) -> None:
        """Drop the upload and its parts; nothing is published. A no-op once finished."""
        if self._finished:
            return
        self._finished = True
        self._abort()

    def _check_open(self) -> None:
        if self._finished:
            raise ValueError(f"upload of {self.key} to {self.store.url} is already finished")

    def __enter__(self) -> PartsUpload:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.abort()


class _BufferedUpload(PartsUpload):
    """Parts kept in a temporary file, published with one ``put_if_absent``."""

    def __init__(self, store: CheckpointStore, key: str) -> None:
        super().__init__(store, key)
        self._buffer = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 (closed by complete or abort)

    def _write(self, data: bytes) -> None:
        self._buffer.write(data)

    def _complete(self) -> bool:
        self._buffer.seek(0)
        return self.store.put_if_absent(self.key, self._buffer.read())

    def _abort(self) -> None:
        self._buffer.close()

    def complete(self) -> None:
        try:
            super().complete()
        finally:
            self._buffer.close()


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
