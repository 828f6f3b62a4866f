"""The embedded cluster's reaper: removes a job's temporaries when its command dies outright.

SIGKILL of ``chkq consolidate`` takes its private broker and workers with it
(``PR_SET_PDEATHSIG``), but nothing in that tree can then remove the job's
``.chkq-JOB.*`` files from the run directory. The reaper is a small process
the command starts with a *lifeline*, a pipe it alone holds the writing end
of, over which it names each job (``OUT_DIR<TAB>MODEL<TAB>JOB``). When the
pipe reaches its end without the word ``done`` — the command died, however —
the reaper waits until the worker processes are gone (no task can still be
writing), then removes those jobs' temporaries (never an output, never a
checkpoint), and the private broker's directory (its socket) if named. It
imports nothing of Celery or HDF5.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from chkq.consolidation.temporaries import JobFiles, discard_job_files

#: Longest wait for the workers to be gone before the temporaries are removed anyway.
WORKERS_GONE_SECONDS = 10.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z"
    return False


def remove_broker_dir(path: Path) -> None:
    """Remove the dead broker's socket and its private directory (nothing else it may hold)."""
    with contextlib.suppress(OSError):
        (path / "redis.sock").unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def main(worker_pid: int, broker_dir: Path | None = None) -> int:
    """Read the lifeline on stdin until it closes; reap unless told ``done``."""
    jobs: list[JobFiles] = []
    finished = False
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line == "done":
            finished = True
            continue
        with contextlib.suppress(ValueError):
            out_dir, model, job = line.split("\t")
            jobs.append(JobFiles(Path(out_dir), model, job))
    if finished:
        return 0
    if broker_dir is not None:
        remove_broker_dir(broker_dir)
    if not jobs:
        return 0
    deadline = time.monotonic() + WORKERS_GONE_SECONDS
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # pool processes go with their main process
    for files in jobs:
        with contextlib.suppress(OSError):
            discard_job_files(files)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
