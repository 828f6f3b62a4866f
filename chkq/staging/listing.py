"""A run kept in a store, found and pinned: its checkpoint objects or a log run's named files.

:func:`find_store_run` lists them once and pins each (its size and the store's
version, or a log entry's checkpoint id), choosing the names discovery would
see in a run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chkq.consolidation.discovery import (
    Checkpoint,
    check_model_name,
    checkpoint_pattern,
    find_checkpoints,
    missing_numbers,
)
from chkq.core_settings import CoreSettings
from chkq.errors import (
    BadCheckpointError,
    BadNameError,
    CheckpointGapError,
    InvalidKeyError,
    NoCheckpointsError,
)
from chkq.log import CheckpointLog, check_relative_name
from chkq.log.keys import RunKeys
from chkq.stores.base import CheckpointStore, bucket_prefix, validate_key
from chkq.stores.url import parse_store_url

__all__ = ["SourceObject", "StoreRun", "checkpoint_member", "default_output_key", "find_store_run",
           "open_run_log", "open_run_store"]


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


def open_run_store(url: str, core: CoreSettings | None = None) -> CheckpointStore:
    """The store at ``url``; an error naming it if its bucket or directory is missing."""
    timeouts = None if core is None else core.timeouts
    store = parse_store_url(url).open(must_exist=True, timeouts=timeouts)
    store.check_available()
    return store


def open_run_log(store: CheckpointStore, run_id: str, core: CoreSettings | None,
                 cache_bytes: int) -> CheckpointLog:
    """Run ``run_id``'s log in ``store``: ``core``'s trust and size cap, else the environment's."""
    if core is None:
        return CheckpointLog(store, run_id, cache_bytes=cache_bytes)
    return CheckpointLog(store, run_id, cache_bytes=cache_bytes, trust=core.trust,
                         max_checkpoint=core.max_checkpoint)


def find_store_run(source: str, model: str, run: str | None = None, *,
                   allow_gaps: bool | None = None, core: CoreSettings | None = None) -> StoreRun:
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
    core
        Store waits and log trust (:meth:`chkq.config.settings.Settings.core`);
        None: the environment's (:class:`chkq.core_settings.CoreSettings`).

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
        return _find_log_run(source, model, run, allow_gaps=allow_gaps, core=core)
    location = parse_store_url(source)
    if location.local_root is not None:
        store_url, prefix = location.local_root.as_uri(), ""
    elif location.scheme == "memory":
        store_url, prefix = f"memory://{location.bucket}", ""
    else:
        store_url, prefix = f"{location.scheme}://{location.bucket}", \
            bucket_prefix(location.prefix)
    store = open_run_store(store_url, core)
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


def _find_log_run(source: str, model: str, run_id: str, *, allow_gaps: bool | None,
                  core: CoreSettings | None) -> StoreRun:
    store = open_run_store(source, core)
    log = open_run_log(store, run_id, core, cache_bytes=0)
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


def default_output_key(run: StoreRun) -> str:
    """Where the consolidated output goes in the run's store unless told otherwise.

    Plain objects: ``MODEL.h5`` beside them (under the prefix); a log run:
    ``runs/RUN/outputs/MODEL.h5``, outside the groups a log reads.
    """
    if run.run_id is None:
        return f"{run.prefix}{run.model}.h5"
    return RunKeys(run.run_id).output(run.model)
