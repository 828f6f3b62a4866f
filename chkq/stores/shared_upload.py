"""Uploads whose parts many processes write: the tokens they share and the rules of parts.

A :class:`~chkq.stores.uploads.PartsUpload` is one sequential writer in one
process. A *shared* upload is begun once
(:meth:`~chkq.stores.base.CheckpointStore.begin_shared_upload`), its token
(:class:`SharedUpload`, JSON-able through :meth:`SharedUpload.to_record`)
handed to other processes on other machines, each of which puts or copies
parts of it (:meth:`~chkq.stores.base.CheckpointStore.put_part`,
:meth:`~chkq.stores.base.CheckpointStore.copy_part`) and hands back what it
did (:class:`PartRecord`); one of them then publishes the object
create-if-absent from every part's record
(:meth:`~chkq.stores.base.CheckpointStore.complete_shared_upload`), or drops
it (:meth:`~chkq.stores.base.CheckpointStore.abort_shared_upload`).

Records come back from other processes through a broker, so
:meth:`SharedUpload.from_record` and :meth:`PartRecord.from_record` treat
them as untrusted input (:class:`~chkq.errors.BadMessageError`). The part
rules every store shares (:func:`check_part` of each part as it is added,
:func:`validate_parts` of them all on completion), the errors every store
raises alike (:func:`check_random_id`, :func:`source_changed`) and the
checksums a completed object must have (:func:`composite_sha256`,
:func:`combined_crc32c`, :func:`checksums_match`) live here too.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chkq.errors import BadMessageError, BadMessageTypeError, CheckpointChangedError
from chkq.stores.keys import validate_key
from chkq.stores.objects import ObjectChecksums

__all__ = [
    "MAX_PART",
    "MAX_PART_NUMBER",
    "PIN_READ",
    "PartRecord",
    "SharedUpload",
    "check_part",
    "check_random_id",
    "check_upload",
    "checksums_match",
    "combined_crc32c",
    "composite_sha256",
    "multipart_etag",
    "crc32c_combine",
    "source_changed",
    "validate_parts",
]

MAX_PART_NUMBER = 10_000
"""Highest part number (S3's limit, kept by every store)."""
MAX_PART = 5 << 30
"""Largest part, put or copied (S3's limit, kept by every store)."""
PIN_READ = 32 << 20
"""Most bytes read at a time where a copied range passes through the caller."""

_UPLOAD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~+=-]{0,1023}")
_WRITE_ID = re.compile(r"[0-9a-f]{32}")
_PRINTABLE = re.compile(r"[\x21-\x7e]{0,1024}")


