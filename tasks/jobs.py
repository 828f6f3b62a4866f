"""Job bookkeeping in the result backend's Redis, beside Celery's own results.

Celery overwrites a task's stored state when the task runs again (a
redelivered ``chkq.link`` first stores STARTED), so the fact that a job
finished is kept under a key of its own, and the recent jobs are listed
for ``chkq status``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from chkq.config.celery_app import app, settings

RECENT_JOBS = "chkq-jobs"
RECENT_LIMIT = 200


def _client() -> Any:
    return app.backend.client


def record_submitted(job: str, model: str, out_dir: str) -> None:
    """Remember a submitted job so that ``chkq status`` can list it."""
    client = _client()
    entry = json.dumps({"job": job, "model": model, "out_dir": out_dir, "submitted": time.time()})
    client.set(f"chkq-job-{job}", entry, ex=settings.result_expires)
    client.lpush(RECENT_JOBS, job)
    client.ltrim(RECENT_JOBS, 0, RECENT_LIMIT - 1)


def job_info(job: str) -> dict[str, Any] | None:
    """What was recorded when ``job`` was submitted, or None."""
    raw = _client().get(f"chkq-job-{job}")
    return json.loads(raw) if raw else None


def recent_jobs(limit: int = 20) -> list[str]:
    """Ids of the most recently submitted jobs, newest first."""
    return [j.decode() if isinstance(j, bytes) else j
            for j in _client().lrange(RECENT_JOBS, 0, limit - 1)]


def record_finished(job: str, result: dict[str, Any]) -> None:
    """Remember that ``job`` linked its output (kept as long as results are)."""
    _client().set(f"chkq-job-done-{job}", json.dumps(result), ex=settings.result_expires)


def finished_result(job: str) -> dict[str, Any] | None:
    """The result of ``job`` if it already finished, else None."""
    raw = _client().get(f"chkq-job-done-{job}")
    return json.loads(raw) if raw else None
