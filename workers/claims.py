"""One consolidation of a run at a time: a second is refused at submission, naming the first."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from chkq.errors import ForgedRecordError, RunBusyError
from chkq.jobs import keys
from chkq.jobs.records import RECENT_LIMIT
from chkq.tasks.state import job_status, records


def refuse_if_running(model: str, target: str) -> None:
    """Refuse a second consolidation of ``model`` in ``target`` while one is queued or running.

    ``target`` is the run directory (or the store URL of a run in a store), as
    the first job recorded it at submission. Both jobs would run in full and
    the second fail at the end, its output refused: one is enough. A job lost
    for good (its workers gone) stays "running" until cancelled, and the
    message says how.

    Raises
    ------
    RunBusyError
        Naming the job that holds the run, and how to follow or cancel it.
    """
    held = records()
    # An entry that cannot name a job's records (planted in Redis) holds no run.
    recent = [job for job in held.recent_jobs(RECENT_LIMIT) if job and keys.SEP not in job]
    infos = held.job_records_of(recent, "info", "a submission")
    same = [job for job in recent if isinstance(infos[job], dict)
            and infos[job].get("model") == model and infos[job].get("out_dir") == target]
    # A job with a done marker succeeded (and one whose marker is refused is skipped, as
    # its status would be): only the others need their whole status read.
    done = held.job_records_of(same, "done", "a job's result", required="output")
    for job in same:
        if done[job] is not None:
            continue
        try:
            status = job_status(job)
        except (LookupError, ForgedRecordError):
            continue
        if status.state in ("PENDING", "RUNNING"):
            phase = "queued" if status.state == "PENDING" else f"running ({status.phase})"
            raise RunBusyError(
                f"model {model!r} in {target!r} is already being consolidated by job {job} "
                f"({phase}): wait for it (chkq status {job}) or cancel it (chkq cancel {job}) "
                "before submitting again")


#: Variables that choose which store serves a bucket URL (S3 and GCS emulators, other clouds).
STORE_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST")


@contextlib.contextmanager
def run_claim(model: str, target: str) -> Iterator[Callable[[str], None]]:
    """Hold this user's claim on consolidating ``model`` in ``target`` on an embedded cluster.

    Each embedded cluster has a private broker, so two commands consolidating
    the same run cannot see each other's jobs there: an exclusive ``flock``
    on a file in this user's private claims directory (``~/.cache/chkq/claims-UID``,
    where no other user can create it first) stands in. The claim goes
    with the process, however it ends. Yields a function that records the
    job id, so that a refused second command can name it.

    Raises
    ------
    RunBusyError
        If another process holds the claim (naming its pid and job).
    """
    import fcntl
    import hashlib
    import stat

    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = (Path(cache) if os.path.isabs(cache) else Path.home() / ".cache") / "chkq"
    folder = base / f"claims-{os.getuid()}"
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        info = os.lstat(folder)
    except OSError:
        info = None  # no home to keep claims in: the output's create-if-absent link decides
    if info is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or info.st_mode & 0o077:
        yield lambda job: None  # not ours to trust: the output's create-if-absent link decides
        return
    # A store URL names a run only together with the endpoint that serves it.
    where = [target] + [os.environ.get(name, "") for name in STORE_ENDPOINT_VARIABLES
                        if "://" in target and not target.startswith("file://")]
    digest = hashlib.sha256("\0".join([*where, model]).encode()).hexdigest()[:32]
    fd = os.open(folder / f"{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            pid = holder[0] if holder else "?"
            job = f"job {holder[1]}, " if len(holder) > 1 else ""
            raise RunBusyError(
                f"model {model!r} in {target!r} is already being consolidated by another "
                f"chkq command ({job}process {pid}): wait for it to end, or stop it "
                f"(kill {pid}), before starting again") from None

        def record(job: str) -> None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {job}\n".encode(), 0)

        record("")
        yield record
    finally:
        os.close(fd)
