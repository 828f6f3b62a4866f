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


def record_cancelled(job: str, by: str = "chkq cancel") -> dict[str, Any]:
    """Remember that ``job`` was cancelled (kept as long as results are); return the entry.

    Tasks of the job that a worker picks up later can check :func:`cancelled`
    and stop before touching anything.
    """
    entry = {"job": job, "cancelled": time.time(), "by": by}
    _client().set(f"chkq-job-cancelled-{job}", json.dumps(entry), ex=settings.result_expires)
    return entry


def cancelled(job: str) -> dict[str, Any] | None:
    """What :func:`record_cancelled` recorded for ``job``, or None if it was not cancelled."""
    raw = _client().get(f"chkq-job-cancelled-{job}")
    return json.loads(raw) if raw else None


def find_jobs(prefix: str, limit: int = 10) -> list[str]:
    """Ids of recorded jobs that start with ``prefix`` (at most ``limit``, sorted).

    Lets people type a job id's first digits, as with git commits.
    """
    found: set[str] = set()
    for key in _client().scan_iter(match=f"chkq-job-{prefix}*", count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        job = name.removeprefix("chkq-job-")
        if len(job) == 32 and all(c in "0123456789abcdef" for c in job):
            found.add(job)
            if len(found) > limit:
                break
    return sorted(found)[:limit]
