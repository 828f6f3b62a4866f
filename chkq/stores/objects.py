"""The values a store hands out and takes, apart from the store classes.

Object versions, file access, stray uploads and checksums are shared by
:class:`~chkq.stores.base.CheckpointStore`, the uploads it makes
(:mod:`chkq.stores.uploads`) and its backends; they live here so that each
of those modules can name them without importing another. They are
importable from :mod:`chkq.stores.base` too.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["FileAccess", "ObjectChecksums", "ObjectVersion", "StrayUpload"]


@dataclass(frozen=True)
class ObjectVersion:
    """What pins one stored object: its size and the store's name for this version of it.

    ``version`` changes whenever the object is written again: an S3 ETag, a
    GCS generation, a local file's inode and modification time in
    nanoseconds; stores with none of these use the size and modification
    time. Reads pinned to a version (:meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`)
    give bytes of that version only.
    """

    size: int
    version: str


@dataclass(frozen=True)
class FileAccess:
    """Permission bits, owner and group an object gets where the store keeps objects as files.

    A local directory gives them to an object it publishes before the object
    has a name, as far as the worker may (:meth:`~chkq.stores.base.CheckpointStore.upload`);
    network stores keep no file modes and ignore them.

    Attributes
    ----------
    mode
        Permission bits (``0o777`` at most).
    uid
        Owner, or -1 to keep the writer's.
    gid
        Group, or -1 to keep the writer's (the object then gets no group bits).
    """

    mode: int
    uid: int = -1
    gid: int = -1

    @classmethod
    def of(cls, found: os.stat_result) -> FileAccess:
        """The access of a file as ``fstat`` gave it (a published file's, to carry over)."""
        return cls(stat.S_IMODE(found.st_mode) & 0o777, found.st_uid, found.st_gid)


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
    """Checksums a store computed itself of one object's bytes (``CheckpointStore.checksums``).

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
    etag
        S3's ETag (no quotes): for an object uploaded in parts, the MD5 of
        its parts' MD5 digests one after the other, ``-N``; or None.
    """

    size: int
    sha256: str | None = None
    sha256_parts: int | None = None
    crc32c: int | None = None
    etag: str | None = None
