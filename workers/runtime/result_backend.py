"""The result backend never records a broker or backend outage as a task's failure.

When a task meets a connection error of the result backend (or of the
broker), Celery's tracer records the failure in the backend, counts the task
as a failed member of its chord and runs its errbacks, all from the pool
process, before the worker's request class sees it. If the backend answers
again by then (the cut is over, a new connection succeeds), the whole job
fails with ``Dependency JOB-verify-1 raised ConnectionError`` although
nothing was wrong with its input. Such a failure says nothing about the
task: it is not recorded here, and the request class
(:class:`chkq.workers.runtime.request.WorkerLimitsRequest`) hands the message back
to run again.

:class:`RequeueOutages` is mixed into the app's backend class by the app
factory, which names it by import string (:data:`chkq.config.celery_app.BACKEND_MIXIN`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("chkq.worker")

#: Errors of a task that mean "the broker or the result backend did not answer".
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OperationalError)


def is_outage(exc: BaseException | None) -> bool:
    """True if ``exc`` (or the exception a wrapper holds) is a broker or backend outage."""
    exc = getattr(exc, "exc", exc)
    return isinstance(exc, OUTAGE_ERRORS)


class RequeueOutages:
    """Backend mixin: a task's outage error is neither stored nor passed to chords/errbacks."""

    def mark_as_failure(self, task_id: str, exc: BaseException, traceback: Any = None,
                        request: Any = None, store_result: bool = True,
                        call_errbacks: bool = True, state: str = states.FAILURE) -> Any:
        if request is not None and is_outage(exc):
            log.warning("task %s met a broker or backend outage (%r): not recorded as "
                        "failed, it runs again", task_id, exc)
            return None
        return super().mark_as_failure(  # type: ignore[misc]
            task_id, exc, traceback=traceback, request=request, store_result=store_result,
            call_errbacks=call_errbacks, state=state)
