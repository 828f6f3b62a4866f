"""Committing checkpoints from Python: the API simulations written in Python call.

``submit_commit`` sends a ``chkq.commit`` task naming the file (never its
bytes) and returns its AsyncResult; ``commit_checkpoint`` waits for it when
a broker is configured, and otherwise commits in this process
(:func:`commit_in_process`), for every store: a commit needs no cluster, and
starting one would cost seconds per commit. A commit only reads its file:
nothing is staged, and nothing is deleted after the commit. Arguments are
checked here for the caller's sake (a clear error at once); the worker
checks them again, since it cannot trust the message.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from celery.canvas import Signature
from celery.result import AsyncResult

from chkq.config.celery_app import get_app, get_settings
from chkq.errors import SourceNotFoundError
from chkq.log import CheckpointLog, CheckpointRecord, default_writer, validate_run_id
from chkq.log.transfer import CommitOptions, commit_bytes, read_stable
from chkq.stores import open_store
from chkq.stores.retry import RETRY_LOGGER, StoreTimeouts, overall_budget
from chkq.stores.url import parse_store_url

#: The logger store operations report their transient failures (and retries) on.
STORE_RETRY_LOGGER = RETRY_LOGGER


class _RetryNotices(logging.Handler):
    """Pass each "transient error, retrying" record of the stores to a callback."""

    def __init__(self, notice: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.notice = notice

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.notice(f"retrying: {record.getMessage()}")


@contextlib.contextmanager
def store_retries_reported(notice: Callable[[str], None]) -> Iterator[None]:
    """Call ``notice`` with one line each time a store operation retries, inside the block.

    Without it a commit to an unreachable store is silent until its budget is
    spent.
    """
    logger = logging.getLogger(STORE_RETRY_LOGGER)
    handler = _RetryNotices(notice)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _source(store_url: str, run: str, path: str | Path) -> Path:
    """``path`` made absolute, once the URL, the run id and the file are checked."""
    parse_store_url(store_url)
    validate_run_id(run)
    source = Path(path).absolute()
    if not source.is_file():
        raise SourceNotFoundError(f"checkpoint file {str(source)!r} does not exist")
    return source


def commit_in_process(
    store_url: str,
    run: str,
    path: str | Path,
    options: CommitOptions | None = None,
    *,
    budget: float | None = None,
    **changes: Any,
) -> CheckpointRecord:
    """Commit the checkpoint file at ``path`` to ``run`` of ``store_url`` in this process.

    What a ``chkq.commit`` task does, by the file's owner, for any store, with
    ``options`` (a :class:`~chkq.log.transfer.CommitOptions`, or its fields as
    keyword arguments; the writer defaults to ``chkq@HOST``). The store
    operations of the whole commit share one retry budget (``budget``,
    default ``CHKQ_STORE_RETRY_SECONDS``), so an unreachable store fails the
    commit within that budget plus one attempt's timeouts.

    Raises
    ------
    FileNotFoundError
        If ``path`` is not a file.
    TransientStoreError
        If the store stayed unreachable for the whole budget.
    FileChangedError
        If the file changed while it was read, or is not ``expect_id``.
    """
    wanted = CommitOptions.of(options, **changes)
    if wanted.writer is None:
        wanted = replace(wanted, writer=f"chkq@{default_writer()}")
    source = _source(store_url, run, path)
    seconds = StoreTimeouts.from_env().budget if budget is None else budget
    with overall_budget(seconds):
        log = CheckpointLog(open_store(store_url), run)
        data, mode = read_stable(source)
        return commit_bytes(log, data, wanted, mode=mode)


def commit_signature(store_url: str, run: str, path: str | Path,
                     options: CommitOptions | None = None, **changes: Any) -> Signature:
    """The ``chkq.commit`` task for the file at ``path``, not sent yet (immutable).

    The message carries ``options``' :meth:`~chkq.log.transfer.CommitOptions.to_json`
    as keyword arguments, the file's absolute path and never its bytes.

    Raises
    ------
    ValueError
        For a malformed store URL, run id or option.
    FileNotFoundError
        If ``path`` is not a file here.
    """
    wanted = CommitOptions.of(options, **changes)
    source = _source(store_url, run, path)
    return get_app().signature("chkq.commit", args=(store_url, run, str(source)),
                               kwargs=wanted.to_json(), immutable=True)


def submit_commit(store_url: str, run: str, path: str | Path,
                  options: CommitOptions | None = None, **changes: Any) -> AsyncResult:
    """Enqueue the commit of the checkpoint file at ``path`` to ``run`` in ``store_url``.

    ``options`` as for :func:`commit_in_process` (a writer is not sent: the
    worker records itself). The path must be readable by the workers (shared
    storage) and, where the workers set ``CHKQ_ALLOWED_ROOTS``, inside those
    roots; the workers resolve it (links, ``..``) and read it, and never
    remove it. Raises what :func:`commit_signature` raises, before sending.
    """
    return commit_signature(store_url, run, path, options, **changes).apply_async()


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
        steps.append(commit_signature(
            store_url, run, source,
            CommitOptions(parent=parent, step=step, name=source.name, model=model,
                          expect_id=ident)))
        parent = ident
    if not steps:
        raise ValueError("no checkpoint files to commit")
    return chain(*steps).apply_async()


def record_of(result: dict[str, Any]) -> CheckpointRecord:
    """The CheckpointRecord a commit task returned (as JSON)."""
    return CheckpointRecord(**result)


def commit_checkpoint(
    store_url: str, run: str, path: str | Path, options: CommitOptions | None = None, *,
    timeout: float | None = None, **changes: Any,
) -> CheckpointRecord:
    """Commit a checkpoint file through the cluster and wait, or (no broker) in this process.

    ``options`` as for :func:`commit_in_process`.
    """
    wanted = CommitOptions.of(options, **changes)
    if get_settings().broker_url:
        return record_of(submit_commit(store_url, run, path, wanted).get(timeout=timeout))
    return commit_in_process(store_url, run, path, wanted)
