"""kombu's Redis transport, made to survive a Redis restart (celery/kombu 5.7).

When the connection to Redis is lost, Celery closes it and later acks or
rejects the messages of tasks that were running. On the closed channel
kombu can no longer build a Redis client (``AttributeError: 'NoneType'
object has no attribute 'hostname'``), which Celery treats as
unrecoverable: the worker stays alive but never consumes again. Here an
operation on a channel whose connection is gone is skipped with a warning:
the message is still in Redis's unacknowledged index, and the restore sweep
delivers it again after the visibility timeout; chkq's tasks are idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis

log = logging.getLogger("chkq.worker")


def _lost(channel: Any) -> bool:
    return bool(channel.closed) or getattr(channel.connection, "client", None) is None


class QoS(redis.QoS):
    """Redis QoS whose ack, reject and restore skip a channel that lost its connection."""

    def ack(self, delivery_tag: Any) -> None:
        if _lost(self.channel):
            log.warning("message %s not acknowledged: its broker connection was lost; Redis "
                        "delivers it again after the visibility timeout", delivery_tag)
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if _lost(self.channel):
            log.warning("message %s not rejected: its broker connection was lost", delivery_tag)
            return
        super().reject(delivery_tag, requeue=requeue)

    def restore_unacked(self, client: Any = None) -> None:
        if client is None and _lost(self.channel):
            log.warning("unacknowledged messages left to the restore sweep: the broker "
                        "connection was lost")
            return
        super().restore_unacked(client)


class Channel(redis.Channel):
    """Redis channel using :class:`QoS`."""

    QoS = QoS


class Transport(redis.Transport):
    """Redis transport using :class:`Channel` (``broker_transport`` of the chkq app)."""

    Channel = Channel
