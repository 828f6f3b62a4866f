"""Enqueueing commits from Python: the API simulations written in Python call.

``submit_commit`` sends a ``chkq.commit`` task naming the file (never its
bytes) and returns its AsyncResult; ``commit_checkpoint`` waits for it,
running an embedded cluster when no broker is configured. A commit only
reads its file: nothing is staged, and nothing is deleted after the commit.
Arguments are checked here for the caller's sake (a clear error at once);
the worker checks them again, since it cannot trust the message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery.result import AsyncResult

from chkq.config.celery_app import get_app, get_settings
from chkq.errors import SourceNotFoundError
from chkq.log import CheckpointRecord, validate_run_id
from chkq.stores.url import parse_store_url


def submit_commit(
    store_url: str,
    run: str,
    path: str | Path,
    *,
    parent: str | None = None,
    parent_head: bool = False,
    step: int | None = None,
    label: str | None = None,
    name: str | None = None,
    model: str | None = None,
    expect_id: str | None = None,
) -> AsyncResult:
    """Enqueue the commit of the checkpoint file at ``path`` to ``run`` in ``store_url``.

    The path must be readable by the workers (shared storage) and, where
    the workers set ``CHKQ_ALLOWED_ROOTS``, inside those roots; the workers
    resolve it (links, ``..``) and read it, and never remove it.

    Raises
    ------
    ValueError
        For a malformed store URL or run id.
    FileNotFoundError
        If ``path`` is not a file here.
    """
    parse_store_url(store_url)
    validate_run_id(run)
    source = Path(path).absolute()
    if not source.is_file():
        raise SourceNotFoundError(f"checkpoint file {str(source)!r} does not exist")
    kwargs: dict[str, Any] = {
        "parent": parent, "parent_head": parent_head, "step": step, "label": label,
        "name": name, "model": model, "expect_id": expect_id,
    }
    return get_app().signature("chkq.commit", args=(store_url, run, str(source)),
                         kwargs=kwargs).apply_async()


def submit_commit_chain(
    store_url: str,
    run: str,
    paths: list[str | Path],
    *,
    parent: str | None = None,
    first_step: int | None = None,
    model: str | None = None,
) -> AsyncResult:
    """Enqueue the commits of ``paths`` in order, each on the one before, as one Celery chain.

    Each commit is sent only when the one before it finished, so no task waits
    for its parent. The files are hashed here (read once) to name the parents;
    the tasks check the bytes they read against those ids. Returns the result
    of the last commit. The files are only read, never removed.
    """
    from celery import chain

    from chkq.watcher import file_id

    parse_store_url(store_url)
    validate_run_id(run)
    steps = []
    for index, path in enumerate(paths):
        source = Path(path).absolute()
        ident = file_id(source)
        step = None if first_step is None else first_step + index
        steps.append(get_app().signature(
            "chkq.commit", args=(store_url, run, str(source)),
            kwargs={"parent": parent, "step": step, "name": source.name, "model": model,
                    "expect_id": ident},
            immutable=True))
        parent = ident
    if not steps:
        raise ValueError("no checkpoint files to commit")
    return chain(*steps).apply_async()


def record_of(result: dict[str, Any]) -> CheckpointRecord:
    """The CheckpointRecord a commit task returned (as JSON)."""
    return CheckpointRecord(**result)


def commit_checkpoint(
    store_url: str, run: str, path: str | Path, *, workers: int | None = None,
    timeout: float | None = None, **options: Any,
) -> CheckpointRecord:
    """Commit a checkpoint file through the cluster (or an embedded one) and wait."""
    if get_settings().broker_url:
        return record_of(submit_commit(store_url, run, path, **options).get(timeout=timeout))
    from chkq.workers.embedded import EmbeddedCluster

    with EmbeddedCluster(workers or 1) as cluster:
        result = submit_commit(store_url, run, path, **options)
        return record_of(cluster.wait(result, timeout))
