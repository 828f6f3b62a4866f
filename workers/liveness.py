"""Whether the workers that a job's running tasks name still run them.

A task recorded as running (``STARTED`` or ``PROGRESS``) names the worker
node and pool process that last recorded it. :func:`check_workers` asks
those nodes, once and only them, which tasks they run: a task whose node
does not answer, or answers but no longer runs it, is on a gone worker,
and the broker's records say when its message goes to another worker.
``chkq status`` and a waiting client (:mod:`chkq.workers.client`) both use it.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chkq.jobs.status import JobStatus, UnitState

#: Seconds a liveness check waits for the workers running a job's tasks to answer.
LIVENESS_TIMEOUT = 1.5


def _running(statuses: list[JobStatus]) -> list[UnitState]:
    return [u for s in statuses for units in s.steps.values() for u in units
            if u.state in ("STARTED", "PROGRESS") and u.worker]


def check_workers(statuses: list[JobStatus]) -> str | None:
    """Mark the running tasks of ``statuses`` whose worker is gone, and when they run again.

    One ``inspect active`` to the nodes the tasks name, nothing when no task
    runs. A node that does not answer within :data:`LIVENESS_TIMEOUT` is
    gone; one that answers but does not run the task (its pool process died,
    or the node restarted under the same name) no longer runs it, once the
    task's state, read again after the answers, still names that node and
    process: a task that ended or moved meanwhile is shown as it is now.

    Returns
    -------
    str or None
        A warning for people when the workers could not be asked (the broker
        unreachable): the tasks are then shown as their states say.
    """
    from kombu.exceptions import OperationalError

    from chkq.config.celery_app import get_app
    from chkq.jobs.status import unit_states
    from chkq.tasks.state import fetch_metas

    units = _running(statuses)
    if not units:
        return None
    nodes = sorted({str(u.worker) for u in units})
    try:
        replies = get_app().control.inspect(destination=nodes, timeout=LIVENESS_TIMEOUT,
                                            limit=len(nodes)).active() or {}
    except (OperationalError, OSError) as exc:
        return (f"could not ask the workers whether they still run these tasks: the broker "
                f"is unreachable ({type(exc).__name__}: {exc})")
    suspects: list[UnitState] = []
    for unit in units:
        if unit.worker not in replies:
            unit.worker_gone = "not answering"
            suspects.append(unit)
            continue
        active = replies.get(str(unit.worker)) or []
        if not any(isinstance(t, dict) and t.get("id") == unit.task_id for t in active):
            unit.worker_gone = "it answers but does not run the task"
            suspects.append(unit)
    if not suspects:
        return None
    now = unit_states(fetch_metas, [u.task_id for u in suspects])
    for unit in suspects:
        again = now[unit.task_id]
        if (again.state, again.worker, again.pid) != (unit.state, unit.worker, unit.pid):
            vars(unit).update(vars(again))  # it moved or ended meanwhile: show it as it is
    gone = [u for u in suspects if u.worker_gone]
    if gone:
        _redelivery(gone)
    return None


def _redelivery(units: list[UnitState]) -> None:
    """Say when the broker hands the messages of ``units`` (tasks of gone workers) out again.

    RabbitMQ returns a consumer's unacknowledged messages to their queue as
    soon as its connection closes: at once when the worker's process died,
    within about two heartbeats when its host went silent. Redis keeps a
    delivered message in its unacknowledged index, stamped with the moment
    of delivery, until a live worker's sweep finds it older than the
    visibility timeout.
    """
    from chkq.config.celery_app import get_app, get_settings
    from chkq.config.settings import AMQP_SCHEMES, broker_scheme
    from chkq.jobs.status import when

    settings = get_settings()
    if broker_scheme(get_app().conf.broker_url) in AMQP_SCHEMES:
        within = (f"within ~{2 * settings.broker_heartbeat} s (two heartbeats)"
                  if settings.broker_heartbeat else "when TCP gives up (heartbeats are off)")
        for unit in units:
            unit.redelivery = ("RabbitMQ redelivers it once the worker's connection is closed: "
                               f"at once if its process died, {within} if its host went silent")
        return
    import redis

    try:
        delivered, queued = _redis_held({u.task_id for u in units})
    except (redis.RedisError, OSError) as exc:
        for unit in units:
            unit.redelivery = f"when is unknown: the broker could not be read ({exc})"
        return
    now = time.time()
    for unit in units:
        if unit.task_id in queued:
            unit.redelivery = "back in its queue: the next free worker runs it"
        elif unit.task_id in delivered:
            by = delivered[unit.task_id] + settings.takeover_bound
            unit.redelivered_by = by
            timeout = f"the broker's visibility timeout, {settings.visibility_timeout} s"
            unit.redelivery = (
                f"redelivered by {when(by)}, in ~{round(by - now)} s ({timeout}, swept by a "
                "running worker)" if by > now else
                f"overdue since {when(by)} ({timeout}): the next worker to start redelivers it")
        else:
            unit.redelivery = "its message is neither queued nor held by the broker"


def broker_holds(task_id: str) -> bool | None:
    """Whether the broker holds a message of task ``task_id``, queued or delivered and not
    acknowledged; None if that cannot be read (RabbitMQ gives no look inside its queues,
    or Redis did not answer)."""
    import redis

    from chkq.config.celery_app import get_app
    from chkq.config.settings import AMQP_SCHEMES, broker_scheme

    if broker_scheme(get_app().conf.broker_url) in AMQP_SCHEMES:
        return None
    try:
        delivered, queued = _redis_held({task_id})
    except (redis.RedisError, OSError):
        return None
    return task_id in delivered or task_id in queued


def _redis_held(tasks: set[str]) -> tuple[dict[str, float], set[str]]:
    """Of ``tasks``: when each delivered but unacknowledged message was delivered, and
    which wait in a queue, read from kombu's Redis transport (its ``unacked`` hash of
    ``[message, exchange, routing key]`` by delivery tag, its ``unacked_index`` of
    delivery times, and the queues' lists)."""
    import redis

    from chkq.config.celery_app import get_app
    from chkq.workers.cancel import redis_queued

    client = redis.Redis.from_url(get_app().conf.broker_url)
    delivered: dict[str, float] = {}
    try:
        for tag, raw in client.hscan_iter("unacked", count=1000):
            try:
                task = json.loads(raw)[0].get("headers", {}).get("id")
            except (ValueError, AttributeError, IndexError, KeyError, TypeError):
                continue
            if isinstance(task, str) and task in tasks:
                score = client.zscore("unacked_index", tag)
                if score is not None:
                    delivered[task] = max(delivered.get(task, 0.0), float(score))
        queued = {task for _, _, task in redis_queued(client) if task in tasks}
    finally:
        client.close()
    return delivered, queued
