"""The signatures that start a consolidation job, and the failures Celery reports of them."""

from __future__ import annotations

from typing import Any

from celery import signature
from celery.exceptions import ChordError
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.jobs.first_messages import plan_kwargs
from chkq.jobs.records import task_id


def fail_signature(out_dir: str, model: str, job: str, queue: str | None = None) -> Any:
    """The errback every step of a job carries: ``chkq.fail`` with the job's arguments.

    ``queue``: the queue of the worker whose scratch directory holds the job's
    files (a job from an object store), where its failure must be cleaned up.
    """
    sig = signature("chkq.fail", args=(out_dir, model, job), app=get_app())
    return sig if queue is None else sig.set(queue=queue)


def consolidation_signature(out_dir: str, model: str, job: str, cleanup: bool,
                            allow_gaps: bool = False, queue: str | None = None,
                            party: dict[str, Any] | None = None,
                            through: int | None = None) -> Any:
    """The message that starts a job: ``chkq.plan`` with ``chkq.fail`` as errback.

    ``allow_gaps`` travels only when set, so that the message of an ordinary
    job is the one every worker version accepts. ``queue`` places the job on
    one worker (see :func:`fail_signature`). ``party``: the submitter's
    credential (:func:`chkq.tasks.parties.plan_credential`), which workers
    with users' keys require; it too travels only when given, as does ``through``
    (only the checkpoints numbered up to it: the first version of a followed run).
    """
    sig = signature(
        "chkq.plan", args=(out_dir, model, job),
        kwargs=plan_kwargs(cleanup, allow_gaps, party, through), app=get_app()
    ).set(task_id=task_id(job, "plan"), link_error=[fail_signature(out_dir, model, job, queue)])
    return sig if queue is None else sig.set(queue=queue)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a header task raised, when ``exc`` is the ChordError wrapping it."""
    return failing_task(exc, None)[1]


def failing_task(exc: BaseException, task: str | None) -> tuple[str | None, BaseException]:
    """The task that really failed, and its exception, when ``exc`` is a ChordError.

    Celery reports a failed chord header only as a ChordError naming the
    header task's id; its result holds the real exception.
    """
    seen = 0
    while isinstance(exc, ChordError) and seen < 4:
        words = str(exc).split()
        if len(words) < 2 or words[0] != "Dependency":
            break
        inner = AsyncResult(words[1], app=get_app()).result
        if not isinstance(inner, BaseException):
            break
        task, exc, seen = words[1], inner, seen + 1
    return task, exc
