"""A followed run's next version published mostly by the store copying the previous one.

Version *k+1* of a followed output is version *k* cloned and extended: most
of its bytes are version *k*'s at the same offsets (the chunks of the
checkpoints it held), and only the head metadata, the chunks that gained
rows and the new tail differ. Where the store copies ranges of one object
into an upload of another itself (S3 ``UploadPartCopy``), a part of the new
version whose bytes equal the previous version's same range is copied from
the previous version's object instead of sent: the version costs the
changed parts' upload, not the whole file's.

The proof is the one a spread job's assembly uses, part by part: S3's ETag of
each part is the MD5 of the bytes S3 holds for it, computed by S3 (for a
copied part, of the range it copied), and must be the MD5 of the new file's
own bytes there, read here; a sent part also carries its SHA-256, which S3
checks; where S3 gives a copied part's SHA-256 too (moto does not) it must be
ours. The completed object's ETag (the MD5 of the parts' MD5s) and, where
every part has one, its composite SHA-256 must be the parts'. A copied part
that is not ours (the previous object is not the previous version any more)
aborts the upload, and the version is sent whole (:func:`publish_file`).
Stores that link files (a local directory) or cannot copy ranges (GCS) get
:func:`publish_file` itself.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from chkq.errors import StoredBytesMismatchError
from chkq.stores.base import CheckpointStore
from chkq.stores.publish import Published, publish_file
from chkq.stores.shared_upload import MAX_PART_NUMBER, PartRecord, checksums_match

log = logging.getLogger("chkq.staging")

#: S3's smallest part but the last.
MIN_PART = 5 << 20


@dataclass(frozen=True)
class VersionUpload:
    """A version published: the object, and how many of its bytes the store copied."""

    published: Published
    copied: int


class _NotOurs(Exception):
    """A copied part is not the new file's bytes: send the version whole instead."""


def reuses_ranges(store: CheckpointStore) -> bool:
    """Whether a version there can be copied in part from the previous one by the store."""
    return (store.copies_ranges and store.supports_shared_uploads
            and not store.supports_links)


def publish_version_file(store: CheckpointStore, key: str, path: Path, *, part_bytes: int,
                         previous: tuple[str, Path] | None) -> VersionUpload:
    """Publish the version ``path`` at ``key``, create-if-absent, proven as stored.

    ``previous``: the key of the previous version's object and its local
    file (the very bytes published there); its equal parts are copied by the
    store where it can (see the module's docstring), else the file is sent
    whole as :func:`publish_file` sends it.

    Raises
    ------
    FileExistsError
        If another object has the key (one this publish did not make).
    StoredBytesMismatchError
        If the stored object is not the file.
    """
    if previous is None or not reuses_ranges(store) or not previous[1].exists():
        return VersionUpload(publish_file(store, key, path, part_bytes=part_bytes), 0)
    size = path.stat().st_size
    part = max(part_bytes, MIN_PART, -(-size // MAX_PART_NUMBER))
    try:
        return _reusing(store, key, path, previous, part, size)
    except _NotOurs as exc:
        log.warning("store %s: %s; sending %s whole", store.url, exc, key)
        return VersionUpload(publish_file(store, key, path, part_bytes=part_bytes), 0)


def _reusing(store: CheckpointStore, key: str, path: Path, previous: tuple[str, Path],
             part: int, size: int) -> VersionUpload:
    source, old_path = previous
    pinned = store.version(source)
    if pinned.size != old_path.stat().st_size:
        raise _NotOurs(f"{source} is not the previous version's file (its size differs)")
    whole = hashlib.sha256()
    md5s: list[bytes] = []
    records: list[PartRecord] = []
    copied = 0
    upload = store.begin_shared_upload(key)
    try:
        with open(path, "rb") as new, open(old_path, "rb") as old:
            offset = 0
            while offset < size or not records:
                piece = new.read(part)
                whole.update(piece)
                md5 = hashlib.md5(piece).digest()
                md5s.append(md5)
                number = len(records) + 1
                same = (len(piece) == part and offset + part <= pinned.size
                        and os.pread(old.fileno(), part, offset) == piece)
                if same:
                    record = store.copy_part(upload, number, source, pinned, offset, part,
                                             offset)
                    if record.etag.strip('"') != md5.hex() or (
                            record.checksum and base64.b64decode(record.checksum)
                            != hashlib.sha256(piece).digest()):
                        raise _NotOurs(f"part {number} copied from {source} is not the bytes "
                                       f"of {path} at {offset}")
                    copied += part
                else:
                    record = store.put_part(upload, number, piece, offset)
                    if record.etag.strip('"') != md5.hex():
                        raise StoredBytesMismatchError(
                            f"store {store.url}: part {number} of {key} as stored is not the "
                            f"bytes of {path} at {offset}")
                records.append(record)
                offset += len(piece)
        expected = store.shared_upload_checksums(records)
        if not store.complete_shared_upload(upload, records):
            found = store.checksums(key)
            if not checksums_match(found, expected):
                raise FileExistsError(f"store {store.url}: {key} exists")
        elif not checksums_match(found := store.checksums(key), expected):
            store.delete(key)
            raise StoredBytesMismatchError(
                f"store {store.url}: {key} as stored is not the parts sent and copied "
                f"({found} against {expected}); the object was deleted again")
    except BaseException:
        store.abort_shared_upload(upload)
        raise
    etag = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
    proof = (f"S3 ETag of each of the {len(records)} parts, computed by the store, is the "
             f"MD5 of our bytes there ({copied:,} of {size:,} bytes copied by the store from "
             f"{source}); the object's ETag is {etag}, as theirs")
    url = f"{store.url.rstrip('/')}/{key}"
    return VersionUpload(Published(url, key, size, whole.hexdigest(), proof), copied)
