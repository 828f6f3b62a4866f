"""A run whose checkpoints are objects in a store, fetched into a local run directory.

A run may keep its checkpoints in an object store instead of a shared
file system: plain objects under a key prefix (``s3://bucket/prefix/``,
``gs://bucket/prefix/``, ``file:///dir/``) named as a run directory's files
(``MODEL_chkNNNNN.h5`` or ``MODEL_chkNNNNN/<name>.h5``), or the named files of
one run of a checkpoint log. :func:`find_store_run` lists them once and pins
each (its size and the store's version, or a log entry's checkpoint id);
:func:`fetch_objects` writes them into a local directory laid out exactly as
a run directory, so that the consolidation code runs on it unchanged, and
refuses any byte that is not of the pinned version.

Store contents are untrusted: the names chosen are the ones discovery would
see in a run directory (:func:`chkq.consolidation.discovery.checkpoint_pattern`
and its rules for checkpoint directories), so that other objects are ignored
as a run directory's other files are, and no name can put a file outside the
directory it is fetched into. A ``file://`` store is a directory: its
checkpoints are found by :func:`chkq.consolidation.discovery.find_checkpoints`
itself, which refuses symbolic links.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from chkq.consolidation.discovery import (
    Checkpoint,
    check_model_name,
    check_out_dir,
    checkpoint_pattern,
    find_checkpoints,
    missing_numbers,
)
from chkq.errors import (
    BadCheckpointError,
    BadNameError,
    CheckpointChangedError,
    CheckpointCorruptionError,
    CheckpointGapError,
    InvalidKeyError,
    NoCheckpointsError,
    OutputExistsError,
    SymlinkInRunError,
    TransientStoreError,
)
from chkq.log import CheckpointLog, NameEntry, check_relative_name
from chkq.log.keys import RunKeys
from chkq.rundir import CREATE, DIRECTORY, READ_NONBLOCK
from chkq.stores.base import CheckpointStore, ObjectVersion, bucket_prefix, validate_key
from chkq.stores.local import LocalDirectoryStore
from chkq.stores.url import parse_store_url

__all__ = [
    "FETCH_BYTES",
    "SourceObject",
    "StoreRun",
    "default_output_key",
    "delete_sources",
    "fetch_objects",
    "find_store_run",
]

FETCH_BYTES = 32 << 20
"""Bytes of a plain object read at a time: a fetch holds no more of it in memory."""


@dataclass(frozen=True)
class SourceObject:
    """One file of a run in a store, pinned to the version the job was planned on.

    Attributes
    ----------
    name
        Its name inside the run directory: ``M_chk00001.h5`` or ``M_chk00001/w0.h5``.
    key
        The store key it is read from (for a log, its checkpoint's record key:
        the bytes are loaded through :class:`chkq.log.CheckpointLog`).
    size
        Its size in bytes.
    version
        What pins it: the store's version of a plain object (S3 ETag, GCS
        generation, a local file's inode and modification time), or the
        checkpoint id (SHA-256) of a log entry.
    mode
        Permission bits of the fetched file (a log entry's own, else 0600).
    """

    name: str
    key: str
    size: int
    version: str
    mode: int = 0o600


@dataclass(frozen=True)
class StoreRun:
    """A run's checkpoints in a store, as :func:`find_store_run` found and pinned them.

    Attributes
    ----------
    source
        The URL as the user gave it (for messages).
    store_url
        The store the keys are in (a bucket's root, a directory, or the log's store).
    prefix
        Plain objects: the key prefix of the run's objects (``""`` or ending
        in ``/``); a log: ``""``.
    run_id
        The log run, or None for plain objects.
    model
        The model whose checkpoints these are.
    objects
        The run's files, sorted by name.
    warnings
        What was accepted but is worth saying (a gap accepted, unreadable log entries).
    """

    source: str
    store_url: str
    prefix: str
    run_id: str | None
    model: str
    objects: tuple[SourceObject, ...]
    warnings: tuple[str, ...] = ()

    def url_of(self, name: str) -> str:
        """Where the file ``name`` of the run is, for messages."""
        if self.run_id is not None:
            return f"{self.store_url} (log run {self.run_id!r}) {name}"
        return f"{self.store_url}/{self.prefix}{name}"

    @property
    def names(self) -> list[str]:
        """The run's file names, in order."""
        return [o.name for o in self.objects]

    @property
    def size(self) -> int:
        """Bytes of all the run's files."""
        return sum(o.size for o in self.objects)


