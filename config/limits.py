"""Time limits are the worker's, never a message's.

Celery 5.7 takes a task's limits from the ``timelimit`` header of its
message, ``(hard, soft)``, and falls back to the task's ``time_limit`` /
``soft_time_limit`` only when the header is empty
(``celery.worker.request.Request.__init__`` and ``execute_using_pool``).
Whoever can write to the broker (and, before this module, every chkq client,
whose own ``task_time_limit`` went into every message) could therefore run a
task for as long as they liked: past the Redis visibility timeout, so that the
message is delivered again and runs twice at once.

:class:`chkq.workers.runtime.request.WorkerLimitsRequest` is the request class of every chkq
task (the app's ``task_cls`` and :class:`chkq.tasks.base.ChkqTask` name it). It caps
the message's limits at the worker's own (``CHKQ_TIME_LIMIT``,
``CHKQ_SOFT_TIME_LIMIT``, kept in the app's configuration under
:data:`CONF_KEY`), treats a missing, zero, negative or non-numeric limit as
the worker's, and removes the header from what the task sees, so that a retry
or a replacement message carries no limits either. A message may shorten its
limits, never lengthen them. Remote control (``celery control time_limit``)
changes a task's class attributes, which are not read here either.
"""

from __future__ import annotations

import math
from typing import Any

from chkq.errors import ConfigurationError

#: Key of the app configuration that holds the worker's ``(hard, soft)`` limits in seconds.
CONF_KEY = "chkq_time_limits"

#: Request class path, as Celery's ``Task.Request`` and ``task_cls`` expect it.
REQUEST_CLASS = "chkq.workers.runtime.request:WorkerLimitsRequest"


def _positive(value: Any) -> float | None:
    """``value`` if it is a positive finite number of seconds, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def clamp_limits(message: Any, worker: tuple[float, float]) -> tuple[float, float]:
    """The ``(hard, soft)`` limits a task runs under.

    Parameters
    ----------
    message
        The message's ``timelimit`` header: ``(hard, soft)``, None, or anything
        a hostile sender put there.
    worker
        The worker's ``(hard, soft)`` limits, both positive, soft <= hard.

    Returns
    -------
    tuple of float
        Each limit is the message's if it is a positive number below the
        worker's, else the worker's; the soft limit never exceeds the hard one.
    """
    worker_hard, worker_soft = worker
    asked_hard = asked_soft = None
    if isinstance(message, list | tuple) and len(message) == 2:
        asked_hard, asked_soft = _positive(message[0]), _positive(message[1])
    hard = min(asked_hard or worker_hard, worker_hard)
    soft = min(asked_soft or worker_soft, worker_soft, hard)
    return float(hard), float(soft)


def worker_limits(conf: Any) -> tuple[float, float]:
    """The worker's ``(hard, soft)`` limits from the app configuration ``conf``.

    Raises
    ------
    RuntimeError
        If the app was not configured by :func:`chkq.config.celery_app.celery_config`:
        running a task with no limit at all is worse than not running it.
    """
    limits = conf.get(CONF_KEY)
    if not (isinstance(limits, list | tuple) and len(limits) == 2
            and all(_positive(v) is not None for v in limits)):
        raise ConfigurationError(f"the app's configuration has no valid {CONF_KEY!r}: {limits!r}")
    return float(limits[0]), float(limits[1])
