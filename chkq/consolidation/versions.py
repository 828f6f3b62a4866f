"""One version of a followed run: built beside the published one, proven, then swapped in.

While a simulation runs, ``MODEL.h5`` is kept current: after each completed
checkpoint a new version holds the rows of every checkpoint up to it
(:mod:`chkq.consolidation.extend` builds and proves it). A version is
published by an atomic rename over the previous one, so a reader opening
``MODEL.h5`` gets one whole, verified version, and one that holds the
previous version open keeps reading that file, which the rename leaves intact.

A version's record says what it holds: the last checkpoint's number, every
file it took rows from with the stamp (size, times, inode) that file had,
and the stamp of the published file. The next version starts only if the
published file is still that one and every one of those checkpoint files is
unchanged: a simulation that restarted from an earlier checkpoint and wrote
later ones again is refused, naming the file, and the last good version
stays. Without a record (the follower restarted with a new broker, or a
``MODEL.h5`` it did not publish) every row the published file holds is
verified against its checkpoint before a new version relies on it.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py

from chkq.consolidation.completeness import seen_complete
from chkq.consolidation.discovery import Checkpoint
from chkq.consolidation.extend import (
    ExtendStats,
    check_file_rows,
    clone_file,
    extend_output,
    file_ends,
    included_files,
    opened_version,
    prove_version,
    refuse_unfollowable,
)
from chkq.consolidation.link import remove_run_files
from chkq.consolidation.prepare import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_DECODED_BYTES,
    SurveyedRun,
    job_files,
    surveyed_run,
)
from chkq.consolidation.run_scan import find_run, run_files, scan_files
from chkq.consolidation.skeleton import format_bounds
from chkq.consolidation.stamps import FileStamp
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.errors import FollowError, HistoryChangedError, NoCheckpointsError
from chkq.rundir import CREATE, READ, RunDir, fd_path

log = logging.getLogger(__name__)

#: The ``kind`` of a version's record (the job's finished result).
VERSION_KIND = "follow-version"


@dataclass(frozen=True)
class RunProgress:
    """How far a running simulation's checkpoints are complete.

    ``through``: the newest checkpoint such that it and all before it are
    complete (every file has ``trials_completed``, set as a simulation closes
    it), None when the first is not. ``waiting``: the files of the next
    checkpoint not complete yet. ``overtaken``: a later checkpoint is
    complete, so those files will not be completed: they are damaged.
    """

    through: int | None
    waiting: tuple[Path, ...] = ()
    overtaken: bool = False


def run_progress(out_dir: str | Path, model: str, ended: bool = False) -> RunProgress:
    """:class:`RunProgress` of ``model``'s checkpoints in ``out_dir``, as they are now.

    A checkpoint that is a directory may still be missing files its writers have not
    created yet: it counts as complete once it has as many files as the checkpoint
    before it (the first: once a later checkpoint has begun), or the run has ``ended``.
    """
    with RunDir.open(out_dir, exact=True) as rundir:
        try:
            checkpoints = find_run(Path(out_dir), model, rundir, allow_gaps=True)
        except NoCheckpointsError:
            return RunProgress(None)
    through = None
    for index, checkpoint in enumerate(checkpoints):
        waiting = tuple(path for path in checkpoint.files if not seen_complete(path))
        if waiting:
            overtaken = any(all(seen_complete(path) for path in later.files)
                            for later in checkpoints[index + 1:])
            return RunProgress(through, waiting, overtaken)
        if not ended and not _has_every_file(checkpoints, index):
            return RunProgress(through)
        through = checkpoint.number
    return RunProgress(through)


def _has_every_file(checkpoints: list[Checkpoint], index: int) -> bool:
    """Whether checkpoint ``index`` can gain no more files from its writers."""
    checkpoint = checkpoints[index]
    if not checkpoint.is_directory:
        return True
    if index > 0:
        return len(checkpoint.files) >= len(checkpoints[index - 1].files)
    return index + 1 < len(checkpoints)


def completed_checkpoints(out_dir: str | Path, model: str) -> list[tuple[int, float]]:
    """Each complete checkpoint of the run, in order up to the first not complete, with when.

    The moment a checkpoint completed is the newest modification time of
    its files (``trials_completed`` is written as each is closed). Empty
    when the run has no checkpoints (or they were cleaned up).
    """
    with RunDir.open(out_dir, exact=True) as rundir:
        try:
            checkpoints = find_run(Path(out_dir), model, rundir, allow_gaps=True)
        except NoCheckpointsError:
            return []
    found = []
    for checkpoint in checkpoints:
        if not all(seen_complete(path) for path in checkpoint.files):
            break
        found.append((checkpoint.number,
                      max((path.stat().st_mtime for path in checkpoint.files), default=0.0)))
    return found


def publish_version(out_dir: str | Path, model: str, job_id: str, through: int,
                    previous: dict[str, Any] | None, *, cleanup: bool = False,
                    block_bytes: int = DEFAULT_BLOCK_BYTES,
                    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                    prepare_next: bool = False) -> dict[str, Any]:
    """Publish the version of ``DIR/MODEL.h5`` holding checkpoints up to ``through``.

    ``previous`` is the record of the version now published (None: unknown,
    see the module's docstring). With ``cleanup`` the checkpoint files the
    version holds are deleted once it is published. With ``prepare_next``
    (a version that is not the run's last), the published file is then
    cloned for the next version (:attr:`JobFiles.next_version`), which the
    next version's job takes over instead of cloning it then, when a reader
    waits for it. Returns the new version's record (the previous one's, if
    there is nothing new).

    Raises
    ------
    HistoryChangedError
        A checkpoint file the published version holds changed.
    FollowError
        The published file is not the recorded version, or is no version of
        this run, or the run changed in a way a version cannot follow.
    OutputMismatchError
        The new version failed its proof (nothing was published).
    """
    job = job_files(out_dir, model, job_id, extending=True)
    with RunDir.open(job.out_dir, exact=True) as rundir:
        checkpoints = [c for c in find_run(job.out_dir, model, rundir, allow_gaps=True)
                       if c.number <= through]
        if not checkpoints:
            raise FollowError(f"no checkpoint of {model!r} up to number {through} in "
                              f"{str(job.out_dir)!r}")
        scanned = scan_files(run_files(checkpoints), job.out_dir, rundir, reuse=True)
    try:
        with surveyed_run(out_dir, model, job_id, block_bytes=block_bytes,
                          run=(checkpoints, scanned), allow_gaps=True,
                          max_decoded_bytes=max_decoded_bytes, extending=True) as survey:
            record = _publish(survey, through, previous, block_bytes)
            if prepare_next and record.get("job") == job_id:
                prepared = _prepare_next(survey)
                if prepared is not None:
                    record["next"] = prepared
    except BaseException:
        discard_job_files(job)
        raise
    if cleanup:
        files = [(Path(path), FileStamp(*rest)) for path, *rest in record["held"]]
        record["warnings"] = remove_run_files(
            RunDir.open(job.out_dir, exact=True), files,
            [[c.number, str(c.path), c.is_directory] for c in checkpoints])
    return record


def _publish(survey: SurveyedRun, through: int, previous: dict[str, Any] | None,
             block_bytes: int) -> dict[str, Any]:
    job, rundir = survey.job, survey.rundir
    try:
        out_fd = rundir.open_file(job.output, READ)
    except FileNotFoundError:
        raise FollowError(f"{str(job.output)!r} does not exist: its first version is a "
                          "consolidation of the checkpoints so far") from None
    try:
        published = FileStamp.of(os.fstat(out_fd))
        with opened_version(job.output, out_fd, ("earliest", "latest"), "r") as old:
            refuse_unfollowable(old, job.output)
            if previous is None:
                first = included_files(old, survey, job.output)
                _verify_held(old, survey, first, block_bytes)
            else:
                first = _check_history(previous, survey, published)
                if included_files(old, survey, job.output) != first:
                    raise FollowError(
                        f"{str(job.output)!r} does not hold the rows its record says: the "
                        "follow stops")
            if first == len(survey.scanned):
                return previous or _record(survey, through, published, ExtendStats(), 0)
            stats = _build(survey, out_fd, old, first, block_bytes, _prepared(survey, previous))
        record = _swap_in(survey, out_fd, through, stats, first)
    finally:
        os.close(out_fd)
    return record


def _check_history(previous: dict[str, Any], survey: SurveyedRun, published: FileStamp
                   ) -> int:
    """The published file is ``previous``'s, and every file it holds is unchanged.

    Returns how many of the run's files (in order) it holds.
    """
    if previous.get("kind") != VERSION_KIND or previous.get("output_stamp") != published.as_list():
        raise FollowError(
            f"{str(survey.job.output)!r} is not the version this follow published last (it was "
            "replaced or changed): the follow stops; consolidate again to start anew")
    held = previous.get("held", [])
    if not isinstance(held, list) or len(held) > len(survey.scanned):
        raise HistoryChangedError(
            f"the run now has fewer checkpoint files than version {previous.get('through')} "
            "holds: the simulation restarted from an earlier checkpoint; MODEL.h5 stays at "
            "that version")
    for (path, *stamp), scanned in zip(held, survey.scanned, strict=False):
        if path != str(scanned.scan.path) or list(stamp) != scanned.stamp.as_list():
            raise HistoryChangedError(
                f"checkpoint file {path!r} changed after version {previous.get('through')} "
                "was published from it: the simulation restarted from an earlier checkpoint "
                "or rewrote one; MODEL.h5 stays at that version, and no version mixing two "
                "histories is made")
    return len(held)


def _verify_held(old: h5py.File, survey: SurveyedRun, first: int, block_bytes: int) -> None:
    """Every row ``old`` holds, against the checkpoint file it comes from."""
    for index in range(first):
        check_file_rows(survey, index, old, block_bytes)


def _build(survey: SurveyedRun, out_fd: int, old: h5py.File, first: int,
           block_bytes: int, prepared: int | None = None) -> ExtendStats:
    """The new version in the job's temporary: cloned, extended, closed and proven.

    ``prepared``: the previous version's clone, taken over as the temporary
    (:func:`_prepared`), which the proof checks as it checks a fresh clone.
    It is written under the format bounds a one-shot output of the newest
    checkpoint gets (:func:`chkq.consolidation.skeleton.format_bounds`).
    """
    job, rundir = survey.job, survey.rundir
    mode = stat.S_IMODE(os.fstat(out_fd).st_mode)
    if prepared is None:
        temp_fd = rundir.open_file(job.temp, (CREATE & ~os.O_WRONLY) | os.O_RDWR, mode)
    else:
        temp_fd = prepared
    try:
        if prepared is None:
            os.fchmod(temp_fd, mode)
            clone = clone_file(out_fd, temp_fd)
        else:
            clone = "prepared"
        with h5py.File(fd_path(survey.template), "r") as template:
            libver = format_bounds(template, [d.name for d in survey.datasets])
            with opened_version(job.temp, temp_fd, libver) as new:
                stats = extend_output(new, template, survey, first, block_bytes)
        stats.clone = clone
        os.fsync(temp_fd)
        with opened_version(job.temp, temp_fd, libver, "r") as new:
            prove_version(job.temp, new, old, survey.reference, survey, first, block_bytes,
                          stats, (temp_fd, survey.template))
    finally:
        os.close(temp_fd)
    return stats


def _prepare_next(survey: SurveyedRun) -> dict[str, Any] | None:
    """Clone the version just published for the next one; return what the next job checks.

    The version is published already: a clone that cannot be made (no room)
    is removed and left to the next job to make, and this job still succeeds.
    """
    job, rundir = survey.job, survey.rundir
    try:
        return _clone_published(job, rundir)
    except OSError as exc:
        log.warning("the next version of %r was not prepared (%s): its job clones it",
                    str(job.output), exc)
        rundir.unlink(job.next_version)
        return None


def _clone_published(job: JobFiles, rundir: RunDir) -> dict[str, Any]:
    published = rundir.open_file(job.output, READ)
    try:
        mode = stat.S_IMODE(os.fstat(published).st_mode)
        rundir.unlink(job.next_version)
        next_fd = rundir.open_file(job.next_version, (CREATE & ~os.O_WRONLY) | os.O_RDWR, mode)
        try:
            os.fchmod(next_fd, mode)
            clone = clone_file(published, next_fd)
            # Flushed now, so that the next version's own flush writes its new rows only.
            os.fsync(next_fd)
            return {"of": FileStamp.of(os.fstat(published)).as_list(),
                    "stamp": FileStamp.of(os.fstat(next_fd)).as_list(), "clone": clone}
        finally:
            os.close(next_fd)
    finally:
        os.close(published)


def _prepared(survey: SurveyedRun, previous: dict[str, Any] | None) -> int | None:
    """The previous version's prepared clone, moved to this job's temporary and open; or None.

    Taken only if it is a regular file with the stamp recorded when it was
    made, of the file published now; anything else is removed and the
    version clones afresh. What it holds is proven like any clone.
    """
    if previous is None or not isinstance(previous.get("next"), dict):
        return None
    prepared = previous["next"]
    try:
        made_by = JobFiles(survey.job.out_dir, survey.job.model, str(previous.get("job")))
    except ValueError:
        return None
    rundir, job = survey.rundir, survey.job
    try:
        now = FileStamp.of(rundir.lstat(job.output)).as_list()
        fd = rundir.open_file(made_by.next_version, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    held = os.fstat(fd)
    if (stat.S_ISREG(held.st_mode) and held.st_nlink == 1 and prepared.get("of") == now
            and prepared.get("stamp") == FileStamp.of(held).as_list()):
        rundir.rename(made_by.next_version, job.temp)
        moved = rundir.lstat(job.temp)
        if (moved.st_dev, moved.st_ino) == (held.st_dev, held.st_ino):
            return fd
        rundir.unlink(job.temp)
    os.close(fd)
    rundir.unlink(made_by.next_version)
    return None


def _swap_in(survey: SurveyedRun, out_fd: int, through: int, stats: ExtendStats,
             first: int) -> dict[str, Any]:
    """Rename the proven temporary over the published version, if that is still ``out_fd``'s."""
    job, rundir = survey.job, survey.rundir
    now = rundir.lstat(job.output)
    held = os.fstat(out_fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        raise FollowError(f"{str(job.output)!r} was replaced while its next version was "
                          "built: nothing was published")
    temp_fd = rundir.open_file(job.temp, READ)
    try:
        rundir.rename(job.temp, job.output)
        rundir.fsync()
        return _record(survey, through, FileStamp.of(os.fstat(temp_fd)), stats, first)
    finally:
        os.close(temp_fd)


def _record(survey: SurveyedRun, through: int, output: FileStamp, stats: ExtendStats,
            first: int) -> dict[str, Any]:
    ends = file_ends(survey)
    return {
        "kind": VERSION_KIND,
        "job": survey.job.job_id,
        "output_stamp": output.as_list(),
        "output": str(survey.job.output),
        "through": through,
        "checkpoints": len(ends),
        "files": len(survey.scanned),
        "held": [[str(s.scan.path), *s.stamp.as_list()] for s in survey.scanned],
        "datasets": {f"/{d.name}": d.total for d in survey.datasets},
        "rows": sum(d.total for d in survey.datasets),
        "new_files": len(survey.scanned) - first,
        "new_rows": sum(stats.datasets.values()),
        "clone": stats.clone,
        "chunks_moved": stats.chunks_moved,
        "bytes_moved": stats.bytes_moved,
        "rows_encoded": stats.rows_encoded,
        "rows_checked": stats.rows_checked,
        "chunks_kept": stats.chunks_kept,
        "bytes": output.size,
    }

