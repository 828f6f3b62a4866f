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

kombu takes a message with ``BRPOP``: if Redis dies after the pop and before
its answer reaches the worker (the pop is in its append-only file, the reply
never sent), the message is in no queue and no index, and nothing would
ever deliver it again. So a consumer here never pops with ``BRPOP``. It
takes a message with a script that, in one step, pops it, records it in the
unacknowledged index (where the visibility timeout finds it if the worker
dies) and notes under the consumer's ``popped`` key which call took it; an
answer lost with the connection is then found by that key and the message
handed back at once. A script cannot block, so an idle consumer waits with
``BRPOP`` on its queues' *rings* instead: every message sent through this
transport pushes a token there, and a lost token costs only the wait (one
``brpop_timeout``) before the next look at the queues.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable
from itertools import count
from queue import Empty
from typing import Any

from kombu.transport import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from chkq.jobs import keys

log = logging.getLogger("chkq.worker")

#: Seconds between two attempts to settle orphaned messages while any are left.
SETTLE_INTERVAL = 1.0

#: Most tokens a queue's ring keeps (a consumer that finds messages keeps taking them).
RING_TOKENS = 1000

#: Seconds a ring outlives the last message sent to its queue (reply queues come and go).
RING_SECONDS = 3600

#: Pops, from the first of ``KEYS[1..n]`` that holds one, a message; drops a token of its
#: queue's ring ``KEYS[n+i]`` if ``ARGV[3]`` is 1; and, if the ``i``-th character of
#: ``ARGV[6]`` is 1 (its queue is consumed with acknowledgements), in the same step
#: records it as kombu's ``QoS.append`` would (``KEYS[2n+2]`` the unacknowledged hash,
#: ``KEYS[2n+3]`` its index, ``ARGV[2]`` the time) and notes ``ARGV[4] .. " " .. tag``
#: under the consumer's key ``KEYS[2n+1]`` for ``ARGV[5]`` seconds. Returns
#: ``{key, message}``, or nil (and forgets the note).
POP_SCRIPT = """
local n = tonumber(ARGV[1])
for i = 1, n do
    local item = redis.call('RPOP', KEYS[i])
    if item then
        if ARGV[3] == '1' then
            redis.call('RPOP', KEYS[n + i])
        end
        local ok, message = pcall(cjson.decode, item)
        if string.sub(ARGV[6], i, i) == '1' and ok and type(message) == 'table'
                and type(message.properties) == 'table' and message.properties.delivery_tag then
            local tag = tostring(message.properties.delivery_tag)
            local info = message.properties.delivery_info
            if type(info) ~= 'table' then
                info = {}
            end
            redis.call('ZADD', KEYS[2 * n + 3], ARGV[2], tag)
            redis.call('HSET', KEYS[2 * n + 2], tag, '[' .. item .. ','
                .. cjson.encode(info.exchange or '') .. ','
                .. cjson.encode(info.routing_key or '') .. ']')
            redis.call('SET', KEYS[2 * n + 1], ARGV[4] .. ' ' .. tag, 'EX', ARGV[5])
        end
        return {KEYS[i], item}
    end
end
redis.call('DEL', KEYS[2 * n + 1])
return false
"""

_POP, _WAIT = "pop", "wait"

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
        self.pops: dict[str, str] = {}
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

    def unread(self, consumer_key: str, call: str) -> None:
        """The answer to pop ``call`` was lost with the connection: what it took, if
        anything, is named under ``consumer_key`` and goes back to its queue."""
        self.pops[consumer_key] = call

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
        if not self.pending and not self.pops:
            return
        channel = self._live()
        if channel is None:
            return
        held = _requests()
        for consumer_key, call in list(self.pops.items()):
            try:
                self._settle_pop(channel, consumer_key, call, held)
            except channel.connection.connection_errors as exc:
                log.warning("a lost pop not settled yet (%r): trying again", exc)
                return
            del self.pops[consumer_key]
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

    def _settle_pop(self, channel: Any, consumer_key: str, call: str,
                    held: dict[Any, int | None]) -> None:
        """Hand back the message that pop ``call`` took, if it took one and no one holds it."""
        with channel.conn_or_acquire() as client:
            noted = client.get(consumer_key)
            found, _, tag = bytes_to_str(noted or b"").partition(" ")
            if found == call and tag and tag not in held and tag not in self.pending:
                _restore(channel, tag, None, leftmost=False)
                log.warning("message %s taken as the broker connection broke handed back "
                            "to its queue", tag)
            client.delete(consumer_key)


