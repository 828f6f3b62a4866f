"""Following a running simulation whose checkpoints are in an object store: one version a task.

A follow of a store run (``chkq consolidate MODEL --from URL --follow``) is a
series of ``chkq.store_version`` tasks, each its own job (its id is the
task's), sent by the follower whenever the store's listing changed. The
first goes to any worker (``chkq.control``); it keeps the follow's
**workspace** in its scratch directory (``SCRATCH/follow-DIGEST``: the
fetched checkpoints, the current version, a state file) and every later
task goes to that worker's own queue, ``chkq.node.NODENAME``, as a store
job's steps do. Each task:

1. lists the run in the store and pins every object; fetches only the
   objects not fetched yet (each read against its pin, as a store job's
   fetch); an object that changed after a published version was made from
   it stops the follow, naming it;
2. finds how far the fetched checkpoints are complete
   (:func:`chkq.consolidation.versions.run_progress` on the workspace);
3. if more are, makes the next version in the workspace: the first by a
   whole consolidation in this process, each later one by extending the
   previous (:func:`chkq.consolidation.versions.publish_version`: the new
   checkpoints' rows only, proven);
4. uploads it create-if-absent as ``DEST.versions/NNNNNN.h5`` and, once its
   stored bytes are proven, its pointer ``NNNNNN.json``
   (:mod:`chkq.staging.follow_versions`); the last task of the follow
   publishes the final version at ``DEST`` instead, and its pointer.

``chkq.store_follow_end``, sent after a grace time, deletes the interim
versions and the workspace. A task that finds no workspace, or one behind the
store's newest pointer (its worker was lost, or another took the follow up),
resumes from the newest version in the store: fetched, checked against its
pointer, and every row it holds verified against the checkpoints before
a new version extends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h5py

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.discovery import check_model_name
from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.stamps import FileStamp
from chkq.consolidation.temporaries import check_job_id
from chkq.consolidation.versions import RunProgress, publish_version, run_progress
from chkq.errors import (
    BadCheckpointError,
    BadMessageTypeError,
    CheckpointChangedError,
    CheckpointGapError,
    HistoryChangedError,
    NoCheckpointsError,
    RunBusyError,
)
from chkq.fsutil import private_directory
from chkq.staging import StoreRun, checkpoint_member, fetch_objects, find_store_run
from chkq.staging.follow_upload import publish_version_file
from chkq.staging.follow_versions import (
    VersionPointer,
    fetch_version,
    interim_keys,
    latest_pointer,
    pointer_key,
    version_key,
    write_pointer,
)
from chkq.stores.base import CheckpointStore
from chkq.stores.url import open_store
from chkq.tasks.base import Checked, ChkqTask, task_lifecycle
from chkq.tasks.canvas import fail_signature
from chkq.tasks.from_store import (
    StoreDestinationExistsError,
    check_store_allowed,
    destination_of,
    own_queue,
)
from chkq.tasks.parties import admit_store_run, authorize_stage
from chkq.tasks.state import records

log = logging.getLogger("chkq.tasks")

#: The name of a follow's workspace in a worker's scratch directory starts with this.
WORKSPACE_PREFIX = "follow-"
#: The ``kind`` of a store version's result.
STORE_VERSION_KIND = "store-follow-version"


@dataclass
class FollowState:
    """What a follow's workspace holds, kept in its ``state.json`` (the worker's own file).

    ``pins``: each fetched file's name and the store version it was fetched at.
    ``number``: the last version whose pointer is in the store (0: none).
    ``local``: the number of the version in the workspace's ``MODEL.h5`` (ahead of
    ``number`` while it is not uploaded yet). ``through``: the last checkpoint it holds.
    ``record``: its version record (:func:`publish_version`'s), None after a whole
    consolidation or a resume (its rows are then verified before they are extended).
    ``sha256``: the SHA-256 of the version ``number`` in the store.
    """

    destination: list[str]
    pins: dict[str, str] = field(default_factory=dict)
    number: int = 0
    local: int = 0
    through: int = 0
    record: dict[str, Any] | None = None
    sha256: str = ""
    resumed: bool = False
    final: bool = False
    #: The version the workspace's ``prev.h5`` holds (0: none): the one a new version's
    #: unchanged parts are copied from, in a store that copies ranges.
    previous: int = 0
    #: Bytes of the last version uploaded that the store copied from the one before.
    copied: int = 0

    @classmethod
    def load(cls, path: Path) -> FollowState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, path: Path) -> None:
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(temp, "w") as out:
            json.dump(asdict(self), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)


def workspace_of(source: str, model: str, destination: tuple[str, str]) -> Path:
    """The follow's workspace in this worker's scratch directory, named by what it follows."""
    digest = hashlib.sha256("\0".join([source, model, *destination]).encode()).hexdigest()
    return get_settings().scratch_root / f"{WORKSPACE_PREFIX}{digest[:32]}"


def _message(self: ChkqTask, job: str, follow: str, source: str, model: str,
             to: str | None = None, ended: bool = False, final: bool = False,
             party: Any = None) -> Checked:
    job = check_job_id(job)
    check_job_id(follow)
    model = check_model_name(model)
    for name, value in (("source", source), ("to", to)):
        if value is not None and not isinstance(value, str):
            raise BadMessageTypeError(f"{name} must be a string, got {value!r}")
    if not isinstance(source, str):
        raise BadMessageTypeError(f"source must be a store URL, got {source!r}")
    for name, flag in (("ended", ended), ("final", final)):
        if not isinstance(flag, bool):
            raise BadMessageTypeError(f"{name} must be true or false, got {flag!r}")
    return Checked(job, (job, follow, source, model, to, ended, final, party), {},
                   {"model": model, "source": source, "final": final})


def store_version_signature(job: str, follow: str, source: str, model: str, to: str | None,
                            ended: bool, final: bool, queue: str | None,
                            party: dict[str, Any] | None) -> Any:
    """The message of one look of a store follow, under the job's id, ``chkq.fail`` errback."""
    options: dict[str, Any] = {"task_id": job, "link_error": [fail_signature("", model, job)]}
    if queue is not None:
        options["queue"] = queue
    return store_version.si(job, follow, source, model, to, ended, final, party).set(**options)


@get_app().task(name="chkq.store_version", bind=True, base=ChkqTask)
@task_lifecycle(_message)
def store_version(self: ChkqTask, job: str, follow: str, source: str, model: str,
                  to: str | None = None, ended: bool = False, final: bool = False,
                  party: Any = None) -> dict[str, Any]:
    """Fetch what is new, publish the next version if more checkpoints are complete.

    ``ended``: the run has ended (a checkpoint directory counts with the files
    it has; one still incomplete never will be). ``final``: publish the
    version holding every checkpoint at the destination key.
    """
    done = records().finished_result(job)
    if done is not None:
        return done
    settings = get_settings()
    core = settings.core()
    admitted = authorize_stage(job, source, model, None, to, False, False, party)
    check_store_allowed(source)
    started = time.monotonic()
    try:
        found = find_store_run(source, model, None, core=core)
    except (NoCheckpointsError, BadCheckpointError):
        # A checkpoint directory made but still empty, say: the next look will see.
        if ended:
            raise
        found = None
    if found is None:
        result = {"kind": STORE_VERSION_KIND, "output": "", "store": True, "through": 0,
                  "version": 0, "queue": own_queue(self), "follow": follow,
                  "published": False}
        records().record_finished(job, result)
        return result
    destination = destination_of(found, to)
    check_store_allowed(destination[0])
    admit_store_run(job, admitted, found, destination, False)
    store = open_store(destination[0], timeouts=core.timeouts)
    private_directory(settings.scratch_root)
    space = workspace_of(source, model, destination)
    with _held(space):
        result = _look(space, store, found, destination, job, follow, ended, final)
    result.update(queue=own_queue(self), seconds=round(time.monotonic() - started, 3))
    records().record_finished(job, result)
    return result


@contextlib.contextmanager
def _held(space: Path) -> Iterator[None]:
    """Hold the workspace ``space`` alone for this process (an ``flock`` beside it).

    Raises
    ------
    RunBusyError
        If another task of a follow of the same run uses it now (a second
        follower that no claim of the first could see).
    """
    fd = os.open(f"{space}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunBusyError(
                f"another follow of this run is using its workspace on this worker "
                f"({space.name}): one follow of a run at a time") from None
        yield
    finally:
        os.close(fd)


def _look(space: Path, store: CheckpointStore, found: StoreRun,
          destination: tuple[str, str], job: str, follow: str, ended: bool, final: bool
          ) -> dict[str, Any]:
    """One look of the follow in its workspace: fetch, make and upload the next version."""
    model = found.model
    state, latest = _workspace_state(space, store, destination, model)
    made = None
    if state.final and latest is not None:
        pointer: VersionPointer | None = latest  # a final look delivered again
    else:
        run_dir = space / "run"
        _fetch_new(found, state, run_dir, get_settings().core())
        state.save(space / "state.json")
        progress = run_progress(run_dir, model, ended=ended)
        through = _contiguous(progress, found, state, ended)
        if through > state.through or (final and state.resumed and state.through):
            made = _make_version(run_dir, model, job, through, state)
            state.save(space / "state.json")
        if not state.through:
            if final:
                raise NoCheckpointsError(f"no checkpoint of {model!r} in {found.source} is "
                                         "complete: nothing to publish")
            pointer = None
        elif final or state.local > state.number:
            pointer = _upload(store, destination, run_dir / f"{model}.h5", state, follow, final)
        else:
            pointer = None
        state.save(space / "state.json")
    return {"kind": STORE_VERSION_KIND, "store": True, "follow": follow,
            "through": state.through, "version": state.number,
            "published": pointer is not None, "final": final,
            "output": (f"{destination[0].rstrip('/')}/{pointer.key(destination[1])}"
                       if pointer else ""),
            "bytes": pointer.size if pointer else 0, "rows": pointer.rows if pointer else 0,
            "copied_bytes": state.copied if pointer else 0,
            "new_rows": int((made or {}).get("new_rows") or (made or {}).get("rows") or 0),
            "warnings": []}


def _workspace_state(space: Path, store: CheckpointStore, destination: tuple[str, str],
                     model: str) -> tuple[FollowState, VersionPointer | None]:
    """The follow's state in its workspace, or a new one resumed from the store's newest version.

    Returned with the store's newest pointer.

    The workspace is trusted only while it agrees with the store: its last
    uploaded version must be the store's newest pointer (same number and
    SHA-256). Otherwise (no workspace: a new follow, or a worker lost; or
    one left behind while another worker went on) it is made anew.
    """
    latest = latest_pointer(store, destination[1])
    state = FollowState.load(space / "state.json")
    if state is not None and state.final and latest is not None and latest.final \
            and state.number == latest.number and state.sha256 == latest.sha256:
        return state, latest
    if latest is not None and latest.final:
        raise StoreDestinationExistsError(
            f"the follow of this run already published its final version at "
            f"{destination[0].rstrip('/')}/{latest.key(destination[1])}; it is never "
            "overwritten")
    if latest is None and store.exists(destination[1]):
        raise StoreDestinationExistsError(
            f"output {destination[0].rstrip('/')}/{destination[1]} exists; it is never "
            "overwritten")
    if state is not None and state.destination == list(destination) and (
            (latest is None and state.number == 0)
            or (latest is not None and state.number == latest.number
                and state.sha256 == latest.sha256)):
        return state, latest
    if space.exists():
        shutil.rmtree(space)
    space.mkdir(mode=0o700)
    (space / "run").mkdir(mode=0o700)
    state = FollowState(list(destination))
    if latest is not None:
        fetch_version(store, destination[1], latest, space / "run" / f"{model}.h5")
        state.number = state.local = latest.number
        state.through, state.sha256, state.resumed = latest.through, latest.sha256, True
    state.save(space / "state.json")
    return state, latest


def _number_of(model: str, name: str) -> int:
    member = checkpoint_member(model, name)
    return member[0] if member is not None else 0


def _fetch_new(found: StoreRun, state: FollowState, run_dir: Path, core: Any) -> None:
    """Fetch the objects not fetched yet; refuse one a version was made from that changed.

    An object not in a version yet that changed since it was fetched (a
    ``file://`` store's file still being written) is fetched again; one that
    changes while it is read is left for the next look.
    """
    listed = {obj.name: obj for obj in found.objects}
    for name, version in list(state.pins.items()):
        obj = listed.get(name)
        if obj is not None and obj.version == version:
            continue
        if _number_of(found.model, name) <= state.through:
            what = "was deleted" if obj is None else "was replaced"
            raise HistoryChangedError(
                f"checkpoint object {found.url_of(name)!r} {what} after version "
                f"{state.local} was made from it (the simulation restarted from an earlier "
                f"checkpoint, or the object was damaged): the follow stops; version "
                f"{state.number} stays the latest, and no version mixing two histories is made")
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
        del state.pins[name]
    for obj in found.objects:
        if obj.name in state.pins:
            continue
        try:
            fetch_objects(found, [obj.name], run_dir, core=core)
        except CheckpointChangedError:
            continue
        state.pins[obj.name] = obj.version


def _contiguous(progress: RunProgress, found: StoreRun, state: FollowState, ended: bool) -> int:
    """The last checkpoint the next version may hold: complete, with none missing before it.

    Raises
    ------
    BadCheckpointError
        For a checkpoint that will never be complete (a later one is, or the
        run has ended), naming its object: the last version stays.
    CheckpointGapError
        At the run's end, for checkpoints missing between those found.
    """
    if progress.overtaken or (ended and progress.waiting):
        waiting = progress.waiting[0]
        folder = waiting.parent.name
        name = (f"{folder}/{waiting.name}" if checkpoint_member(found.model, f"{folder}/x.h5")
                else waiting.name)
        why = "a later checkpoint is complete" if progress.overtaken else "the run has ended"
        raise BadCheckpointError(
            f"checkpoint object {found.url_of(name)!r} is damaged or incomplete (it cannot be "
            f"read, or lacks trials_completed) though {why}: the follow stops; "
            + (f"version {state.number} (checkpoints 1..{state.through}) stays the latest"
               if state.number else "no version was published"))
    numbers = sorted({_number_of(found.model, o.name) for o in found.objects})
    limit = progress.through or 0
    for expected, number in enumerate(numbers, start=numbers[0] if numbers else 1):
        if number != expected:
            if ended:
                raise CheckpointGapError(
                    f"checkpoint {expected} of {found.model!r} is missing from "
                    f"{found.source} though later ones are there: the follow stops")
            limit = min(limit, expected - 1)
            break
    return max(limit, state.through)


def _rows(path: Path) -> tuple[int, dict[str, int]]:
    found: dict[str, int] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(f"/{name}", int(obj.shape[0]))
                     if isinstance(obj, h5py.Dataset) and obj.maxshape
                     and obj.maxshape[0] is None else None)
    return sum(found.values()), found


