"""Following a running simulation: ``MODEL.h5`` kept current, one verified version at a time.

:func:`follow_run` runs beside the simulation. Whenever more checkpoints are
complete (every file of each has ``trials_completed``, in number order), it
publishes a new version of ``DIR/MODEL.h5`` holding all of them: the first
version is an ordinary consolidation job of the checkpoints so far, each
later one a ``chkq.version`` job that extends the published file with the
new checkpoints only. It ends when the done file appears (or after ``idle``
seconds without a new checkpoint), having published the final version,
equal in content to a one-shot consolidation of every checkpoint.

The same jobs run on the cluster ``CHKQ_BROKER_URL`` names or on an embedded
one started for the follow, as ``chkq consolidate`` runs them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chkq.config.celery_app import get_settings
from chkq.consolidation.discovery import check_model_name
from chkq.consolidation.temporaries import JobFiles
from chkq.consolidation.versions import RunProgress, run_progress
from chkq.errors import BadCheckpointError, ConfigurationError
from chkq.tasks.parties import plan_credential
from chkq.tasks.state import records
from chkq.workers.claims import refuse_if_running, run_claim
from chkq.workers.client import ConsolidationJob, JobSummary, out_dir_of, submit_consolidation

#: Seconds between two looks at the run directory for newly completed checkpoints.
POLL_SECONDS = 0.25


@dataclass
class Version:
    """One published version: its job, the last checkpoint it holds, what it cost."""

    number: int
    job: str
    through: int
    rows: int
    seconds: float
    published_at: float
    new_rows: int = 0
    clone: str = ""


@dataclass
class FollowSummary:
    """What a follow published: the output, and every version in order."""

    output: Path
    versions: list[Version] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def line(self) -> str:
        last = self.versions[-1] if self.versions else None
        if last is None:
            return f"{self.output}: no version published"
        return (f"{self.output}: {len(self.versions)} versions, the last through checkpoint "
                f"{last.through} ({last.rows:,} rows)")


def submit_version(model: str, directory: Path, through: int, previous: str | None,
                   cleanup: bool = False) -> ConsolidationJob:
    """Send the job of the next version (``chkq.version``); return its handle at once.

    ``previous``: the job that published the version to extend (None: a
    ``MODEL.h5`` of unknown origin, whose rows the job verifies first).
    """
    from chkq.tasks.follow import version_signature

    job = uuid.uuid4().hex
    submitted = time.monotonic()
    party = plan_credential(job, str(directory), model, cleanup, False)
    records().record_submitted(job, model, str(directory))
    version_signature(str(directory), model, job, through, previous, cleanup,
                      party=party).apply_async()
    return ConsolidationJob.sent(job, JobFiles(directory, model, job), submitted)


@contextlib.contextmanager
def _cluster(workers: int | None) -> Iterator[Callable[[], None] | None]:
    """The configured cluster, or an embedded one for the follow's length."""
    if get_settings().broker_url:
        yield None
        return
    from chkq.workers.embedded import EmbeddedCluster

    with EmbeddedCluster(workers) as cluster:
        yield cluster.check_alive


