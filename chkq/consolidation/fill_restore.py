"""A recreated dataset's fill made what its template's says, after chunks were allocated without it.

The skeleton allocates a recreated dataset's chunks with no fill value
written over them (the copy writes every row), which HDF5 allows only by
storing the fill time "never". Here the template's fill time is written
back into the dataset's object header, in place (:func:`restore_fill_time`:
the message keeps its size, a version 2 block its lookup3 checksum), and
the parts of edge chunks past the extent, which readers take to hold the
fill value, are made to read as zeros (:func:`zero_edge_chunks`).
"""

from __future__ import annotations

import errno
import os

import numpy as np

_MASK = 0xFFFFFFFF


def _rotate(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def lookup3(data: bytes) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data`` (initial value 0).

    The checksum HDF5 keeps at the end of every block of a version 2
    object header.
    """
    length = len(data)
    a = b = c = (0xDEADBEEF + length) & _MASK
    at = 0
    while length > 12:
        a = (a + int.from_bytes(data[at:at + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[at + 4:at + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[at + 8:at + 12], "little")) & _MASK
        a = ((a - c) & _MASK) ^ _rotate(c, 4)
        c = (c + b) & _MASK
        b = ((b - a) & _MASK) ^ _rotate(a, 6)
        a = (a + c) & _MASK
        c = ((c - b) & _MASK) ^ _rotate(b, 8)
        b = (b + a) & _MASK
        a = ((a - c) & _MASK) ^ _rotate(c, 16)
        c = (c + b) & _MASK
        b = ((b - a) & _MASK) ^ _rotate(a, 19)
        a = (a + c) & _MASK
        c = ((c - b) & _MASK) ^ _rotate(b, 4)
        b = (b + a) & _MASK
        at += 12
        length -= 12
    if length == 0:
        return c
    tail = data[at:] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    c = ((c ^ b) - _rotate(b, 14)) & _MASK
    a = ((a ^ c) - _rotate(c, 11)) & _MASK
    b = ((b ^ a) - _rotate(a, 25)) & _MASK
    c = ((c ^ b) - _rotate(b, 16)) & _MASK
    a = ((a ^ c) - _rotate(c, 4)) & _MASK
    b = ((b ^ a) - _rotate(a, 14)) & _MASK
    c = ((c ^ b) - _rotate(b, 24)) & _MASK
    return c


#: Object header message types: the fill value (the one with the fill time) and a continuation.
_FILL_MESSAGE, _CONTINUATION = 0x05, 0x10
#: A message's flag that it is stored in the file's shared message table, not in the header.
_SHARED = 0x02


class Unpatchable(Exception):
    """An object header that :func:`restore_fill_time` does not rewrite (shared fill message)."""


Block = tuple[int, bytearray, int, int, bool, int]


def _header_blocks(fd: int, base: int, address: int, sizes: tuple[int, int]) -> list[Block]:
    """The blocks of the object header at ``address``: ``(offset, bytes, first, end, v2, step)``.

    ``bytes`` is the whole block as read from ``offset`` (a file offset),
    its messages lie in ``bytes[first:end]``, each after a ``step``-byte
    header; ``v2`` says whether the block ends in a checksum. ``base`` is
    the file's base address (the userblock's size), ``sizes`` the file's
    sizes of addresses and lengths.
    """
    head = os.pread(fd, 64, base + address)
    if head[:4] == b"OHDR":
        flags = head[5]
        at = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 0x03)
        size = int.from_bytes(head[at:at + width], "little")
        first = at + width
        block = bytearray(os.pread(fd, first + size + 4, base + address))
        step = 6 if flags & 0x04 else 4
        blocks = [(base + address, block, first, first + size, True, step)]
    elif head[0] == 1:
        size = int.from_bytes(head[8:12], "little")
        block = bytearray(os.pread(fd, 16 + size, base + address))
        step = 8
        blocks = [(base + address, block, 16, 16 + size, False, step)]
    else:
        raise Unpatchable(f"object header version {head[0]}")
    v2 = blocks[0][4]
    done = 0
    while done < len(blocks):
        _offset, block, at, end, _, _ = blocks[done]
        done += 1
        while at + step <= end:
            if v2:
                kind, size = block[at], int.from_bytes(block[at + 1:at + 3], "little")
            else:
                kind, size = (int.from_bytes(block[at:at + 2], "little"),
                              int.from_bytes(block[at + 2:at + 4], "little"))
            data = at + step
            if kind == _CONTINUATION:
                where = int.from_bytes(block[data:data + sizes[0]], "little")
                length = int.from_bytes(block[data + sizes[0]:data + sizes[0] + sizes[1]],
                                        "little")
                more = bytearray(os.pread(fd, length, base + where))
                if v2 and more[:4] != b"OCHK":
                    raise Unpatchable("a continuation block without its signature")
                blocks.append((base + where, more, 4 if v2 else 0,
                               length - 4 if v2 else length, v2, step))
            at = data + size
    return blocks


def restore_fill_time(fd: int, base: int, address: int, sizes: tuple[int, int],
                      fill_time: int) -> None:
    """Store ``fill_time`` in the fill value message of the object header at ``address``.

    The message keeps its size (the fill time is two bits or one byte of
    it), so only its bytes and the block's checksum change; nothing else
    of the file moves. The file must be closed by HDF5.

    Raises
    ------
    Unpatchable
        If the header has no fill value message of its own (a shared one
        would change every dataset sharing it) or one of an unknown version.
    """
    for offset, block, at, end, v2, step in _header_blocks(fd, base, address, sizes):
        while at + step <= end:
            if v2:
                kind, size, flags = (block[at], int.from_bytes(block[at + 1:at + 3], "little"),
                                     block[at + 3])
            else:
                kind, size, flags = (int.from_bytes(block[at:at + 2], "little"),
                                     int.from_bytes(block[at + 2:at + 4], "little"),
                                     block[at + 4])
            data = at + step
            if kind == _FILL_MESSAGE:
                if flags & _SHARED:
                    raise Unpatchable("a shared fill value message")
                version = block[data]
                if version in (1, 2):
                    block[data + 2] = fill_time
                elif version == 3:
                    block[data + 1] = (block[data + 1] & ~0x0C) | (fill_time << 2)
                else:
                    raise Unpatchable(f"fill value message version {version}")
                if v2:
                    block[end:end + 4] = lookup3(bytes(block[:end])).to_bytes(4, "little")
                os.pwrite(fd, bytes(block), offset)
                return
            at = data + size
    raise Unpatchable("no fill value message")


def zero_edge_chunks(fd: int, chunk: tuple[int, ...], shape: tuple[int, ...], size: int,
                     offsets: list[int]) -> None:
    """Make the elements past the extent in ``dsid``'s edge chunks read as zeros.

    HDF5 takes elements past a dataset's extent in its stored chunks to
    hold the fill value (growing the dataset shows them); chunks allocated
    without writing the fill hold whatever the file held there: a hole,
    which reads as zeros (the default fill), or freed space. Edge chunks
    that are not holes are written with zeros before the copy writes
    their rows. ``chunk`` and ``shape`` are the dataset's, ``size`` a
    chunk's bytes, ``offsets`` its chunks'
    (:func:`chkq.consolidation.skeleton.chunk_offsets`).
    """
    grid = [-(-n // c) for n, c in zip(shape, chunk, strict=True)]
    for coords, offset in zip(np.ndindex(*grid), offsets, strict=True):
        if all((i + 1) * c <= n for i, c, n in zip(coords, chunk, shape, strict=True)):
            continue
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: nothing but holes from ``offset`` on
                raise
            continue
        if data < offset + size:
            os.pwrite(fd, bytes(size), offset)
