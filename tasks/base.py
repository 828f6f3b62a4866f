"""What every chkq task shares: a log line at start and end, progress, a redelivery cap.

Progress goes two ways: ``update_state(state="PROGRESS")`` for
the result backend, which the CLI reads, and a ``task-progress`` event,
which Flower shows. Both are throttled.

Each node's throughput at copying, verifying and merging is measured on its
own tasks and kept in the result backend (:meth:`ChkqTask.record_rate`); the
planner cuts a job's units to what the slowest node moves in the task time
budget (:func:`slowest_rates`), which bounds every unit's duration.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Retry

from chkq.config.celery_app import get_settings
from chkq.config.limits import REQUEST_CLASS
from chkq.errors import (  # noqa: F401 (re-exported)
    ChkqError,
    JobInterruptedError,
    PoisonMessageError,
    is_user_error,
)

log = logging.getLogger("chkq.tasks")

PROGRESS = "PROGRESS"
PROGRESS_INTERVAL = 0.5

#: Redis hash (result backend) per kind of work: node name -> ``[bytes per second, when]``.
RATE_KEY = "chkq-rate-{kind}"
#: Kinds of work whose rate is measured.
RATE_KINDS = ("copy", "verify", "merge")
#: Only tasks that moved this many bytes or ran this long are timed. A rate only matters
#: when it is low enough to cut units below the byte bound, and a task of at least a MiB
#: that slow runs long enough for its fixed cost (opening files) to be a small part of it;
#: a tiny task is mostly fixed cost and would make every later job's units tiny.
RATE_MIN_BYTES = 1024 * 1024
RATE_MIN_SECONDS = 2.0
#: A node's rate older than this is not used (the node may be gone or its storage changed).
RATE_MAX_AGE = 24 * 3600


def _client(app: Any) -> Any:
    return getattr(app.backend, "client", None)


def slowest_rates(app: Any, now: float | None = None) -> dict[str, float | None]:
    """The lowest recent rate (bytes/s) of any node at each kind of work, None if unmeasured.

    The slowest node sets the budget: any node may take any unit. Entries
    that are not ``[positive finite number, time]`` are ignored.
    """
    client = _client(app)
    now = time.time() if now is None else now
    rates: dict[str, float | None] = dict.fromkeys(RATE_KINDS)
    if client is None:
        return rates
    for kind in RATE_KINDS:
        for raw in client.hvals(RATE_KEY.format(kind=kind)):
            try:
                rate, when = json.loads(raw)
                rate, when = float(rate), float(when)
            except (ValueError, TypeError):
                continue
            if math.isfinite(rate) and rate > 0 and now - when <= RATE_MAX_AGE:
                old = rates[kind]
                rates[kind] = rate if old is None else min(old, rate)
    return rates


def deliveries_key(task_id: str, retries: int = 0, replaced: int = 0) -> str:
    """Redis key (result backend) counting deliveries of one task message.

    A task that replaced itself (``Task.replace``, as ``chkq.plan`` does for
    a large run) hands its id on: ``replaced`` (the replacement's nesting)
    keeps the two messages' counts apart.
    """
    return f"chkq-deliveries-{task_id}-{retries}" + (f"-r{replaced}" if replaced else "")


class ChkqTask(Task):
    """Base class of chkq tasks (see module docstring)."""

    abstract = True
    Request = REQUEST_CLASS  # time limits are the worker's
    _last_report = 0.0

    def check_deliveries(self) -> None:
        """Fail a message that was delivered more often than the cap allows.

        With late acks and reject-on-worker-lost, a task that kills its worker
        process is delivered again at once; without a cap it would loop for ever.
        The count lives in the result backend's Redis under the task's id.
        """
        client = getattr(self.backend, "client", None)
        task_id = self.request.id
        if client is None or task_id is None:
            return
        key = deliveries_key(task_id, self.request.retries or 0,
                             self.request.get("replaced_task_nesting") or 0)
        count = client.incr(key)
        client.expire(key, get_settings().result_expires)
        if count > get_settings().max_redeliveries:
            raise PoisonMessageError(
                f"task {self.name}[{task_id}] was delivered {count} times without "
                f"finishing (its worker died each time); giving up"
            )

    def record_rate(self, kind: str, nbytes: int, seconds: float) -> None:
        """Keep this node's rate at ``kind`` of work: ``nbytes`` moved in ``seconds``."""
        client = _client(self)
        node = self.request.hostname
        if client is None or not node or nbytes <= 0 or seconds <= 0:
            return
        if nbytes < RATE_MIN_BYTES and seconds < RATE_MIN_SECONDS:
            return
        key = RATE_KEY.format(kind=kind)
        client.hset(key, node, json.dumps([nbytes / seconds, time.time()]))
        client.expire(key, RATE_MAX_AGE)

    def report(self, done: int, total: int, **info: Any) -> None:
        """Publish progress, at most every PROGRESS_INTERVAL seconds (and at the end)."""
        now = time.monotonic()
        if done < total and now - self._last_report < PROGRESS_INTERVAL:
            return
        self._last_report = now
        meta = {"done": done, "total": total, **info}
        if self.request.id and not self.request.called_directly:
            # Which worker runs the task, as Celery's STARTED state says: ``chkq
            # status`` asks that worker whether it still does.
            self.update_state(state=PROGRESS, meta={
                **meta, "hostname": self.request.hostname, "pid": os.getpid()})
            self.send_event("task-progress", **meta)


class Timer:
    """Logs one line when a task starts and one when it ends, with what it did.

    A step that ends with a user error (bad input, a changed checkpoint...)
    logs its end at WARNING; only an unexpected exception logs at ERROR.
    """

    def __init__(self, task: str, job: str, **what: Any) -> None:
        self.task, self.job, self.what = task, job, what
        self.started = time.monotonic()

    def _fields(self, extra: dict[str, Any]) -> str:
        items = {"task": self.task, "job": self.job, **self.what, **extra}
        return " ".join(f"{k}={v}" for k, v in items.items())

    def __enter__(self) -> Timer:
        log.info("start %s", self._fields({}))
        self.result: dict[str, Any] = {}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        seconds = round(time.monotonic() - self.started, 3)
        if exc is None:
            log.info("end %s", self._fields({**self.result, "seconds": seconds}))
        elif isinstance(exc, Ignore | Retry):
            log.info("skip %s", self._fields({"why": type(exc).__name__, "seconds": seconds}))
        else:
            (log.warning if is_user_error(type(exc)) else log.error)(
                "fail %s", self._fields({"error": repr(exc), "seconds": seconds}))