def checkpoint_member(model: str, name: str) -> tuple[int, bool] | None:
    """Whether a run directory's discovery would take ``name`` as a file of ``model``.

    ``name`` is a ``/``-separated path relative to the run directory. A
    checkpoint file ``MODEL_chkNNNNN.h5`` at the top gives ``(N, False)``; a
    ``.h5`` file not starting with ``.`` directly inside a checkpoint directory
    ``MODEL_chkNNNNN/`` gives ``(N, True)``; anything else (other names,
    deeper nesting, empty or ``..`` components) is None, as discovery
    ignores it.
    """
    parts = name.split("/")
    found = checkpoint_pattern(model).fullmatch(parts[0])
    if found is None:
        return None
    number = int(found.group(1))
    if found.group(2):
        return (number, False) if len(parts) == 1 else None
    if len(parts) != 2:
        return None
    member = parts[1]
    if not member.endswith(".h5") or member.startswith("."):
        return None
    return number, True


def _refuse_unholdable(run: StoreRun, name: str) -> None:
    """Refuse a checkpoint file whose name no run directory can hold or no store can read.

    Leaving it out would leave its rows out of the output without a word.
    """
    try:
        if run.run_id is None:
            validate_key(run.prefix + name)
        check_relative_name(name)
    except (InvalidKeyError, BadNameError) as exc:
        raise BadCheckpointError(
            f"checkpoint file {run.url_of(name)!r} cannot be fetched into a run directory: "
            f"{exc}") from None


def _select(run: StoreRun, found: dict[str, SourceObject], *, allow_gaps: bool | None,
            folders: frozenset[int] = frozenset()) -> StoreRun:
    """The run with the objects of ``found`` that discovery would take, checked as find_run.

    ``folders``: numbers of checkpoint directories known to exist (a store
    has a directory where a key has its name and a ``/`` after it). A file
    checkpoint wins over a directory of the same number; a checkpoint
    directory with no ``.h5`` file, no checkpoint at all, or a gap in the
    numbers (if ``allow_gaps`` is False) is refused naming the store.
    """
    pattern = checkpoint_pattern(run.model)
    files: dict[int, SourceObject] = {}
    dirs: dict[int, list[SourceObject]] = {number: [] for number in folders}
    for name, obj in found.items():
        matched = pattern.fullmatch(name.split("/", 1)[0])
        if matched is not None and not matched.group(2) and "/" in name:
            dirs.setdefault(int(matched.group(1)), [])
        member = checkpoint_member(run.model, name)
        if member is None:
            continue
        number, in_dir = member
        if in_dir:
            dirs[number].append(obj)
        else:
            files[number] = obj
    chosen: list[SourceObject] = []
    numbers = sorted(files.keys() | dirs.keys())
    for number in numbers:
        if number in files:
            chosen.append(files[number])
        elif dirs[number]:
            chosen.extend(sorted(dirs[number], key=lambda o: o.name))
        else:
            folder = f"{run.model}_chk{number:05d}/"
            raise BadCheckpointError(
                f"checkpoint directory {run.url_of(folder)!r} holds no .h5 file")
    where = repr(run.source) if run.run_id is None \
        else f"{run.source!r} (log run {run.run_id!r})"
    if not chosen:
        raise NoCheckpointsError(
            f"no checkpoints of model {run.model!r} in {where} "
            f"(expected {run.model}_chkNNNNN.h5 or {run.model}_chkNNNNN/<name>.h5)")
    for obj in chosen:
        _refuse_unholdable(run, obj.name)
    warnings = list(run.warnings)
    missing = missing_numbers([Checkpoint(n, Path(f"{run.model}_chk{n:05d}"), ())
                               for n in numbers])
    if missing and allow_gaps is not None:
        shown = ", ".join(f"{n:05d}" for n in missing[:20])
        if len(missing) > 20:
            shown += f" and {len(missing) - 20} more"
        what = (f"checkpoint(s) {shown} of model {run.model!r} are missing in {where} "
                f"(found {len(numbers)} between {numbers[0]:05d} and {numbers[-1]:05d})")
        if not allow_gaps:
            raise CheckpointGapError(
                f"{what}: their rows would be missing from the output; put them back, or "
                "accept the gap with --allow-gaps (Python: allow_gaps=True)")
        warnings.append(f"{what}: consolidated without them")
    return StoreRun(run.source, run.store_url, run.prefix, run.run_id, run.model,
                    tuple(sorted(chosen, key=lambda o: o.name)), tuple(warnings))


