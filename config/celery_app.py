"""The Celery application: its configuration, a factory, and this process's app.

As in cookiecutter-django's ``config/celery_app.py``, workers, Flower and
clients name the app ``chkq.config.celery_app:app``. Importing this module
reads nothing and builds nothing: :func:`make_app` builds an app from the
settings it is given, and this process's app (:func:`get_app`, also the
module attribute ``app``) is built on first use from the settings read once
from the environment (:func:`get_settings`, the attribute ``settings``). The
embedded cluster and the tests build an app of their own for their private
broker and make it this process's app with :func:`use_app`, instead of
rewiring a live one.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import Celery, Task
from celery.app import backends
from kombu.utils.imports import symbol_by_name

from chkq.config.limits import CONF_KEY, REQUEST_CLASS
from chkq.config.routing import CONTROL_QUEUE, TASK_ROUTES, task_queues
from chkq.config.security import install_signing, signing_config
from chkq.config.settings import Settings

TASK_MODULES = ("chkq.tasks.consolidate", "chkq.tasks.planning", "chkq.tasks.from_store",
                "chkq.tasks.commit", "chkq.tasks.follow", "chkq.tasks.store_parts",
                "chkq.tasks.store_follow", "chkq.tasks.store_verify")
#: The worker runtime, named here and loaded by Celery where it is used: the consumer in
#: workers, the transport in every process that talks to a Redis broker.
CONSUMER_CLASS = "chkq.workers.runtime.consumer:GuardedConsumer"
TRANSPORT_CLASS = "chkq.workers.runtime.broker_transport:Transport"
#: Mixed into the result backend's class: an outage is never a task's recorded failure.
BACKEND_MIXIN = "chkq.workers.runtime.result_backend:RequeueOutages"



class _LimitedTask(Task):
    """The app's default task class: time limits are the worker's (:mod:`chkq.config.limits`)."""

    Request = REQUEST_CLASS


@functools.cache
def _backend_class(base: type) -> type:
    """``base`` (the backend class the URL names) with :data:`BACKEND_MIXIN` before it."""
    return type(base.__name__, (symbol_by_name(BACKEND_MIXIN), base), {})


#: URL schemes whose result backend class is Celery's own, named without asking every
#: installed package for its ``celery.result_backends`` entry points (a read of every
#: package's metadata, in every client's start).
BUILTIN_BACKENDS = {
    "redis": "celery.backends.redis:RedisBackend",
    "rediss": "celery.backends.redis:RedisBackend",
    "sentinel": "celery.backends.redis:SentinelBackend",
}


def backend_by_url(backend: Any, loader: Any) -> tuple[type, str | None]:
    """The result backend class and URL for ``backend``, as :func:`celery.app.backends.by_url`.

    A Redis URL (:data:`BUILTIN_BACKENDS`, not overridden by the loader) resolves to
    Celery's class directly; anything else goes through Celery's lookup.
    """
    if isinstance(backend, str) and "://" in backend:
        scheme = backend.partition("://")[0]
        if scheme in BUILTIN_BACKENDS and scheme not in loader.override_backends:
            return symbol_by_name(BUILTIN_BACKENDS[scheme]), backend
    base, url = backends.by_url(backend, loader)
    return base, url


class _Chkq(Celery):
    """The chkq app: its result backend's class is the configured one with :data:`BACKEND_MIXIN`."""

    def _get_backend(self) -> Any:
        base, url = backend_by_url(self.backend_cls or self.conf.result_backend, self.loader)
        return _backend_class(base)(app=self, url=url)


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for a long-running I/O pipeline.

    Late acks with reject-on-worker-lost and prefetch 1 mean a message is
    removed only after its task finished, and a worker that dies hands its
    one reserved message back. The visibility timeout exceeds the hard time
    limit so a running task is never delivered twice at once.

    The time limits are not Celery's ``task_time_limit`` settings: those
    would go into every message a client sends, and a message's limits are
    not trusted. They are the worker's (:mod:`chkq.config.limits`). With
    ``CHKQ_SECURITY_*`` set, messages are signed (:mod:`chkq.config.security`).
    """
    broker = settings.broker_url or "redis://127.0.0.1:6379/0"
    return {
        "broker_url": broker,
        "result_backend": settings.result_backend or broker,
        "broker_connection_retry_on_startup": True,
        **broker_config(settings),
        "result_backend_transport_options": {"visibility_timeout": settings.visibility_timeout},
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        CONF_KEY: (settings.time_limit, settings.soft_time_limit),
        "result_expires": settings.result_expires,
        "result_chord_expires": settings.result_expires,
        "result_extended": True,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "task_queues": task_queues(quorum=settings.broker_is_amqp),
        "task_default_queue": CONTROL_QUEUE,
        "task_routes": TASK_ROUTES,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_consumer": CONSUMER_CLASS,
        **signing_config(settings),
    }


def broker_config(settings: Settings) -> dict[str, Any]:
    """The settings that differ between a Redis and a RabbitMQ broker.

    Redis: chkq's transport (:mod:`chkq.workers.runtime.broker_transport`) with its
    visibility timeout and restore sweep. RabbitMQ: kombu's py-amqp
    transport with publisher confirms (a task is sent once the broker has
    it, or the sender gets an error), heartbeats (a silent peer's
    connection is closed and its unacknowledged tasks handed back within
    about two heartbeats), and quorum queues (:func:`task_queues`), whose
    prefetch is per consumer: Celery's quorum detection turns global QoS
    off. Countdowns (a commit waiting for its parent) are held by the worker
    until due, as on Redis: chkq's queues use direct exchanges, which
    Celery's native delayed delivery does not serve. A worker's control
    queue is not exclusive: after a network cut the worker reconnects
    before RabbitMQ has closed its old connection, and the declaration of an
    exclusive queue that connection still owns fails, which stops the worker.
    """
    if not settings.broker_is_amqp:
        return {
            "broker_transport": TRANSPORT_CLASS,
            "broker_transport_options": settings.broker_transport_options(),
        }
    return {
        "broker_transport_options": {"confirm_publish": True},
        "broker_heartbeat": settings.broker_heartbeat or None,
        "task_default_queue_type": "quorum",
        "worker_detect_quorum_queues": True,
        "control_queue_exclusive": False,
    }


def make_app(settings: Settings | None = None) -> Celery:
    """Build the chkq Celery app from ``settings`` (default: the environment)."""
    settings = settings or Settings.from_env()
    # Every task of the app (chkq.fail, Celery's built-in tasks) caps the
    # time limits of its messages at the worker's; ChkqTask names the same class.
    celery = _Chkq("chkq", include=list(TASK_MODULES), task_cls=_LimitedTask)
    celery.conf.update(celery_config(settings))
    install_signing(celery, settings)
    if not settings.broker_is_amqp:
        use_chkq_transport()
    return celery


def use_chkq_transport() -> None:
    """Make chkq's transport the one kombu takes for ``redis`` in this process.

    ``broker_transport`` names it, but kombu takes a URL's ``redis+socket://``
    prefix as the transport's name instead, which would give a broker on a
    Unix socket (the embedded cluster's) kombu's own Redis transport.
    """
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES["redis"] = TRANSPORT_CLASS


_settings: Settings | None = None
_app: Celery | None = None


def get_settings() -> Settings:
    """This process's settings, read from the ``CHKQ_*`` environment on first use."""
    global _settings  # noqa: PLW0603 - the process's one settings object, made once
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def get_app() -> Celery:
    """This process's chkq app: built from :func:`get_settings` on first use."""
    global _app  # noqa: PLW0603 - the process's one app, made once (or swapped by use_app)
    if _app is None:
        _app = make_app(get_settings())
    return _app


def use_app(celery: Celery | None, settings: Settings | None = None) -> Celery | None:
    """Make ``celery`` this process's app (None: the next use builds one); return the previous.

    For the embedded cluster and the tests, which build an app for a broker
    of their own with :func:`make_app`. Code resolves the app when it runs
    (``get_app()``), so everything after the call uses ``celery``. With
    ``settings``, they become this process's settings too.
    """
    global _app, _settings  # noqa: PLW0603
    previous, _app = _app, celery
    if settings is not None:
        _settings = settings
    if celery is not None:
        celery.set_current()
    return previous


def close_app(celery: Celery) -> None:
    """Close ``celery``'s own connections (its broker is going away); other apps keep theirs.

    (kombu's process-wide producer pools are keyed by connection: resetting
    them would close the pools of every other app of the process too.)
    """
    celery.close()


def __getattr__(name: str) -> Any:
    """``app`` and ``settings`` are this process's, made when first asked for (PEP 562)."""
    if name == "app":
        return get_app()
    if name == "settings":
        return get_settings()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
