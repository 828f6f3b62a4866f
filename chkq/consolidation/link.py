"""Linking the verified output into place, and removing what a job leaves.

The output appears only by a hard link (create-if-absent) of the verified
temporary, made through a descriptor checked to be the very file the
planner created (``/proc/self/fd``), into the run directory's descriptor
(:mod:`chkq.rundir`), so a temporary swapped for another
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
from typing import Any

from chkq.consolidation.plan import Plan
from chkq.consolidation.stamps import FileStamp, check_descriptor
from chkq.consolidation.temporaries import discard_job_files  # noqa: F401 (re-exported)
from chkq.errors import BadMessageError, JobStateGoneError, OutputExistsError
from chkq.rundir import DIRECTORY, RunDir

log = logging.getLogger(__name__)


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
    with plan.open_run() as run:
        try:
            fd = run.open_file(temp)
        except FileNotFoundError:
            if _is_ours(run, output, plan.temp_inode):
                return output
            raise JobStateGoneError(
                f"the temporary output of job {plan.job_id} ({str(temp)!r}) is gone: "
                "the job was cancelled or cleaned up") from None
        try:
            check_descriptor(temp, fd, plan.temp_inode)
            try:
                _link_descriptor(run, fd, temp, output, plan.temp_inode)
            except FileExistsError:
                if not _is_ours(run, output, plan.temp_inode):
                    raise OutputExistsError(
                        f"{str(output)!r} appeared while job {plan.job_id} ran; it was left "
                        "untouched and the job's output discarded") from None
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            if run.lstat(temp).st_ino == plan.temp_inode:
                run.unlink(temp, missing_ok=False)
        run.fsync()
    return output


def _link_descriptor(run: RunDir, fd: int, temp: Path, output: Path, inode: int) -> None:
    """Hard-link the file open as ``fd`` (the checked temporary) to ``output`` in ``run``.

    Through ``/proc/self/fd`` where the kernel allows it; otherwise by name
    (relative to the run directory's descriptor), checking afterwards that
    the new link is the checked file (and removing it, if a swap in between
    made it another).
    """
    try:
        run.link_descriptor(fd, output)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    (_, temp_name), (_, output_name) = run.split(temp), run.split(output)
    os.link(temp_name, output_name, src_dir_fd=run.fd, dst_dir_fd=run.fd,
            follow_symlinks=False)
    if not _is_ours(run, output, inode):
        run.unlink(output)
        raise OutputExistsError(f"{str(temp)!r} was replaced by another file before it was linked")


def _is_ours(run: RunDir, output: Path, inode: int) -> bool:
    try:
        return run.lstat(output).st_ino == inode
    except FileNotFoundError:
        return False


def remove_checkpoints(plan: Plan) -> list[str]:
    """Delete the run's planned checkpoint files (after link); return warnings.

    A file that changed since planning is kept, with a warning. A
    checkpoint directory is removed when it is empty afterwards, and left in
    place, with a warning, when it holds other files. Missing files are
    fine, so that a second run of the same step does nothing more.
    """
    return remove_run_files(plan.open_run(), [(Path(path), plan.stamp(i))
                                              for i, (path, *_rest) in enumerate(plan.files)],
                            plan.checkpoints)


def remove_run_files(opened: RunDir, files: list[tuple[Path, FileStamp]],
                     checkpoints: list[list[Any]]) -> list[str]:
    """:func:`remove_checkpoints` of ``files`` (each with the stamp it must still have).

    ``opened`` (closed here) is the run directory; ``checkpoints`` holds
    ``[number, path, is_directory]``, the directories to remove once empty.
    """
    warnings: list[str] = []
    run = opened.path
    run_fd = opened.fd
    try:
        by_dir: dict[str, list[tuple[str, FileStamp]]] = {}
        for path, expected in files:
            parts = Path(path).relative_to(run).parts
            if len(parts) not in (1, 2) or ".." in parts:
                raise BadMessageError(f"checkpoint {path!r} is not inside the run directory")
            folder = parts[0] if len(parts) == 2 else ""
            by_dir.setdefault(folder, []).append((parts[-1], expected))
        for folder, members in by_dir.items():
            try:
                dir_fd = os.open(folder, DIRECTORY, dir_fd=run_fd) if folder else run_fd
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
        for _number, where, is_dir in checkpoints:
            if is_dir:
                warning = _remove_folder(run_fd, Path(where).name, Path(where))
                if warning:
                    warnings.append(warning)
        os.fsync(run_fd)
    finally:
        opened.close()
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
            dir_fd = os.open(name, DIRECTORY, dir_fd=run_fd)
        except OSError:
            return f"checkpoint directory {str(shown)!r} was kept: it is no longer a directory"
        try:
            others = sorted(os.listdir(dir_fd))
        finally:
            os.close(dir_fd)
        return (f"checkpoint directory {str(shown)!r} was kept: it holds other "
                f"files ({', '.join(others[:5])})")
    return None