def follow_run(
    model_name: str, out_dir: str | Path | None = None, *, done_file: str | Path | None = None,
    idle: float | None = None, cleanup: bool = False, workers: int | None = None,
    poll: float = POLL_SECONDS, on_version: Callable[[Version], None] | None = None,
) -> FollowSummary:
    """Keep ``OUT_DIR/MODEL.h5`` current while the run goes on; return what was published.

    ``done_file``: the follow ends once this path exists (the simulation's
    end), after publishing the version that holds every checkpoint
    complete then. ``idle``: or once this many seconds pass with no new
    complete checkpoint. One of them is needed. With ``cleanup``, the
    checkpoints are deleted once the final version is published, as
    ``chkq consolidate --cleanup`` deletes them. ``on_version`` hears of
    each version as it is published.

    A ``MODEL.h5`` that exists when the follow starts (a follow that was
    stopped) is taken as the version to extend: the next version's job
    verifies every row it holds first.

    Raises
    ------
    HistoryChangedError
        A checkpoint that a published version holds was rewritten (the
        simulation restarted from an earlier one): the last good version stays.
    RunBusyError
        Another follow or consolidation of the run is under way (naming it).
    ChkqError
        As a consolidation raises, for a damaged checkpoint and the like:
        the last good version stays published.
    """
    if done_file is None and idle is None:
        raise ConfigurationError("a follow needs a done file or an idle time to know when "
                                 "the run has ended")
    directory = out_dir_of(out_dir)
    model = check_model_name(model_name)
    output = directory / f"{model}.h5"
    summary = FollowSummary(output)
    with run_claim(model, str(directory)) as claimed, _cluster(workers) as alive:
        if get_settings().broker_url:
            refuse_if_running(model, str(directory))
        tag = _FollowTag(uuid.uuid4().hex, time.time())
        try:
            _follow(model, directory, output, done_file, idle, cleanup, poll, on_version,
                    summary, claimed, alive, tag)
        except BaseException as exc:
            tag.end(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        tag.end("done")
    return summary


@dataclass
class _FollowTag:
    """The follow record of each version's job, which ``chkq status`` reads the follow from."""

    follow: str
    started: float
    last: tuple[str, dict[str, Any]] | None = None

    def version(self, job: str, number: int, through: int) -> None:
        entry = {"follow": self.follow, "version": number, "through": through,
                 "started": self.started}
        records().record_follow(job, entry)
        self.last = (job, entry)

    def end(self, outcome: str) -> None:
        """Mark the last version's record with the follow's end (best effort: the broker may
        be what failed)."""
        if self.last is None:
            return
        job, entry = self.last
        with contextlib.suppress(Exception):
            records().record_follow(job, {**entry, "ended": time.time(), "outcome": outcome})


def _follow(model: str, directory: Path, output: Path, done_file: str | Path | None,
            idle: float | None, cleanup: bool, poll: float,
            on_version: Callable[[Version], None] | None, summary: FollowSummary,
            claimed: Callable[[str], None], alive: Callable[[], None] | None,
            tag: _FollowTag) -> None:
    """The follow's loop: a version whenever more checkpoints are complete, until the end."""
    previous: str | None = None
    resumed = output.exists()
    published = -1
    last_new = time.monotonic()
    while True:
        ended = ((done_file is not None and Path(done_file).exists())
                 or (idle is not None and time.monotonic() - last_new > idle))
        progress = run_progress(directory, model, ended=ended)
        through = progress.through
        if progress.overtaken:
            raise _damaged(progress, published)
        if through is not None and through > published:
            job = _next(model, directory, through, previous, resumed)
            tag.version(job.id, len(summary.versions) + 1, through)
            claimed(job.id)
            result = _wait(job, alive)
            previous, published, resumed = job.id, through, False
            version = Version(len(summary.versions) + 1, job.id, through,
                              int(result.get("rows") or 0),
                              float(result.get("seconds") or 0.0), time.time(),
                              int(result.get("new_rows") or result.get("rows") or 0),
                              str(result.get("clone") or ""))
            summary.versions.append(version)
            summary.warnings.extend(str(w) for w in result.get("warnings") or [])
            if on_version is not None:
                on_version(version)
            last_new = time.monotonic()
            continue
        if ended:
            if progress.waiting:
                raise _damaged(progress, published)
            break
        if alive is not None:
            alive()
        time.sleep(poll)
    if cleanup and previous is not None:
        job = submit_version(model, directory, published, previous, cleanup=True)
        claimed(job.id)
        result = _wait(job, alive)
        summary.warnings.extend(str(w) for w in result.get("warnings") or [])


def _damaged(progress: RunProgress, published: int) -> BadCheckpointError:
    """The error of a checkpoint that will never be complete: the last version stays."""
    why = ("a later checkpoint is complete" if progress.overtaken
           else "the run has ended")
    kept = (f"MODEL.h5 stays at checkpoints 1..{published}" if published > 0
            else "no version was published")
    return BadCheckpointError(
        f"checkpoint file {str(progress.waiting[0])!r} is damaged or incomplete (it cannot be "
        f"read, or lacks trials_completed) though {why}: the follow stops; {kept}")


def _next(model: str, directory: Path, through: int, previous: str | None,
          resumed: bool) -> ConsolidationJob:
    """The job of the next version: a one-shot consolidation first, then extensions."""
    if previous is None and not resumed:
        return submit_consolidation(model, directory, through=through)
    return submit_version(model, directory, through, previous)


def _wait(job: ConsolidationJob, alive: Callable[[], None] | None) -> dict[str, Any]:
    summary: JobSummary = job.wait_for_summary(is_alive=alive)
    done = records().finished_result(job.id) or {}
    return {"seconds": summary.seconds, **done, "rows": summary.rows,
            "output": str(summary.output)}
