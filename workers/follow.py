"""Following a running simulation: ``MODEL.h5`` kept current, one verified version at a time.

Whenever more checkpoints are complete (every file of each has
``trials_completed``, in number order), a follow publishes a new version of
``DIR/MODEL.h5`` holding all of them: the first version is an ordinary
consolidation job of the checkpoints so far, each later one a
``chkq.version`` job that extends the published file with the new
checkpoints only. Once the run has ended it publishes the final version,
equal in content to a one-shot consolidation of every checkpoint.

A :class:`Follow` (made by :func:`following`) decides what to publish; the
loop that drives it says when to look and when the run has ended. Two loops
drive it: :func:`follow_run` (``chkq consolidate --follow``), which looks
every quarter second and ends at a done file or after an idle time, and
``chkq watch --consolidate``, which looks between its commits and ends when
it decides the run has finished.

The same jobs run on the cluster ``CHKQ_BROKER_URL`` names or on an embedded
one started for the follow, as ``chkq consolidate`` runs them."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.config.celery_app import get_settings
from chkq.consolidation.discovery import check_model_name
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.consolidation.versions import RunProgress, run_progress
from chkq.errors import BadCheckpointError, ConfigurationError
from chkq.tasks.parties import plan_credential
from chkq.tasks.state import records
from chkq.workers.claims import refuse_if_running, run_claim
from chkq.workers.client import ConsolidationJob, JobSummary, out_dir_of, submit_consolidation

if TYPE_CHECKING:
    from chkq.workers.embedded import EmbeddedCluster

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
    #: Where the version was published, when it is not the follow's output path (a store's
    #: interim version object, or the final one at the destination key).
    where: str = ""

    def line(self) -> str:
        """What a follower prints of the version as it is published."""
        return (f"version {self.number}: checkpoints 1..{self.through}, {self.rows:,} rows "
                f"({self.new_rows:,} new) in {self.seconds:.1f} s"
                + (f": {self.where}" if self.where else ""))


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
                   cleanup: bool = False, prepare_next: bool = False) -> ConsolidationJob:
    """Send the job of the next version (``chkq.version``); return its handle at once.

    ``previous``: the job that published the version to extend (None: a
    ``MODEL.h5`` of unknown origin, whose rows the job verifies first).
    ``prepare_next``: the run goes on, so the job then clones its version for
    the next one, which waits for its own rows only.
    """
    from chkq.tasks.follow import version_signature

    job = uuid.uuid4().hex
    submitted = time.monotonic()
    party = plan_credential(job, str(directory), model, cleanup, False)
    records().record_submitted(job, model, str(directory))
    version_signature(str(directory), model, job, through, previous, cleanup,
                      party=party, prepare_next=prepare_next).apply_async()
    return ConsolidationJob.sent(job, JobFiles(directory, model, job), submitted)


@contextlib.contextmanager
def follow_cluster(workers: int | None) -> Iterator[EmbeddedCluster | None]:
    """The configured cluster (None), or an embedded one for the follow's length."""
    if get_settings().broker_url:
        yield None
        return
    from chkq.workers.embedded import EmbeddedCluster

    with EmbeddedCluster(workers) as cluster:
        yield cluster


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

    This is :func:`following`'s :class:`Follow` driven by a loop that looks
    every ``poll`` seconds; ``chkq watch --consolidate`` drives the same
    :class:`Follow` from its own loop.

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
    with following(model_name, out_dir, cleanup=cleanup, workers=workers,
                   on_version=on_version) as follow:
        last_new = time.monotonic()
        while True:
            ended = ((done_file is not None and Path(done_file).exists())
                     or (idle is not None and time.monotonic() - last_new > idle))
            if follow.step(ended) is not None:
                last_new = time.monotonic()
                continue
            if ended:
                break
            time.sleep(poll)
        return follow.finish()


