"""Names of a consolidation job's files in the run's output directory.

Temporaries start with ``.chkq-`` so that they can never match the
checkpoint pattern ``MODEL_chkNNNNN`` nor ``MODEL.h5``, and carry the job id
so that two jobs never share one and cleanup removes only its own job's.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from chkq.consolidation.discovery import check_model_name
from chkq.errors import BadNameError
from chkq.rundir import RunDir

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"[0-9a-f]{8,32}")


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a plain hex id (it becomes part of file names)."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise BadNameError(f"invalid job id {job_id!r}: expected 8 to 32 lowercase hex digits")
    return job_id


@dataclass(frozen=True)
class JobFiles:
    """Where one consolidation job keeps its output and temporaries."""

    out_dir: Path
    model: str
    job_id: str

    def __post_init__(self) -> None:
        check_model_name(self.model)
        check_job_id(self.job_id)

    @property
    def prefix(self) -> str:
        return f".chkq-{self.job_id}.{self.model}"

    @property
    def output(self) -> Path:
        """The result, ``OUT_DIR/MODEL.h5``."""
        return self.out_dir / f"{self.model}.h5"

    @property
    def temp(self) -> Path:
        """The output while it is written and verified."""
        return self.out_dir / f"{self.prefix}.h5.tmp"

    @property
    def next_version(self) -> Path:
        """A followed run's next version, cloned from the one this job published.

        Made as soon as this job's version is published, while the simulation
        writes its next checkpoint, and taken over by the next version's job,
        which then extends it: without reflinks, a clone is a copy of the
        whole file, and the next version then waits only for its own rows.
        """
        return self.out_dir / f"{self.prefix}.next.h5.tmp"

    @property
    def pipeline(self) -> Path:
        """Where planning copies a template's dataset to take its pipeline (removed after)."""
        return self.out_dir / f"{self.prefix}.pipeline.h5.tmp"

    def journal_path(self) -> Path:
        """The undo journal of the merge piece under way (:mod:`chkq.consolidation.merge`)."""
        return self.out_dir / f"{self.prefix}.merge-journal"

    def part(self, unit: int) -> Path:
        """Part file written by copy unit ``unit`` for a dataset HDF5 must encode."""
        return self.out_dir / f"{self.prefix}.part{unit:05d}.h5"

    def temporaries(self) -> list[Path]:
        """Every file of this job that exists now, output excepted."""
        with RunDir.open(self.out_dir) as run:
            return self._listed(run)

    def _listed(self, run: RunDir) -> list[Path]:
        start = self.prefix + "."
        return sorted(self.out_dir / name for name in run.listdir() if name.startswith(start))


def discard_job_files(job: JobFiles) -> list[Path]:
    """Remove every temporary of ``job`` (never the output, never a checkpoint); never raise.

    Only regular files go: a job creates its temporaries as files
    (``O_EXCL|O_NOFOLLOW``), so an entry named like one that is a directory,
    a link or anything else was planted, and is left as it is (logged), never
    entered or followed. Entries are listed and removed through the run
    directory's descriptor (:class:`chkq.rundir.RunDir`: opened with no link
    followed at any level), by name, one at a time; one that cannot be
    removed is logged and the others still go, so that a failing job's
    cleanup never fails.
    """
    removed: list[Path] = []
    start = job.prefix + "."
    try:
        run = RunDir.open(job.out_dir)
    except (OSError, ValueError) as exc:
        log.warning("temporaries of job %s in %r were left: %s", job.job_id, str(job.out_dir),
                    exc)
        return removed
    with run:
        dir_fd = run.fd
        for name in sorted(os.listdir(dir_fd)):
            if not name.startswith(start):
                continue
            shown = str(job.out_dir / name)
            try:
                st = os.lstat(name, dir_fd=dir_fd)
                if not stat.S_ISREG(st.st_mode):
                    log.warning("%r was left: it is named like a temporary of job %s but is "
                                "not a regular file, so the job did not make it", shown,
                                job.job_id)
                    continue
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("temporary %r of job %s was left: %s", shown, job.job_id,
                            exc.strerror)
                continue
            removed.append(job.out_dir / name)
    return removed
