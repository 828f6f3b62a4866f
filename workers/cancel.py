"""Cancel a job on a cluster: its queued messages removed, its tasks stopped, its temporaries gone.

It removes the job's messages still queued in the broker, revokes its tasks
(terminating running ones), removes its temporaries, and records the job as
cancelled, which ``chkq status`` shows. Its checkpoints are never touched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chkq.jobs.records import task_id

#: How long ``chkq cancel`` waits for the job's running tasks to stop.
CANCEL_WAIT_SECONDS = 15.0


def job_task_ids(job: str, plan: dict[str, Any] | None) -> list[str]:
    """Every task and group id the job has or will have (as far as its plan tells)."""
    ids = [task_id(job, "plan"), task_id(job, "merge"), job, f"{job}-copies", f"{job}-verifies"]
    if plan:
        ids += [task_id(job, "copy", n) for n in range(int(plan.get("copy_units") or 0))]
        ids += [task_id(job, "verify", n) for n in range(int(plan.get("verify_units") or 0))]
    return ids


def _of_job(task: str, job: str) -> bool:
    return task == job or task.startswith(job + "-")


def purge_queued(job: str) -> int:
    """Remove the job's messages still waiting in the broker's queues; return how many.

    A revoke reaches only the workers alive now: a message left in a queue
    would run on a worker started later.
    """
    from chkq.config.celery_app import get_app
    from chkq.config.settings import AMQP_SCHEMES, broker_scheme

    if broker_scheme(get_app().conf.broker_url) in AMQP_SCHEMES:
        return _purge_amqp(job)
    return _purge_redis(job)


def redis_queued(client: Any) -> Iterator[tuple[bytes, bytes, str]]:
    """``(list key, raw message, task id)`` of every message waiting in chkq's queues.

    kombu's Redis transport keeps each queue as lists (one per priority step)
    of JSON messages whose headers carry the task id.
    """
    from chkq.config.routing import QUEUES

    for queue in QUEUES:
        keys = [k for k in client.scan_iter(match=f"{queue}*", count=1000)
                if k.decode(errors="replace") == queue
                or k.decode(errors="replace").startswith(queue + "\x06\x16")]
        for key in keys:
            for raw in client.lrange(key, 0, -1):
                try:
                    task = json.loads(raw).get("headers", {}).get("id", "")
                except (ValueError, AttributeError):
                    continue
                if isinstance(task, str):
                    yield key, raw, task


def _purge_redis(job: str) -> int:
    """Remove the job's messages from the queues' lists in Redis."""
    import redis

    from chkq.config.celery_app import get_app

    client = redis.Redis.from_url(get_app().conf.broker_url)
    removed = 0
    try:
        for key, raw, task in list(redis_queued(client)):
            if _of_job(task, job):
                removed += int(client.lrem(key, 0, raw))  # type: ignore[arg-type]
    finally:
        client.close()
    return removed


def _purge_amqp(job: str) -> int:
    """Take every message waiting in chkq's RabbitMQ queues, keep the job's, hand back the rest.

    AMQP removes a message only by acknowledging it, so each queue's
    messages are fetched one by one (``basic.get``, as many as the queue
    held when the sweep began) and held unacknowledged: the job's are then
    acknowledged (removed), every other one is returned to its queue
    (``basic.reject`` with requeue). Should this process die meanwhile, RabbitMQ
    returns all it held when its connection closes: no message is lost, and
    for the sweep's few seconds other workers merely do not see them.
    Messages that workers hold reserved are out of reach here; the revoke
    that :func:`cancel_job` broadcasts drops those.
    """
    from chkq.config.celery_app import get_app
    from chkq.config.routing import task_queues

    removed = 0
    with get_app().connection_for_write() as connection:
        channel = connection.default_channel
        for queue in task_queues(quorum=True):
            bound = queue.bind(channel)
            try:
                _, waiting, _ = bound.queue_declare(passive=True)
            except connection.channel_errors:
                channel = connection.channel()  # a queue never declared: nothing queued
                continue
            others: list[Any] = []
            for _ in range(waiting):
                message = bound.get(no_ack=False)
                if message is None:
                    break
                task = (message.headers or {}).get("id")
                if isinstance(task, str) and _of_job(task, job):
                    message.ack()
                    removed += 1
                else:
                    others.append(message)
            for message in others:
                message.requeue()
    return removed


#: Seconds the workers get to say which tasks they run (one broadcast per look).
INSPECT_SECONDS = 1.0


def _running_tasks(job: str) -> tuple[set[str], set[str]]:
    """Ids of the job's tasks that live workers run now, and the workers that answered.

    One broadcast (``inspect active``). Tasks a worker holds reserved are
    left out: they run nothing yet, and the revoke makes the worker drop
    them when their turn comes.
    """
    from chkq.config.celery_app import get_app

    replies = get_app().control.inspect(timeout=INSPECT_SECONDS).active() or {}
    found = {str(t["id"]) for tasks in replies.values() for t in tasks or []
             if isinstance(t, dict) and _of_job(str(t.get("id")), job)}
    return found, set(replies)


def cancel_job(job: str) -> str:
    """Cancel consolidation job ``job`` on the cluster; return what was done, for people.

    Order matters: record the cancellation first (so nothing takes it for a
    lost job), remove queued messages, revoke and terminate running tasks,
    wait for them to stop, then remove the temporaries they were writing.

    Raises
    ------
    LookupError
        Unknown job.
    ValueError
        The job already finished or failed: there is nothing to cancel.
    """
    from chkq.config.celery_app import get_app
    from chkq.consolidation.temporaries import JobFiles, discard_job_files
    from chkq.tasks.state import job_status, records

    status = job_status(job)
    if status.state == "SUCCESS":
        raise ValueError(f"job {job} already finished ({status.output}): nothing to cancel")
    if status.state == "FAILURE":
        raise ValueError(f"job {job} already failed ({status.error}): nothing to cancel")
    if status.state == "CANCELLED":
        return f"job {job} was already {status.error}"
    records().record_cancelled(job)
    purged, revoked, stopped = 0, set[str](), set[str]()
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    running: set[str] = set()
    current = job_status(job)
    while True:
        ids = [i for i in job_task_ids(job, current.plan) if i not in revoked]
        purged += purge_queued(job)
        if ids:
            get_app().control.revoke(ids, terminate=True, signal="SIGTERM")
            revoked.update(ids)
        active, answered = _running_tasks(job)
        # A task recorded as running whose worker did not answer runs nowhere (the
        # worker is gone): there is nothing to wait for.
        running = active | {
            u.task_id for units in current.steps.values() for u in units
            if u.state in ("STARTED", "PROGRESS", "RETRY") and u.worker in answered}
        stopped |= running
        # The plan may have finished meanwhile and launched copies: read the job again
        # (no broadcast) and look once more only if it has tasks not yet revoked.
        current = job_status(job)
        fresh = any(i not in revoked for i in job_task_ids(job, current.plan))
        if (not running and not fresh) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    get_app().backend.mark_as_revoked(job, reason="cancelled")
    removed: list[Path] = []
    where = ""
    if status.out_dir and status.model:
        try:
            removed = discard_job_files(JobFiles(Path(status.out_dir), status.model, job))
        except OSError as exc:
            where = f"; its temporaries in {status.out_dir} could not be removed here ({exc})"
    still = f", {len(running)} still stopping" if running else ""
    return (f"cancelled job {job}: {purged} queued tasks removed, {len(stopped)} running tasks "
            f"stopped{still}, {len(removed)} temporary files removed{where}")
