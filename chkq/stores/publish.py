"""Publishing a verified local file to a store key: create-if-absent, all or nothing, proven.

A worker builds and verifies an output file in its own scratch directory;
:func:`publish_file` then puts it under a key of an object store so that

* an existing object is never replaced (:class:`FileExistsError` naming the
  store and the key), unless it already holds the same bytes, which is what
  a redelivered publish finds and reports as published;
* nothing is ever visible at the key but the whole file: the bytes go in
  parts through :meth:`~chkq.stores.base.CheckpointStore.upload`, which
  publishes them all at once on completion or not at all;
* a publish that fails leaves nothing behind (its upload is aborted), and
  what a killed publisher leaves is listed by
  :meth:`~chkq.stores.base.CheckpointStore.stray_uploads` and removed by
  :func:`sweep_uploads`;
* the stored bytes are shown equal to the local ones, the cheapest way the
  store allows, and :attr:`Published.proof` says how; where the store tells
  which object an upload made (a local directory: its inode), the object at
  the key is checked to be that one before and after the proof, and a
  read-back reads that object only;
* where the store keeps files (a local directory), the object gets the
  file's mode, owner and group before it has a name, as far as the worker
  may (:class:`~chkq.stores.base.FileAccess`).

The file is read once, one part at a time, hashing as it goes: the
SHA-256 of the whole file, of each part and, where google-crc32c is
installed, its CRC32C. A file that changed after the caller verified it
(``sha256``) or while it was read is not published.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from chkq.errors import FileChangedError, StoredBytesMismatchError
from chkq.stores.base import (
    CheckpointStore,
    FileAccess,
    ObjectChecksums,
    ObjectVersion,
    StrayUpload,
    validate_key,
)

try:
    import google_crc32c
except ImportError:  # pragma: no cover - installed with google-cloud-storage
    google_crc32c = None  # type: ignore[assignment]

__all__ = ["FileDigests", "Published", "publish_file", "published_as", "staged_key",
           "sweep_staged", "sweep_uploads"]

_STAGED = re.compile(r"\.chkq-staged-[0-9a-f]{32}")
STAGED_LENGTH = len(".chkq-staged-") + 32


def staged_key(key: str, job: str) -> str:
    """Where job ``job`` stages its output for ``key`` until every row is read back
    (``--verify-data``): beside it, named by the job, never a checkpoint's name."""
    staged = f"{key}.chkq-staged-{job}"
    if not _STAGED.fullmatch(staged[len(key):]):
        raise ValueError(f"{job!r} is not a job id")
    return staged

log = logging.getLogger(__name__)

MAX_PARTS = 10_000
"""Most parts of one upload (S3's limit): larger files get larger parts."""
READ_BACK_CHUNK = 8 << 20
"""Bytes read at a time when an object is read back to be hashed, where no part size is given
(a publish reads back a part at a time)."""


@dataclass(frozen=True)
class Published:
    """An object published from a local file, and how its bytes were shown equal.

    Attributes
    ----------
    url
        The object's URL, the store's URL and the key (``s3://bucket/prefix/key``).
    key
        Its key in the store.
    size
        Its size in bytes.
    sha256
        Hex SHA-256 of its bytes (the local file's, which the store's were shown equal to).
    proof
        How the stored bytes were shown equal to the local ones, one line.
    """

    url: str
    key: str
    size: int
    sha256: str
    proof: str


@dataclass(frozen=True)
class FileDigests:
    """What reading a file once, in parts of ``part_size`` bytes, computed of its bytes.

    Attributes
    ----------
    size
        Bytes read.
    sha256
        Hex SHA-256 of all of them.
    part_size
        Bytes per part (the last may be shorter).
    part_sha256
        SHA-256 digest of each part, in order (one, of no bytes, for an empty file).
    crc32c
        CRC32C of all the bytes, or None without google-crc32c.
    """

    size: int
    sha256: str
    part_size: int
    part_sha256: tuple[bytes, ...]
    crc32c: int | None

    @property
    def composite_sha256(self) -> str:
        """Base64 SHA-256 of the parts' digests one after the other, as S3 composes them."""
        return base64.b64encode(hashlib.sha256(b"".join(self.part_sha256)).digest()).decode()