def _open_store(url: str) -> CheckpointStore:
    """The store at ``url``; an error naming it if its bucket or directory is missing."""
    store = parse_store_url(url).open(must_exist=True)
    store.check_available()
    return store


def find_store_run(source: str, model: str, run: str | None = None, *,
                   allow_gaps: bool | None = None) -> StoreRun:
    """List and pin the checkpoints of ``model`` in the store at ``source``.

    Parameters
    ----------
    source
        A store URL: ``s3://bucket/prefix/``, ``gs://bucket/prefix/``, ``file:///dir/``.
    model
        The model's name, as for a run directory.
    run
        With a run id, ``source`` holds a checkpoint log and the run's named
        files of ``model`` (:meth:`chkq.log.CheckpointLog.files`) are the
        checkpoints; without, the objects directly under the URL's prefix.
    allow_gaps
        Numbers missing between the first checkpoint and the last: False
        refuses them here, naming the store, before anything is fetched;
        True accepts them (said in :attr:`StoreRun.warnings`); None leaves
        them to ``find_run`` on the fetched directory, which the consolidation
        runs with its own ``allow_gaps``.

    Raises
    ------
    StoreNotFoundError
        If the bucket or directory does not exist, naming it.
    NoCheckpointsError
        If no checkpoint of ``model`` is there, naming the URL and the model.
    BadCheckpointError
        For a checkpoint directory without a ``.h5`` file, a checkpoint file
        whose name no run directory can hold, a symbolic link in a
        ``file://`` run, or log names whose entries conflict; naming them.
    CheckpointGapError
        For a gap in the numbers, if ``allow_gaps`` is False.
    """
    check_model_name(model)
    if run is not None:
        return _find_log_run(source, model, run, allow_gaps=allow_gaps)
    location = parse_store_url(source)
    if location.local_root is not None:
        store_url, prefix = location.local_root.as_uri(), ""
    elif location.scheme == "memory":
        store_url, prefix = f"memory://{location.bucket}", ""
    else:
        store_url, prefix = f"{location.scheme}://{location.bucket}", \
            bucket_prefix(location.prefix)
    store = _open_store(store_url)
    empty = StoreRun(source, store_url, prefix, None, model, ())
    if location.local_root is not None:
        found, folders = _local_objects(store, location.local_root, model)
        return _select(empty, found, allow_gaps=allow_gaps, folders=folders)
    listing = store.versions(prefix + f"{model}_chk")
    found = {key[len(prefix):]: SourceObject(key[len(prefix):], key, v.size, v.version)
             for key, v in listing.items()}
    return _select(empty, found, allow_gaps=allow_gaps)


def _local_objects(store: CheckpointStore, root: Path, model: str
                   ) -> tuple[dict[str, SourceObject], frozenset[int]]:
    """The checkpoint files discovery finds in the store's directory, with their versions,
    and the numbers of its checkpoint directories.

    Raises
    ------
    BadCheckpointError
        If a checkpoint is a symbolic link (as discovery refuses it).
    """
    found = {}
    folders = set()
    for checkpoint in find_checkpoints(root, model):
        if checkpoint.is_directory:
            folders.add(checkpoint.number)
        for path in checkpoint.files:
            name = path.relative_to(root).as_posix()
            try:
                version = store.version(name)
            except KeyError:
                continue
            except InvalidKeyError as exc:
                raise BadCheckpointError(
                    f"checkpoint file {str(path)!r} cannot be read through the store: "
                    f"{exc}") from None
            found[name] = SourceObject(name, name, version.size, version.version)
    return found, frozenset(folders)