def _field(record: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    if name not in record:
        raise BadMessageError(f"{what}: field {name!r} is missing")
    value = record[name]
    # bool is an int to Python, never a number here
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadMessageTypeError(f"{what}: field {name!r} must be {kind.__name__}, "
                                  f"got {type(value).__name__}")
    return value


def _mapping(record: Any, names: tuple[str, ...], what: str) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise BadMessageTypeError(f"{what} must be a JSON object, got {type(record).__name__}")
    extra = sorted(str(name) for name in record if name not in names)
    if extra:
        raise BadMessageError(f"{what}: unknown field(s) {', '.join(map(repr, extra))}")
    return record


@dataclass(frozen=True)
class SharedUpload:
    """A shared upload in flight: what another process needs to add parts to it or finish it.

    Attributes
    ----------
    key
        The object it publishes.
    upload_id
        The store's name for it: S3's ``UploadId``; for GCS and a local
        directory a random id naming its staging place.
    write_id
        A random id the object it publishes carries (S3 and GCS metadata), so
        that a completion whose answer was lost and is asked again knows the
        object found as this upload's own.
    """

    key: str
    upload_id: str
    write_id: str

    def __post_init__(self) -> None:
        what = "shared upload record"
        try:
            validate_key(self.key)
        except ValueError as exc:
            raise BadMessageError(f"{what}: {exc}") from None
        if not _UPLOAD_ID.fullmatch(self.upload_id) or ".." in self.upload_id:
            raise BadMessageError(f"{what}: upload id {self.upload_id!r} is no store's upload "
                                  "id (letters, digits and ._~+=- only, at most 1024)")
        if not _WRITE_ID.fullmatch(self.write_id):
            raise BadMessageError(f"{what}: write id {self.write_id!r} is not 32 hex digits")

    def to_record(self) -> dict[str, Any]:
        """The token as a JSON-able dict (:meth:`from_record` reads it back)."""
        return {"key": self.key, "upload_id": self.upload_id, "write_id": self.write_id}

    @classmethod
    def from_record(cls, record: Any) -> SharedUpload:
        """The token of a :meth:`to_record` dict, from whoever sent it.

        Raises
        ------
        BadMessageError
            If it is not such a dict: a field missing or unknown, of the wrong
            type (:class:`~chkq.errors.BadMessageTypeError`), a key a store
            refuses, an upload id with a ``/`` or ``..``, naming what is wrong.
        """
        what = "shared upload record"
        found = _mapping(record, ("key", "upload_id", "write_id"), what)
        return cls(_field(found, "key", str, what), _field(found, "upload_id", str, what),
                   _field(found, "write_id", str, what))


@dataclass(frozen=True)
class PartRecord:
    """What one part put or copied into a shared upload is: JSON-able, handed to the completer.

    Attributes
    ----------
    number
        The part's number, 1 to :data:`MAX_PART_NUMBER`; parts are assembled
        in number order.
    size
        Its bytes.
    offset
        Where it starts in the object (what a local directory writes at; the
        others check it on completion).
    etag
        S3's ETag of the part; GCS's generation of the staged part; "" for a
        local directory.
    checksum
        The store's own checksum of the part: S3's ``ChecksumSHA256``
        (base64), GCS's CRC32C (base64), a local directory's SHA-256 (hex).
    """

    number: int
    size: int
    offset: int
    etag: str
    checksum: str

    def __post_init__(self) -> None:
        what = f"part record {self.number!r}"
        if not 1 <= self.number <= MAX_PART_NUMBER:
            raise BadMessageError(f"{what}: a part number is 1 to {MAX_PART_NUMBER}")
        if not 0 <= self.size <= MAX_PART:
            raise BadMessageError(f"{what}: size {self.size} is not 0 to {MAX_PART}")
        if not 0 <= self.offset < 1 << 62:
            raise BadMessageError(f"{what}: offset {self.offset} is out of range")
        for name, value in (("etag", self.etag), ("checksum", self.checksum)):
            if not _PRINTABLE.fullmatch(value):
                raise BadMessageError(f"{what}: {name} {value[:80]!r} is not printable ASCII "
                                      "of at most 1024 characters")

    @property
    def end(self) -> int:
        """Offset of the byte after the part."""
        return self.offset + self.size

    def to_record(self) -> dict[str, Any]:
        """The record as a JSON-able dict (:meth:`from_record` reads it back)."""
        return {"number": self.number, "size": self.size, "offset": self.offset,
                "etag": self.etag, "checksum": self.checksum}

    @classmethod
    def from_record(cls, record: Any) -> PartRecord:
        """The part of a :meth:`to_record` dict, from whoever sent it.

        Raises
        ------
        BadMessageError
            If it is not such a dict (a field missing, unknown, of the wrong
            type or out of range), naming what is wrong.
        """
        what = "part record"
        found = _mapping(record, ("number", "size", "offset", "etag", "checksum"), what)
        return cls(*(_field(found, name, kind, what) for name, kind in (
            ("number", int), ("size", int), ("offset", int), ("etag", str),
            ("checksum", str))))


def check_upload(upload: SharedUpload) -> None:
    """Refuse anything but a :class:`SharedUpload` where a store is handed one.

    Raises
    ------
    TypeError
        If ``upload`` is of another type, naming it.
    """
    if not isinstance(upload, SharedUpload):
        raise TypeError(f"a shared upload is a SharedUpload, not {type(upload).__name__}")


def check_part(url: str, upload: SharedUpload, number: int, offset: int, size: int) -> None:
    """Check a part as it is put or copied into ``upload`` of the store ``url``.

    Raises
    ------
    ValueError
        If the number is not 1 to :data:`MAX_PART_NUMBER`, ``offset`` is
        negative or ``size`` is more than :data:`MAX_PART`, naming the store,
        the part and the key.
    """
    check_upload(upload)
    if isinstance(number, bool) or not isinstance(number, int) \
            or not 1 <= number <= MAX_PART_NUMBER:
        raise ValueError(f"store {url}: part number {number!r} of {upload.key} is not "
                         f"1 to {MAX_PART_NUMBER}")
    if offset < 0:
        raise ValueError(f"store {url}: part {number} of {upload.key}: offset "
                         f"{offset} is negative")
    if size > MAX_PART:
        raise ValueError(f"store {url}: part {number} of {upload.key} has {size} "
                         f"bytes, more than the {MAX_PART} a part may have")


def check_random_id(url: str, upload: SharedUpload, store: str) -> None:
    """Refuse an upload id that a store naming its uploads by 32 random hex digits never gave.

    Raises
    ------
    BadMessageError
        If the id is not 32 lowercase hex digits (``store`` says which kind of
        store, for the message).
    """
    if not _WRITE_ID.fullmatch(upload.upload_id):
        raise BadMessageError(f"store {url}: {upload.upload_id!r} is no shared "
                              f"upload of {store} (32 hex digits)")


def source_changed(url: str, source: str, upload: SharedUpload, number: int,
                   how: str = "replaced or deleted") -> CheckpointChangedError:
    """The error of a part copied from ``source`` of the store ``url``, which is not the
    version pinned any more (``how``: what may have become of it)."""
    return CheckpointChangedError(
        f"store {url}: {source} changed since it was pinned ({how}): part {number} of "
        f"{upload.key} was not copied from it")


def validate_parts(upload: SharedUpload, parts: Sequence[PartRecord], *,
                   min_part: int = 0) -> int:
    """Check that ``parts`` make one object: number order, offsets contiguous from 0.

    Parameters
    ----------
    upload
        The upload they are parts of (named in errors).
    parts
        Every part, in the order they are assembled.
    min_part
        Smallest size of a part but the last (S3's 5 MiB).

    Returns
    -------
    int
        The object's size.

    Raises
    ------
    ValueError
        If there is no part, a part is not a :class:`PartRecord`, numbers do
        not increase, a part does not start where the one before ends (the
        first at 0), a part but the last is smaller than ``min_part``, or a
        part is empty but the only one.
    """
    what = f"shared upload {upload.upload_id} of {upload.key}"
    if not parts:
        raise ValueError(f"{what}: no parts to complete it from (an empty object is one "
                         "empty part)")
    end, number = 0, 0
    for index, part in enumerate(parts):
        if not isinstance(part, PartRecord):
            raise TypeError(f"{what}: part {index} is a {type(part).__name__}, not a PartRecord")
        if part.number <= number:
            raise ValueError(f"{what}: part {part.number} comes after part {number}: parts "
                             "are given in increasing number order")
        if part.offset != end:
            raise ValueError(f"{what}: part {part.number} starts at {part.offset}, not at "
                             f"{end} where the parts before it end")
        last = index == len(parts) - 1
        if part.size == 0 and len(parts) > 1:
            raise ValueError(f"{what}: part {part.number} is empty")
        if not last and part.size < min_part:
            raise ValueError(f"{what}: part {part.number} has {part.size} bytes: every part "
                             f"but the last needs at least {min_part} in this store")
        number, end = part.number, part.end
    return end


def multipart_etag(parts: Sequence[PartRecord]) -> str:
    """The ETag S3 gives an object completed from ``parts``: the MD5 of their MD5s, ``-N``.

    Each part's ETag is the MD5 of its bytes, as S3 computed them (for a
    copied part, of the range it copied).
    """
    digests = b"".join(bytes.fromhex(part.etag.strip('"')) for part in parts)
    return f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"


def composite_sha256(parts: Sequence[PartRecord]) -> str:
    """S3's composite ``ChecksumSHA256`` of an object made of ``parts`` (base64, no ``-N``).

    The SHA-256 of the parts' SHA-256 digests one after the other, which
    :meth:`~chkq.stores.base.CheckpointStore.checksums` reports of the
    completed object: equal, it proves the object is these parts.
    """
    digests = b"".join(base64.b64decode(part.checksum, validate=True) for part in parts)
    return base64.b64encode(hashlib.sha256(digests).digest()).decode("ascii")


_CASTAGNOLI = 0x82F63B78


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32c_combine(first: int, second: int, second_size: int) -> int:
    """CRC32C of ``A + B`` from CRC32C ``first`` of A, ``second`` of B and B's size (zlib's
    ``crc32_combine``, with the Castagnoli polynomial)."""
    if second_size <= 0:
        return first
    odd = [_CASTAGNOLI] + [1 << n for n in range(31)]   # the operator of one zero bit
    even = _gf2_square(odd)                             # two zero bits
    odd = _gf2_square(even)                             # four
    while True:
        even = _gf2_square(odd)
        if second_size & 1:
            first = _gf2_times(even, first)
        second_size >>= 1
        if not second_size:
            break
        odd = _gf2_square(even)
        if second_size & 1:
            first = _gf2_times(odd, first)
        second_size >>= 1
        if not second_size:
            break
    return first ^ second


def combined_crc32c(parts: Sequence[PartRecord]) -> int:
    """GCS's CRC32C of an object composed of ``parts`` (whose checksums are GCS's, base64)."""
    total = 0
    for part in parts:
        value = int.from_bytes(base64.b64decode(part.checksum, validate=True), "big")
        total = crc32c_combine(total, value, part.size)
    return total


def checksums_match(found: ObjectChecksums, expected: ObjectChecksums) -> bool:
    """Whether ``found`` (``store.checksums(key)``) proves the object ``expected`` describes.

    The sizes must be equal, and every checksum ``expected`` has must be
    there and equal (a part count that the store does not tell is no
    difference).
    """
    if found.size != expected.size:
        return False
    if expected.sha256 is not None and found.sha256 != expected.sha256:
        return False
    if expected.sha256_parts is not None and found.sha256_parts not in (
            None, expected.sha256_parts):
        return False
    if expected.etag is not None and found.etag != expected.etag:
        return False
    return expected.crc32c is None or found.crc32c == expected.crc32c
