"""A job's first message, sent straight to Redis as Celery would send it, without Celery.

A client sends one message per job (``chkq.plan``, or ``chkq.stage`` for a run
in an object store, with ``chkq.fail`` as its errback); sending it through
Celery's canvas and kombu's producer loads and sets up far more than the
message needs (docs/performance.md has the figures), and a client that
sends without them need not load Celery at all. For a Redis broker this
module writes what Celery's ``apply_async`` writes through chkq's transport
(:mod:`chkq.workers.runtime.broker_transport`), in one transaction:

- the task message (protocol 2: headers, properties, and the body
  ``[args, kwargs, embed]`` in JSON, base64-encoded as kombu's Redis
  transport encodes it), pushed on its queue's list: priority 0, which kombu
  keeps in the list named as the queue;
- the queue's binding (``_kombu.binding.QUEUE``), as Celery's first publish
  to a queue declares it;
- a token on the queue's ring, which wakes an idle worker;
- the ``task-sent`` event (``task_send_sent_event``), published on the
  ``celeryev`` fanout channel.

:func:`direct_broker` is the one decision: it gives the Redis URL when the
app that would send is configured as chkq configures one for Redis (JSON
messages, no signing, chkq's transport and routes, no priorities), and None
otherwise (RabbitMQ, signed messages, anything else): the message then goes
through Celery. ``tests/test_sender.py`` holds the two to the same bytes.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from chkq.config.routing import TASK_ROUTES
from chkq.jobs import keys
from chkq.jobs.records import task_id as step_id

PLAN_TASK, STAGE_TASK, FAIL_TASK = "chkq.plan", "chkq.stage", "chkq.fail"
#: The tasks that start a job, whose message this module sends, and the modules defining them.
FIRST_TASKS = {PLAN_TASK: "chkq.tasks.planning", STAGE_TASK: "chkq.tasks.from_store"}
#: The chkq transport's ring of a queue (:func:`chkq.workers.runtime.broker_transport._push_token`).
RING_TOKENS, RING_SECONDS = 1000, 3600
#: kombu's separator in Redis key names (``_kombu.binding.*`` members, priority lists).
KOMBU_SEP = "\x06\x16"
#: Celery's limit on a message's ``argsrepr``/``kwargsrepr``, and its nesting depth; a
#: representation near the limit (which Celery would cut) is left to Celery.
REPR_MAXSIZE, REPR_MAXLEVELS = 1024, 3
REPR_SAFE = REPR_MAXSIZE - 64

#: Celery settings the direct message reproduces; an app with any other value sends itself.
EXPECTED_CONF = {
    "task_serializer": "json",
    "task_protocol": 2,
    "task_default_priority": None,
    "task_queue_max_priority": None,
    "task_default_exchange": None,
    "task_default_delivery_mode": 2,
    "task_send_sent_event": True,
    "event_exchange": "celeryev",
    "event_serializer": "json",
    "task_create_missing_queues": True,
    "task_inherit_parent_priority": False,
}
EXPECTED_TRANSPORT = "chkq.workers.runtime.broker_transport:Transport"
#: Broker URLs sent to directly: TCP, and kombu's Unix socket (the embedded cluster's). TLS
#: (``rediss://``, whose certificate options kombu and redis-py spell differently) and
#: redis-py's ``unix://`` go through Celery.
DIRECT_SCHEMES = ("redis", "redis+socket")
#: Transport options that leave the message and its keys as kombu's defaults write them
#: (:meth:`chkq.config.settings.Settings.broker_transport_options`); any other (a key
#: prefix, a separator, priority steps, fanout settings) goes through Celery.
NEUTRAL_TRANSPORT_OPTIONS = frozenset({"visibility_timeout", "unacked_restore_interval",
                                       "unacked_restore_throttle", "unacked_mutex_expire"})


def direct_broker(app: Any) -> str | None:
    """The Redis URL this client sends its job's first message to directly, or None.

    ``app`` is the Celery app that would otherwise send it (whose settings
    the message must match); None whenever anything differs from what
    :func:`job_message` reproduces: then Celery sends it.
    """
    conf = app.conf
    url = conf.broker_url
    if not isinstance(url, str) or url.partition("://")[0] not in DIRECT_SCHEMES:
        return None
    routes = conf.task_routes
    if conf.broker_transport != EXPECTED_TRANSPORT or conf.broker_use_ssl \
            or not set(conf.broker_transport_options or {}) <= NEUTRAL_TRANSPORT_OPTIONS \
            or not isinstance(routes, dict) \
            or any(routes.get(task) != TASK_ROUTES[task] for task in FIRST_TASKS):
        return None
    if any(conf.get(name) != value for name, value in EXPECTED_CONF.items()):
        return None
    return url


def redis_client(url: str) -> Any:
    """A redis-py client of the broker at ``url`` (``redis://``, or kombu's
    ``redis+socket://:PASSWORD@/PATH?virtual_host=DB``)."""
    import redis

    if url.startswith("redis+socket://"):
        parts = urlsplit(url)
        return redis.Redis(unix_socket_path=unquote(parts.path),
                           password=unquote(parts.password) if parts.password else None,
                           username=unquote(parts.username) if parts.username else None,
                           db=_db_of(url))
    return redis.Redis.from_url(url)


def _db_of(url: str) -> int:
    """The Redis database ``url`` names (kombu's ``virtual_host``), 0 by default."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    named = (query.get("virtual_host") or query.get("db") or [""])[0]
    if not named and parts.scheme == "redis":
        named = parts.path.strip("/")
    return int(named or 0)


def _dumps(value: Any) -> str:
    """JSON as kombu writes it (:func:`kombu.utils.json.dumps`: Python's defaults)."""
    return json.dumps(value)


def safe_repr(value: Any, level: int = 0) -> str | None:
    """``value`` as Celery's ``saferepr`` writes it into ``argsrepr``/``kwargsrepr``.

    For the types a job's arguments hold (strings, numbers, None, and lists,
    tuples and dicts of them); None for anything else, which Celery renders.
    """
    if isinstance(value, str):
        return "'{}'".format(value.replace("'", "\\'"))
    if isinstance(value, bool | int | float):
        return str(value)
    if value is None:
        return "None"
    if isinstance(value, dict):
        opening, closing = "{", "}"
    elif isinstance(value, list):
        opening, closing = "[", "]"
    elif isinstance(value, tuple):
        opening, closing = "(", ",)" if len(value) == 1 else ")"
    else:
        return None
    if level >= REPR_MAXLEVELS:
        return f"{opening}...{closing}"
    items: list[str | None]
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            shown_key, shown = safe_repr(key, 0), safe_repr(item, level + 1)
            items.append(None if shown_key is None or shown is None else f"{shown_key}: {shown}")
    else:
        items = [safe_repr(item, level + 1) for item in value]
    if any(item is None for item in items):
        return None
    return opening + ", ".join(item for item in items if item is not None) + closing


def origin() -> str:
    """This process's Celery node name as a sender (``genPID@HOST``)."""
    return f"gen{os.getpid()}@{socket.gethostname()}"


def ignore_result(app: Any, task: str) -> bool | None:
    """The message's ``ignore_result`` header, as Celery gives it: the task's own setting
    when this process has loaded the task (its module), None when it sends it by name."""
    if FIRST_TASKS[task] not in sys.modules:
        return None
    registered = app.tasks.get(task)
    return None if registered is None else bool(registered.ignore_result)


def job_message(task: str, job: str, args: list[Any], kwargs: dict[str, Any],
                fail_args: list[Any], *, sender: str, reply_to: str, delivery_tag: str,
                ignored: bool | None = None) -> tuple[str, dict[str, Any]] | None:
    """The Redis list entry of job ``job``'s first message, and its sent event's fields.

    ``task`` (one of :data:`FIRST_TASKS`) with ``args`` and ``kwargs``, and
    ``chkq.fail`` with ``fail_args`` as its errback.

    None if Celery's representation of the arguments could differ (a type
    :func:`safe_repr` does not know, or one near Celery's length limit).
    ``sender``, ``reply_to`` and ``delivery_tag`` are the per-message values
    Celery picks (its node name, its app's reply queue, a random tag);
    ``ignored`` the ``ignore_result`` header (:func:`ignore_result`).
    """
    argsrepr, kwargsrepr = safe_repr(tuple(args)), safe_repr(kwargs)
    if argsrepr is None or kwargsrepr is None or max(len(argsrepr), len(kwargsrepr)) > REPR_SAFE:
        return None
    queue = TASK_ROUTES[task]["queue"]
    task_id = step_id(job, task.removeprefix("chkq."))
    errback: dict[str, Any] = {"task": FAIL_TASK, "args": fail_args, "kwargs": {},
                               "options": {}, "subtask_type": None, "immutable": False}
    body = [args, kwargs, {"callbacks": None, "errbacks": [errback], "chain": None,
                           "chord": None}]
    headers: dict[str, Any] = {
        "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": argsrepr, "kwargsrepr": kwargsrepr, "origin": sender,
        "ignore_result": ignored, "replaced_task_nesting": 0, "stamped_headers": None,
        "stamps": {},
    }
    message = {
        "body": base64.b64encode(_dumps(body).encode("utf-8")).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": task_id, "reply_to": reply_to, "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
            "body_encoding": "base64", "delivery_tag": delivery_tag,
        },
    }
    event = {"uuid": task_id, "root_id": task_id, "parent_id": None, "name": task,
             "args": argsrepr, "kwargs": kwargsrepr, "retries": 0, "eta": None,
             "expires": None, "queue": queue, "exchange": "", "routing_key": queue}
    return _dumps(message), event


def sent_event(fields: dict[str, Any], *, sender: str, clock: int, timestamp: float,
               delivery_tag: str) -> str:
    """The ``task-sent`` event Celery publishes for a message (``fields``: its own part)."""
    local = time.localtime()
    offset = (time.altzone if local.tm_isdst else time.timezone) / 3600
    body = {"hostname": sender, "utcoffset": offset, "pid": os.getpid(), "clock": clock,
            **fields, "timestamp": timestamp, "type": "task-sent"}
    return _dumps({
        "body": base64.b64encode(_dumps(body).encode("utf-8")).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"hostname": sender},
        "properties": {
            "delivery_mode": 1,
            "delivery_info": {"exchange": "celeryev", "routing_key": "task.sent"},
            "priority": 0, "body_encoding": "base64", "delivery_tag": delivery_tag,
        },
    })


