"""The abstract object-store interface shared by every checkpoint store.

The interface is deliberately minimal (modelled on zarr-python v3's
``zarr/abc/store.py``): a store maps ``/``-separated relative keys to
immutable byte strings and offers exactly the operations a write-once,
lock-free log needs — atomic replace, atomic create-if-absent, read,
existence, complete sorted listing and idempotent delete.  Concrete stores
implement the underscore-prefixed hooks; the public methods validate keys
once, here (:mod:`chkq.stores.keys`), so that no backend can be handed a key
that escapes its root.

The rest of a store lives beside it: the values it hands out and takes
(:mod:`chkq.stores.objects`), the key rules (:mod:`chkq.stores.keys`),
retries and budgets (:mod:`chkq.stores.retry`) and uploads from parts
(:mod:`chkq.stores.uploads`), whose names in ``__all__`` below are importable
from here too; what S3 and GCS share builds on this module
(:mod:`chkq.stores.bucket`), and is imported from there.
"""

from __future__ import annotations

import builtins
import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator

from chkq.errors import InvalidKeyError, StoreNotFoundError, TransientStoreError
from chkq.stores.keys import bucket_prefix, validate_key, validate_prefix
from chkq.stores.objects import FileAccess, ObjectChecksums, ObjectVersion, StrayUpload
from chkq.stores.retry import StoreTimeouts, overall_budget, retry_transient
from chkq.stores.shared_upload import PartRecord, SharedUpload, check_part, check_upload
from chkq.stores.uploads import BufferedUpload, PartsUpload

