"""An in-process store for tests: ``memory://name``."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import ClassVar

from chkq.stores.base import CheckpointStore, ObjectVersion

__all__ = ["MemoryStore"]


class _Bucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.serials: dict[str, int] = {}
        """Which write of the process gave each object its bytes (its version)."""


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
