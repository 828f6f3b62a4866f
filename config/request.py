"""The request class of every chkq task: time limits capped at the worker's.

Loaded by Celery by name (:data:`chkq.config.limits.REQUEST_CLASS`) where
tasks execute, so clients do not import the worker's request machinery.
The rules are in :mod:`chkq.config.limits`.
"""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request

from chkq.config.limits import clamp_limits, worker_limits


class WorkerLimitsRequest(Request):
    """A task request whose time limits are capped at the worker's (module docstring)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        asked = self._request_dict.get("timelimit")
        self.time_limits = clamp_limits(asked, worker_limits(self._app.conf))
        # The task's context (self.request.timelimit) and its retries see no
        # limits of the sender's.
        self._request_dict["timelimit"] = None
