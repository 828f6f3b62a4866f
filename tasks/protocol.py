"""A consolidation job's protocol: task ids, its state in Redis, and the link's proof.

Everything a job's steps record lives here, in the result backend's Redis,
where only workers (and clients, for submission) write — never in the run
directory, whose owner is not trusted (SPEC "Trust model"):

===============================  =============================================
key                              what
===============================  =============================================
``chkq-job-JOB-plan``            the plan (JSON), written once by ``chkq.plan``
``chkq-job-JOB-copied``          hash: copy unit -> its result (digests)
``chkq-job-JOB-merged``          the output's stamp once merged and durable
``chkq-job-JOB-verified``        hash: verify unit -> output stamp it verified
``chkq-job-JOB-failed``          the failure, as data (step, type, message)
``chkq-job-done-JOB``            the result once the output was linked
===============================  =============================================

``chkq.link`` publishes only when :func:`proof_gaps` finds nothing missing:
the plan exists for this directory and model, every copy unit and the
merge are recorded, and every verify unit (the whole-output check
included) verified the output *as it is now* (inode, size, mtime, ctime).
A duplicated, early, replayed or forged link message therefore cannot
publish an unverified file or delete a checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

from chkq.config.celery_app import app, settings
from chkq.plan import Plan
from chkq.stamps import FileStamp


def task_id(job: str, step: str, unit: int | None = None) -> str:
    """The id of one step of a job: ``JOB-plan``, ``JOB-copy-3``... (link: ``JOB``)."""
    return job if step == "link" else f"{job}-{step}" + ("" if unit is None else f"-{unit}")


def _key(job: str, what: str) -> str:
    return f"chkq-job-{job}-{what}"


def _client() -> Any:
    return app.backend.client


def store_plan(plan: Plan) -> Plan:
    """Record ``plan`` as its job's plan unless one is recorded; return the recorded one."""
    client = _client()
    if client.set(_key(plan.job_id, "plan"), plan.to_json(), nx=True,
                  ex=settings.result_expires):
        return plan
    recorded = recorded_plan(plan.job_id)
    assert recorded is not None
    return recorded


def recorded_plan(job: str) -> Plan | None:
    """The plan recorded for ``job``, or None."""
    raw = _client().get(_key(job, "plan"))
    return Plan.from_json(raw.decode() if isinstance(raw, bytes) else raw) if raw else None


def load_plan(job: str, out_dir: str, model: str) -> Plan:
    """The plan of ``job``, checked against the message's directory and model.

    Raises
    ------
    FileNotFoundError
        If the job has no plan (never planned, failed, cancelled or expired).
    ValueError
        If the message names another directory or model than the plan.
    """
    plan = recorded_plan(job)
    if plan is None:
        raise FileNotFoundError(f"consolidation job {job} has no recorded plan: it failed, "
                                "was cancelled, or its records expired")
    if plan.out_dir != out_dir or plan.model != model:
        raise ValueError(f"the message for job {job} names {out_dir!r}/{model!r}, but the job "
                         f"consolidates {plan.out_dir!r}/{plan.model!r}")
    return plan


def output_stamp(plan: Plan) -> list[int]:
    """The stamp of the job's temporary output now (not following a link)."""
    return FileStamp.of(os.lstat(plan.job.temp)).as_list()


def record_copied(job: str, unit: int, result: Any) -> None:
    """Record that copy unit ``unit`` finished, with what verification needs of it."""
    _hset(job, "copied", unit, result)


def copied(job: str) -> dict[int, Any]:
    """Results of the copy units that finished, by unit."""
    return _hgetall(job, "copied")


def record_merged(plan: Plan) -> None:
    """Record that the output is merged and durable, with its stamp."""
    _client().set(_key(plan.job_id, "merged"), json.dumps(output_stamp(plan)),
                  ex=settings.result_expires)


def merged(job: str) -> list[int] | None:
    """The output's stamp when it was merged, or None if it was not."""
    raw = _client().get(_key(job, "merged"))
    return json.loads(raw) if raw else None


def record_verified(plan: Plan, unit: int, stamp: list[int]) -> None:
    """Record that verify unit ``unit`` checked the output of stamp ``stamp``."""
    _hset(plan.job_id, "verified", unit, stamp)


def verified(job: str) -> dict[int, Any]:
    """Stamps of the output each finished verify unit checked, by unit."""
    return _hgetall(job, "verified")


def verify_unit_count(plan: Plan) -> int:
    """Verify units of a job: one per batch of files, plus the whole-output check (last)."""
    return len(plan.verify_units) + 1


def proof_gaps(plan: Plan) -> list[str]:
    """What the job's records lack for its output to be published (empty: proven)."""
    job = plan.job_id
    gaps = []
    done = copied(job)
    missing = [u for u in range(len(plan.copy_units)) if u not in done]
    if missing:
        gaps.append(f"copy units {missing[:5]} did not finish")
    merged_stamp = merged(job)
    if merged_stamp is None:
        gaps.append("the merge did not finish")
    checks = verified(job)
    try:
        now = output_stamp(plan)
    except FileNotFoundError:
        return [*gaps, "the temporary output is gone"]
    if now[3] != plan.temp_inode:
        gaps.append("the temporary output is not the file the job planned")
    if merged_stamp is not None and merged_stamp != now:
        gaps.append("the output changed after it was merged")
    for unit in range(verify_unit_count(plan)):
        if unit not in checks:
            gaps.append(f"verify unit {unit} did not finish")
        elif checks[unit] != now:
            gaps.append(f"verify unit {unit} checked another version of the output")
    return gaps


def record_failed(job: str, step: str, exc: BaseException) -> None:
    """Record a job's failure as data: the failing step, exception type and message."""
    _client().set(_key(job, "failed"), json.dumps(
        {"step": step, "type": type(exc).__name__, "message": str(exc)}),
        ex=settings.result_expires)


def failure(job: str) -> dict[str, str] | None:
    """The recorded failure of ``job`` (step, type, message), or None."""
    raw = _client().get(_key(job, "failed"))
    return json.loads(raw) if raw else None


def forget_progress(job: str) -> None:
    """Drop a finished or failed job's plan and step records (its result stays)."""
    _client().delete(*(_key(job, what) for what in ("plan", "copied", "merged", "verified")))


def _hset(job: str, what: str, unit: int, value: Any) -> None:
    client = _client()
    key = _key(job, what)
    client.hset(key, str(unit), json.dumps(value))
    client.expire(key, settings.result_expires)


def _hgetall(job: str, what: str) -> dict[int, Any]:
    raw = _client().hgetall(_key(job, what))
    return {int(k): json.loads(v) for k, v in raw.items()}
