"""Pinned objects fetched into a local directory laid out as a run directory.

:func:`fetch_objects` writes what :func:`~chkq.staging.listing.find_store_run`
pinned, refusing any byte that is not of the pinned version and any name that
would put a file outside the directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkq.consolidation.discovery import (
    check_out_dir,
)
from chkq.consolidation.stamps import FileStamp
from chkq.core_settings import CoreSettings
from chkq.errors import (
    BadNameError,
    CheckpointChangedError,
    CheckpointCorruptionError,
    OutputExistsError,
    OutputWriteError,
    SymlinkInRunError,
)
from chkq.fsutil import WRITE_ERRNOS, describe_filesystem
from chkq.log import CheckpointLog, check_relative_name
from chkq.rundir import CREATE, DIRECTORY, READ_NONBLOCK
from chkq.staging.listing import (
    SourceObject,
    StoreRun,
    checkpoint_member,
    open_run_log,
    open_run_store,
)
from chkq.stores.base import CheckpointStore, ObjectVersion

__all__ = ["FETCH_BYTES", "FetchedFile", "changed_error", "check_room", "fetch_objects"]


#: Writes an object's mirror into an open file: ``(store, key, pinned, fd)``, giving the
#: bytes it fetched and the digest that seals it.
Mirror = Callable[[CheckpointStore, str, ObjectVersion, int], tuple[int, str]]

FETCH_BYTES = 32 << 20
"""Bytes of a plain object read at a time: a fetch holds no more of it in memory."""


@dataclass(frozen=True)
class FetchedFile:
    """One file as a fetch left it in the job's run directory: what its record says of it.

    Attributes
    ----------
    name
        Its name inside the run directory.
    size
        Its size in bytes (the pinned size).
    sha256
        The SHA-256 of its bytes, as written (or found in place).
    stamp
        Its identity in the run directory (``chkq.consolidation.stamps.FileStamp``
        as a list: size, mtime, ctime, inode, device), which planning compares
        with the file it scans.
    """

    name: str
    size: int
    sha256: str
    stamp: list[int]

    def to_record(self) -> list[Any]:
        return [self.name, self.size, self.sha256, *self.stamp]

    @classmethod
    def from_record(cls, entry: Any) -> FetchedFile:
        """The file a fetch record's entry describes (TypeError/ValueError if malformed)."""
        if not isinstance(entry, list) or len(entry) != 8:
            raise ValueError(f"not a fetched file: {entry!r}")
        name, size, digest, *stamp = entry
        if not (isinstance(name, str) and isinstance(digest, str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in [size, *stamp])):
            raise TypeError(f"not a fetched file: {entry!r}")
        return cls(name, size, digest, stamp)


def changed_error(url: str) -> CheckpointChangedError:
    """The refusal of the object at ``url``: not the pinned version (any more)."""
    return CheckpointChangedError(
        f"checkpoint file {url!r} changed since the job was planned (replaced, "
        "rewritten or deleted in the store): nothing of it was used")


def _changed(run: StoreRun, name: str) -> CheckpointChangedError:
    return changed_error(run.url_of(name))


