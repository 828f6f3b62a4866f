"""What every chkq task shares: one lifecycle, progress, a redelivery cap.

The lifecycle (:func:`task_lifecycle`) is the same for every task, in this
order: the message's arguments are checked before anything is read or
written, the delivery is counted, one line is logged when the body starts
and one when it ends (a user error, :func:`chkq.errors.is_user_error`, at
WARNING; anything else at ERROR).

Progress goes two ways: ``update_state(state="PROGRESS")`` for
the result backend, which the CLI reads, and a ``task-progress`` event,
which Flower shows. Both are throttled.

Each node's throughput at copying, verifying and merging is measured on its
own tasks and kept in the result backend (:meth:`ChkqTask.record_rate`); the
planner cuts a job's units to what the slowest node moves in the task time
budget (:func:`slowest_rates`), which bounds every unit's duration.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
from chkq.jobs import keys

log = logging.getLogger("chkq.tasks")

PROGRESS = "PROGRESS"
PROGRESS_INTERVAL = 0.5

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
        for raw in client.hvals(keys.rate(kind)):
            try:
                rate, when = json.loads(raw)
                rate, when = float(rate), float(when)
            except (ValueError, TypeError):
                continue
            if math.isfinite(rate) and rate > 0 and now - when <= RATE_MAX_AGE:
                old = rates[kind]
                rates[kind] = rate if old is None else min(old, rate)
    return rates


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
        key = keys.deliveries(task_id, self.request.retries or 0,
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
        key = keys.rate(kind)
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


@dataclass(frozen=True)
class Checked:
    """A task message's arguments once checked: what the body gets, what its log lines name.

    Attributes
    ----------
    subject
        The job (or, for a commit, the run) the task works for: the ``job=`` of its lines.
    args, kwargs
        The body's arguments, built from the checked message (resolved paths, parsed
        options), never the message's own values unchecked.
    what
        What the task works on, for its log lines (and people reading Flower).
    """

    subject: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    what: dict[str, Any] = field(default_factory=dict)


def scalars(result: dict[str, Any]) -> dict[str, Any]:
    """The fields of a task's result that fit on its end line (strings and numbers)."""
    return {k: v for k, v in result.items() if isinstance(v, str | int | float)}


def task_lifecycle(check: Callable[..., Checked],
                   summary: Callable[[dict[str, Any]], dict[str, Any]] = scalars
                   ) -> Callable[[Callable[..., dict[str, Any]]], Callable[..., dict[str, Any]]]:
    """Run a task's body inside the one lifecycle every chkq task has.

    ``check(self, *message_args, **message_kwargs)`` validates the message
    and returns what the body gets (:class:`Checked`); it raises a user
    error for a malformed message, before anything else happens. Then the
    delivery is counted (:meth:`ChkqTask.check_deliveries`), and the body
    runs between a start line and an end line, which ``summary`` of its
    result completes. The task's signature, which Celery checks a call
    against, is the message's — ``check``'s, with the body's return type.
    """
    def decorate(body: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        @functools.wraps(body)
        def task(self: ChkqTask, *args: Any, **kwargs: Any) -> dict[str, Any]:
            checked = check(self, *args, **kwargs)
            self.check_deliveries()
            with Timer(self.name, checked.subject, **checked.what) as timer:
                result = body(self, *checked.args, **checked.kwargs)
                timer.result = summary(result)
            return result
        signature = inspect.signature(check).replace(
            return_annotation=inspect.signature(body).return_annotation)
        task.__signature__ = signature  # type: ignore[attr-defined]
        return task
    return decorate
