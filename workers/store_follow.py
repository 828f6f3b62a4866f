"""Following a running simulation whose checkpoints are in an object store.

``chkq consolidate MODEL --from URL --follow --done-file PATH`` (or ``--idle
SECONDS``): the follower (this process) lists the run in the store with its
own store settings, every quarter second, and whenever the listing changed
sends one ``chkq.store_version`` job (:mod:`chkq.tasks.store_follow`) and
waits for it. The first goes to any worker; every later one to the worker
that took the first (its own queue), whose scratch directory keeps the
fetched checkpoints and the current version between versions. Each job
publishes the next version if more checkpoints are complete: an object of
its own under ``DEST.versions/``, then its pointer, which readers find the
latest version by (:mod:`chkq.staging.follow_versions`).

The run has ended when the done file exists — a path **on the follower's
machine**, which workers need not see — or after the idle time with no
change in the store's listing. The last job then publishes the final
version at the destination key a one-shot ``--from`` job would write,
create-if-absent; after ``keep_versions`` seconds (readers holding an
interim version may still be reading it) the interim versions and the
worker's workspace are deleted.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chkq.config.celery_app import get_settings
from chkq.consolidation.discovery import check_model_name
from chkq.errors import BadCheckpointError, ConfigurationError, NoCheckpointsError
from chkq.tasks.parties import stage_credential
from chkq.tasks.state import records
from chkq.workers.claims import refuse_if_running, run_claim
from chkq.workers.client import ConsolidationJob
from chkq.workers.follow import POLL_SECONDS, FollowTag, Version, follow_cluster

#: Seconds the interim versions stay after the final version is published, by default.
KEEP_VERSIONS_SECONDS = 30.0
#: Seconds a stopped follow waits for its workspace to be removed before it gives up.
DISCARD_SECONDS = 30.0


@dataclass
class StoreFollowSummary:
    """What a follow of a store run published: the final output's URL, every version in order."""

    output: str = ""
    versions: list[Version] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def line(self) -> str:
        last = self.versions[-1] if self.versions else None
        if last is None:
            return f"{self.output or 'the follow'}: no version published"
        return (f"{self.output}: {len(self.versions)} versions, the last through checkpoint "
                f"{last.through} ({last.rows:,} rows)")


def _listing(source: str, model: str, ended: bool,
             before: tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...]:
    """The run's objects in the store now, each name with its version (empty: none yet).

    While the run goes on, a listing the store refuses (a checkpoint directory of a
    ``file://`` store made but its first file not yet in it) is taken as no change
    (``before``); once it has ended, the refusal is the follow's error.
    """
    from chkq.staging import find_store_run

    try:
        found = find_store_run(source, model, None, core=get_settings().core())
    except NoCheckpointsError:
        return ()
    except BadCheckpointError:
        if ended or before is None:
            raise
        return before
    return tuple((o.name, o.version) for o in found.objects)


def _check_destination(source: str, model: str, to: str | None) -> None:
    """Refuse, before anything is sent, a destination that already holds an output."""
    from chkq.staging import find_store_run
    from chkq.tasks.from_store import check_destination_free, destination_of

    try:
        found = find_store_run(source, model, None, core=get_settings().core())
    except NoCheckpointsError:
        return
    check_destination_free(found, destination_of(found, to))


