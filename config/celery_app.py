"""The Celery application and its configuration.

As in cookiecutter-django's ``config/celery_app.py``: one app object,
configured from :mod:`config.settings`, that workers, Flower and clients
import as ``config.celery_app:app``.  Broker and backend default to the
embedded cluster's URL when the caller has set ``CHKQ_BROKER_URL`` for it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from config.routing import CONTROL_QUEUE, TASK_ROUTES, task_queues
from config.settings import Settings

TASK_MODULES = ("tasks.consolidate", "tasks.commit")


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for a long-running I/O pipeline (see NOTES.md).

    Late acks with reject-on-worker-lost and prefetch 1 mean a message is
    removed only after its task finished, and a worker that dies hands its
    one reserved message back. The visibility timeout exceeds the hard time
    limit so a running task is never delivered twice at once.
    """
    broker = settings.broker_url or "redis://127.0.0.1:6379/0"
    return {
        "broker_url": broker,
        "result_backend": settings.result_backend or broker,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout},
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
        "task_soft_time_limit": settings.soft_time_limit,
        "task_time_limit": settings.time_limit,
        "result_expires": settings.result_expires,
        "result_chord_expires": settings.result_expires,
        "result_extended": True,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "task_queues": task_queues(),
        "task_default_queue": CONTROL_QUEUE,
        "task_routes": TASK_ROUTES,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
    }


def make_app(settings: Settings | None = None) -> Celery:
    """Build the chkq Celery app from ``settings`` (default: the environment)."""
    settings = settings or Settings.from_env()
    celery = Celery("chkq", include=list(TASK_MODULES))
    celery.conf.update(celery_config(settings))
    return celery


def use_broker(celery: Celery, url: str) -> None:
    """Point ``celery`` (broker and backend) at ``url``, e.g. an embedded broker."""
    celery.conf.broker_url = url
    celery.conf.result_backend = url
    celery._backend_cache = None
    celery._local.__dict__.pop("backend", None)
    if celery._pool is not None:
        celery._pool.force_close_all()
        celery._pool = None
    celery.amqp._producer_pool = None


settings = Settings.from_env()
app = make_app(settings)
