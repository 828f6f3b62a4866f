"""Committing checkpoint files to a log, and bringing a run back from it.

Core operations (no Celery) used by the commit task, the ``chkq log``
commands and the watcher. A checkpoint file is committed under the name it
has in its run directory (``run_chk00003.h5`` or
``run_chk00003/thread_0001.h5``): a name entry of its own in the log (see
:class:`chkq.log.NameEntry`), which is how ``restore`` puts it back — every
name, even when two files have the same bytes.

Files written here (restore, pull) never follow a symbolic link planted in
the output directory: directories are walked one name at a time with
``O_NOFOLLOW``, data goes to a randomly named temporary created with
``O_CREAT|O_EXCL|O_NOFOLLOW``, and is then linked (restore: never replacing)
or renamed (pull) into place, which acts on the name itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chkq.errors import (  # noqa: F401 (re-exported)
    CheckpointCorruptionError,
    FileChangedError,
    NothingToRestoreError,
    ParentNotCommittedError,
)
from chkq.log import (
    CheckpointLog,
    CheckpointRecord,
    NameEntry,
    check_relative_name,
    checkpoint_id,
    model_of_name,
)
from chkq.rundir import CREATE, DIRECTORY, READ_NONBLOCK

__all__ = [
    "FileChangedError",
    "ParentNotCommittedError",
    "RestoreResult",
    "check_relative_name",
    "commit_bytes",
    "read_stable",
    "resolve_id",
    "restore_run",
    "single_head",
    "write_output",
]

_DIR_FLAGS = DIRECTORY
_TEMP_FLAGS = CREATE
_READ_FLAGS = READ_NONBLOCK


def read_stable(path: str | Path) -> bytes:
    """Read a whole file, refusing one that changes while it is read.

    Size and modification time are compared before and after the read; a
    simulation still writing the file makes them differ.

    Raises
    ------
    FileChangedError
        If the file changed during the read.
    """
    before = os.stat(path)
    with open(path, "rb") as fh:
        data = fh.read()
    after = os.stat(path)
    if (before.st_size, before.st_mtime_ns, before.st_ino) != (
        after.st_size, after.st_mtime_ns, after.st_ino
    ) or len(data) != after.st_size:
        raise FileChangedError(f"checkpoint file {str(path)!r} changed while it was read")
    return data


def resolve_id(log: CheckpointLog, ref: str) -> str:
    """Turn a full id or a unique prefix (at least 6 hex digits) into a checkpoint id.

    Raises
    ------
    KeyError
        If no checkpoint, or more than one, matches.
    """
    if len(ref) == 64 and ref in log:
        return ref
    if len(ref) < 6:
        raise KeyError(f"checkpoint id {ref!r} is too short (give at least 6 hex digits)")
    matches = [i for i in log.ids() if i.startswith(ref)]
    if len(matches) != 1:
        what = "no checkpoint" if not matches else f"{len(matches)} checkpoints"
        raise KeyError(f"{what} of run {log.run_id!r} match id {ref!r}")
    return matches[0]


def single_head(log: CheckpointLog) -> str | None:
    """The run's one head (None for an empty run); ValueError if it has several."""
    heads = log.heads()
    if len(heads) > 1:
        raise ValueError(
            f"run {log.run_id!r} has {len(heads)} heads; name the parent with --parent ID"
        )
    return heads[0].id if heads else None


def commit_bytes(
    log: CheckpointLog,
    data: bytes,
    *,
    parent: str | None = None,
    parent_head: bool = False,
    step: int | None = None,
    label: str | None = None,
    meta: dict[str, Any] | None = None,
    expect_id: str | None = None,
    name: str | None = None,
    model: str | None = None,
    writer: str | None = None,
) -> CheckpointRecord:
    """Commit ``data``; return its record.

    The file's ``name`` and ``model`` may come as arguments or, as the
    commit task sends them, as ``meta["name"]`` / ``meta["model"]``; either
    way they go into the file's :class:`~chkq.log.NameEntry`, not into the
    record (which describes content and is shared by every name of it).
    Without a model, the one a slug-style name says is kept.

    Raises
    ------
    ParentNotCommittedError
        If ``parent`` is not in the log yet (its commit may still be running).
    FileChangedError
        If ``expect_id`` is given and the bytes are not that checkpoint.
    """
    extra = dict(meta or {})
    name = name if name is not None else extra.pop("name", None)
    model = model if model is not None else extra.pop("model", None)
    extra.pop("name", None)
    extra.pop("model", None)
    if name is not None:
        check_relative_name(name)
        if model is None:
            model = model_of_name(name)
    if expect_id is not None and checkpoint_id(data) != expect_id:
        raise FileChangedError(
            f"the checkpoint's bytes no longer have id {expect_id} (the file changed)")
    if parent_head:
        parent = single_head(log)
    if parent is not None and parent not in log:
        raise ParentNotCommittedError(
            f"parent {parent} is not a checkpoint of run {log.run_id!r} (yet)")
    checkpoint = log.commit(data, parent, step=step, label=label, meta=extra or None,
                            name=name, model=model, writer=writer)
    return log.record(checkpoint)


