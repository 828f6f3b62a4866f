"""A consolidated output's byte layout, fixed before any row is copied.

libhdf5 writes the output's metadata (superblock, object headers, chunk
indexes, heaps) as it always does, but into a :class:`LayoutImage`: a file
object that keeps what libhdf5 writes as metadata and keeps nothing of the raw
chunks, which are written as *placeholders* of their planned stored size.
Each placeholder carries a random mark and its chunk's tag, so the image learns
where libhdf5 put every chunk from the write itself. The result, a
:class:`Layout`, says for every byte of the output file whether it is metadata
(bytes the planner holds) or a chunk (bytes that exist already, somewhere in a
source, and can be copied there by whoever holds them: a node, a store's
server-side range copy, ``copy_file_range``).

A layout is proven from metadata alone (:func:`check_chunk_map`): the file's
own chunk index, read back through libhdf5 from the metadata, must place each
planned chunk at the planned address with the planned size and filter mask.
"""

from __future__ import annotations

import io
import os
import secrets
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import h5py

from chkq.consolidation.checkpoint_files import chunk_index
from chkq.errors import BadCheckpointError

#: Bytes of a placeholder's head: a mark of 16 random bytes and its chunk's tag (8 bytes).
PLACEHOLDER_HEAD = 24


@dataclass(frozen=True)
class ChunkExtent:
    """Where one planned chunk lies in the output: ``length`` bytes at ``offset``."""

    offset: int
    length: int
    tag: int


@dataclass
class Layout:
    """Every byte of an output file: metadata held here, chunks named by tag.

    ``metadata`` holds ``(offset, bytes)`` runs in order, none overlapping a
    chunk; bytes that are neither are never read by HDF5 (free space) and are
    left as holes.
    """

    size: int
    metadata: list[tuple[int, bytes]]
    chunks: list[ChunkExtent]

    def metadata_bytes(self) -> int:
        """How many bytes of the output are metadata (what the planner must write itself)."""
        return sum(len(data) for _, data in self.metadata)

    def pieces(self) -> Iterator[tuple[int, int, bytes | ChunkExtent]]:
        """``(offset, length, what)`` of every metadata run and chunk, in file order."""
        merged: list[tuple[int, int, bytes | ChunkExtent]] = [
            (offset, len(data), data) for offset, data in self.metadata]
        merged += [(c.offset, c.length, c) for c in self.chunks]
        yield from sorted(merged, key=lambda piece: piece[0])


@dataclass
class LayoutImage(io.RawIOBase):
    """The file libhdf5 writes an output into while its layout is planned.

    Metadata writes are kept (and read back, as libhdf5 rereads what it
    wrote); a write that is a placeholder (:meth:`placeholder`) is recorded as
    a chunk extent and not kept. A metadata write that contains a placeholder's
    mark (libhdf5 merged raw data into a larger write) is refused: the layout
    would not know where the chunk lies.
    """

    mark: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    _runs: dict[int, bytearray] = field(default_factory=dict)
    chunks: list[ChunkExtent] = field(default_factory=list)
    _position: int = 0
    _size: int = 0

    def placeholder(self, tag: int, length: int) -> bytes:
        """The bytes to write in place of chunk ``tag``, whose stored size is ``length``."""
        if length < PLACEHOLDER_HEAD:
            # A chunk shorter than the head is metadata-sized: the planner writes it itself.
            raise ValueError(f"chunk {tag} of {length} bytes is too short for a placeholder")
        return self.mark + tag.to_bytes(8, "little") + bytes(length - PLACEHOLDER_HEAD)

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def truncate(self, size: int | None = None) -> int:
        self._size = self._position if size is None else size
        return self._size

    def write(self, data: Any) -> int:
        data = bytes(data)
        start = self._position
        if len(data) >= PLACEHOLDER_HEAD and data.startswith(self.mark):
            self.chunks.append(ChunkExtent(start, len(data),
                                           int.from_bytes(data[16:PLACEHOLDER_HEAD], "little")))
        elif self.mark in data:
            raise BadCheckpointError("libhdf5 wrote a planned chunk together with other bytes: "
                                     "the output's layout cannot be fixed")
        else:
            self._keep(start, data)
        self._position = start + len(data)
        self._size = max(self._size, self._position)
        return len(data)

    def _keep(self, start: int, data: bytes) -> None:
        """Keep ``data`` at ``start``, over whatever was kept there (runs stay disjoint)."""
        end = start + len(data)
        merged = bytearray(data)
        for offset in [o for o, run in self._runs.items() if o <= end and o + len(run) >= start]:
            run = self._runs.pop(offset)
            if offset < start:
                merged[0:0] = run[:start - offset]
                start = offset
            if offset + len(run) > end:
                merged += run[end - offset:]
                end = offset + len(run)
        self._runs[start] = merged

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        start, length = self._position, len(view)
        view[:] = bytes(length)
        for offset, run in self._runs.items():
            low, high = max(offset, start), min(offset + len(run), start + length)
            if low < high:
                view[low - start:high - start] = run[low - offset:high - offset]
        self._position += length
        return length

    def layout(self) -> Layout:
        """The layout of what was written: metadata runs outside every chunk, chunks by offset."""
        chunks = sorted(self.chunks, key=lambda c: c.offset)
        starts = [c.offset for c in chunks]
        metadata = []
        for offset, run in sorted(self._runs.items()):
            # libhdf5 may have written metadata, then reused the space for a chunk.
            pieces = [(offset, bytes(run))]
            for c in chunks[max(0, bisect_right(starts, offset) - 1):]:
                if c.offset >= offset + len(run):
                    break
                pieces = [cut for piece in pieces for cut in _without(piece, c)]
            metadata += [p for p in pieces if p[1]]
        return Layout(self._size, metadata, chunks)


