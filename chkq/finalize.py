"""Linking the verified output into place, and removing what a job leaves.

The output appears only by ``os.link`` (create-if-absent) of the verified
temporary: an existing ``MODEL.h5`` is never overwritten. Linking is
idempotent: a second run of the same job (a redelivered callback)
recognises its own link by the inode it recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from chkq.fsutil import fsync_dir, write_durably
from chkq.naming import JobFiles
from chkq.plan import Plan

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
    output, temp, marker = job.output, job.temp, job.linked
    if temp.exists():
        try:
            os.link(temp, output)
        except FileExistsError:
            if not os.path.samefile(temp, output):
                raise FileExistsError(
                    f"{str(output)!r} appeared while job {plan.job_id} ran; it was left "
                    "untouched and the job's output discarded"
                ) from None
        write_durably(marker, str(os.stat(output).st_ino))
        os.unlink(temp)
        fsync_dir(job.out_dir)
        return output
    if marker.exists() and output.exists() and marker.read_text() == str(os.stat(output).st_ino):
        return output
    raise FileNotFoundError(
        f"the temporary output of job {plan.job_id} ({str(temp)!r}) is gone: "
        "the job was cancelled or cleaned up"
    )


def remove_checkpoints(plan: Plan) -> list[str]:
    """Delete the run's checkpoint files (after link); return warnings for kept directories.

    A checkpoint directory is removed when it is empty afterwards, and left in
    place, with a warning, when it holds other files. Missing files are fine,
    so that a second run of the same step does nothing more.
    """
    warnings = []
    for path, *_ in plan.files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    for _number, where, is_dir in plan.checkpoints:
        if not is_dir:
            continue
        folder = Path(where)
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            others = sorted(p.name for p in folder.iterdir())
            message = (f"checkpoint directory {str(folder)!r} was kept: it holds other "
                       f"files ({', '.join(others[:5])})")
            log.warning(message)
            warnings.append(message)
    fsync_dir(Path(plan.out_dir))
    return warnings


def discard_job_files(job: JobFiles) -> list[Path]:
    """Remove every temporary of ``job`` (never the output, never a checkpoint)."""
    removed = []
    for path in job.temporaries():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
