"""Committing checkpoint files to a log, and bringing a run back from it.

Core operations (no Celery) used by the commit task, the ``chkq log``
commands and the watcher. :class:`CommitOptions` is the one definition of how
a file is committed, for every layer: the task's message carries it, the
in-process path and the clients build it. A checkpoint file is committed under the name it
has in its run directory (``run_chk00003.h5`` or
``run_chk00003/thread_0001.h5``): a name entry of its own in the log (see
:class:`chkq.log.NameEntry`), which is how ``restore`` puts it back — every
name, even when two files have the same bytes.

Files written here (restore, pull) never follow a symbolic link planted in
the output directory: directories are walked one name at a time with
``O_NOFOLLOW``, data goes to a randomly named temporary created with
``O_CREAT|O_EXCL|O_NOFOLLOW``, and is then linked into place (never
replacing a file; ``pull --force`` renames over it), which acts on the name
itself.  They are never more readable than the files committed: a restored
file gets the permission bits its name entry kept (``0600`` for entries
that kept none), without setuid, setgid or sticky bits.

A run's consolidated outputs come back with :func:`restore_outputs`, as
``<MODEL>.h5``: streamed from the store in ranged pieces into the temporary
(memory holds one piece), checked against the output entry's size and
SHA-256, and linked into place only if they match, so a damaged object
leaves no file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from chkq.errors import (  # noqa: F401 (re-exported)
    AmbiguousParentError,
    BadMessageError,
    BadMessageTypeError,
    CheckpointCorruptionError,
    CheckpointNotFoundError,
    FileChangedError,
    NothingToRestoreError,
    OutputCorruptionError,
    OutputEntryError,
    OutputExistsError,
    ParentNotCommittedError,
    SourceNotFoundError,
)
from chkq.fsutil import write_temp
from chkq.log import (
    CheckpointLog,
    CheckpointRecord,
    NameEntry,
    OutputEntry,
    check_output_model,
    check_relative_name,
    checkpoint_id,
    format_created,
    model_of_name,
)
from chkq.log.files import digest_at, directory_at, put_file, write_output
from chkq.log.reader import OUTPUT_PIECE_BYTES
from chkq.rundir import READ_NONBLOCK

__all__ = [
    "CommitOptions",
    "FileChangedError",
    "ParentNotCommittedError",
    "RestoreResult",
    "check_relative_name",
    "commit_bytes",
    "pull_mode",
    "read_stable",
    "resolve_id",
    "restore_outputs",
    "restore_run",
    "single_head",
    "write_output",
]



def read_stable(path: str | Path) -> tuple[bytes, int]:
    """Read the regular file at ``path``, refusing one that changes while it is read.

    Returns the bytes and the opened file's ``st_mode`` (its permission bits
    are kept in the name entry, for restore).

    The file is opened with O_NOFOLLOW|O_NONBLOCK and checked with fstat, so
    a link swapped in after a check is not followed and a FIFO or device can
    neither block the reader nor be read. Size and mtime are compared before
    and after the read, as a simulation still writing the file changes them.

    Raises
    ------
    FileNotFoundError
        If there is no regular file at ``path``.
    FileChangedError
        If the file changed during the read.
    """
    try:
        fd = os.open(path, READ_NONBLOCK)
    except FileNotFoundError:
        raise SourceNotFoundError(f"checkpoint file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise SourceNotFoundError(
            f"checkpoint file {str(path)!r} cannot be opened as a regular file: "
            f"{exc.strerror}") from None
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):
        os.close(fd)
        raise SourceNotFoundError(f"checkpoint file {str(path)!r} is not a regular file")
    with open(fd, "rb", closefd=True) as fh:
        data = fh.read()
        after = os.fstat(fh.fileno())
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) \
            or len(data) != after.st_size:
        raise FileChangedError(f"checkpoint file {str(path)!r} changed while it was read")
    return data, before.st_mode


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
        raise CheckpointNotFoundError(
            f"checkpoint id {ref!r} is too short (give at least 6 hex digits)")
    matches = [i for i in log.ids() if i.startswith(ref)]
    if len(matches) != 1:
        what = "no checkpoint" if not matches else f"{len(matches)} checkpoints"
        raise CheckpointNotFoundError(f"{what} of run {log.run_id!r} match id {ref!r}")
    return matches[0]


def single_head(log: CheckpointLog) -> str | None:
    """The run's one head (None for an empty run); ValueError if it has several."""
    heads = log.heads()
    if len(heads) > 1:
        raise AmbiguousParentError(
            f"run {log.run_id!r} has {len(heads)} heads; name the parent with --parent ID"
        )
    return heads[0].id if heads else None