# writing files without following planted links ----------------------------


def _open_dir_at(fd: int, name: str, *, create: bool, shown: str) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FileExistsError(
                f"{shown!r} is a symbolic link or not a directory; not followed") from None
        raise


@contextlib.contextmanager
def _directory(root_fd: int, parts: list[str], root: Path) -> Iterator[int]:
    """fd of ``root/parts...``, created as needed, never through a link."""
    fd = os.dup(root_fd)
    try:
        shown = root
        for part in parts:
            shown = shown / part
            child = _open_dir_at(fd, part, create=True, shown=str(shown))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _write_temp(dir_fd: int, data: bytes) -> str:
    """A new, randomly named, fsynced file in ``dir_fd`` holding ``data``; its name."""
    for _ in range(16):
        temp = f".chkq-{secrets.token_hex(12)}.tmp"
        try:
            fd = os.open(temp, _TEMP_FLAGS, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError("could not create a temporary file")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    os.close(fd)
    return temp


def _digest_at(dir_fd: int, name: str, shown: str) -> str | None:
    """SHA-256 of the regular file ``name`` in ``dir_fd`` (None if missing); links refused."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileExistsError(f"{shown!r} is a symbolic link; not overwritten") from None
        raise
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise FileExistsError(f"{shown!r} exists and is not a regular file")
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_output(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, replacing a file there (``chkq log pull -o``).

    The bytes go to a random ``O_EXCL|O_NOFOLLOW`` temporary next to
    ``path``, are fsynced and renamed over ``path``; a symbolic link at
    ``path`` is replaced, not written through.
    """
    target = Path(path).absolute()
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        temp = _write_temp(dir_fd, data)
        try:
            os.replace(temp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


@dataclass
class RestoreResult:
    """What :func:`restore_run` did.

    Attributes
    ----------
    written
        Files written.
    kept
        Files that were already there with the right bytes.
    bytes_written
        Bytes of the files written.
    failed
        ``(name, why)`` of files that could not be restored.
    malformed
        Store keys of records or entries that could not be read, with why.
    """

    out_dir: Path
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    bytes_written: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    malformed: dict[str, str] = field(default_factory=dict)

    @property
    def restored(self) -> list[Path]:
        """Every file now in place with its committed bytes, in name order."""
        return sorted(self.written + self.kept)

    def summary(self) -> str:
        """One line: what was restored, where."""
        text = (f"restored {len(self.written)} file(s), {self.bytes_written} bytes, "
                f"into {self.out_dir}")
        if self.kept:
            text += f" ({len(self.kept)} already there)"
        return text


def restore_run(
    log: CheckpointLog,
    out_dir: str | Path,
    model: str | None = None,
    *,
    on_file: Callable[[Path], None] | None = None,
) -> RestoreResult:
    """Write every file of the run back under its name in ``out_dir``.

    Each name's latest entry is restored; with ``model``, only files of that
    model (:meth:`chkq.log.NameEntry.model_matches`). A file that already
    exists with the same bytes is kept; one with other bytes, or a symbolic
    link, is an error for that file (nothing is overwritten, no link is
    followed). Files appear atomically. A file whose record or payload is
    damaged is reported in ``failed`` and the others are still restored.

    Raises
    ------
    NothingToRestoreError
        If the run has no named files, or none of ``model``; nothing is written.
    """
    records = log.manifest()
    files = log.files(model, records)
    result = RestoreResult(Path(out_dir).absolute(), malformed=dict(log.malformed))
    if not files:
        every = log.files(None, records)
        if model is not None and every:
            models = sorted({e.model or model_of_name(e.name) or "?" for e in every.values()})
            raise NothingToRestoreError(
                f"run {log.run_id!r} has no files of model {model!r} "
                f"(its models: {', '.join(models)})")
        raise NothingToRestoreError(f"run {log.run_id!r} has no named files to restore")
    result.out_dir.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(result.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, entry in files.items():
            try:
                path = _restore_one(log, root_fd, result.out_dir, name, entry, result)
            except (CheckpointCorruptionError, KeyError, FileExistsError) as exc:
                why = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
                result.failed.append((name, why))
                continue
            if on_file is not None:
                on_file(path)
    finally:
        os.close(root_fd)
    return result


def _restore_one(log: CheckpointLog, root_fd: int, root: Path, name: str, entry: NameEntry,
                 result: RestoreResult) -> Path:
    parts = name.split("/")
    target = root.joinpath(*parts)
    with _directory(root_fd, parts[:-1], root) as dir_fd:
        if _digest_at(dir_fd, parts[-1], str(target)) == entry.id:
            result.kept.append(target)
            return target
        data = log.load(entry.id)
        temp = _write_temp(dir_fd, data)
        try:
            os.link(temp, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                    follow_symlinks=False)
        except FileExistsError:
            if _digest_at(dir_fd, parts[-1], str(target)) == entry.id:
                result.kept.append(target)
                return target
            raise FileExistsError(
                f"{str(target)!r} exists with other content; not overwritten") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        os.fsync(dir_fd)
    result.written.append(target)
    result.bytes_written += len(data)
    return target