@contextlib.contextmanager
def _parent_dir(root_fd: int, root: Path, parts: list[str],
                made: list[tuple[int, str, bool]]) -> Iterator[int]:
    """fd of the directory holding ``parts[-1]`` under ``root_fd``, made if missing, no link.

    Directories made here are appended to ``made`` as ``(parent fd, name, True)``.
    """
    fd = os.dup(root_fd)
    try:
        shown = root
        for part in parts[:-1]:
            shown = shown / part
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                made.append((os.dup(fd), part, True))
            except FileExistsError:
                pass
            try:
                child = os.open(part, DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SymlinkInRunError(
                        f"{str(shown)!r} is a symbolic link or not a directory: nothing is "
                        "fetched through it") from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _new_temp(dir_fd: int, mode: int) -> tuple[str, int]:
    """A new, randomly named file (``O_EXCL|O_NOFOLLOW``) in ``dir_fd`` with ``mode``: name, fd."""
    while True:
        name = f".chkq-{secrets.token_hex(12)}.tmp"
        try:
            fd = os.open(name, CREATE, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
        os.fchmod(fd, mode & 0o777)
        return name, fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _pinned_pieces(store: CheckpointStore, run: StoreRun, obj: SourceObject
                   ) -> Iterator[bytes]:
    """The object's pinned bytes, :data:`FETCH_BYTES` at a time.

    Every read is made against the pin, whose version fixes the size too, so
    the object cannot have grown. One that is not the pinned version (any
    more) is refused, naming its URL.
    """
    for piece in store.read_pinned(obj.key, ObjectVersion(obj.size, obj.version), FETCH_BYTES):
        if piece is None:
            raise _changed(run, obj.name)
        yield piece


def _copy_plain(store: CheckpointStore, run: StoreRun, obj: SourceObject, fd: int) -> str:
    """Write the object's pinned bytes to ``fd``; return their SHA-256."""
    digest = hashlib.sha256()
    for piece in _pinned_pieces(store, run, obj):
        digest.update(piece)
        _write_all(fd, piece)
    return digest.hexdigest()


def _digest_of(fd: int) -> str:
    """The SHA-256 of the file open at ``fd``, read from its start."""
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, FETCH_BYTES, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def _load_entry(log: CheckpointLog, run: StoreRun, obj: SourceObject) -> bytes:
    """The verified bytes of a log entry's checkpoint."""
    try:
        data = log.load(obj.version)
    except CheckpointCorruptionError as exc:
        raise CheckpointCorruptionError(f"{run.url_of(obj.name)}: {exc}") from exc
    except KeyError:
        raise _changed(run, obj.name) from None
    if len(data) != obj.size:
        raise _changed(run, obj.name)
    return data


def check_room(run: StoreRun, objects: Sequence[SourceObject], into: Path) -> None:
    """Refuse to fetch ``objects`` into ``into`` unless its filesystem has room for them.

    The sizes are the pinned ones, which every read is held to: an object
    that declares more bytes than the scratch directory has free (a sparse
    file of a ``file://`` store, say, which holds no blocks where it lies)
    is refused here, naming it, before a byte of it is written, rather than
    filling the disk.

    Raises
    ------
    OutputWriteError
        (``ENOSPC``) naming the largest object and the filesystem.
    """
    if not objects:
        return
    needed = sum(obj.size for obj in objects)
    info = os.statvfs(into)
    free = info.f_bavail * info.f_frsize
    if needed <= free:
        return
    largest = max(objects, key=lambda o: o.size)
    raise OutputWriteError(
        errno.ENOSPC,
        f"checkpoint file {run.url_of(largest.name)!r} declares {largest.size:,} bytes "
        f"({len(objects)} file(s) to fetch: {needed:,} bytes), more than the {free:,} bytes "
        f"free in the scratch directory {str(into)!r} ({describe_filesystem(into)}): "
        "nothing is fetched (a sparse or oversized object, or a scratch directory too "
        "small: see CHKQ_SCRATCH_DIR)")


def fetch_objects(run: StoreRun, names: Sequence[str], into: Path,
                  fetched: list[FetchedFile] | None = None, *,
                  core: CoreSettings | None = None, mirror: Mirror | None = None) -> int:
    """Write the run's files ``names`` into the directory ``into``, each under its name.

    Each file appears whole or not at all: its bytes go to a random
    ``O_EXCL|O_NOFOLLOW`` temporary in its directory, are fsynced, and are
    hard-linked into place, never replacing a file and never through a
    symbolic link. Plain objects are read :data:`FETCH_BYTES` at a time, each
    read pinned to the version listed (:meth:`CheckpointStore.get_range_pinned`);
    a log entry's checkpoint is loaded whole (at most
    ``CHKQ_LOG_MAX_CHECKPOINT_BYTES``) and verified by its SHA-256. A file is
    made with mode 0600, or its log entry's mode. A file already in place
    with exactly the pinned bytes is kept (a fetch delivered again after it
    was killed); anything else there is refused. If any file fails, the
    files and directories this call made are removed again: ``into`` is left
    as it was. Before anything is written, the files' pinned sizes must fit
    in the free space of ``into``'s filesystem (:func:`check_room`).

    ``fetched``, if given, receives what each file is once in place
    (:class:`FetchedFile`: its size, SHA-256 and identity), in order.

    With ``mirror``, a plain object is fetched as ``mirror`` writes it (a
    metadata mirror, :func:`chkq.consolidation.mirror.sealed_mirror`: every
    chunk of its raw datasets a hole, for a job that copies its rows from the
    store by range), sealed by the digest it gives (``mirror:HEX``); what an
    earlier delivery left at its name in the private workspace is mirrored
    again, and no room is asked for the holes.

    Returns
    -------
    int
        Bytes written (not counting files kept).

    Raises
    ------
    CheckpointChangedError
        If an object is not the version listed any more, naming its URL.
    CheckpointCorruptionError
        If a log checkpoint's stored bytes do not rebuild it, naming it.
    OutputExistsError
        If something other than the pinned bytes is at a file's name in
        ``into`` (it is never overwritten, nor a link followed).
    OutputWriteError
        If the files do not fit in ``into``, or a write fails for want of
        space, naming the object and the filesystem.
    BadNameError
        If a name is not one of the run's files.
    """
    by_name = {obj.name: obj for obj in run.objects}
    for name in names:
        if name not in by_name or checkpoint_member(run.model, name) is None:
            raise BadNameError(f"{name!r} is not a checkpoint file of {run.source!r}")
        check_relative_name(name)
    root = check_out_dir(into)
    if mirror is None:
        check_room(run, [by_name[n] for n in names if not _same_size_there(root, by_name[n])],
                   root)
    store = open_run_store(run.store_url, core)
    # A fetch loads its checkpoints in run order: the one before each (a delta's base, most
    # often) is all the log's cache needs to hold.
    largest = max((by_name[name].size for name in names), default=0)
    log = None if run.run_id is None else open_run_log(store, run.run_id, core,
                                                       cache_bytes=2 * largest)
    made: list[tuple[int, str, bool]] = []
    written = 0
    root_fd = os.open(root, DIRECTORY)
    try:
        for name in names:
            try:
                size, done = _fetch_one(store, log, run, by_name[name], root_fd, root, made,
                                        mirror if log is None else None)
            except OSError as exc:
                if exc.errno in WRITE_ERRNOS and not isinstance(exc, OutputWriteError):
                    raise OutputWriteError(
                        exc.errno, f"cannot fetch checkpoint file {run.url_of(name)!r} "
                        f"({by_name[name].size:,} bytes) into {str(root / name)!r}: "
                        f"{os.strerror(exc.errno)} ({describe_filesystem(root)})") from None
                raise
            written += size
            if fetched is not None:
                fetched.append(done)
    except BaseException:
        for parent, made_name, is_dir in reversed(made):
            with contextlib.suppress(OSError):
                if is_dir:
                    os.rmdir(made_name, dir_fd=parent)
                else:
                    os.unlink(made_name, dir_fd=parent)
        raise
    finally:
        for parent, _, _ in made:
            os.close(parent)
        os.close(root_fd)
    return written


def _same_size_there(root: Path, obj: SourceObject) -> bool:
    """Whether a regular file of the object's size is at its name already (fetched before)."""
    try:
        found = os.lstat(root.joinpath(*obj.name.split("/")))
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_size == obj.size


def _placed(obj: SourceObject, dir_fd: int, name: str, digest: str) -> FetchedFile:
    """What the file ``name`` of ``dir_fd`` is now (not following a link)."""
    found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    return FetchedFile(obj.name, obj.size, digest, FileStamp.of(found).as_list())


def _fetch_one(store: CheckpointStore, log: CheckpointLog | None, run: StoreRun,
               obj: SourceObject, root_fd: int, root: Path,
               made: list[tuple[int, str, bool]], mirror: Mirror | None = None
               ) -> tuple[int, FetchedFile]:
    """Fetch one file (or its mirror): bytes written and what it is in place; what is made is
    appended to ``made`` as (parent fd, name, is a dir)."""
    parts = obj.name.split("/")
    target = root.joinpath(*parts)
    with _parent_dir(root_fd, root, parts, made) as dir_fd:
        if mirror is not None:
            return _mirror_one(store, run, obj, dir_fd, parts[-1], made, mirror)
        kept = _already_there(store, log, run, obj, dir_fd, target)
        if kept is not None:
            return 0, _placed(obj, dir_fd, parts[-1], kept)
        if log is None and store.supports_links:
            try:
                linked = _linked(store, run, obj, dir_fd, parts[-1])
            except FileExistsError:
                return 0, _placed_meanwhile(store, log, run, obj, dir_fd, target)
        else:
            linked = False
        if linked:
            made.append((os.dup(dir_fd), parts[-1], False))
            os.fsync(dir_fd)
            fd = os.open(parts[-1], READ_NONBLOCK, dir_fd=dir_fd)
            try:
                digest = _digest_of(fd)
            finally:
                os.close(fd)
            return obj.size, _placed(obj, dir_fd, parts[-1], digest)
        temp, fd = _new_temp(dir_fd, obj.mode)
        try:
            try:
                if log is None:
                    digest = _copy_plain(store, run, obj, fd)
                else:
                    _write_all(fd, _load_entry(log, run, obj))
                    digest = obj.version
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(temp, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except FileExistsError:
                return 0, _placed_meanwhile(store, log, run, obj, dir_fd, target)
            made.append((os.dup(dir_fd), parts[-1], False))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        os.fsync(dir_fd)
        return obj.size, _placed(obj, dir_fd, parts[-1], digest)


def _mirror_one(store: CheckpointStore, run: StoreRun, obj: SourceObject, dir_fd: int,
                name: str, made: list[tuple[int, str, bool]], mirror: Mirror
                ) -> tuple[int, FetchedFile]:
    """Write the object's metadata mirror at ``name`` of ``dir_fd``, replacing an earlier one.

    Raises
    ------
    OutputExistsError
        If what is at ``name`` is not a regular file (a link, a directory).
    """
    with contextlib.suppress(FileNotFoundError):
        found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode):
            raise OutputExistsError(f"{name!r} in the job's workspace is not a file: refused")
        os.unlink(name, dir_fd=dir_fd)
    temp, fd = _new_temp(dir_fd, obj.mode)
    try:
        try:
            fetched, seal = mirror(store, obj.key, ObjectVersion(obj.size, obj.version), fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        made.append((os.dup(dir_fd), name, False))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
    os.fsync(dir_fd)
    return fetched, _placed(obj, dir_fd, name, "mirror:" + seal)


def _placed_meanwhile(store: CheckpointStore, log: CheckpointLog | None, run: StoreRun,
                      obj: SourceObject, dir_fd: int, target: Path) -> FetchedFile:
    """The file another delivery of the same fetch put at ``target`` while this one fetched.

    A worker restarted under its name is handed its unfinished tasks at once,
    while a pool process of the killed one may still be fetching the same
    object: whichever links its copy second keeps the first's, if it holds
    the pinned bytes.

    Raises
    ------
    OutputExistsError
        If what is there is not the object's pinned bytes.
    """
    kept = _already_there(store, log, run, obj, dir_fd, target)
    if kept is None:
        raise OutputExistsError(f"{str(target)!r} came and went while it was fetched; a "
                                "fetch never overwrites")
    return _placed(obj, dir_fd, target.name, kept)


def _linked(store: CheckpointStore, run: StoreRun, obj: SourceObject, dir_fd: int,
            name: str) -> bool:
    """Fetch a local store's object by a hard link to its pinned file; False if it cannot be.

    A store on the scratch directory's filesystem then costs no copy. An
    object that is no longer the pinned version fails the fetch, as a read
    would; one the kernel will not link (another filesystem, another user's
    file under ``fs.protected_hardlinks``) is copied instead.

    Raises
    ------
    FileExistsError
        If ``name`` exists (another delivery of the fetch linked it first).
    """
    try:
        if store.link_to(obj.key, ObjectVersion(obj.size, obj.version), dir_fd, name):
            return True
    except FileExistsError:
        raise
    except OSError:
        return False
    raise _changed(run, obj.name)


def _already_there(store: CheckpointStore, log: CheckpointLog | None, run: StoreRun,
                   obj: SourceObject, dir_fd: int, target: Path) -> str | None:
    """The SHA-256 of ``target`` if it holds exactly the object's pinned bytes (a fetch
    delivered again); None if nothing is there.

    A log entry's file is compared by SHA-256, a plain object's with its
    pinned bytes, read again.

    Raises
    ------
    OutputExistsError
        If something else is there: other bytes, a link, not a regular file.
    """
    refusal = OutputExistsError(
        f"{str(target)!r} exists and is not {run.url_of(obj.name)!r} as pinned; a fetch "
        "never overwrites")
    try:
        fd = os.open(target.name, READ_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refusal from None
        raise
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        found = os.fstat(fh.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_size != obj.size:
            raise refusal
        if log is not None:
            while block := fh.read(FETCH_BYTES):
                digest.update(block)
            if digest.hexdigest() != obj.version:
                raise refusal
            return obj.version
        for piece in _pinned_pieces(store, run, obj):
            if fh.read(len(piece)) != piece:
                raise refusal
            digest.update(piece)
    return digest.hexdigest()


# --------------------------------------------------------------------------- after the job