def _without(piece: tuple[int, bytes], chunk: ChunkExtent) -> list[tuple[int, bytes]]:
    offset, data = piece
    low, high = chunk.offset - offset, chunk.offset + chunk.length - offset
    if high <= 0 or low >= len(data):
        return [piece]
    return [(offset, data[:max(low, 0)]), (chunk.offset + chunk.length, data[max(high, 0):])]


def plan_layout(build: Callable[[h5py.File, LayoutImage], None], **file_options: Any) -> Layout:
    """The layout of the file ``build`` writes through h5py into a :class:`LayoutImage`.

    ``build(file, image)`` creates the output's objects and writes each
    chunk with ``write_direct_chunk(offset, image.placeholder(tag, size), mask)``.
    """
    image = LayoutImage()
    with h5py.File(image, "w", **file_options) as out:
        build(out, image)
    return image.layout()


def assemble(layout: Layout, out_fd: int,
             source_of: Callable[[ChunkExtent], tuple[int, int]]) -> int:
    """Write the output ``layout`` describes into ``out_fd``; return the bytes copied.

    ``source_of(chunk)`` names the open file and offset holding a chunk's
    stored bytes; they are copied by ``copy_file_range`` (in the kernel, or
    shared extents on filesystems that can).
    """
    os.ftruncate(out_fd, layout.size)
    copied = 0
    for offset, data in layout.metadata:
        os.pwrite(out_fd, data, offset)
    for chunk in layout.chunks:
        fd, start = source_of(chunk)
        done = 0
        while done < chunk.length:
            moved = os.copy_file_range(fd, out_fd, chunk.length - done, start + done,
                                       chunk.offset + done)
            if moved == 0:
                raise BadCheckpointError(f"a source ended before chunk {chunk.tag}'s "
                                         f"{chunk.length} bytes")
            done += moved
        copied += chunk.length
    return copied


def check_chunk_map(dataset: h5py.Dataset, planned: dict[tuple[int, ...], ChunkExtent],
                    masks: dict[tuple[int, ...], int]) -> list[str]:
    """What differs between a dataset's chunk index and the chunks planned for it.

    ``planned`` maps each chunk's logical offset to its extent, ``masks`` to its
    filter mask. Read from the file's metadata only: no chunk is read.
    """
    problems = []
    dsid = dataset.id
    found = {tuple(info.chunk_offset): info
             for info in chunk_index(dsid, dataset.chunks, dataset.shape).values()}
    for where in sorted(set(found) | set(planned)):
        info, plan = found.get(where), planned.get(where)
        if info is None or plan is None:
            problems.append(f"chunk {where} of {dataset.name} is "
                            + ("not in the file" if info is None else "not planned"))
        elif (info.byte_offset, info.size, info.filter_mask) != (plan.offset, plan.length,
                                                                  masks.get(where, 0)):
            problems.append(f"chunk {where} of {dataset.name} lies at {info.byte_offset} "
                            f"({info.size} bytes, mask {info.filter_mask}), planned at "
                            f"{plan.offset} ({plan.length} bytes, mask {masks.get(where, 0)})")
    return problems
