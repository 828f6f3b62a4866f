"""Queue routing: which queue each kind of chkq task goes to.

Operators give I/O-heavy copies their own workers by starting them with
``chkq worker -Q copy``; a worker started without ``-Q`` serves every queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chkq.errors import ConfigurationError

if TYPE_CHECKING:
    from kombu import Queue

CONTROL_QUEUE = "chkq.control"
COPY_QUEUE = "chkq.copy"
VERIFY_QUEUE = "chkq.verify"
COMMIT_QUEUE = "chkq.commit"

QUEUES: tuple[str, ...] = (CONTROL_QUEUE, COPY_QUEUE, VERIFY_QUEUE, COMMIT_QUEUE)

#: Each worker also serves a queue of its own, ``chkq.node.NODENAME``: the steps of a job
#: whose files are in that worker's scratch directory are sent there.
NODE_QUEUE_PREFIX = "chkq.node."

#: Short names accepted by ``chkq worker -Q`` (``copy`` means ``chkq.copy``).
SHORT_NAMES: dict[str, str] = {name.removeprefix("chkq."): name for name in QUEUES}

TASK_ROUTES: dict[str, dict[str, str]] = {
    "chkq.stage": {"queue": CONTROL_QUEUE},
    "chkq.fetch": {"queue": COPY_QUEUE},
    "chkq.part": {"queue": COPY_QUEUE},
    "chkq.assemble": {"queue": CONTROL_QUEUE},
    "chkq.verify_object": {"queue": VERIFY_QUEUE},
    "chkq.publish_verified": {"queue": CONTROL_QUEUE},
    "chkq.plan": {"queue": CONTROL_QUEUE},
    "chkq.scan": {"queue": CONTROL_QUEUE},
    "chkq.merge": {"queue": CONTROL_QUEUE},
    "chkq.link": {"queue": CONTROL_QUEUE},
    "chkq.fail": {"queue": CONTROL_QUEUE},
    "chkq.copy": {"queue": COPY_QUEUE},
    "chkq.verify": {"queue": VERIFY_QUEUE},
    "chkq.version": {"queue": COPY_QUEUE},
    "chkq.store_version": {"queue": CONTROL_QUEUE},
    "chkq.store_follow_end": {"queue": CONTROL_QUEUE},
    "chkq.commit": {"queue": COMMIT_QUEUE},
}


def task_queues(quorum: bool = False) -> list[Queue]:
    """The kombu queues chkq declares, one per kind of work.

    With ``quorum`` (the broker is RabbitMQ) they are durable quorum queues:
    replicated across the RabbitMQ cluster's nodes, and a message goes back
    to its queue as soon as the connection of the consumer holding it
    closes. Every client and worker declares them alike (RabbitMQ refuses a
    queue declared again with other arguments).
    """
    from kombu import Queue

    arguments = {"x-queue-type": "quorum"} if quorum else None
    return [Queue(name, routing_key=name, durable=True, queue_arguments=arguments)
            for name in QUEUES]


def node_queue(nodename: str, quorum: bool = False) -> Queue:
    """The queue of the worker named ``nodename`` (``celery@host``), declared as chkq's are."""
    from kombu import Queue

    name = NODE_QUEUE_PREFIX + nodename
    arguments = {"x-queue-type": "quorum"} if quorum else None
    return Queue(name, routing_key=name, durable=True, queue_arguments=arguments)


def resolve_queues(spec: str | None) -> list[str]:
    """Turn a ``-Q`` argument (``copy,verify`` or full names) into queue names.

    Raises
    ------
    ValueError
        If a name is not one of chkq's queues.
    """
    if not spec:
        return list(QUEUES)
    names = []
    for part in spec.split(","):
        part = part.strip()
        name = SHORT_NAMES.get(part, part)
        if name not in QUEUES:
            known = ", ".join(sorted(SHORT_NAMES))
            raise ConfigurationError(f"unknown queue {part!r}: chkq's queues are {known}")
        names.append(name)
    return names
