"""What a client waiting on a job watches besides the job: its end, and the workers it needs.

:class:`EndSignal` wakes the client the moment the job's last step stores its
result; :class:`QueueWatch` tells, within seconds, when no worker serves the queue
the job waits in, or when a worker running its task is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chkq.config.celery_app import get_app
from chkq.config.routing import NODE_QUEUE_PREFIX
from chkq.tasks.state import job_status

if TYPE_CHECKING:
    from chkq.workers.client import ConsolidationJob

#: Errors that mean "the broker/result backend did not answer", not "the job failed".
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OperationalError, ConnectionError,
)

#: When a waiting client first checks that a worker serves its job's queue, and how
#: often after that (each check is a broadcast that waits up to ``INSPECT_SECONDS``).
FIRST_WORKER_CHECK_SECONDS = 2.0
WORKER_CHECK_SECONDS = 10.0
INSPECT_SECONDS = 1.0
#: A queue no worker answered for is asked about once more, waiting this long, before the
#: client says so: a worker busy with a long task can miss a one-second broadcast.
CONFIRM_SECONDS = 2.0

#: The queue a job waits in, by the phase ``chkq status`` gives it.
PHASE_QUEUES = {"queued": "chkq.control", "fetching": "chkq.copy",
                "planning": "chkq.control", "copying": "chkq.copy",
                "merging": "chkq.control", "verifying": "chkq.verify",
                "linking": "chkq.control"}


def served_queues(timeout: float = INSPECT_SECONDS) -> set[str]:
    """Names of the queues that live workers consume from (a broadcast; waits ``timeout``)."""
    replies = get_app().control.inspect(timeout=timeout).active_queues() or {}
    return {str(q.get("name")) for queues in replies.values() for q in queues or []
            if isinstance(q, dict)}


class EndSignal:
    """Wakes a waiting client as soon as the job's result is stored.

    The job's result (its link step's, or the failure stored under the job
    id) is written by Celery's Redis result backend with a ``PUBLISH`` on
    the result's key: a subscription to that channel lets :meth:`wait`
    return the moment the job ends instead of at the next poll. It only
    wakes the client, which then reads the job's records as it always does;
    without a Redis subscription (another backend, a broker outage) it
    sleeps.
    """

    def __init__(self, job: AsyncResult) -> None:
        self._pubsub: Any = None
        try:
            key = job.backend.get_key_for_task(job.id)
            pubsub = job.backend.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(key)
            self._pubsub = pubsub
        except Exception:  # noqa: BLE001 - a wake-up only: polling still decides
            self._pubsub = None

    def __enter__(self) -> EndSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the job's result is published meanwhile."""
        if self._pubsub is None:
            time.sleep(seconds)
            return
        try:
            self._pubsub.get_message(timeout=seconds)
        except Exception:  # noqa: BLE001 - the broker went away: poll from now on
            self.close()
            time.sleep(seconds)

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None


class QueueWatch:
    """Tells, once per queue, when no worker serves the queue a job waits in.

    Without it, a job sent to a cluster with no worker (or none for, say,
    the copy queue) waits silently for ever. The check is a broadcast that
    waits ``INSPECT_SECONDS`` for replies; it runs in a thread of its own,
    so that the waiting client notices the job's end as soon as it comes.
    """

    def __init__(self, job: ConsolidationJob, notice: Callable[[str], None]) -> None:
        self.job, self.notice = job, notice
        self.next_check = time.monotonic() + FIRST_WORKER_CHECK_SECONDS
        self.told: set[str] = set()
        self.checking: threading.Thread | None = None

    def waiting_in(self) -> tuple[str, str] | None:
        """The queue the job waits in now, and its phase (None: it is not waiting)."""
        status = job_status(self.job.id)
        if status.state not in ("PENDING", "RUNNING"):
            return None
        queue = status.queue or PHASE_QUEUES.get(status.phase)
        return (queue, status.phase) if queue else None

    def check(self) -> None:
        """Start a check of the job's queue and workers, if one is due and none is running."""
        now = time.monotonic()
        if now < self.next_check or (self.checking is not None and self.checking.is_alive()):
            return
        self.next_check = now + WORKER_CHECK_SECONDS
        try:
            waiting = self.waiting_in()
        except (LookupError, *BROKER_ERRORS):  # type: ignore[misc]
            return
        if waiting is None:
            return
        self.checking = threading.Thread(target=self._look, args=waiting,
                                         name="chkq-queue-watch", daemon=True)
        self.checking.start()

    def _look(self, queue: str, phase: str) -> None:
        try:
            if queue not in self.told:
                self._tell_if_unserved(queue, phase)
            self._tell_gone_workers(phase)
        except Exception:  # noqa: BLE001 - advisory: the broker may be down, the client closing
            return

    def _tell_gone_workers(self, phase: str) -> None:
        """Say which worker running a task of the job is gone, and when the task runs again.

        The same check as ``chkq status`` (one ``inspect active`` to the nodes
        the job's running tasks name), told once per task and worker.
        """
        from chkq.workers.liveness import check_workers

        status = job_status(self.job.id)
        check_workers([status])
        for units in status.steps.values():
            for unit in units:
                seen = f"{unit.task_id} {unit.worker} {unit.pid}"
                if not unit.worker_gone or seen in self.told:
                    continue
                self.told.add(seen)
                self.notice(f"the worker {unit.worker} running task {unit.task_id} of job "
                            f"{self.job.id} is gone ({unit.worker_gone}; {phase}): "
                            f"{unit.redelivery or 'it runs again when the broker redelivers it'}"
                            f"; still waiting (chkq status {self.job.id}; chkq cancel "
                            f"{self.job.id} to cancel it)")

    def _tell_if_unserved(self, queue: str, phase: str) -> None:
        if queue in served_queues() or queue in served_queues(CONFIRM_SECONDS):
            return
        self.told.add(queue)
        if queue.startswith(NODE_QUEUE_PREFIX):
            node = queue.removeprefix(NODE_QUEUE_PREFIX)
            self.notice(f"the worker {node}, which holds job {self.job.id} in its scratch "
                        f"directory, is gone ({phase}); start it again (chkq worker -n {node}, "
                        f"the same CHKQ_SCRATCH_DIR) or cancel the job (chkq cancel "
                        f"{self.job.id}) and submit it again; still waiting")
            return
        short = queue.removeprefix("chkq.")
        self.notice(f"no worker serves queue {queue}, where job {self.job.id} waits ({phase}); "
                    f"start one (chkq worker -Q {short}) or cancel the job (chkq cancel "
                    f"{self.job.id}); still waiting")
