"""A job's state as this process reaches it: the app's result backend and record key.

The records themselves are :mod:`chkq.jobs`; this module binds them to the
Celery app of this process (its backend's Redis client, its settings).
"""

from __future__ import annotations

from typing import Any

from chkq.config.celery_app import get_app, get_settings
from chkq.config.security import record_key
from chkq.jobs.records import JobRecords
from chkq.jobs.status import JobStatus
from chkq.jobs.status import job_status as _job_status

#: Record keys derived in this process, by signing key file: derived once (a PEM parse).
_RECORD_KEYS: dict[str, bytes | None] = {}


def record_secret() -> bytes | None:
    """This process's job-record key, or None when message signing is off."""
    settings = get_settings()
    if settings.security_key is None:
        return None
    if settings.security_key not in _RECORD_KEYS:
        _RECORD_KEYS[settings.security_key] = record_key(settings)
    return _RECORD_KEYS[settings.security_key]


def worker_roots() -> tuple[str, ...]:
    """The directories a job's steps may touch: ``CHKQ_ALLOWED_ROOTS`` and this worker's
    scratch directory (where a store job's run is fetched); empty: no restriction."""
    settings = get_settings()
    roots = settings.allowed_roots
    return roots and (*roots, str(settings.scratch_root))


def records() -> JobRecords:
    """The job records in this process's result backend, sealed with its record key.

    Plans read back must name a run directory inside :func:`worker_roots`.
    """
    return JobRecords(get_app().backend.client, record_secret(), get_settings().result_expires,
                      worker_roots())


def fetch_metas(task_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """Stored result metadata of ``task_ids`` (None: nothing stored), in one MGET per 1,000."""
    backend = get_app().backend
    metas: dict[str, dict[str, Any] | None] = {}
    for start in range(0, len(task_ids), 1000):
        batch = task_ids[start:start + 1000]
        raws = backend.client.mget([backend.get_key_for_task(t) for t in batch])
        for task_id, raw in zip(batch, raws, strict=True):
            metas[task_id] = backend.decode_result(raw) if raw else None
    return metas


def job_status(job: str) -> JobStatus:
    """The state of ``job`` now (:func:`chkq.jobs.status.job_status`)."""
    return _job_status(records(), fetch_metas, job)