def _restore(channel: Any, tag: Any, kept: tuple[Any, str, str] | None, leftmost: bool) -> None:
    """Put the message of ``tag`` back in its queue and out of the unacknowledged index.

    As kombu's ``restore_by_tag``, in one transaction, but a message the index
    lacks (its recording was lost with the connection) is restored from ``kept``.
    """
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
    """Redis channel using :class:`QoS`, registered with :data:`ORPHANS`, that takes
    messages with :data:`POP_SCRIPT` and waits for them on its queues' rings."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ORPHANS.channels.add(self)
        self._consumer_key = keys.popped(uuid.uuid4().hex)
        self._calls = count(1)
        self._call = ""
        self._sent = _WAIT
        self._look = True
        self._token = False
        self._acknowledged: set[str] = set()

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """Consume ``queue`` as kombu does, minding whether its messages are acknowledged
        (a message of a queue consumed without is never recorded as unacknowledged)."""
        no_ack = kwargs["no_ack"] if "no_ack" in kwargs else (args[0] if args else False)
        if no_ack:
            self._acknowledged.discard(queue)
        else:
            self._acknowledged.add(queue)
        return super().basic_consume(queue, *args, **kwargs)

    def _key(self, name: str) -> str:
        return f"{self.global_keyprefix}{name}"

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Send the next look at the queues (:data:`POP_SCRIPT`) or, after a look that
        found nothing, a wait of up to ``timeout`` seconds for a token of their rings."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        if self._look:
            pairs = [(queue, self._q_for_pri(queue, pri)) for pri in self.priority_steps
                     for queue in queues]
            names = [name for _, name in pairs]
            rings = [keys.ring(queue) for queue, _ in pairs]
            recorded = "".join("1" if queue in self._acknowledged else "0"
                               for queue, _ in pairs)
            self._call = f"{next(self._calls)}"
            command: list[Any] = [
                "EVAL", POP_SCRIPT, 2 * len(names) + 3,
                *(self._key(name) for name in (*names, *rings)),
                self._key(self._consumer_key), self._key(self.unacked_key),
                self._key(self.unacked_index_key),
                len(names), repr(time.time()), "0" if self._token else "1", self._call,
                max(1, int(self.visibility_timeout)), recorded]
            self._sent = _POP
        else:
            wait = self.brpop_timeout if timeout is None else timeout
            command = ["BRPOP", *(keys.ring(queue) for queue in queues), wait or 0]
            if self.global_keyprefix:
                command = self.client._prefix_args(command)
            self._sent = _WAIT
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        """Read the answer :meth:`_brpop_start` asked for: deliver a message it took, or
        raise :class:`queue.Empty` (the next start looks, or waits, as this one found)."""
        try:
            try:
                answer = self.client.parse_response(self.client.connection, "BRPOP",
                                                    **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                if self._sent == _POP:
                    ORPHANS.unread(self._consumer_key, self._call)
                raise
            if self._sent == _WAIT:
                self._look, self._token = True, bool(answer)
                raise Empty()
            self._token = False
            if not answer:
                self._look = False
                raise Empty()
            dest, item = answer
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            self.connection._deliver(loads(bytes_to_str(item)), dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """Send ``message`` as kombu does, then push a token to ``queue``'s ring."""
        batch = kwargs.get("_publish_batch")
        super()._put(queue, message, **kwargs)
        if batch is not None:
            _push_token(batch.add, queue)
            return
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            _push_token(lambda command, *args: getattr(pipe, command)(*args), queue)
            pipe.execute()

    def _do_restore_message(self, payload: Any, exchange: str, routing_key: str,
                            pipe: Any, leftmost: bool = False) -> None:
        """Put a message back in its queues as kombu does, with a token in each ring."""
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        for queue in self._lookup(exchange, routing_key):
            _push_token(lambda command, *args: getattr(pipe, command)(*args), queue)


def _push_token(send: Callable[..., Any], queue: str) -> None:
    """Have ``send(command, *args)`` push one token to ``queue``'s ring, kept short and
    expiring (a pipeline's command, or a publish batch's ``add``)."""
    ring = keys.ring(queue)
    send("lpush", ring, "1")
    send("ltrim", ring, 0, RING_TOKENS - 1)
    send("expire", ring, RING_SECONDS)


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
