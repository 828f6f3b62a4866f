"""kombu's Redis transport, made to survive a Redis restart (celery/kombu 5.7).

When the connection to Redis is lost, Celery closes it, terminates the
steps that were running (``worker_cancel_long_running_tasks_on_connection_loss``)
and later acks or rejects the messages of tasks that ended. Two things go
wrong in kombu 5.7:

- On the closed channel kombu can no longer build a Redis client
  (``AttributeError: 'NoneType' object has no attribute 'hostname'``),
  which Celery treats as unrecoverable: the worker stays alive but never
  consumes again.
- The closed channel's unacknowledged messages cannot be restored then
  (Redis is down), so they stay in Redis's unacknowledged index until the
  visibility timeout (an hour by default) hands them back: the job waits
  that long with no task running, its temporaries in the run directory.

- A message Redis handed out just as the connection broke, before the
  worker recorded it in the unacknowledged index, is in no queue and no
  index: nothing would ever deliver it again.

Here a channel that lost its connection hands its unacknowledged messages
to :class:`Orphans`, the worker process's record of them: what became of
each (acked, rejected, or nothing yet) is settled through a live channel
once the worker has reconnected. A message whose task is over (terminated
at the connection loss, failed, or never started) goes back to its queue
at once; one whose task finished is acknowledged; one still held by a
request, or nothing heard of but whose pool process has not exited yet,
waits until it has, so a task is never handed back while it runs. A
message whose recording failed is kept whole and goes back to its queue the
same way (recorded or not, it is handed back once).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from kombu.transport import redis

log = logging.getLogger("chkq.worker")

#: Seconds between two attempts to settle orphaned messages while any are left.
SETTLE_INTERVAL = 1.0

RESTORE, ACK, REQUEUE = "restore", "ack", "requeue"


def _lost(channel: Any) -> bool:
    return bool(channel.closed) or getattr(channel.connection, "client", None) is None


def _requests() -> dict[Any, int | None]:
    """Delivery tag -> pool process id of the requests this worker runs or holds."""
    from celery.worker import state

    found: dict[Any, int | None] = {}
    for request in (*state.active_requests, *state.reserved_requests):
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if tag is not None:
            found[tag] = getattr(request, "worker_pid", None)
    return found


def _alive(pid: int | None) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class Orphans:
    """Unacknowledged messages of channels that lost their connection, and what to do.

    One per worker process (module attribute :data:`ORPHANS`); every
    channel of the transport registers with it, and a live one settles
    the orphans: ``restore`` (nothing heard of its task: back to the queue
    once no request holds it), ``ack`` (its task ended: removed),
    ``requeue`` (rejected with requeue: back to the queue at the front).
    """

    def __init__(self) -> None:
        self.pending: dict[Any, str] = {}
        self.pids: dict[Any, int | None] = {}
        self.messages: dict[Any, tuple[Any, str, str]] = {}
        self.channels: weakref.WeakSet[Channel] = weakref.WeakSet()

    def adopt(self, tags: list[Any]) -> None:
        """Keep ``tags``, with the pool process running each (Celery terminates those next)."""
        running = _requests()
        for tag in tags:
            self.pending.setdefault(tag, RESTORE)
            self.pids[tag] = running.get(tag)

    def unrecorded(self, tag: Any, message: tuple[Any, str, str]) -> None:
        """Keep ``message`` (payload, exchange, routing key), which Redis handed out as the
        connection broke and which no index holds, to go back to its queue."""
        self.pending[tag] = RESTORE
        self.pids[tag] = None
        self.messages[tag] = message

    def settled(self, tag: Any, action: str) -> None:
        """The task of ``tag`` ended (``ack``/``requeue``) on a lost channel.

        Its request says so: the pool process that ran it is no longer waited for.
        A task can fail on its own from the outage (its result could not be
        stored) before Celery terminates it; its process then lives on, taking
        other tasks, and the message would wait for it for ever.
        """
        self.pending[tag] = action
        self.pids.pop(tag, None)
        self.settle()

    def _live(self) -> Channel | None:
        for channel in list(self.channels):
            if not _lost(channel):
                return channel
        return None

    def settle(self) -> None:
        """Settle every orphan no request holds, through a live channel (if there is one)."""
        if not self.pending:
            return
        channel = self._live()
        if channel is None:
            return
        held = _requests()
        for tag, action in list(self.pending.items()):
            if tag in held or _alive(self.pids.get(tag)):
                continue
            try:
                if action == ACK:
                    channel.qos._remove_from_indices(tag).execute()
                else:
                    _restore(channel, tag, self.messages.get(tag), leftmost=action == REQUEUE)
            except channel.connection.connection_errors as exc:
                log.warning("message %s not settled yet (%r): trying again", tag, exc)
                return
            del self.pending[tag]
            self.pids.pop(tag, None)
            self.messages.pop(tag, None)
            if action == ACK:
                log.info("message %s of a lost connection acknowledged", tag)
            else:
                log.warning("message %s of a lost connection handed back to its queue", tag)


def _restore(channel: Any, tag: Any, kept: tuple[Any, str, str] | None, leftmost: bool) -> None:
    """Put the message of ``tag`` back in its queue and out of the unacknowledged index.

    As kombu's ``restore_by_tag``, in one transaction, but a message the index
    lacks (its recording was lost with the connection) is restored from ``kept``.
    """
    from kombu.utils.encoding import bytes_to_str
    from kombu.utils.json import loads

    def restore(pipe: Any) -> None:
        recorded = pipe.hget(channel.unacked_key, tag)
        pipe.multi()
        channel.qos._remove_from_indices(tag, pipe)
        message = loads(bytes_to_str(recorded)) if recorded else kept
        if message is not None:
            payload, exchange, routing_key = message
            channel._do_restore_message(payload, exchange, routing_key, pipe, leftmost)

    channel.client.transaction(restore, channel.unacked_key)


ORPHANS = Orphans()


class QoS(redis.QoS):
    """Redis QoS that hands a lost channel's unacknowledged messages to :data:`ORPHANS`."""

    def append(self, message: Any, delivery_tag: Any) -> None:
        try:
            super().append(message, delivery_tag)
        except self.channel.connection.connection_errors:
            delivery = message.delivery_info
            ORPHANS.unrecorded(delivery_tag, (message._raw, delivery["exchange"],
                                              delivery["routing_key"]))
            log.warning("message %s handed out as the broker connection broke: kept, to go "
                        "back to its queue once the worker has reconnected", delivery_tag)
            raise

    def ack(self, delivery_tag: Any) -> None:
        if _lost(self.channel):
            ORPHANS.settled(delivery_tag, ACK)
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if _lost(self.channel):
            ORPHANS.settled(delivery_tag, REQUEUE if requeue else ACK)
            return
        super().reject(delivery_tag, requeue=requeue)

    def restore_unacked(self, client: Any = None) -> None:
        if client is None and _lost(self.channel):
            tags = list(self._delivered)
            self._delivered.clear()
            if tags:
                log.warning("%d unacknowledged messages of a lost broker connection kept: "
                            "handed back once the worker has reconnected and their tasks "
                            "have stopped", len(tags))
            ORPHANS.adopt(tags)
            return
        super().restore_unacked(client)


class Channel(redis.Channel):
    """Redis channel using :class:`QoS`, registered with :data:`ORPHANS`."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ORPHANS.channels.add(self)


class Transport(redis.Transport):
    """Redis transport using :class:`Channel` (``broker_transport`` of the chkq app).

    In a worker's event loop it also settles orphaned messages every
    :data:`SETTLE_INTERVAL` seconds (nothing to do, nothing done).
    """

    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        old = getattr(self, "_settle_tref", None)
        if old is not None:
            old.cancel()
        self._settle_tref = loop.call_repeatedly(SETTLE_INTERVAL, ORPHANS.settle)
