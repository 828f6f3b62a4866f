"""A seekable, read-only file over one store object: :class:`ObjectFile`.

HDF5 needs to seek, so a file in a bucket cannot be read through a stream;
``h5py.File(ObjectFile(store, key))`` opens it in place instead, each read
served by ranged reads (:meth:`~chkq.stores.base.CheckpointStore.get_range`)
of whole blocks, the last few kept, since HDF5 reads the same metadata
blocks again and again in small pieces.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from chkq.errors import CheckpointChangedError
from chkq.lru import LRU
from chkq.stores.base import CheckpointStore, ObjectVersion

__all__ = ["ObjectFile"]

MiB = 1 << 20


class ObjectFile(io.RawIOBase):
    """The object under ``key`` as a read-only binary file.

    The object's size is read once, when the file is made; the object must
    not change while it is read (store objects written create-if-absent
    never do). A read past the object's end is short, as on a file.

    Parameters
    ----------
    store, key
        The object.
    block_size
        Bytes fetched per ranged read.
    cache_blocks
        Blocks kept (least recently used evicted), so at most
        ``block_size * cache_blocks`` bytes are held.
    pinned
        Read this version only (:meth:`~chkq.stores.base.CheckpointStore.get_range_pinned`),
        its size the version's: a block the store refuses, or shorter than the
        version holds there, fails the read with ``changed(name)`` (kept in
        :attr:`failure`, since HDF5 reports an error of its own).

    Raises
    ------
    KeyError
        If there is no such object.
    """

    def __init__(self, store: CheckpointStore, key: str, *, block_size: int = MiB,
                 cache_blocks: int = 16, pinned: ObjectVersion | None = None,
                 changed: Callable[[str], Exception] | None = None) -> None:
        super().__init__()
        if block_size < 1 or cache_blocks < 1:
            raise ValueError(f"block_size and cache_blocks must be >= 1, got "
                             f"{block_size} and {cache_blocks}")
        self.store, self.key, self.pinned = store, key, pinned
        self.size = store.size(key) if pinned is None else pinned.size
        self.block_size = block_size
        self._blocks: LRU[int, bytes] = LRU(block_size * cache_blocks, len)
        self._position = 0
        self._changed = changed or (lambda name: CheckpointChangedError(
            f"{name} is not the version pinned any more (replaced, rewritten or deleted)"))
        self.fetches = 0
        """Ranged reads made so far (for tests and tuning)."""
        self.starts: set[int] = set()
        """Where each read asked for began (where HDF5 read metadata, for a mirror)."""
        self.failure: Exception | None = None
        """Why a pinned read failed: the object changed (HDF5 reports an error of its own)."""

    @property
    def name(self) -> str:
        """The object's URL, for messages."""
        return f"{self.store.url.rstrip('/')}/{self.key}"

    def __repr__(self) -> str:
        return f"ObjectFile({self.name!r}, size={self.size})"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        raise io.UnsupportedOperation(f"{self.name} is read-only")

    def truncate(self, size: int | None = None) -> int:
        raise io.UnsupportedOperation(f"{self.name} is read-only")

    def tell(self) -> int:
        self._check_open()
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if position < 0:
            raise OSError(f"{self.name}: negative seek position {position}")
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        self._check_open()
        view = memoryview(buffer).cast("B")
        end = min(self._position + len(view), self.size)
        if self._position < end:
            self.starts.add(self._position)
        done = 0
        while self._position + done < end:
            offset = self._position + done
            index, within = divmod(offset, self.block_size)
            block = self._block(index)
            if within >= len(block):
                raise OSError(f"{self.name}: object shorter than its size {self.size}: "
                              "changed while read")
            piece = block[within : within + (end - offset)]
            view[done : done + len(piece)] = piece
            done += len(piece)
        self._position += done
        return done

    def _block(self, index: int) -> bytes:
        block = self._blocks.get(index)
        if block is None:
            start = index * self.block_size
            if self.pinned is None:
                block = self.store.get_range(self.key, start, self.block_size)
            else:
                want = min(self.block_size, self.size - start)
                found = self.store.get_range_pinned(self.key, self.pinned, start, want)
                if found is None or len(found) != want:
                    self.failure = self._changed(self.name)
                    raise self.failure
                block = found
            self.fetches += 1
            self._blocks.put(index, block)
        return block

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.name}")

    def close(self) -> None:
        self._blocks.clear()
        super().close()
