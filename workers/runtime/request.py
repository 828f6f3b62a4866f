"""The request class of every chkq task: time limits capped at the worker's, outages retried.

Loaded by Celery by name (:data:`chkq.config.limits.REQUEST_CLASS`) where
tasks execute, so clients do not import the worker's request machinery.
The rules of the limits are in :mod:`chkq.config.limits`. A task that
failed because the broker or the result backend did not answer is handed
back to its queue after a delay that grows with each such failure
(:func:`requeue_delay`), never recorded as failed
(:mod:`chkq.workers.runtime.result_backend`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from celery.exceptions import Reject
from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.asynchronous import get_event_loop

from chkq.backoff import Backoff
from chkq.config.limits import clamp_limits, worker_limits
from chkq.workers.runtime.result_backend import OUTAGE_ERRORS, is_outage

log = logging.getLogger("chkq.worker")

__all__ = ["OUTAGE_ERRORS", "WorkerLimitsRequest", "requeue_delay"]

#: Seconds before a message interrupted by an outage goes back to its queue: the first
#: time, then doubled at each outage of the same task in this worker, up to the last.
REQUEUE_BACKOFF = Backoff(1.0, 30.0)
#: Tasks whose outages this worker remembers (for the doubling), the oldest forgotten first.
REMEMBERED_OUTAGES = 1024
_outages: OrderedDict[str, int] = OrderedDict()


def requeue_delay(task_id: str) -> float:
    """Seconds to hold ``task_id``'s message before handing it back after an outage.

    A worker that reaches the broker but not the result backend would
    otherwise take the same message back at once and fail it again, tens
    of times a second, for as long as the cut lasts.
    """
    count = _outages.pop(task_id, 0)
    _outages[task_id] = count + 1
    while len(_outages) > REMEMBERED_OUTAGES:
        _outages.popitem(last=False)
    return REQUEUE_BACKOFF.wait(count)


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
        the worker has reconnected (:mod:`chkq.workers.runtime.broker_transport`),
        after a delay (:func:`requeue_delay`) during which this worker takes
        no other message in its place; the redelivery cap bounds how often.
        """
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, Reject) and exc.requeue and is_outage(exc.reason):
            exc = exc.reason
        if is_outage(exc) and not self.acknowledged:
            task_ready(self)
            delay = requeue_delay(self.id)
            log.warning("task %s[%s] interrupted by a broker or backend outage (%r): "
                        "handed back to run again in %.0f s", self.task_name, self.id, exc,
                        delay)
            hub = get_event_loop()
            if hub is None:
                self.reject(requeue=True)
            else:
                hub.call_later(delay, self.reject, True)
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
        (:mod:`chkq.workers.runtime.broker_transport`) and runs again: the record of
        a retry is not needed for that.
        """
        try:
            super()._announce_cancelled(emit_retry=emit_retry)
        except Exception as exc:  # noqa: BLE001 - the backend may be any way down
            self._already_cancelled = True
            log.warning("task %s[%s] cancelled at a broker connection loss; its retry could "
                        "not be recorded (%r): it runs again once its message is back",
                        self.task_name, self.id, exc)
