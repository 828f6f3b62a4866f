"""One piece of the merge as one transaction on the output, undone from any instant.

HDF5 writes a file's metadata in place, when it closes the file: a writer
killed midway leaves old and new metadata mixed. A piece of the merge
holds the output alone (:func:`hold_output`) and has HDF5 write through a
:class:`PieceJournal` (:func:`open_for_merge`), which keeps an undo
journal beside the output until the piece's writes are durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
from h5py import h5f, h5fd, h5p

from chkq.consolidation.h5types import hdf5_library
from chkq.consolidation.plan import Plan
from chkq.consolidation.rowio import ByteCopier
from chkq.errors import BadCheckpointError, MergeError
from chkq.rundir import CREATE, RunDir

log = logging.getLogger(__name__)


#: Bytes kept of a write :meth:`PieceJournal.replace_later` drops (what it is checked by).
HEAD_KEPT = 64

#: How long a piece waits for an earlier writer of the output to go: a node killed while
#: it fsynced the output keeps it until the disk answers.
LOCK_WAIT_SECONDS = 60.0

#: Opening the output for a piece: reading and writing, no link followed.
READ_WRITE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def hold_output(fd: int, plan: Plan, wait: float | None = None) -> None:
    """Hold the output open as ``fd`` for this piece alone (an exclusive ``flock``).

    The job's records let one piece run at a time, but a writer of an
    earlier delivery on a node that was killed can outlive it a while (a
    process killed inside ``fsync`` goes only when the disk answers; a
    broker hands its message on as soon as the node's connection drops).
    Its lock goes with it, and the piece waits for that, up to ``wait``
    seconds (:data:`LOCK_WAIT_SECONDS`). HDF5's own file lock, which
    refuses at once, is not used: the output is opened through this
    descriptor (:class:`PieceJournal`).

    Raises
    ------
    MergeError
        If the output is still held after ``wait`` seconds.
    """
    deadline = time.monotonic() + (LOCK_WAIT_SECONDS if wait is None else wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise MergeError(
                    f"the temporary output of job {plan.job_id} ({str(plan.job.temp)!r}) is "
                    "still held by another process after "
                    f"{LOCK_WAIT_SECONDS if wait is None else wait:.0f} s (a merge of an "
                    "earlier delivery that has not ended?); the job goes no further") from None
            time.sleep(0.05)


class PieceJournal:
    """The output as HDF5 sees it during one piece of the merge, changed as one transaction.

    HDF5 writes a file's metadata in place, when it closes the file: a
    writer killed midway leaves old and new metadata mixed, which no later
    open can read or extend. Here HDF5 writes through this object (h5py's
    file-object driver) and never opens the file itself. The output's size
    when the piece starts is its committed length: bytes written past it
    (new chunks, heaps, metadata) go to the file at once, since undoing
    them is a truncation; overwrites of committed bytes are held here, and
    reads see them. At :meth:`commit` the committed bytes about to be
    overwritten are saved into an undo journal (a file beside the output,
    renamed into place once complete and fsynced), then the held writes
    are applied and the output is fsynced, then the journal is removed.
    :meth:`roll_back`, which every piece calls first, puts a journal's
    saved bytes back and truncates the output to its committed length.
    A piece is thus undone from any instant until its journal is removed,
    and from then on it is done.
    """

    MAGIC = b"chkq merge undo journal 1\n"
    _HEAD = struct.Struct("<QQ")
    _ENTRY = struct.Struct("<QQ")

    def __init__(self, run: RunDir, path: Path, fd: int) -> None:
        self.run, self.path, self.fd = run, path, fd
        self.committed = self.size = os.fstat(fd).st_size
        self.position = 0
        self.held: list[tuple[int, bytes]] = []
        self.copier = ByteCopier()
        self.replaced: dict[int, int] = {}
        self.dropped: dict[int, bytes] = {}

    # -- the journal's life

    def roll_back(self) -> bool:
        """Undo what a killed piece did to the output, if it left a journal; whether it did."""
        self.run.unlink(self._staging)
        try:
            jfd = self.run.open_file(self.path)
        except FileNotFoundError:
            return False
        with os.fdopen(jfd, "rb") as fh:
            raw = fh.read()
        committed, regions = self._parse(raw)
        for offset, data in regions:
            _pwrite_all(self.fd, data, offset)
        os.ftruncate(self.fd, committed)
        os.fsync(self.fd)
        self.run.unlink(self.path)
        self.run.fsync()
        self.committed = self.size = committed
        log.info("merge piece of %r undone from its journal (%d regions, committed length %d)",
                 str(self.run.path), len(regions), committed)
        return True

    def begin(self) -> None:
        """Record the committed length before anything is written past it."""
        self.committed = self.size = os.fstat(self.fd).st_size
        self.held = []
        self._write_journal([])

    def commit(self) -> None:
        """Make the piece's writes the output's, durably, and remove the journal."""
        regions = _union([(offset, len(data)) for offset, data in self.held])
        if self.size < self.committed:
            regions = _union([*regions, (self.size, self.committed - self.size)])
        self._write_journal([(offset, _pread_all(self.fd, length, offset))
                             for offset, length in regions])
        for offset, data in self.held:
            _pwrite_all(self.fd, data, offset)
        if self.size < self.committed:
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        self.held = []
        self.run.unlink(self.path)
        self.run.fsync()
        self.committed = self.size

    @property
    def _staging(self) -> Path:
        return self.path.with_name(self.path.name + ".new")

    def _write_journal(self, regions: list[tuple[int, bytes]]) -> None:
        body = bytearray(self.MAGIC + self._HEAD.pack(self.committed, len(regions)))
        for offset, data in regions:
            body += self._ENTRY.pack(offset, len(data)) + data
        body += hashlib.sha256(body).digest()
        self.run.unlink(self._staging)
        jfd = self.run.open_file(self._staging, CREATE)
        try:
            _pwrite_all(jfd, bytes(body), 0)
            os.fsync(jfd)
        finally:
            os.close(jfd)
        self.run.rename(self._staging, self.path)
        self.run.fsync()

    def _parse(self, raw: bytes) -> tuple[int, list[tuple[int, bytes]]]:
        """The committed length and saved regions of a journal (BadCheckpointError if not one)."""
        bad = BadCheckpointError(f"the merge journal {str(self.path)!r} of the job is not one it "
                                 "wrote: the run directory was changed; submit the job again")
        body, digest = raw[:-32], raw[-32:]
        if (len(raw) < len(self.MAGIC) + self._HEAD.size + 32 or not body.startswith(self.MAGIC)
                or hashlib.sha256(body).digest() != digest):
            raise bad
        at = len(self.MAGIC)
        committed, count = self._HEAD.unpack_from(body, at)
        at += self._HEAD.size
        regions = []
        for _ in range(count):
            if at + self._ENTRY.size > len(body):
                raise bad
            offset, length = self._ENTRY.unpack_from(body, at)
            at += self._ENTRY.size
            if offset + length > committed or at + length > len(body):
                raise bad
            regions.append((offset, body[at:at + length]))
            at += length
        if at != len(body):
            raise bad
        return committed, regions

    # -- the file object HDF5 writes through

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read_at(self.position, len(view))
        view[:len(data)] = data
        self.position += len(data)
        return len(data)

    def read_at(self, start: int, length: int) -> bytes:
        """The output's bytes ``[start, start + length)`` as this piece sees them (to its end)."""
        stop = min(start + length, self.size)
        if stop <= start:
            return b""
        data = bytearray(_pread_all(self.fd, stop - start, start))
        data += bytes(stop - start - len(data))
        if start < self.committed:
            for offset, held in self.held:
                lo, hi = max(start, offset), min(stop, offset + len(held))
                if lo < hi:
                    data[lo - start:hi - start] = held[lo - offset:hi - offset]
        return bytes(data)

    def copy_in(self, fd: int, offset_in: int, offset: int, count: int) -> None:
        """Copy ``count`` bytes of file ``fd`` from ``offset_in`` to ``offset`` of the output.

        Past the committed length in the kernel
        (:class:`chkq.consolidation.rowio.ByteCopier`: a roll-back's
        truncation undoes it); over committed bytes as a held write.
        """
        held = max(0, min(count, self.committed - offset))
        if held:
            data = _pread_all(fd, held, offset_in)
            if len(data) != held:
                raise BadCheckpointError("a checkpoint file ended while the merge read it")
            self.write_at(offset, data)
        if count > held:
            self.copier.copy(fd, offset_in + held, self.fd, offset + held, count - held)
            self.size = max(self.size, offset + count)

    def replace_later(self, offset: int, size: int) -> None:
        """Drop HDF5's write of exactly ``size`` bytes at ``offset`` (past the committed length).

        Its first bytes are kept (:meth:`written_head`): the caller writes
        the bytes itself once HDF5 has closed the output (a placeholder
        heap collection, :class:`chkq.consolidation.heap_collections.HeapWriter`).
        """
        self.replaced[offset] = size

    def written_head(self, offset: int, length: int) -> bytes:
        """The first ``length`` bytes HDF5 wrote at ``offset``, whether or not they were dropped."""
        self.replaced.pop(offset, None)
        kept = self.dropped.pop(offset, None)
        return kept[:length] if kept is not None else self.read_at(offset, length)

    def write_at(self, offset: int, data: bytes) -> None:
        """:meth:`write` ``data`` at ``offset``, wherever HDF5 was."""
        position = self.position
        self.seek(offset)
        self.write(data)
        self.position = position

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, self.size - self.position)
        buffer = bytearray(size)
        return bytes(buffer[:self.readinto(buffer)])

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        start, stop = self.position, self.position + len(view)
        if start >= self.committed and self.replaced.get(start) == written:
            del self.replaced[start]
            self.dropped[start] = bytes(view[:HEAD_KEPT])
            self.size = max(self.size, stop)
            self.position = stop
            return written
        if start < self.committed:
            cut = min(stop, self.committed) - start
            self.held.append((start, bytes(view[:cut])))
            view, start = view[cut:], start + cut
        if len(view):
            _pwrite_all(self.fd, view, start)
        self.size = max(self.size, stop)
        self.position = stop
        return written

    def truncate(self, size: int | None = None) -> int:
        size = self.position if size is None else size
        os.ftruncate(self.fd, max(size, self.committed))
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing: the piece is made durable at :meth:`commit`."""


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges merged where they overlap or touch, in order."""
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
        elif length:
            merged.append([offset, length])
    return [(a, b) for a, b in merged]


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        length, offset = length - len(data), offset + len(data)
    return b"".join(parts)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@contextlib.contextmanager
