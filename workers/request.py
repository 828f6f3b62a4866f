"""The request class of every chkq task: time limits capped at the worker's.

Loaded by Celery by name (:data:`chkq.config.limits.REQUEST_CLASS`) where
tasks execute, so clients do not import the worker's request machinery.
The rules are in :mod:`chkq.config.limits`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chkq.config.limits import clamp_limits, worker_limits

log = logging.getLogger("chkq.worker")

#: Errors of a task that mean "the broker or the result backend did not answer".
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OperationalError)


class WorkerLimitsRequest(Request):
    """A task request whose time limits are capped at the worker's (module docstring)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        asked = self._request_dict.get("timelimit")
        self.time_limits = clamp_limits(asked, worker_limits(self._app.conf))
        # The task's context (self.request.timelimit) and its retries see no
        # limits of the sender's.
        self._request_dict["timelimit"] = None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        """A task that failed because the broker or result backend went away runs again.

        Such a failure says nothing about the task's input: recording it
        would fail the whole job with a bare connection error (or, with the
        backend down, record nothing and park the job). The message goes
        back to its queue instead, at once on a live connection, or once
        the worker has reconnected (:mod:`chkq.workers.broker_transport`);
        the redelivery cap bounds how often.
        """
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, OUTAGE_ERRORS) and not self.acknowledged:
            task_ready(self)
            log.warning("task %s[%s] interrupted by a broker or backend outage (%r): "
                        "handed back to run again", self.task_name, self.id, exc)
            self.reject(requeue=True)
            return None
        return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                  return_ok=return_ok)

    def _announce_cancelled(self, emit_retry: bool = True) -> None:
        """Mark the request cancelled even when the result backend is down.

        Celery cancels running tasks when the broker connection is lost and
        records them as retrying; with Redis (broker and backend) restarting,
        that record fails, the request is left "not cancelled", and when its
        terminated process is reaped Celery records the task as revoked,
        failing the whole job. The message itself goes back to its queue
        (:mod:`chkq.workers.broker_transport`) and runs again: the record of
        a retry is not needed for that.
        """
        try:
            super()._announce_cancelled(emit_retry=emit_retry)
        except Exception as exc:  # noqa: BLE001 - the backend may be any way down
            self._already_cancelled = True
            log.warning("task %s[%s] cancelled at a broker connection loss; its retry could "
                        "not be recorded (%r): it runs again once its message is back",
                        self.task_name, self.id, exc)