_CHECKPOINT_ID = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CommitOptions:
    """How a checkpoint is committed: everything but the log, the bytes and their file.

    The one definition of a commit's options, shared by :func:`commit_bytes`,
    the ``chkq.commit`` task (whose keyword arguments are :meth:`to_json`),
    the in-process commit and the clients that send the task. Every value is
    checked when the options are made, so a wrong one is refused, naming the
    field, before anything is read or written; a message is untrusted input,
    and :meth:`from_json` is how the task reads one.

    Attributes
    ----------
    parent
        Id of the checkpoint this one is committed on.
    parent_head
        Commit on the run's one head (an error if it has several).
    step, label
        Annotations kept in the record.
    name
        The file's name relative to its run directory, kept (with ``model``)
        in a name entry of its own so that restore puts it back there.
    model
        The model the file belongs to; without one, the model a slug-style
        name says.
    expect_id
        The id the bytes must have (what a watcher hashed): a file changed
        since is refused.
    writer
        Who commits, kept in the record. Not sent in a task message: the
        worker records itself.
    meta
        Further record metadata (``name``/``model`` found here are taken as
        those fields). Not sent in a task message.
    """

    parent: str | None = field(default=None, metadata={"id": True})
    parent_head: bool = False
    step: int | None = None
    label: str | None = None
    name: str | None = None
    model: str | None = None
    expect_id: str | None = field(default=None, metadata={"id": True})
    writer: str | None = field(default=None, metadata={"local": True})
    meta: Mapping[str, Any] | None = field(default=None, metadata={"local": True})

    def __post_init__(self) -> None:
        hints = _field_kinds()
        for item in fields(self):
            value = getattr(self, item.name)
            kind = hints[item.name]
            if value is None and item.default is None:
                continue
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise BadMessageTypeError(
                    f"commit {item.name} must be {kind.__name__}, got {type(value).__name__}")
            if item.metadata.get("id") and not _CHECKPOINT_ID.fullmatch(str(value)):
                raise BadMessageError(
                    f"commit {item.name} {value!r} is not a checkpoint id (64 hex digits)")
        if self.name is not None:
            check_relative_name(self.name)

    @classmethod
    def wire_fields(cls) -> tuple[str, ...]:
        """The fields a ``chkq.commit`` message carries, as keyword arguments."""
        return tuple(f.name for f in fields(cls) if not f.metadata.get("local"))

    def to_json(self) -> dict[str, Any]:
        """The task message's keyword arguments (JSON types only; no local-only field)."""
        return {name: getattr(self, name) for name in self.wire_fields()}

    @classmethod
    def from_json(cls, data: Any) -> CommitOptions:
        """Options from a task message's keyword arguments, every one checked.

        Raises
        ------
        BadMessageTypeError
            For keyword arguments that are not a JSON object, an argument that
            is not a commit option (or is local-only), or a value of the wrong type.
        BadMessageError
            For a parent or ``expect_id`` that is not a checkpoint id, or a
            name that is not a relative path inside a run directory.
        """
        if not isinstance(data, Mapping):
            raise BadMessageTypeError(
                f"commit options must be a JSON object, got {type(data).__name__}")
        unknown = sorted(str(key) for key in data if key not in cls.wire_fields())
        if unknown:
            raise BadMessageTypeError(
                f"commit got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        return cls(**data)

    @classmethod
    def of(cls, options: CommitOptions | None = None, **changes: Any) -> CommitOptions:
        """``options`` (default: none set) with the fields named in ``changes`` replaced.

        How the functions that take options also take them as keyword arguments.

        Raises
        ------
        TypeError
            For a keyword that is not a field, naming it; or a value of the wrong type.
        """
        unknown = sorted(set(changes) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unexpected commit option(s) {', '.join(map(repr, unknown))}")
        base = options if options is not None else cls()
        return replace(base, **changes) if changes else base


@functools.cache
def _field_kinds() -> dict[str, type]:
    """The runtime class each :class:`CommitOptions` field's annotation allows (None aside)."""
    kinds = {}
    for name, hint in get_type_hints(CommitOptions).items():
        allowed = [a for a in get_args(hint) if a is not type(None)] or [hint]
        kinds[name] = get_origin(allowed[0]) or allowed[0]
    return kinds


def commit_bytes(
    log: CheckpointLog,
    data: bytes,
    options: CommitOptions | None = None,
    *,
    mode: int | None = None,
    **changes: Any,
) -> CheckpointRecord:
    """Commit ``data`` with ``options`` (or its fields as keyword arguments); return its record.

    The file's ``name`` and ``model`` go into the file's
    :class:`~chkq.log.NameEntry`, not into the record (which describes content
    and is shared by every name of it); given in ``meta`` instead, they are
    taken from there. Without a model, the one a slug-style name says is
    kept. ``mode`` is the file's ``st_mode`` (its permission bits are kept for
    restore).

    Raises
    ------
    ParentNotCommittedError
        If the parent is not in the log yet (its commit may still be running).
    FileChangedError
        If ``expect_id`` is given and the bytes are not that checkpoint.
    """
    wanted = CommitOptions.of(options, **changes)
    extra = dict(wanted.meta or {})
    name = wanted.name if wanted.name is not None else extra.pop("name", None)
    model = wanted.model if wanted.model is not None else extra.pop("model", None)
    extra.pop("name", None)
    extra.pop("model", None)
    if name is not None:
        check_relative_name(name)
        if model is None:
            model = model_of_name(name)
    if wanted.expect_id is not None and checkpoint_id(data) != wanted.expect_id:
        raise FileChangedError(
            f"the checkpoint's bytes no longer have id {wanted.expect_id} (the file changed)")
    parent = single_head(log) if wanted.parent_head else wanted.parent
    if parent is not None and parent not in log:
        raise ParentNotCommittedError(
            f"parent {parent} is not a checkpoint of run {log.run_id!r} (yet)")
    checkpoint = log.commit(data, parent, step=wanted.step, label=wanted.label,
                            meta=extra or None, name=name, model=model,
                            writer=wanted.writer, mode=mode)
    return log.record(checkpoint)


def pull_mode(log: CheckpointLog, checkpoint: str) -> int:
    """Permission bits for a pulled copy of ``checkpoint``: those every name of it allows.

    The intersection of the modes its name entries kept (``0600`` for an
    entry that kept none, or a checkpoint without names).
    """
    mode = 0o777
    named = False
    for entry in log.entries():
        if entry.id == checkpoint:
            mode &= entry.file_mode
            named = True
    return mode if named else 0o600


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
        ``(name, why)`` of files that could not be restored, a name in
        conflict (see :meth:`chkq.log.CheckpointLog.files`) included.
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
            text += (f"; {len(self.kept)} file(s) already there with their committed bytes "
                     "were kept, not rewritten")
        return text


def restore_run(
    log: CheckpointLog,
    out_dir: str | Path,
    model: str | None = None,
    *,
    on_file: Callable[[Path], None] | None = None,
    on_kept: Callable[[Path], None] | None = None,
) -> RestoreResult:
    """Write every file of the run back under its name in ``out_dir``.

    ``on_file`` hears of each file as it is in place; with ``on_kept``, a file that
    was already there with its committed bytes goes to ``on_kept`` instead.

    Each name's entry chosen by :meth:`chkq.log.CheckpointLog.files` is
    restored (a name in conflict, or rolled back against what the log's
    reader saw before, is not, and is reported in ``failed``); with
    ``model``, only files of that model (:meth:`chkq.log.NameEntry.model_matches`).
    A file gets the permission bits its entry kept (:attr:`NameEntry.file_mode`).
    A file that already exists with the same bytes is kept; one with other
    bytes, or a symbolic link, is an error for that file (nothing is overwritten, no link is
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
    for name, found in sorted(log.conflicts.items()):
        ids = ", ".join(f"{e.id[:12]} (created {format_created(e.created)})" for e in found)
        result.failed.append((name, f"conflicting entries name different checkpoints: {ids}; "
                              "not restored, since without trusted log keys any of them may "
                              "have been planted (pull the one you mean with chkq log pull)"))
    for name, why in sorted(log.rollbacks.items()):
        result.failed.append((name, f"{why}; not restored (the store's history of the name "
                              "is not the one this reader saw)"))
    if not files and not result.failed:
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
            except (CheckpointCorruptionError, KeyError, OSError) as exc:
                why = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
                result.failed.append((name, why))
                continue
            _tell(path, path in result.kept[-1:], on_file, on_kept)
    finally:
        os.close(root_fd)
    return result


def _restore_one(log: CheckpointLog, root_fd: int, root: Path, name: str, entry: NameEntry,
                 result: RestoreResult) -> Path:
    parts = name.split("/")
    target = root.joinpath(*parts)
    with directory_at(root_fd, parts[:-1], root) as dir_fd:
        if digest_at(dir_fd, parts[-1], str(target)) == entry.id:
            result.kept.append(target)
            return target
        data = log.load(entry.id)
        if not put_file(dir_fd, parts[-1], str(target), data, entry.id, entry.file_mode):
            result.kept.append(target)
            return target
    result.written.append(target)
    result.bytes_written += len(data)
    return target


def restore_outputs(
    log: CheckpointLog,
    out_dir: str | Path,
    model: str | None = None,
    *,
    on_file: Callable[[Path], None] | None = None,
    piece: int = OUTPUT_PIECE_BYTES,
    on_kept: Callable[[Path], None] | None = None,
) -> RestoreResult:
    """Write the run's recorded consolidated outputs (``model``'s only) to ``out_dir/<MODEL>.h5``.

    Each output object is read in ranged pieces of ``piece`` bytes
    (:meth:`CheckpointLog.read_output`) straight into a temporary next to its
    target and linked into place only once its size and SHA-256 are its
    entry's: an object that is missing, changed or damaged leaves no file and
    is reported in ``failed``, as is an output entry that cannot be used.
    A file already at the target with the entry's bytes is kept (told to ``on_kept``
    when given, else to ``on_file`` as a file restored is); any other
    file, or a link, is never replaced. Files are created ``0600``.

    Raises
    ------
    NothingToRestoreError
        If the run has no recorded output (of ``model``); nothing is written.
    OutputEntryError
        If ``model``'s entry is malformed or refused for its signature.
    """
    if model is not None:
        found = log.output(check_output_model(model))
        entries = [] if found is None else [found]
    else:
        entries = log.outputs()
    result = RestoreResult(Path(out_dir).absolute(), malformed=dict(log.malformed))
    prefix = log.keys.group("outputs")
    result.failed.extend((key, why) for key, why in sorted(log.malformed.items())
                         if key.startswith(prefix))
    if not entries and not result.failed:
        which = f" of model {model!r}" if model is not None else ""
        models = ", ".join(e.model for e in log.outputs()) if model is not None else ""
        raise NothingToRestoreError(
            f"run {log.run_id!r} has no recorded output{which}"
            + (f" (its outputs: {models})" if models else ""))
    result.out_dir.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(result.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for entry in entries:
            name = f"{entry.model}.h5"
            target = result.out_dir / name
            try:
                written = _put_output(log, root_fd, name, str(target), entry, piece)
            except (OutputCorruptionError, OutputEntryError, OSError) as exc:
                result.failed.append((name, str(exc)))
                continue
            if written:
                result.written.append(target)
                result.bytes_written += entry.size
            else:
                result.kept.append(target)
            _tell(target, not written, on_file, on_kept)
    finally:
        os.close(root_fd)
    return result


def _tell(path: Path, kept: bool, on_file: Callable[[Path], None] | None,
          on_kept: Callable[[Path], None] | None) -> None:
    """Call ``on_file(path)``, or ``on_kept(path)`` for a file kept when that is given."""
    hear = on_kept if kept and on_kept is not None else on_file
    if hear is not None:
        hear(path)


def _put_output(log: CheckpointLog, dir_fd: int, name: str, shown: str, entry: OutputEntry,
                piece: int) -> bool:
    """Stream ``entry``'s object to ``name`` in ``dir_fd``, verified; False if already there."""
    if digest_at(dir_fd, name, shown) == entry.sha256:
        return False
    temp = write_temp(dir_fd, log.read_output(entry, piece), 0o600)
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        if digest_at(dir_fd, name, shown) == entry.sha256:
            return False
        raise OutputExistsError(f"{shown!r} exists with other content; not overwritten"
                                ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
    os.fsync(dir_fd)
    return True