@contextlib.contextmanager
def following(
    model_name: str, out_dir: str | Path | None = None, *, cleanup: bool = False,
    workers: int | None = None, on_version: Callable[[Version], None] | None = None,
    on_wait: Callable[[], None] | None = None,
) -> Iterator[Follow]:
    """A follow of the run for a ``with`` block, which drives it (see :class:`Follow`).

    For the block's length it holds the run's claim (a second follow or
    consolidation of the run is refused, naming this one) and the cluster:
    the one ``CHKQ_BROKER_URL`` names, or an embedded one of ``workers``
    processes started now. ``on_version`` hears of each version as it is
    published; ``on_wait`` is called at each poll while a version's job runs
    (a caller with work of its own between looks, as ``chkq watch`` commits
    files meanwhile). A block that raises marks the follow stopped with
    that error, for ``chkq status``; an embedded cluster then takes the
    temporaries of a version cut short with it.

    Raises
    ------
    RunBusyError
        Another follow or consolidation of the run is under way (naming it).
    """
    directory = out_dir_of(out_dir)
    model = check_model_name(model_name)
    with run_claim(model, str(directory)) as claimed, follow_cluster(workers) as cluster:
        if get_settings().broker_url:
            refuse_if_running(model, str(directory))
        tag = FollowTag(uuid.uuid4().hex, time.time())
        follow = Follow(model, directory, cleanup, on_version, on_wait, claimed, cluster, tag)
        try:
            yield follow
        except BaseException as exc:
            # An embedded cluster's records go with it: an interrupted command does not wait
            # on its broker (held, or stopping) to mark an end no one could read.
            if cluster is None or not isinstance(exc, KeyboardInterrupt):
                tag.end(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        finally:
            follow.discard_prepared()


@dataclass
class FollowTag:
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


class Follow:
    """One follow under way: a version of ``MODEL.h5`` whenever more checkpoints are complete.

    Made by :func:`following`, and driven by its caller's loop: :meth:`step`
    at each look while the run goes on, then :meth:`finish` once the run has
    ended. The caller decides when looks happen and when the run has ended
    (a done file, an idle time, a process that exited); the follow decides
    what to publish, so every driver publishes the same versions.

    Attributes
    ----------
    summary
        The output and every version published so far.
    """

    def __init__(self, model: str, directory: Path, cleanup: bool,
                 on_version: Callable[[Version], None] | None,
                 on_wait: Callable[[], None] | None, claimed: Callable[[str], None],
                 cluster: EmbeddedCluster | None, tag: FollowTag) -> None:
        self.model = model
        self.directory = directory
        self.summary = FollowSummary(directory / f"{model}.h5")
        self._cleanup = cleanup
        self._on_version = on_version
        self._on_wait = on_wait
        self._claimed = claimed
        self._cluster = cluster
        self._tag = tag
        self._previous: str | None = None
        self._resumed = self.summary.output.exists()
        self._published = -1

    def step(self, ended: bool = False) -> Version | None:
        """Look at the run once; publish the next version if more checkpoints are complete.

        Blocks while that version's job runs. ``ended``: the run has ended, so
        a checkpoint directory counts with the files it has, and a checkpoint
        still incomplete never will be. Returns the version published, or
        None when no checkpoint completed since the last.

        Raises
        ------
        BadCheckpointError
            A checkpoint that will never be complete (a later one is, or the
            run has ended), naming its file: the last good version stays.
        ChkqError
            As the version's job fails (a rewritten checkpoint:
            :class:`HistoryChangedError`).
        EmbeddedClusterError
            The embedded cluster's worker died.
        """
        self._check_alive()
        progress = run_progress(self.directory, self.model, ended=ended)
        if progress.overtaken:
            raise _damaged(progress, self._published)
        through = progress.through
        if through is not None and through > self._published:
            return self._publish(through, ended)
        if ended and progress.waiting:
            raise _damaged(progress, self._published)
        return None

    def finish(self) -> FollowSummary:
        """Once the run has ended: publish the final version, clean up if asked; return all.

        The final version holds every checkpoint complete now, equal in content
        to a one-shot consolidation of them. With ``cleanup`` the checkpoints
        are then deleted, as ``chkq consolidate --cleanup`` deletes them.
        Raises as :meth:`step`.
        """
        while self.step(ended=True) is not None:
            pass
        if self._cleanup and self._previous is not None:
            job = submit_version(self.model, self.directory, self._published, self._previous,
                                 cleanup=True)
            result = self._wait(job)
            self.summary.warnings.extend(str(w) for w in result.get("warnings") or [])
        self._tag.end("done")
        return self.summary

    def discard_prepared(self) -> None:
        """Remove the clone the last version's job prepared for a next version that never came."""
        if self._previous is not None:
            discard_job_files(JobFiles(self.directory, self.model, self._previous))

    def _publish(self, through: int, ended: bool) -> Version:
        """Publish the version through checkpoint ``through``, waiting for its job.

        ``ended``: the run has ended, so this version is its last and prepares no next one.
        """
        job = _next(self.model, self.directory, through, self._previous, self._resumed,
                    prepare_next=not ended)
        number = len(self.summary.versions) + 1
        self._tag.version(job.id, number, through)
        result = self._wait(job)
        self._previous, self._published, self._resumed = job.id, through, False
        version = Version(number, job.id, through, int(result.get("rows") or 0),
                          float(result.get("seconds") or 0.0), time.time(),
                          int(result.get("new_rows") or result.get("rows") or 0),
                          str(result.get("clone") or ""))
        self.summary.versions.append(version)
        self.summary.warnings.extend(str(w) for w in result.get("warnings") or [])
        if self._on_version is not None:
            self._on_version(version)
        return version

    def _check_alive(self) -> None:
        if self._cluster is not None:
            self._cluster.check_alive()

    def _waiting(self) -> None:
        self._check_alive()
        if self._on_wait is not None:
            self._on_wait()

    def _wait(self, job: ConsolidationJob) -> dict[str, Any]:
        """The result of job ``job``, claimed and (embedded) guarded while it runs."""
        self._claimed(job.id)
        if self._cluster is not None and job.files is not None:
            self._cluster.guard(job.files)
        summary: JobSummary = job.wait_for_summary(is_alive=self._waiting)
        done = records().finished_result(job.id) or {}
        return {"seconds": summary.seconds, **done, "rows": summary.rows,
                "output": str(summary.output)}


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
          resumed: bool, prepare_next: bool) -> ConsolidationJob:
    """The job of the next version: a one-shot consolidation first, then extensions."""
    if previous is None and not resumed:
        return submit_consolidation(model, directory, through=through)
    return submit_version(model, directory, through, previous, prepare_next=prepare_next)
