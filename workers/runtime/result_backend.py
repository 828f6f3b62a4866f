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

Celery's Redis backend sends a chord's callback under a *claim*: the part
that completes the chord takes it (a lease of some seconds), sends the
callback, then marks the chord done. A part cut off between the claim and
the mark (the backend went away, its node was killed) runs again, but finds
the chord complete and the claim taken, and returns: no part is left to
send the callback once the lease lapses, and the job waits for ever. Here
a part that finds a claim not its own waits until it is marked done or
lapses; then, unless the callback is known to be sent (it has a state, or
the broker holds its message), it sends the callback itself.

:class:`RequeueOutages` is mixed into the app's backend class by the app
factory, which names it by import string (:data:`chkq.config.celery_app.BACKEND_MIXIN`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import states
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("chkq.worker")

#: Longest wait, in seconds, for another part's claim on a chord's callback to end.
CLAIM_WAIT_SECONDS = 120.0

#: Seconds between two looks at a chord's claim.
CLAIM_POLL_SECONDS = 0.25

_DONE = b"done"

#: Errors of a task that mean "the broker or the result backend did not answer".
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OperationalError)


def is_outage(exc: BaseException | None) -> bool:
    """True if ``exc`` (or the exception a wrapper holds) is a broker or backend outage."""
    exc = getattr(exc, "exc", exc)
    return isinstance(exc, OUTAGE_ERRORS)


class RequeueOutages:
    """Backend mixin: a task's outage error is neither stored nor passed to chords/errbacks,
    and a chord whose claim lapsed with its callback unsent is completed."""

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             propagate: Any = None, **kwargs: Any) -> Any:
        answer = super().on_chord_part_return(  # type: ignore[misc]
            request, state, result, propagate=propagate, **kwargs)
        group = getattr(request, "group", None)
        if not group or not hasattr(self, "get_key_for_group"):
            return answer
        if self._claim_lapsed(group, request) and not self._sent(request):
            log.warning("chord %s: the claim on its callback lapsed unsent (its holder was "
                        "cut off); sending the callback", group)
            return super().on_chord_part_return(  # type: ignore[misc]
                request, state, result, propagate=propagate, **kwargs)
        return answer

    def _sent(self, request: Any) -> bool:
        """True if the callback of ``request``'s chord is known to be sent: it has a state,
        or the broker holds its message (RabbitMQ's queues cannot be read: not known)."""
        from chkq.workers.liveness import broker_holds

        callback = getattr(request, "chord", None) or {}
        task_id = (callback.get("options") or {}).get("task_id")
        if not isinstance(task_id, str):
            return False
        if self.get_state(task_id) != states.PENDING:  # type: ignore[attr-defined]
            return True
        return broker_holds(task_id) is True

    def _claim_lapsed(self, group: str, request: Any) -> bool:
        """Wait while another part holds the claim on ``group``'s callback and the callback
        is not known to be sent: True if the claim lapsed with the chord not marked done."""
        client = self.client  # type: ignore[attr-defined]
        claim_key = self.get_key_for_group(group, ".c")  # type: ignore[attr-defined]
        size_key = self.get_key_for_group(group, ".s")  # type: ignore[attr-defined]
        claim = client.get(claim_key)
        if claim is None or claim == _DONE or self._sent(request):
            return False
        deadline = time.monotonic() + CLAIM_WAIT_SECONDS
        while time.monotonic() < deadline:
            time.sleep(CLAIM_POLL_SECONDS)
            claim = client.get(claim_key)
            if claim == _DONE:
                return False
            if claim is None:
                return bool(client.exists(size_key))
        log.warning("chord %s: its callback's claim is still held after %.0f s", group,
                    CLAIM_WAIT_SECONDS)
        return False

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