def _find_log_run(source: str, model: str, run_id: str, *, allow_gaps: bool | None
                  ) -> StoreRun:
    store = _open_store(source)
    log = CheckpointLog(store, run_id, cache_bytes=0)
    records = log.manifest()
    sizes = {record.id: record.full_size for record in records}
    files = log.files(model, records)
    warnings = tuple(f"{key}: {why}" for key, why in sorted(log.malformed.items()))
    empty = StoreRun(source, store.url, "", log.run_id, model, (), warnings)
    conflicting = sorted(name for name in log.conflicts if checkpoint_member(model, name))
    if conflicting:
        raise BadCheckpointError(
            "conflicting entries name different checkpoints for "
            + ", ".join(repr(empty.url_of(name)) for name in conflicting)
            + ": without trusted log keys any of them may have been planted, so the run "
            "is not consolidated (pull the one you mean, or use trusted log keys)")
    found = {}
    for name, entry in files.items():
        if entry.id not in sizes:
            if checkpoint_member(model, name) is not None:
                raise BadCheckpointError(
                    f"checkpoint file {empty.url_of(name)!r} names checkpoint {entry.id}, "
                    "whose record is missing or unreadable")
            continue
        found[name] = SourceObject(name, log.record_key(entry.id), sizes[entry.id], entry.id,
                                   entry.file_mode)
    return _select(empty, found, allow_gaps=allow_gaps)


# --------------------------------------------------------------------------- fetching


def _changed(run: StoreRun, name: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"checkpoint file {run.url_of(name)!r} changed since the job was planned (replaced, "
        "rewritten or deleted in the store): nothing of it was used")


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
    the object cannot have grown; an empty object is asked once. One that is
    not the pinned version (any more) is refused, naming its URL.
    """
    pinned = ObjectVersion(obj.size, obj.version)
    offset = 0
    while offset < obj.size:
        piece = store.get_range_pinned(obj.key, pinned, offset,
                                       min(FETCH_BYTES, obj.size - offset))
        if not piece:
            raise _changed(run, obj.name)
        yield piece
        offset += len(piece)
    if obj.size == 0 and store.get_range_pinned(obj.key, pinned, 0, 1) != b"":
        raise _changed(run, obj.name)


def _copy_plain(store: CheckpointStore, run: StoreRun, obj: SourceObject, fd: int) -> None:
    """Write the object's pinned bytes to ``fd``."""
    for piece in _pinned_pieces(store, run, obj):
        _write_all(fd, piece)


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


