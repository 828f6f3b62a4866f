"""A thread-safe least-recently-used cache of byte strings, bounded by their total size."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["ByteLRU"]


class ByteLRU:
    """Byte strings by key, the least recently used evicted once ``capacity`` bytes are held.

    A value larger than the whole capacity is not kept.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> bytes | None:
        """The value under ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: bytes) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used beyond the capacity."""
        if len(value) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._items[key] = value
            self._size += len(value)
            while self._size > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self._size -= len(evicted)

    def clear(self) -> None:
        """Forget every value."""
        with self._lock:
            self._items.clear()
            self._size = 0
