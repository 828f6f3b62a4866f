"""Submitting consolidation jobs and waiting for them: the Python API.

``submit_consolidation`` returns a :class:`ConsolidationJob`, a Celery
``AsyncResult`` for the job id with progress on top; ``consolidate_checkpoints``
submits and waits, running an embedded cluster when no broker is configured.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery.exceptions import ChordError
from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chkq.config.celery_app import app, settings
from chkq.discovery import check_model_name, check_out_dir
from chkq.finalize import discard_job_files
from chkq.naming import JobFiles
from chkq.tasks.base import PROGRESS
from chkq.tasks.consolidate import consolidation_signature, root_cause, task_id
from chkq.tasks.jobs import finished_result, job_info, record_submitted

POLL_SECONDS = 0.05
PROGRESS_SECONDS = 0.25

#: How long ``wait_for_output`` rides out a broker it cannot reach (a Redis restart).
OUTAGE_GRACE_SECONDS = 120.0

#: Errors that mean "the broker/result backend did not answer", not "the job failed".
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OperationalError, ConnectionError,
)


@dataclass(frozen=True)
class Progress:
    """Where a job stands: its phase and rows copied and verified out of ``total``."""

    phase: str
    copied: int = 0
    verified: int = 0
    total: int = 0


class JobLostError(RuntimeError):
    """The broker no longer knows the job (Redis restarted without persistence).

    Also raised when the broker stayed unreachable for longer than the grace
    period of :meth:`ConsolidationJob.wait_for_output`.
    """


class ConsolidationJob(AsyncResult):
    """A submitted consolidation: an AsyncResult on the job id, with progress.

    ``files`` (set by :func:`submit_consolidation`) names the job's files, so
    that a client that learns the job was lost can remove its temporaries.
    """

    files: JobFiles | None = None
    _progress_shown = 0.0

    def _plan_summary(self) -> dict[str, Any] | None:
        plan = AsyncResult(task_id(self.id, "plan"), app=self.app)
        return plan.result if plan.state == "SUCCESS" else None

    def _rows(self, step: str, count: int) -> int:
        done = 0
        for unit in range(count):
            result = AsyncResult(task_id(self.id, step, unit), app=self.app)
            state, info = result.state, result.info
            if state in (PROGRESS, "SUCCESS") and isinstance(info, dict):
                done += int(info.get("done") or info.get("rows") or 0)
        return done

    @property
    def progress(self) -> Progress:
        """Rows copied and verified so far (read from the result backend)."""
        if self.ready():
            return Progress("failed" if self.failed() else "done")
        summary = self._plan_summary()
        if summary is None:
            return Progress("planning")
        total = int(summary["rows"])
        copied = self._rows("copy", int(summary["copy_units"]))
        verified = self._rows("verify", int(summary["verify_units"]))
        phase = "verifying" if verified or copied >= total else "copying"
        return Progress(phase, copied, verified, total)

    def wait_for_output(
        self,
        timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        is_alive: Callable[[], None] | None = None,
        outage_grace: float = OUTAGE_GRACE_SECONDS,
    ) -> Path:
        """Block until the job ends; return the output path or raise the job's error.

        A broker that stops answering (Redis restarting) is waited for, up to
        ``outage_grace`` seconds at a time: with persistence the job carries
        on where it was.

        Raises
        ------
        TimeoutError
            After ``timeout`` seconds.
        JobLostError
            If the broker forgot the job (a Redis restart without persistence),
            or did not answer for ``outage_grace`` seconds. The job's
            temporaries are removed; its checkpoints were never touched.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        unreachable_since: float | None = None
        while True:
            try:
                if self._poll(on_progress):
                    break
                unreachable_since = None
            except BROKER_ERRORS as exc:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > outage_grace:
                    raise JobLostError(
                        f"the broker has not answered for {outage_grace:.0f} s ({exc}); "
                        f"the fate of job {self.id} is unknown: check the broker, then "
                        "submit it again"
                    ) from exc
            if is_alive is not None:
                is_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} did not finish within {timeout} s")
            time.sleep(POLL_SECONDS)
        return self._outcome()

    def _poll(self, on_progress: Callable[[Progress], None] | None) -> bool:
        """True once the job ended; raise JobLostError if the broker forgot it."""
        if self.ready():
            return True
        if job_info(self.id) is None:
            if finished_result(self.id) is not None or self.ready():
                return True
            removed = discard_job_files(self.files) if self.files is not None else []
            raise JobLostError(
                f"the broker no longer knows job {self.id} (was Redis restarted "
                "without persistence?); its checkpoints are untouched"
                + (f" and its {len(removed)} temporary files were removed" if removed else "")
                + ": submit it again"
            )
        now = time.monotonic()
        if on_progress is not None and now - self._progress_shown >= PROGRESS_SECONDS:
            self._progress_shown = now
            on_progress(self.progress)
        return False

    def _outcome(self) -> Path:
        if self.successful():
            return Path(self.result["output"])
        done = finished_result(self.id)
        if done is not None:
            return Path(done["output"])
        exc = self.result
        if isinstance(exc, ChordError):
            exc = root_cause(exc)
        if isinstance(exc, BaseException):
            raise exc
        raise RuntimeError(f"job {self.id} failed: {exc!r}")


def submit_consolidation(
    model_name: str, out_dir: str | Path | None = None, cleanup: bool = False
) -> ConsolidationJob:
    """Send a consolidation job to the configured cluster; return its handle at once.

    The model name and directory are checked here too, so that obvious
    mistakes are reported before anything is sent.
    """
    directory = check_out_dir(out_dir if out_dir is not None else os.getcwd())
    model = check_model_name(model_name)
    job = uuid.uuid4().hex
    record_submitted(job, model, str(directory))
    consolidation_signature(str(directory), model, job, cleanup).apply_async()
    handle = ConsolidationJob(job, app=app)
    handle.files = JobFiles(directory, model, job)
    return handle


def consolidate_checkpoints(
    model_name: str, out_dir: str | Path | None = None, cleanup: bool = False,
    *, workers: int | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> Path:
    """Consolidate ``model_name``'s checkpoints into ``OUT_DIR/MODEL.h5``; return its path.

    With ``CHKQ_BROKER_URL`` set, the job runs on that cluster; otherwise on
    an embedded cluster of ``workers`` local processes (default: CPU count).

    Raises
    ------
    FileNotFoundError
        No checkpoints.
    FileExistsError
        ``MODEL.h5`` exists, or appeared while the job ran.
    ValueError
        An incomplete, unreadable or non-HDF5 file, files that differ in
        structure, or output rows that differ from their source.
    """
    if settings.broker_url:
        job = submit_consolidation(model_name, out_dir, cleanup)
        return job.wait_for_output(on_progress=on_progress)
    from chkq.workers.embedded import EmbeddedCluster

    check_out_dir(out_dir if out_dir is not None else os.getcwd())
    check_model_name(model_name)
    with EmbeddedCluster(workers) as cluster:
        job = submit_consolidation(model_name, out_dir, cleanup)
        return job.wait_for_output(on_progress=on_progress, is_alive=cluster.check_alive)
