"""The request class of every chkq task: time limits capped at the worker's.

Loaded by Celery by name (:data:`chkq.config.limits.REQUEST_CLASS`) where
tasks execute, so clients do not import the worker's request machinery.
The rules are in :mod:`chkq.config.limits`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.request import Request

from chkq.config.limits import clamp_limits, worker_limits

log = logging.getLogger("chkq.worker")


class WorkerLimitsRequest(Request):
    """A task request whose time limits are capped at the worker's (module docstring)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        asked = self._request_dict.get("timelimit")
        self.time_limits = clamp_limits(asked, worker_limits(self._app.conf))
        # The task's context (self.request.timelimit) and its retries see no
        # limits of the sender's.
        self._request_dict["timelimit"] = None

    def _announce_cancelled(self, emit_retry: bool = True) -> None:
        """Mark the request cancelled even when the result backend is down.

        Celery cancels running tasks when the broker connection is lost and
        records them as retrying; with Redis (broker and backend) restarting,
        that record fails, the request is left "not cancelled", and when its
        terminated process is reaped Celery records the task as revoked,
        failing the whole job. The message itself goes back to its queue
        (:mod:`chkq.config.broker_transport`) and runs again: the record of
        a retry is not needed for that.
        """
        try:
            super()._announce_cancelled(emit_retry=emit_retry)
        except Exception as exc:  # noqa: BLE001 - the backend may be any way down
            self._already_cancelled = True
            log.warning("task %s[%s] cancelled at a broker connection loss; its retry could "
                        "not be recorded (%r): it runs again once its message is back",
                        self.task_name, self.id, exc)
