"""An in-process store for tests: ``memory://name``."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from chkq.errors import CheckpointChangedError, StoredBytesMismatchError
from chkq.stores.base import CheckpointStore, ObjectVersion, StrayUpload
from chkq.stores.shared_upload import PartRecord, SharedUpload, validate_parts

__all__ = ["MemoryStore"]


@dataclass
class _Shared:
    """A shared upload in flight: its key, when it began, its parts by number."""

    key: str
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)


class _Bucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.serials: dict[str, int] = {}
        """Which write of the process gave each object its bytes (its version)."""
        self.uploads: dict[str, _Shared] = {}
        """Shared uploads in flight, by upload id."""


class MemoryStore(CheckpointStore):
    """A thread-safe dictionary of objects, shared by name within one process.

    ``MemoryStore("a")`` twice (or ``open_store("memory://a")``) gives two
    handles on the same objects, as two clients of one bucket would; with no
    name, a fresh anonymous store is made.  Objects vanish with the process.

    Parameters
    ----------
    name
        The store's name; ``None`` for a new, unique one.
    """

    _registry: ClassVar[dict[str, _Bucket]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str | None = None) -> None:
        self._name = name if name else f"anon-{uuid.uuid4().hex}"
        with self._registry_lock:
            self._bucket = self._registry.setdefault(self._name, _Bucket())

    @property
    def url(self) -> str:
        return f"memory://{self._name}"

    _writes: ClassVar[itertools.count[int]] = itertools.count(1)

    def _put(self, key: str, data: bytes) -> None:
        with self._bucket.lock:
            self._bucket.objects[key] = (data, time.time())
            self._bucket.serials[key] = next(self._writes)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        with self._bucket.lock:
            if key in self._bucket.objects:
                return False
            self._bucket.objects[key] = (data, time.time())
            self._bucket.serials[key] = next(self._writes)
            return True

    def _get(self, key: str) -> bytes:
        with self._bucket.lock:
            try:
                return self._bucket.objects[key][0]
            except KeyError:
                raise KeyError(key) from None

    def _exists(self, key: str) -> bool:
        with self._bucket.lock:
            return key in self._bucket.objects

    def _list(self, prefix: str) -> list[str]:
        with self._bucket.lock:
            return [key for key in self._bucket.objects if key.startswith(prefix)]

    def _delete(self, key: str) -> None:
        with self._bucket.lock:
            self._bucket.objects.pop(key, None)
            self._bucket.serials.pop(key, None)

    def _version(self, key: str) -> ObjectVersion:
        with self._bucket.lock:
            try:
                data = self._bucket.objects[key][0]
                return ObjectVersion(len(data), f"write:{self._bucket.serials[key]}")
            except KeyError:
                raise KeyError(key) from None

    def _modified(self, key: str) -> float:
        with self._bucket.lock:
            try:
                return self._bucket.objects[key][1]
            except KeyError:
                raise KeyError(key) from None

    # shared uploads (within this process) ---------------------------------------------

    @property
    def supports_shared_uploads(self) -> bool:
        return True

    def _begin_shared_upload(self, key: str) -> SharedUpload:
        upload = SharedUpload(key, uuid.uuid4().hex, uuid.uuid4().hex)
        with self._bucket.lock:
            self._bucket.uploads[upload.upload_id] = _Shared(key, time.time())
        return upload

    def _shared(self, upload: SharedUpload) -> _Shared:
        found = self._bucket.uploads.get(upload.upload_id)
        if found is None or found.key != upload.key:
            raise KeyError(f"store {self.url}: no shared upload {upload.upload_id} of "
                           f"{upload.key} (completed or aborted)")
        return found

    def _put_part(self, upload: SharedUpload, number: int, data: bytes,
                  offset: int) -> PartRecord:
        with self._bucket.lock:
            self._shared(upload).parts[number] = data
        return PartRecord(number, len(data), offset, "", hashlib.sha256(data).hexdigest())

    def _copy_part(self, upload: SharedUpload, number: int, source_key: str,
                   pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        data = self._get_range_pinned(source_key, pinned, start, length)
        if data is None or len(data) != length:
            raise CheckpointChangedError(
                f"store {self.url}: {source_key} changed since it was pinned (replaced or "
                f"deleted): part {number} of {upload.key} was not copied from it")
        return self._put_part(upload, number, data, offset)

    def _complete_shared_upload(self, upload: SharedUpload, parts: list[PartRecord]) -> bool:
        validate_parts(upload, parts)
        with self._bucket.lock:
            shared = self._shared(upload)
            pieces = []
            for part in parts:
                data = shared.parts.get(part.number)
                if data is None:
                    raise ValueError(f"store {self.url}: part {part.number} of {upload.key} "
                                     "was never put")
                if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.checksum:
                    raise StoredBytesMismatchError(
                        f"store {self.url}: part {part.number} of {upload.key} is not the "
                        "part recorded")
                pieces.append(data)
            del self._bucket.uploads[upload.upload_id]
            if upload.key in self._bucket.objects:
                return False
            self._bucket.objects[upload.key] = (b"".join(pieces), time.time())
            self._bucket.serials[upload.key] = next(self._writes)
            return True

    def _abort_shared_upload(self, upload: SharedUpload) -> None:
        with self._bucket.lock:
            found = self._bucket.uploads.get(upload.upload_id)
            if found is not None and found.key == upload.key:
                del self._bucket.uploads[upload.upload_id]

    def _stray_uploads(self, prefix: str) -> list[StrayUpload]:
        with self._bucket.lock:
            return sorted((StrayUpload(shared.key, upload_id, shared.started)
                           for upload_id, shared in self._bucket.uploads.items()
                           if shared.key.startswith(prefix)), key=lambda u: u.upload_id)

    def _abort_upload(self, stray: StrayUpload) -> None:
        with self._bucket.lock:
            self._bucket.uploads.pop(stray.upload_id, None)
