"""Linking the verified output into place, and removing what a job leaves.

The output appears only by a hard link (create-if-absent) of the verified
temporary, made through a descriptor checked to be the very file the
planner created (``/proc/self/fd``), so a temporary swapped for another
file or a symbolic link by whoever can write the run directory is never
published. An existing ``MODEL.h5`` is never overwritten. Linking is
idempotent: a second run of the same step recognises its own output by
the inode the plan recorded.

Cleanup deletes only the checkpoint files the job planned and verified,
each still the same file (inode, size, times), through descriptors of the
run directory and checkpoint directories opened without following links:
a directory replaced by a link out of the run is never entered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from chkq.errors import BadMessageError, JobStateGoneError, OutputExistsError
from chkq.fsutil import fsync_dir
from chkq.naming import discard_job_files  # noqa: F401 (re-exported)
from chkq.plan import Plan
from chkq.stamps import FileStamp, check_descriptor

log = logging.getLogger(__name__)

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def link_output(plan: Plan) -> Path:
    """Link the temporary output to ``MODEL.h5`` if absent; return the output path.

    Raises
    ------
    FileExistsError
        If ``MODEL.h5`` exists and is not this job's output.
    FileNotFoundError
        If this job's temporary output is gone and it never linked it.
    """
    job = plan.job
    output, temp = job.output, job.temp
    try:
        fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if _is_ours(output, plan.temp_inode):
            return output
        raise JobStateGoneError(
            f"the temporary output of job {plan.job_id} ({str(temp)!r}) is gone: "
            "the job was cancelled or cleaned up") from None
    try:
        check_descriptor(temp, fd, plan.temp_inode)
        try:
            _link_descriptor(fd, temp, output, plan.temp_inode)
        except FileExistsError:
            if not _is_ours(output, plan.temp_inode):
                raise OutputExistsError(
                    f"{str(output)!r} appeared while job {plan.job_id} ran; it was left "
                    "untouched and the job's output discarded") from None
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        if os.lstat(temp).st_ino == plan.temp_inode:
            os.unlink(temp)
    fsync_dir(job.out_dir)
    return output


def _link_descriptor(fd: int, temp: Path, output: Path, inode: int) -> None:
    """Hard-link the file open as ``fd`` (the checked temporary) to ``output``.

    Through ``/proc/self/fd`` where the kernel allows it; otherwise by name,
    checking afterwards that the new link is the checked file (and removing
    it, if a swap in between made it another).
    """
    try:
        os.link(f"/proc/self/fd/{fd}", output, follow_symlinks=True)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    os.link(temp, output, follow_symlinks=False)
    if not _is_ours(output, inode):
        os.unlink(output)
        raise OutputExistsError(f"{str(temp)!r} was replaced by another file before it was linked")


def _is_ours(output: Path, inode: int) -> bool:
    try:
        return os.lstat(output).st_ino == inode
    except FileNotFoundError:
        return False


def remove_checkpoints(plan: Plan) -> list[str]:
    """Delete the run's planned checkpoint files (after link); return warnings.

    A file that changed since planning is kept, with a warning. A
    checkpoint directory is removed when it is empty afterwards, and left in
    place, with a warning, when it holds other files. Missing files are
    fine, so that a second run of the same step does nothing more.
    """
    warnings: list[str] = []
    run = Path(plan.out_dir)
    run_fd = os.open(run, _DIRECTORY)
    try:
        by_dir: dict[str, list[tuple[str, FileStamp]]] = {}
        for index, (path, *_stamp) in enumerate(plan.files):
            parts = Path(path).relative_to(run).parts
            if len(parts) not in (1, 2) or ".." in parts:
                raise BadMessageError(f"checkpoint {path!r} is not inside the run directory")
            folder = parts[0] if len(parts) == 2 else ""
            by_dir.setdefault(folder, []).append((parts[-1], plan.stamp(index)))
        for folder, members in by_dir.items():
            try:
                dir_fd = os.open(folder, _DIRECTORY, dir_fd=run_fd) if folder else run_fd
            except FileNotFoundError:
                continue
            except OSError as exc:
                warnings.append(f"checkpoint directory {str(run / folder)!r} was kept: it is "
                                f"no longer a directory ({exc.strerror})")
                continue
            try:
                for name, expected in members:
                    warning = _unlink_if_same(dir_fd, name, expected, run / folder / name)
                    if warning:
                        warnings.append(warning)
                os.fsync(dir_fd)
            finally:
                if folder:
                    os.close(dir_fd)
        for _number, where, is_dir in plan.checkpoints:
            if is_dir:
                warning = _remove_folder(run_fd, Path(where).name, Path(where))
                if warning:
                    warnings.append(warning)
        os.fsync(run_fd)
    finally:
        os.close(run_fd)
    for message in warnings:
        log.warning(message)
    return warnings


def _unlink_if_same(dir_fd: int, name: str, expected: FileStamp, shown: Path) -> str | None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or FileStamp.of(st) != expected:
        return f"checkpoint file {str(shown)!r} was kept: it changed after it was verified"
    os.unlink(name, dir_fd=dir_fd)
    return None


def _remove_folder(run_fd: int, name: str, shown: Path) -> str | None:
    try:
        os.rmdir(name, dir_fd=run_fd)
    except FileNotFoundError:
        return None
    except OSError:
        try:
            dir_fd = os.open(name, _DIRECTORY, dir_fd=run_fd)
        except OSError:
            return f"checkpoint directory {str(shown)!r} was kept: it is no longer a directory"
        try:
            others = sorted(os.listdir(dir_fd))
        finally:
            os.close(dir_fd)
        return (f"checkpoint directory {str(shown)!r} was kept: it holds other "
                f"files ({', '.join(others[:5])})")
    return None