def follow_store_run(
    model_name: str, source: str, *, to: str | None = None,
    done_file: str | Path | None = None, idle: float | None = None,
    workers: int | None = None, poll: float = POLL_SECONDS,
    keep_versions: float = KEEP_VERSIONS_SECONDS,
    on_version: Callable[[Version], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> StoreFollowSummary:
    """Publish a version of the store run's output after each completed checkpoint, to the end.

    ``done_file``: a local path; the follow ends once it exists, after
    publishing the final version. ``idle``: or once this many seconds pass
    with no change in the store's listing. ``keep_versions``: seconds the
    interim versions are kept after the final one is published, for readers
    still reading one. ``on_version`` hears of each version as it is published;
    ``on_notice`` hears while a version's job waits that no worker serves its
    queue, or that the worker running it is gone (the follow waits on).

    Raises
    ------
    RunBusyError
        Another follow or consolidation of the run is under way (naming it).
    StoreDestinationExistsError
        The destination holds an output already.
    HistoryChangedError
        An object a version was made from was replaced: the last version stays.
    ChkqError
        As a consolidation raises (a damaged checkpoint, naming its object):
        the last version stays the latest.
    """
    if done_file is None and idle is None:
        raise ConfigurationError("a follow needs a done file or an idle time to know when "
                                 "the run has ended")
    model = check_model_name(model_name)
    _check_destination(source, model, to)
    with run_claim(model, source) as claimed, follow_cluster(workers) as cluster:
        if get_settings().broker_url:
            refuse_if_running(model, source)
        follow = _StoreFollow(model, source, to, claimed, cluster, on_version, on_notice)
        try:
            last_new = time.monotonic()
            while True:
                ended = ((done_file is not None and Path(done_file).exists())
                         or (idle is not None and time.monotonic() - last_new > idle))
                if follow.look(ended):
                    last_new = time.monotonic()
                if ended:
                    break
                time.sleep(poll)
            follow.finish(keep_versions)
        except BaseException as exc:
            if cluster is None or not isinstance(exc, KeyboardInterrupt):
                follow.tag.end(f"{type(exc).__name__}: {exc}".splitlines()[0])
                follow.discard()
            raise
        return follow.summary


def _where(result: dict[str, Any]) -> str:
    """Where a version went, and what of it the store copied from the version before."""
    copied = int(result.get("copied_bytes") or 0)
    return str(result.get("output") or "") + (
        f" ({copied:,} of {int(result.get('bytes') or 0):,} bytes copied by the store from "
        "the previous version)" if copied else "")


class _StoreFollow:
    """One follow of a store run under way: its jobs, its worker's queue, what it published."""

    def __init__(self, model: str, source: str, to: str | None,
                 claimed: Callable[[str], None], cluster: Any,
                 on_version: Callable[[Version], None] | None,
                 on_notice: Callable[[str], None] | None = None) -> None:
        self.model, self.source, self.to = model, source, to
        self.summary = StoreFollowSummary()
        self.tag = FollowTag(uuid.uuid4().hex, time.time())
        self._claimed, self._cluster, self._on_version = claimed, cluster, on_version
        self._on_notice = on_notice
        self._queue: str | None = None
        self._listed: tuple[tuple[str, str], ...] | None = None
        self._final = 0

    def look(self, ended: bool) -> bool:
        """Look at the store once; send a job if its listing changed (or the run ended).

        Returns whether the listing changed (new or changed objects).
        """
        listed = _listing(self.source, self.model, ended, self._listed)
        changed = listed != self._listed
        if changed and listed:
            self._run(ended=ended, final=False)
        self._listed = listed
        return changed

    def finish(self, keep_versions: float) -> None:
        """Publish the final version; after ``keep_versions`` seconds, delete the interim ones."""
        from chkq.tasks.store_follow import end_signature

        result = self._run(ended=True, final=True)
        self.summary.output = str(result.get("output") or "")
        self._final = int(result["version"])
        self.tag.end("done")
        time.sleep(keep_versions)
        end_signature(self.tag.follow, self.source, self.model, self.to, self._final,
                      self._queue).apply_async().get()

    def discard(self) -> None:
        """After a failure: remove the worker's workspace, keeping every version (best effort).

        A follow started again resumes from the newest version in the store.
        """
        from chkq.tasks.store_follow import end_signature

        if self._queue is None:
            return
        with contextlib.suppress(Exception):
            end_signature(self.tag.follow, self.source, self.model, self.to, 0,
                          self._queue).apply_async().get(timeout=DISCARD_SECONDS)

    def _run(self, ended: bool, final: bool) -> dict[str, Any]:
        """Send one ``chkq.store_version`` job and wait for it; note a version it published."""
        from chkq.tasks.store_follow import store_version_signature

        job = uuid.uuid4().hex
        submitted = time.monotonic()
        party = stage_credential(job, self.source, self.model, None, self.to, False, False)
        records().record_submitted(job, self.model, self.source)
        store_version_signature(job, self.tag.follow, self.source, self.model, self.to, ended,
                                final, self._queue, party).apply_async()
        self._claimed(job)
        handle = ConsolidationJob.sent(job, submitted_at=submitted)
        handle.wait_for_summary(is_alive=self._check_alive, on_notice=self._on_notice)
        result = records().finished_result(job) or {}
        self._queue = str(result.get("queue") or "") or self._queue
        if result.get("published"):
            number = int(result["version"])
            self.tag.version(job, number, int(result["through"]))
            version = Version(number, job, int(result["through"]), int(result.get("rows") or 0),
                              float(result.get("seconds") or 0.0), time.time(),
                              int(result.get("new_rows") or 0),
                              where=_where(result))
            self.summary.versions.append(version)
            if self._on_version is not None:
                self._on_version(version)
        self.summary.warnings.extend(str(w) for w in result.get("warnings") or [])
        return result

    def _check_alive(self) -> None:
        if self._cluster is not None:
            self._cluster.check_alive()
