"""A bounded, thread-safe least-recently-used map: the one cache of a process.

Used for a log's checkpoint bytes (bounded by their total size), the plans a
worker parsed and the run listings its scan units share (bounded by count).
A value heavier than the whole capacity is not kept at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _one(_value: object) -> int:
    return 1


class LRU(Generic[K, V]):
    """At most ``capacity`` of weight (``weigh(value)``, 1 each by default), oldest use out first.

    Parameters
    ----------
    capacity
        The total weight kept.
    weigh
        A value's weight, e.g. ``len`` for bytes.
    """

    def __init__(self, capacity: int, weigh: Callable[[V], int] = _one) -> None:
        self.capacity = capacity
        self._weigh = weigh
        self._items: OrderedDict[K, V] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``, dropping the least recently used beyond capacity."""
        weight = self._weigh(value)
        if weight > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= self._weigh(old)
            self._items[key] = value
            self._weight += weight
            while self._weight > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self._weight -= self._weigh(evicted)

    def pop(self, key: K) -> V | None:
        """Forget ``key``; its value, or None."""
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._weight -= self._weigh(value)
            return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weight = 0

    def __len__(self) -> int:
        return len(self._items)