def open_for_merge(journal: PieceJournal, libver: list[str]) -> Iterator[h5py.File]:
    """The output opened by HDF5 for one piece of the merge, writing through ``journal``.

    A file written under bounds of 1.10 or later (superblock version 3) is
    marked as open for writing while it is: the piece clears a mark that
    it finds (one a piece of an older chkq left, killed), as ``h5clear``
    does. The metadata cache holds every change of the piece until the
    file is closed (no eviction writes part of it earlier), so that the
    overwrites the journal holds are few and small.
    """
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fileobj_driver(h5fd.fileobj_driver, journal)
    fapl.set_libver_bounds(_LIBVER[libver[0]], _LIBVER[libver[1]])
    clear = ctypes.c_bool(True)
    if hdf5_library().H5Pset(ctypes.c_int64(fapl.id), b"clear_status_flags",
                                     ctypes.byref(clear)) < 0:
        raise RuntimeError("HDF5 has no file access property clear_status_flags")
    out = h5py.File(h5f.open(repr(journal).encode(), h5f.ACC_RDWR, fapl=fapl))
    try:
        config = out.id.get_mdc_config()
        config.evictions_enabled = False
        config.incr_mode = config.flash_incr_mode = config.decr_mode = 0
        out.id.set_mdc_config(config)
        yield out
    finally:
        out.close()
        del fapl


#: h5py's names of library version bounds, as HDF5's constants.
_LIBVER = {"earliest": h5f.LIBVER_EARLIEST, "v108": h5f.LIBVER_V18, "v110": h5f.LIBVER_V110,
           "v112": h5f.LIBVER_V112, "v114": h5f.LIBVER_V114, "v200": h5f.LIBVER_V200,
           "latest": h5f.LIBVER_LATEST}