def fetch_objects(run: StoreRun, names: Sequence[str], into: Path) -> int:
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
    as it was.

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
    BadNameError
        If a name is not one of the run's files.
    """
    by_name = {obj.name: obj for obj in run.objects}
    for name in names:
        if name not in by_name or checkpoint_member(run.model, name) is None:
            raise BadNameError(f"{name!r} is not a checkpoint file of {run.source!r}")
        check_relative_name(name)
    root = check_out_dir(into)
    store = _open_store(run.store_url)
    # A fetch loads its checkpoints in run order: the one before each (a delta's base, most
    # often) is all the log's cache needs to hold.
    largest = max((by_name[name].size for name in names), default=0)
    log = None if run.run_id is None else CheckpointLog(store, run.run_id,
                                                         cache_bytes=2 * largest)
    made: list[tuple[int, str, bool]] = []
    written = 0
    root_fd = os.open(root, DIRECTORY)
    try:
        for name in names:
            written += _fetch_one(store, log, run, by_name[name], root_fd, root, made)
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


def _fetch_one(store: CheckpointStore, log: CheckpointLog | None, run: StoreRun,
               obj: SourceObject, root_fd: int, root: Path,
               made: list[tuple[int, str, bool]]) -> int:
    """Fetch one file; what is made is appended to ``made`` as (parent fd, name, is a dir)."""
    parts = obj.name.split("/")
    target = root.joinpath(*parts)
    with _parent_dir(root_fd, root, parts, made) as dir_fd:
        if _already_there(store, log, run, obj, dir_fd, target):
            return 0
        if log is None and isinstance(store, LocalDirectoryStore) \
                and _linked(store, run, obj, dir_fd, parts[-1], target):
            made.append((os.dup(dir_fd), parts[-1], False))
            os.fsync(dir_fd)
            return obj.size
        temp, fd = _new_temp(dir_fd, obj.mode)
        try:
            try:
                if log is None:
                    _copy_plain(store, run, obj, fd)
                else:
                    _write_all(fd, _load_entry(log, run, obj))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(temp, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except FileExistsError:
                raise OutputExistsError(
                    f"{str(target)!r} exists; a fetch never overwrites") from None
            made.append((os.dup(dir_fd), parts[-1], False))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        os.fsync(dir_fd)
    return obj.size


def _linked(store: LocalDirectoryStore, run: StoreRun, obj: SourceObject, dir_fd: int,
            name: str, target: Path) -> bool:
    """Fetch a local store's object by a hard link to its pinned file; False if it cannot be.

    A store on the scratch directory's filesystem then costs no copy. An
    object that is no longer the pinned version fails the fetch, as a read
    would; one the kernel will not link (another filesystem, another user's
    file under ``fs.protected_hardlinks``) is copied instead.
    """
    try:
        if store.link_to(obj.key, ObjectVersion(obj.size, obj.version), dir_fd, name):
            return True
    except FileExistsError:
        raise OutputExistsError(f"{str(target)!r} exists; a fetch never overwrites") from None
    except OSError:
        return False
    raise _changed(run, obj.name)


def _already_there(store: CheckpointStore, log: CheckpointLog | None, run: StoreRun,
                   obj: SourceObject, dir_fd: int, target: Path) -> bool:
    """Whether ``target`` holds exactly the object's pinned bytes (a fetch delivered again).

    False if nothing is there. A log entry's file is compared by SHA-256, a
    plain object's with its pinned bytes, read again.

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
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refusal from None
        raise
    with os.fdopen(fd, "rb") as fh:
        found = os.fstat(fh.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_size != obj.size:
            raise refusal
        if log is not None:
            digest = hashlib.sha256()
            while block := fh.read(FETCH_BYTES):
                digest.update(block)
            if digest.hexdigest() != obj.version:
                raise refusal
            return True
        for piece in _pinned_pieces(store, run, obj):
            if fh.read(len(piece)) != piece:
                raise refusal
    return True


# --------------------------------------------------------------------------- after the job


def default_output_key(run: StoreRun) -> str:
    """Where the consolidated output goes in the run's store unless told otherwise.

    Plain objects: ``MODEL.h5`` beside them (under the prefix); a log run:
    ``runs/RUN/outputs/MODEL.h5``, outside the groups a log reads.
    """
    if run.run_id is None:
        return f"{run.prefix}{run.model}.h5"
    return RunKeys(run.run_id).output(run.model)


def delete_sources(run: StoreRun) -> list[str]:
    """Delete the run's source files from the store, each only if it is the version pinned.

    Plain objects: each object of :attr:`StoreRun.objects` still of its
    listed version is deleted; one that changed or is gone is left alone
    and warned of. A log run: payloads and records are never deleted (other
    names, and the run's history, may need them); the run's name entries
    of these files that name the pinned checkpoints are deleted, so that
    the names no longer restore, while every checkpoint stays loadable by
    id. Entries that name other checkpoints and names kept in records of
    the old format are left and warned of.

    Returns
    -------
    list of str
        Warnings: what was left in place, and why.
    """
    store = _open_store(run.store_url)
    if run.run_id is not None:
        return _delete_entries(store, run)
    warnings = []
    for obj in run.objects:
        try:
            current = store.version(obj.key)
        except KeyError:
            warnings.append(f"{run.url_of(obj.name)}: already gone")
            continue
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(obj.name)}: not deleted: {exc}")
            continue
        if current != ObjectVersion(obj.size, obj.version):
            warnings.append(f"{run.url_of(obj.name)}: changed since the job was planned; "
                            "not deleted")
            continue
        try:
            store.delete(obj.key)
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(obj.name)}: not deleted: {exc}")
    return warnings


def _delete_entries(store: CheckpointStore, run: StoreRun) -> list[str]:
    assert run.run_id is not None
    log = CheckpointLog(store, run.run_id, cache_bytes=0)
    pinned = {(obj.name, obj.version) for obj in run.objects}
    names = {obj.name for obj in run.objects}
    warnings = []
    others: dict[str, NameEntry] = {}
    for entry in log.entries():
        if entry.name not in names:
            continue
        if (entry.name, entry.id) not in pinned:
            others[entry.name] = entry
            continue
        if entry.legacy:
            warnings.append(f"{run.url_of(entry.name)}: named in its record (old format); "
                            "the name is kept")
            continue
        try:
            store.delete(log.entry_key(entry))
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(entry.name)}: name entry not deleted: {exc}")
    for name, entry in sorted(others.items()):
        warnings.append(f"{run.url_of(name)}: also names checkpoint {entry.id[:12]}, not the "
                        "one consolidated; that entry is kept")
    return warnings
