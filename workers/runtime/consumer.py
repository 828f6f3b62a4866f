"""The worker's message consumer, which refuses malformed task messages without dying.

Imported by Celery in worker processes only (the app's ``worker_consumer``
names it), so clients do not load the worker's machinery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker.consumer import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import prepare_accept_content
from kombu.utils.encoding import safe_repr

log = logging.getLogger("chkq.worker")


class GuardedConsumer(Consumer):
    """The worker's message consumer, hardened against hostile or broken messages.

    Celery refuses pickle, but two holes remain in 5.7: kombu passes bodies
    of the "trusted" content types ``application/data`` and
    ``application/text`` through undecoded, and Celery's task handler then
    crashes the whole worker (``Unrecoverable error: TypeError``) on them; so
    do bodies or headers of the wrong shape (a JSON number as the body, a
    list as the task name). With late acks the message goes back to the
    queue and kills every worker that takes it. Here a task message must
    have an accepted content type, and any error while *receiving* one
    (before it reaches a pool process) discards that message with a log
    line instead of stopping the worker.
    """

    class Blueprint(Consumer.Blueprint):
        """Celery's consumer steps but native delayed delivery.

        On quorum queues Celery would declare 28 delay exchanges and queues
        and bind chkq's queues to them; chkq's queues use direct exchanges,
        which that scheme cannot serve (it only warns), and chkq's only
        countdowns are seconds long, held by the worker until due.
        """

        default_steps = [step for step in Consumer.Blueprint.default_steps
                         if not step.endswith(":DelayedDelivery")]

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        handler = super().create_task_handler(*args, **kwargs)
        accepted = prepare_accept_content(self.app.conf.accept_content)
        connection_errors = tuple(self.connection_errors) + tuple(self.channel_errors)

        def on_task_received(message: Any) -> Any:
            if message.content_type not in accepted:
                return self.on_invalid_task(None, message, ContentDisallowed(
                    f"refusing task message of content type {message.content_type!r}: "
                    f"accepted are {', '.join(sorted(accepted))}"))
            problem = _header_problem(message.headers)
            if problem is None:
                try:
                    problem = _body_problem(message.decode())
                except DecodeError as exc:
                    return self.on_decode_error(message, exc)
            if problem:
                return self.on_invalid_task(None, message, InvalidTaskError(problem))
            try:
                return handler(message)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the worker
                # kombu's Redis transport counts KeyError as a connection error, but
                # here one comes from the message: reconnecting would redeliver it.
                if isinstance(exc, connection_errors) and not isinstance(exc, KeyError):
                    raise
                log.error("discarded malformed task message: %r; headers=%s body=%s", exc,
                          safe_repr(message.headers)[:512], safe_repr(message.body)[:512])
                if not message.acknowledged:
                    message.reject_log_error(log, self.connection_errors)
                return None

        return on_task_received


def _header_problem(headers: Any) -> str | None:
    """Why task message ``headers`` are not those of a protocol 2 task, or None.

    chkq never sends protocol 1 (the task name in the body), so a message
    without a task name and id of the right type in its headers is refused.
    """
    if not isinstance(headers, dict):
        return "task message without headers (protocol 1 is not accepted)"
    for key in ("task", "id"):
        value = headers.get(key)
        if not isinstance(value, str) or not value:
            return f"task message header {key!r} is {safe_repr(value)[:80]}, not a name"
    retries, limits = headers.get("retries"), headers.get("timelimit")
    if retries is not None and (not isinstance(retries, int) or isinstance(retries, bool)):
        return f"task message header 'retries' is {safe_repr(retries)[:80]}, not a number"
    if limits is not None and not (
            isinstance(limits, list | tuple) and len(limits) == 2
            and all(v is None or isinstance(v, int | float) for v in limits)):
        return f"task message header 'timelimit' is {safe_repr(limits)[:80]}"
    return None


def _body_problem(body: Any) -> str | None:
    """Why a decoded protocol 2 body is not ``[args, kwargs, embed]``, or None.

    Celery checks this only in the pool process, where some errors escape
    its handling and leave the message unacknowledged, holding a prefetch
    slot for good.
    """
    if not (isinstance(body, list | tuple) and len(body) == 3):
        return f"task message body is not [args, kwargs, embed]: {safe_repr(body)[:80]}"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        return "task message body: args must be a list and kwargs a mapping"
    if embed is None:
        return None
    if not isinstance(embed, dict):
        return f"task message body: embed is {safe_repr(embed)[:80]}, not a mapping"
    for key in ("callbacks", "errbacks", "chain"):
        value = embed.get(key)
        if value is not None and not (
                isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return f"task message body: {key} must be a list of signatures"
    chord_ = embed.get("chord")
    if chord_ is not None and not isinstance(chord_, dict):
        return "task message body: chord must be a signature"
    return None