def _make_version(run_dir: Path, model: str, job: str, through: int,
                  state: FollowState) -> dict[str, Any]:
    """The next version in the workspace's ``MODEL.h5``; the state says it is there, not sent."""
    settings = get_settings()
    output = run_dir / f"{model}.h5"
    if state.number and state.local == state.number and output.exists():
        _keep_previous(output, state)
    if not output.exists():
        consolidate_here(run_dir, model, block_bytes=settings.block_bytes,
                         task_bytes=settings.task_bytes, task_files=settings.task_files,
                         max_decoded_bytes=settings.max_decoded_bytes, through=through)
        rows, _ = _rows(output)
        record: dict[str, Any] = {"rows": rows, "new_rows": rows}
        state.record = None
    else:
        record = publish_version(run_dir, model, job, through, state.record,
                                 block_bytes=settings.block_bytes,
                                 max_decoded_bytes=settings.max_decoded_bytes)
        state.record = record
    if through > state.through or state.local <= state.number:
        state.local = state.number + 1
    state.through, state.resumed = through, False
    return record


def _restamped(output: Path, state: FollowState, before: FileStamp) -> None:
    """The version record's stamp of ``output`` after a new link to it moved its change time.

    Only the change time may differ: a file whose size, modification time or
    inode changed keeps its old stamp, and the next version refuses it.
    """
    after = FileStamp.of(os.stat(output))
    if state.record is not None and state.record.get("output_stamp") == before.as_list() \
            and dataclasses.replace(after, ctime_ns=before.ctime_ns) == before:
        state.record["output_stamp"] = after.as_list()