class _Hasher:
    """The running digests of a file read in parts."""

    def __init__(self, part_size: int, *, whole_only: bool = False) -> None:
        self.part_size = part_size
        self.size = 0
        self._whole = hashlib.sha256()
        self._parts: list[bytes] = []
        self._whole_only = whole_only
        self._crc32c: int | None = \
            0 if google_crc32c is not None and not whole_only else None

    def add(self, piece: bytes) -> bytes | None:
        """Take in the next part; return its SHA-256 digest (None: the whole file's only)."""
        self.size += len(piece)
        self._whole.update(piece)
        if self._whole_only:
            return None
        if self._crc32c is not None:
            self._crc32c = int(google_crc32c.extend(self._crc32c, piece))
        digest = hashlib.sha256(piece).digest()
        self._parts.append(digest)
        return digest

    def digests(self) -> FileDigests:
        parts = tuple(self._parts) or (hashlib.sha256(b"").digest(),)
        return FileDigests(self.size, self._whole.hexdigest(), self.part_size, parts,
                           self._crc32c)


def _pieces(source: BinaryIO, part_size: int) -> Iterator[bytes]:
    while piece := source.read(part_size):
        yield piece


def _object_url(store: CheckpointStore, key: str) -> str:
    return f"{store.url.rstrip('/')}/{key}"


def _exists_error(store: CheckpointStore, key: str) -> FileExistsError:
    return FileExistsError(
        errno.EEXIST, f"store {store.url}: {key} exists with other bytes; it is never replaced",
        key)


def _hex_sha256(value: str) -> str:
    text = value.strip().lower()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"sha256 must be 64 hex digits, got {value!r}")
    return text


