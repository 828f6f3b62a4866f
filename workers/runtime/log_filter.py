"""The worker's log filter: a task's expected failure is one WARNING line, not a traceback."""

from __future__ import annotations

import logging
import re

from chkq.errors import is_user_error


class UserErrorFilter(logging.Filter):
    """Log a task's expected failure (bad input, a refused run) as one WARNING line.

    Celery logs every exception a task raises as ``ERROR ... raised
    unexpected`` with its traceback, and chkq's tasks log ``fail ...`` at
    ERROR: a refused run (no checkpoints, output exists, a corrupt file) is
    not a bug, and a traceback only hides the one line that matters. Records
    about exceptions that :func:`chkq.errors.is_user_error` accepts are turned into
    WARNINGs without traceback; anything else (bugs) is left alone. (The task
    layer could say so itself, with ``Task.throws``.)
    """

    _ERROR_FIELD = re.compile(r"\berror=(\w+)\(")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if not self._about_user_error(record):
            return True
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if isinstance(record.args, dict) and record.args.get("description") == \
                "raised unexpected":
            record.args = {**record.args, "description": "refused"}
        return True

    @staticmethod
    def _about_user_error(record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is not None:
            return is_user_error(record.exc_info[0])
        args = record.args.values() if isinstance(record.args, dict) else (record.args or ())
        for arg in args:
            if isinstance(arg, BaseException):
                return is_user_error(type(arg))
        match = UserErrorFilter._ERROR_FIELD.search(record.getMessage())
        return bool(match and is_user_error(match.group(1)))


#: Loggers whose records :class:`UserErrorFilter` vets in workers.
FILTERED_LOGGERS = ("celery.app.trace", "celery.worker.request", "chkq.tasks", "chkq.worker",
                    "chkq")


def install_log_filter() -> None:
    """Attach :class:`UserErrorFilter` to the loggers tasks fail through."""
    user_errors = UserErrorFilter()
    for name in FILTERED_LOGGERS:
        logging.getLogger(name).addFilter(user_errors)