__all__ = [
    "CheckpointStore",
    "FileAccess",
    "InvalidKeyError",
    "ObjectChecksums",
    "ObjectVersion",
    "PartRecord",
    "PartsUpload",
    "SharedUpload",
    "StoreNotFoundError",
    "StoreTimeouts",
    "StrayUpload",
    "TransientStoreError",
    "bucket_prefix",
    "overall_budget",
    "retry_transient",
    "validate_key",
    "validate_prefix",
]


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

    def read_pinned(self, key: str, pinned: ObjectVersion, piece: int
                    ) -> Iterator[bytes | None]:
        """The whole object under ``key`` if it is ``pinned``, ``piece`` bytes at a time.

        Every byte is of the pinned version, as with :meth:`get_range_pinned`;
        a backend that can stream one object from one request does (S3: one
        GET with ``If-Match``, resumed from where it broke), where reading it
        range by range would cost a request a piece, and, on a server that
        reads the whole object for every range, the object once a piece.

        Yields
        ------
        bytes or None
            The pieces in order, each ``piece`` bytes but the last; None, and
            nothing after it, where the object is gone or is no longer that
            version. An empty object yields nothing.
        """
        if piece < 1:
            raise ValueError(f"piece must be >= 1 byte, got {piece}")
        return self._read_pinned(validate_key(key), pinned, piece)

    def _read_pinned(self, key: str, pinned: ObjectVersion, piece: int
                     ) -> Iterator[bytes | None]:
        offset = 0
        while offset < pinned.size:
            data = self._get_range_pinned(key, pinned, offset, min(piece, pinned.size - offset))
            if not data:
                yield None
                return
            yield data
            offset += len(data)
        if pinned.size == 0 and self._get_range_pinned(key, pinned, 0, 1) != b"":
            yield None

    def upload(self, key: str, *, part_size: int | None = None,
               checksum: bool = False, access: FileAccess | None = None) -> PartsUpload:
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
        access
            Mode, owner and group of the object where the store keeps files
            (a local directory gives them before the object has a name, so it
            is never more readable than that); ignored by other stores.
        """
        upload = self._upload(validate_key(key), part_size=self.upload_part_size(part_size),
                              checksum=checksum)
        upload.access = access
        return upload

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        return BufferedUpload(self, key)

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

    # shared uploads: parts written by many processes -------------------------------------

    @property
    def copies_ranges(self) -> bool:
        """Whether :meth:`copy_part` copies in the store, no byte through the caller.

        True for S3 (``UploadPartCopy``) and a local directory
        (``copy_file_range``); GCS has no ranged copy, so its copied parts pass
        through the caller, once.
        """
        return False

    @property
    def supports_shared_uploads(self) -> bool:
        """Whether this store has :meth:`begin_shared_upload` and the methods after it."""
        return False

    def begin_shared_upload(self, key: str) -> SharedUpload:
        """Start publishing one object under ``key`` from parts that many processes write.

        Its token (:meth:`SharedUpload.to_record`) goes to the writers, each
        of which adds parts (:meth:`put_part`, :meth:`copy_part`) and hands
        back their :class:`PartRecord`; one then publishes the object,
        create-if-absent (:meth:`complete_shared_upload`), or drops it
        (:meth:`abort_shared_upload`). Until then it is one of
        :meth:`stray_uploads` (``chkq gc`` aborts it once old). S3 starts a
        multipart upload with ``ChecksumAlgorithm=SHA256``, GCS names a
        staging place of composed parts, a local directory makes a file in a
        private directory of the writer's (every writer must run as the same
        user, on the same filesystem).

        Raises
        ------
        NotImplementedError
            If the store has no shared uploads (:attr:`supports_shared_uploads`).
        """
        key = validate_key(key)
        self._shared_capable()
        return self._begin_shared_upload(key)

    def put_part(self, upload: SharedUpload, number: int, data: bytes,
                 offset: int) -> PartRecord:
        """Upload ``data`` as part ``number`` of ``upload``, starting at ``offset`` of the object.

        Putting a part again (a redelivered task) with the same bytes is
        harmless; with other bytes the last put is the part. S3 sends the
        part's SHA-256, which S3 checks, GCS its CRC32C; a local directory
        writes the bytes at ``offset`` of the upload's file (S3 and GCS keep
        the offset in the record only; the completion checks it).

        Raises
        ------
        ValueError
            If the number is not 1 to 10000, ``offset`` is negative or the
            part is larger than 5 GiB.
        """
        self._shared_capable()
        data = bytes(data)
        check_part(self.url, upload, number, offset, len(data))
        return self._put_part(upload, number, data, offset)

    def copy_part(self, upload: SharedUpload, number: int, source_key: str,
                  pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        """Make ``length`` bytes of ``source_key`` from ``start`` part ``number`` of ``upload``.

        Only bytes of the ``pinned`` version are copied: S3 copies
        server-side (``UploadPartCopy`` with ``CopySourceIfMatch``, and the
        source's ETag checked after); GCS has no ranged copy, so the range
        is read pinned (:meth:`get_range_pinned`, 32 MiB at a time) and
        uploaded as the part: its bytes pass through the caller; a local
        directory copies in the kernel (``copy_file_range``) from the source
        file, checked to be the pinned version before and after.

        Raises
        ------
        CheckpointChangedError
            If the source is gone or no longer the pinned version, naming it.
        ValueError
            If the range is empty, larger than 5 GiB or reaches past the
            pinned size, or as :meth:`put_part`.
        """
        self._shared_capable()
        source_key = validate_key(source_key)
        if start < 0 or length < 1 or start + length > pinned.size:
            raise ValueError(f"store {self.url}: range {start}+{length} of {source_key} is "
                             f"not within its {pinned.size} bytes (a copied part is not empty)")
        check_part(self.url, upload, number, offset, length)
        return self._copy_part(upload, number, source_key, pinned, start, length, offset)

    def complete_shared_upload(self, upload: SharedUpload,
                               parts: builtins.list[PartRecord]) -> bool:
        """Publish ``upload`` from ``parts`` under its key, create-if-absent.

        ``parts`` are every part of the object, in number order, offsets
        contiguous from 0 (:func:`~chkq.stores.shared_upload.validate_parts`);
        parts put but not listed are dropped. S3 completes with
        ``If-None-Match: *`` and the parts' checksums, a completion whose
        answer was lost settled as :meth:`upload` settles it; GCS composes the
        staged parts (each checked to have the size and CRC32C recorded) 32
        at a time and the last compose with ``ifGenerationMatch=0``; a local
        directory checks each part's SHA-256, fsyncs and links the file into
        place. :meth:`shared_upload_checksums` then tells what
        :meth:`checksums` of the object must be.

        Returns
        -------
        bool
            True if the object is now this upload's (also when asked again
            after a lost answer), False if another object had the key: this
            upload is then aborted, nothing of it left.

        Raises
        ------
        ValueError
            If ``parts`` break the rules above (nothing is changed: complete
            again with the right parts), or a part is not in the store as
            recorded (:class:`~chkq.errors.StoredBytesMismatchError` if its
            bytes differ).
        """
        self._shared_capable()
        check_upload(upload)
        return self._complete_shared_upload(upload, builtins.list(parts))

    def abort_shared_upload(self, upload: SharedUpload) -> None:
        """Drop ``upload`` and every part of it; aborting again, or once complete, is a no-op."""
        self._shared_capable()
        check_upload(upload)
        self._abort_shared_upload(upload)

    def shared_upload_checksums(self, parts: builtins.list[PartRecord]) -> ObjectChecksums:
        """What :meth:`checksums` of an object completed from ``parts`` must be.

        S3: the composite SHA-256 of the parts' checksums
        (:func:`~chkq.stores.shared_upload.composite_sha256`); GCS: the CRC32C
        combined from theirs (:func:`~chkq.stores.shared_upload.combined_crc32c`);
        elsewhere the size alone. Compare with
        :func:`~chkq.stores.shared_upload.checksums_match` to prove the object
        without reading it.
        """
        return ObjectChecksums(size=sum(part.size for part in parts))

    def _shared_capable(self) -> None:
        if not self.supports_shared_uploads:
            raise NotImplementedError(f"store {self.url} has no shared uploads")

    def _begin_shared_upload(self, key: str) -> SharedUpload:
        raise NotImplementedError

    def _put_part(self, upload: SharedUpload, number: int, data: bytes,
                  offset: int) -> PartRecord:
        raise NotImplementedError

    def _copy_part(self, upload: SharedUpload, number: int, source_key: str,
                   pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        raise NotImplementedError

    def _complete_shared_upload(self, upload: SharedUpload,
                                parts: builtins.list[PartRecord]) -> bool:
        raise NotImplementedError

    def _abort_shared_upload(self, upload: SharedUpload) -> None:
        raise NotImplementedError

    # capabilities: what a store can do beyond the interface above --------------------------

    @property
    def supports_links(self) -> bool:
        """Whether objects are files that can be hard-linked to and from local files.

        True for a local directory: :meth:`link_from` and :meth:`link_to` then
        publish or fetch without copying a byte where the file and the store
        share a filesystem. Callers use it to skip the attempt, never to
        decide safety: both methods refuse with :class:`OSError` where they
        cannot link, and the caller copies instead.
        """
        return False

    def link_from(self, key: str, fd: int) -> ObjectVersion | None:
        """Make the local file open as ``fd`` the object ``key`` by a hard link, create-if-absent.

        The file linked is the one open (through its descriptor, not its
        name), so whatever is at its name meanwhile is never published.

        Returns
        -------
        ObjectVersion or None
            The version of the object made (the file itself), or None if an
            object already had the key (left untouched).

        Raises
        ------
        OSError
            If the store cannot link it (any store but a local directory,
            another filesystem, a file the kernel will not let this user link).
        """
        raise OSError(errno.EXDEV, f"store {self.url} keeps no local files to link", key)

    def link_to(self, key: str, pinned: ObjectVersion, dir_fd: int, name: str) -> bool:
        """Hard-link the object ``key``, if it is still ``pinned``, as ``name`` in ``dir_fd``.

        Returns
        -------
        bool
            False if the object is missing or not the pinned version (nothing is left).

        Raises
        ------
        FileExistsError
            If ``name`` exists in ``dir_fd``.
        OSError
            If the store cannot link it (see :meth:`link_from`); the caller copies.
        """
        raise OSError(errno.EXDEV, f"store {self.url} keeps no local files to link", key)

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