def publish_file(store: CheckpointStore, key: str, path: str | os.PathLike[str], *,
                 part_bytes: int = 64 << 20, sha256: str | None = None) -> Published:
    """Publish the local file ``path`` as the object ``key`` of ``store``, create-if-absent.

    The file is read once, a part at a time (memory: three parts at the peak),
    uploaded through ``store.upload(key, checksum=True)`` and published on
    completion only if no object has the key; the stored bytes are then
    shown equal to the bytes read (:attr:`Published.proof`): on S3 by the
    composite of the parts' SHA-256 checksums the store computed, on GCS by
    the object's CRC32C the store computed, elsewhere (a local directory,
    memory) by reading the object back and hashing it.

    Parameters
    ----------
    store
        Where to publish.
    key
        The object's key.
    path
        The local file, complete and verified.
    part_bytes
        Bytes per part (S3 raises it to 5 MiB, and any store to a
        10,000th of the file).
    sha256
        Hex SHA-256 the caller verified the file with: bytes read that do
        not hash to it are not published.

    Returns
    -------
    Published
        The object: also when it already held the same bytes (a
        redelivered publish, or a completion whose answer was lost).

    Raises
    ------
    FileExistsError
        If an object with other bytes has the key (left untouched), naming
        the store's URL and the key.
    FileChangedError
        If the file's bytes are not the ``sha256`` given, or it changed
        while it was read, naming the file; nothing is published.
    StoredBytesMismatchError
        If the stored bytes are shown to differ from the file's (the
        object this publish created is deleted again).
    TransientStoreError
        If the store kept failing; nothing is published, or what is
        published is the whole file and a publish run again returns it.
    """
    validate_key(key)
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    expected = None if sha256 is None else _hex_sha256(sha256)
    source = Path(path)
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):
        os.close(fd)
        raise ValueError(f"{source} is not a regular file; only files are published")
    with os.fdopen(fd, "rb") as handle:
        wanted = max(part_bytes, -(-before.st_size // MAX_PARTS))
        part_size = store.upload_part_size(wanted) or wanted
        if store.exists(key):
            return _published_already(store, key, source, handle, before, part_size, expected)
        if store.supports_links:
            linked = _link(store, key, source, handle, before, part_size, expected)
            if linked is not None:
                return linked
            handle.seek(0)
        return _upload(store, key, source, handle, before, part_size, expected)


def _link(store: CheckpointStore, key: str, source: Path, handle: BinaryIO,
          before: os.stat_result, part_size: int, expected: str | None) -> Published | None:
    """Publish by hard-linking the open file into the store; None where it cannot be linked.

    The file is hashed first (the result names its SHA-256); its descriptor
    is then linked (:meth:`~chkq.stores.base.CheckpointStore.link_from`), so
    the object made is that very file, unchanged since it was hashed, with
    its own mode and owner: no byte is copied or read back, and no part
    digest is needed.
    """
    hasher = _Hasher(part_size, whole_only=True)
    for piece in _pieces(handle, part_size):
        hasher.add(piece)
    digests = hasher.digests()
    _check_unchanged(source, handle, before, digests, expected)
    try:
        made = store.link_from(key, handle.fileno())
    except OSError as exc:
        if isinstance(exc, StoredBytesMismatchError):
            raise
        log.info("store %s: %s cannot be linked (%s); copying it", store.url, source, exc)
        return None
    if made is None:
        handle.seek(0)
        return _published_already(store, key, source, handle, before, part_size, expected)
    after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        if _still(store, key, made):
            store.delete(key)
        raise FileChangedError(f"{source} changed while it was published; nothing is "
                               "published")
    if not _still(store, key, made):
        raise _replaced(store, key)
    return _published(store, key, digests, "local directory: the object is the published "
                      "file itself, hard-linked by descriptor (same inode, unchanged)")


def _still(store: CheckpointStore, key: str, made: ObjectVersion) -> bool:
    """Whether the object at ``key`` is still the one this publish made."""
    try:
        return store.version(key) == made
    except KeyError:
        return False


def _replaced(store: CheckpointStore, key: str) -> StoredBytesMismatchError:
    return StoredBytesMismatchError(
        f"store {store.url}: {key} was replaced by another object right after this publish "
        "made it (someone else writes there); what is there was left as found and nothing "
        "is published")


def _check_unchanged(source: Path, handle: BinaryIO, before: os.stat_result,
                     digests: FileDigests, expected: str | None) -> None:
    after = os.fstat(handle.fileno())
    if (digests.size != before.st_size or after.st_size != before.st_size
            or after.st_mtime_ns != before.st_mtime_ns):
        raise FileChangedError(
            f"{source} changed while it was published ({before.st_size} bytes before, "
            f"{digests.size} read, {after.st_size} after); nothing is published")
    if expected is not None and digests.sha256 != expected:
        raise FileChangedError(
            f"{source} is not the file that was verified: its SHA-256 is {digests.sha256}, "
            f"not {expected}; it changed after verification; nothing is published")


def _published_already(store: CheckpointStore, key: str, source: Path, handle: BinaryIO,
                       before: os.stat_result, part_size: int,
                       expected: str | None) -> Published:
    """The key exists before any upload: ours (the same bytes) or another's."""
    try:
        if store.size(key) != before.st_size:
            raise _exists_error(store, key)
    except KeyError:  # deleted meanwhile: publish after all
        return _upload(store, key, source, handle, before, part_size, expected)
    hasher = _Hasher(part_size)
    for piece in _pieces(handle, part_size):
        hasher.add(piece)
    digests = hasher.digests()
    _check_unchanged(source, handle, before, digests, expected)
    proof = _proof(store, key, digests, own=False)
    if proof is None:
        raise _exists_error(store, key)
    log.info("store %s: %s already holds the bytes of %s", store.url, key, source)
    return _published(store, key, digests, f"already published: {proof}")


def _upload(store: CheckpointStore, key: str, source: Path, handle: BinaryIO,
            before: os.stat_result, part_size: int, expected: str | None) -> Published:
    hasher = _Hasher(part_size)
    with store.upload(key, part_size=part_size, checksum=True,
                      access=FileAccess.of(before)) as upload:
        for piece in _pieces(handle, part_size):
            upload.write(piece, sha256=hasher.add(piece))
        digests = hasher.digests()
        _check_unchanged(source, handle, before, digests, expected)
        try:
            upload.complete()
        except FileExistsError:
            proof = _proof(store, key, digests, own=False)
            if proof is None:
                raise _exists_error(store, key) from None
            return _published(store, key, digests, f"published meanwhile: {proof}")
        except Exception:
            proof = _recovered(store, key, digests)
            if proof is None:
                raise
            return _published(store, key, digests, f"completion answer lost: {proof}")
    made = upload.version
    if made is not None and not _still(store, key, made):
        raise _replaced(store, key)
    try:
        proof = _proof(store, key, digests, own=True, pinned=made)
    except KeyError:
        raise StoredBytesMismatchError(
            f"store {store.url}: {key} vanished right after it was published from "
            f"{source}") from None
    if made is not None and not _still(store, key, made):
        raise _replaced(store, key)
    if proof is None:
        try:
            store.delete(key)
            fate = "the object was deleted again"
        except Exception as exc:
            fate = f"deleting the object failed too: {exc}"
        raise StoredBytesMismatchError(
            f"store {store.url}: {key} as stored is not {source} (SHA-256 {digests.sha256}); "
            f"{fate}")
    log.info("store %s: published %s as %s (%d bytes; %s)", store.url, source, key,
             digests.size, proof)
    return _published(store, key, digests, proof)


def _recovered(store: CheckpointStore, key: str, digests: FileDigests) -> str | None:
    """After a completion that failed: the proof that the key holds our bytes anyway, if it does.

    A completion whose answer was lost may have published the object; any
    error looking is no proof (the completion's own error is then raised).
    """
    try:
        if not store.exists(key):
            return None
        return _proof(store, key, digests, own=False)
    except Exception as exc:
        log.info("store %s: cannot tell whether %s was published: %s", store.url, key, exc)
        return None


def _published(store: CheckpointStore, key: str, digests: FileDigests, proof: str) -> Published:
    return Published(_object_url(store, key), key, digests.size, digests.sha256, proof)


def _proof(store: CheckpointStore, key: str, digests: FileDigests, *, own: bool,
           pinned: ObjectVersion | None = None) -> str | None:
    """How the object ``key`` was shown to hold the bytes of ``digests``, or None if it does not.

    Parameters
    ----------
    own
        The object is the one this publish just created from these parts:
        the store's composite SHA-256 of the parts (S3) and its CRC32C (GCS)
        then tell. An object of unknown origin is shown equal only by a
        collision-resistant digest: the composite SHA-256, where it was
        made from parts of the same size, else a read-back.
    pinned
        The version of the object this publish made, where the store told
        it: a read-back then reads that version only.

    Raises
    ------
    KeyError
        If there is no such object.
    """
    checks: ObjectChecksums = store.checksums(key)
    if checks.size != digests.size:
        return None
    parts = len(digests.part_sha256)
    if checks.sha256 is not None:
        composite = digests.composite_sha256
        if checks.sha256 == composite and checks.sha256_parts in (None, parts):
            return (f"S3 ChecksumSHA256 of each of the {parts} parts, computed by the store, "
                    f"compose to {composite}-{parts}, as ours")
        if own:
            return None
    if own and checks.crc32c is not None and digests.crc32c is not None:
        if checks.crc32c != digests.crc32c:
            return None
        return (f"GCS CRC32C of the composed object, computed by the store, is "
                f"{checks.crc32c:08x}, as ours")
    return _read_back(store, key, digests, pinned)


def _read_back(store: CheckpointStore, key: str, digests: FileDigests,
               pinned: ObjectVersion | None = None) -> str | None:
    whole, offset = hashlib.sha256(), 0
    while True:
        if pinned is None:
            piece: bytes | None = store.get_range(key, offset, digests.part_size)
        else:
            piece = store.get_range_pinned(key, pinned, offset, digests.part_size)
            if piece is None:
                return None
        if not piece:
            break
        whole.update(piece)
        offset += len(piece)
        if offset > digests.size:
            return None
    if offset != digests.size or whole.hexdigest() != digests.sha256:
        return None
    what = "re-read the linked file" if store.supports_links else "read back"
    return f"{what}: {offset} bytes, SHA-256 {digests.sha256}, as ours"


def published_as(store: CheckpointStore, key: str, size: int, sha256: str, *,
                 digests: FileDigests | None = None) -> bool:
    """Whether the object ``key`` holds ``size`` bytes with hex SHA-256 ``sha256``.

    The sizes are compared first. Then, with the ``digests`` of the local
    file, an S3 object made of parts of the same size is proved by the
    composite of its parts' SHA-256 checksums, which the store computed;
    anything else is read back (a part at a time) and hashed. A CRC32C is
    no proof here: it cannot tell an object made to match it.

    Raises
    ------
    ValueError
        If ``digests`` are not of ``size`` bytes with that SHA-256.
    """
    validate_key(key)
    wanted = _hex_sha256(sha256)
    if digests is None:
        digests = FileDigests(size, wanted, READ_BACK_CHUNK, (), None)
    elif digests.size != size or digests.sha256 != wanted:
        raise ValueError(f"digests of {digests.size} bytes with SHA-256 {digests.sha256} "
                         f"are not of {size} bytes with SHA-256 {wanted}")
    try:
        if store.size(key) != size:
            return False
        if not digests.part_sha256:
            return _read_back(store, key, digests) is not None
        return _proof(store, key, digests, own=False) is not None
    except KeyError:
        return False


def sweep_uploads(store: CheckpointStore, prefix: str = "",
                  older_than: float = 3600.0) -> list[StrayUpload]:
    """Abort the stray uploads under ``prefix`` started at least ``older_than`` seconds ago.

    What killed publishers left (their parts); younger uploads may belong
    to a publish still running and are left alone. A local directory
    records no key for its uploads and sweeps them whatever the prefix.

    Returns
    -------
    list of StrayUpload
        Those aborted.
    """
    if older_than < 0:
        raise ValueError(f"older_than must be >= 0 seconds, got {older_than}")
    now = time.time()
    aborted = []
    for stray in store.stray_uploads(prefix):
        if now - stray.started >= older_than:
            store.abort_upload(stray)
            aborted.append(stray)
            log.info("store %s: aborted the upload %s of %r started %.0f s ago", store.url,
                     stray.upload_id, stray.key, now - stray.started)
    return aborted


def sweep_staged(store: CheckpointStore, prefix: str = "",
                 older_than: float = 3600.0) -> list[str]:
    """Delete the staged outputs (:func:`staged_key`) under ``prefix`` written at least
    ``older_than`` seconds ago; return their keys.

    What a ``--verify-data`` job left when it ended with none of its steps
    running (cancelled between two, say), or its worker was lost for good.
    A job still reading its staged output back fails clearly if it is
    deleted under it (its reads are pinned), and publishes nothing.
    """
    if older_than < 0:
        raise ValueError(f"older_than must be >= 0 seconds, got {older_than}")
    now = time.time()
    deleted = []
    for key in store.list(prefix):
        staged = len(key) > STAGED_LENGTH and _STAGED.fullmatch(key[-STAGED_LENGTH:])
        if staged and now - store.modified(key) >= older_than:
            store.delete(key)
            deleted.append(key)
            log.info("store %s: deleted the staged output %r", store.url, key)
    return deleted