def send_job(app: Any, task: str, job: str, args: list[Any], kwargs: dict[str, Any],
             fail_args: list[Any]) -> bool:
    """Send job ``job``'s first message (:func:`job_message`) directly to Redis; False
    (nothing sent) when :func:`direct_broker` or :func:`job_message` leave it to Celery.

    The message, the queue's binding, the ring's token and the sent event go
    in one transaction: the job is sent whole or not at all.
    """
    url = direct_broker(app)
    if url is None:
        return False
    sender = origin()
    built = job_message(task, job, args, kwargs, fail_args, sender=sender,
                        reply_to=str(uuid.uuid4()), delivery_tag=str(uuid.uuid4()),
                        ignored=ignore_result(app, task))
    if built is None:
        return False
    entry, fields = built
    queue = fields["queue"]
    event = sent_event(fields, sender=sender, clock=app.clock.forward(), timestamp=time.time(),
                       delivery_tag=str(uuid.uuid4()))
    binding = KOMBU_SEP.join((queue, "", queue))
    ring = keys.ring(queue)
    client = redis_client(url)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.sadd(f"_kombu.binding.{queue}", binding)
        pipe.sadd(f"_kombu.binding_permanent.{queue}", binding)
        pipe.lpush(queue, entry)
        pipe.lpush(ring, "1")
        pipe.ltrim(ring, 0, RING_TOKENS - 1)
        pipe.expire(ring, RING_SECONDS)
        pipe.publish(f"/{_db_of(url)}.celeryev/task.sent", event)
        pipe.execute()
    finally:
        client.close()
    return True