def _keep_previous(output: Path, state: FollowState) -> None:
    """Keep the uploaded version as ``prev.h5`` (a link) while the next is built from it."""
    before = FileStamp.of(os.stat(output))
    kept = output.parent.parent / "prev.h5"
    temp = kept.with_name(f".prev.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    os.link(output, temp)
    os.replace(temp, kept)
    _restamped(output, state, before)
    state.previous = state.number


def _upload(store: CheckpointStore, destination: tuple[str, str], output: Path,
            state: FollowState, follow: str, final: bool) -> VersionPointer:
    """Publish the workspace's version create-if-absent, then its pointer; return the pointer.

    Where the store copies ranges, the parts equal to the previous version's
    are copied from its object (:mod:`chkq.staging.follow_upload`).
    """
    number = state.number + 1
    key = destination[1] if final else version_key(destination[1], number)
    if not final and store.exists(key) and not store.exists(pointer_key(destination[1], number)):
        # Left by a follower lost before it wrote the pointer: no reader ever used it.
        with contextlib.suppress(KeyError):
            store.delete(key)
    kept = output.parent.parent / "prev.h5"
    previous = None
    if state.number and state.local == state.number:
        previous = (version_key(destination[1], state.number), output)
    elif state.number and state.previous == state.number and kept.exists():
        previous = (version_key(destination[1], state.number), kept)
    before = FileStamp.of(os.stat(output))
    sent = publish_version_file(store, key, output,
                                part_bytes=get_settings().upload_part_bytes, previous=previous)
    published = sent.published
    _restamped(output, state, before)  # a local store links the file itself into place
    with contextlib.suppress(FileNotFoundError):
        kept.unlink()
    state.previous = 0
    rows, _ = _rows(output)
    pointer = VersionPointer(number, published.size, published.sha256, state.through,
                             rows, final, follow)
    write_pointer(store, destination[1], pointer)
    state.number = state.local = number
    state.sha256, state.final = published.sha256, final
    state.copied = sent.copied
    log.info("follow=%s published version %d through checkpoint %d at %s (%d bytes, %d "
             "copied by the store from the previous version)", follow, number, state.through,
             published.url, published.size, sent.copied)
    return pointer


def _end_message(self: ChkqTask, follow: str, source: str, model: str, to: str | None,
                 final: int) -> Checked:
    check_job_id(follow)
    model = check_model_name(model)
    if isinstance(final, bool) or not isinstance(final, int) or final < 0:
        raise BadMessageTypeError(f"final must be a version number or 0, got {final!r}")
    return Checked(follow, (follow, source, model, to, final), {},
                   {"model": model, "source": source})


@get_app().task(name="chkq.store_follow_end", bind=True, base=ChkqTask)
@task_lifecycle(_end_message)
def store_follow_end(self: ChkqTask, follow: str, source: str, model: str, to: str | None,
                     final: int) -> dict[str, Any]:
    """Once the final version is published: delete the interim versions and the workspace.

    Only if the store's newest pointer is the final one, number ``final``:
    nothing is deleted before the final version is there. ``final`` 0: the
    follow stopped; only the workspace is removed, and every version stays
    (a follow started again resumes from the newest).
    """
    core = get_settings().core()
    check_store_allowed(source)
    found = find_store_run(source, model, None, core=core)
    destination = destination_of(found, to)
    check_store_allowed(destination[0])
    deleted = 0
    if final:
        store = open_store(destination[0], timeouts=core.timeouts)
        latest = latest_pointer(store, destination[1])
        if latest is None or not latest.final or latest.number != final:
            raise HistoryChangedError(f"the newest version of {destination[1]} is not the "
                                      f"final version {final}: no interim version deleted")
        for key in interim_keys(store, destination[1], final):
            with contextlib.suppress(KeyError):
                store.delete(key)
                deleted += 1
    space = workspace_of(source, model, destination)
    with _held(space):
        if space.is_dir() and not space.is_symlink():
            shutil.rmtree(space, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{space}.lock")
    return {"deleted": deleted}


def end_signature(follow: str, source: str, model: str, to: str | None, final: int,
                  queue: str | None) -> Any:
    """The message that deletes the interim versions and the workspace of a finished follow."""
    sig = store_follow_end.si(follow, source, model, to, final)
    return sig.set(queue=queue) if queue is not None else sig
