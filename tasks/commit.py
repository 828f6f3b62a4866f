"""The commit task: store one checkpoint in a run's log.

The message names the bytes — a path on shared storage or a staging key in
the store — never carries them. Transient store errors are retried with
backoff; a parent whose own commit is still running is waited for by
retrying; redelivery is harmless because committing the same bytes again
changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from chkq.access import check_allowed
from chkq.commits import (
    FileChangedError,
    ParentNotCommittedError,
    check_relative_name,
    commit_bytes,
    read_stable,
)
from chkq.config.celery_app import app, settings
from chkq.log import CheckpointLog
from chkq.stores import TransientStoreError, open_store
from chkq.tasks.base import ChkqTask, Timer

MAX_RETRIES = 30
#: A parent still being committed is waited for by retries 0.25 s apart at first, then up
#: to 5 s apart, for about 10 minutes. Clients that know a whole chain send it as a Celery
#: chain instead (chkq.workers.commits.submit_commit_chain), which never waits.
PARENT_RETRIES = 130


#: How long a commit waits in its process for a parent being committed by another one
#: before it hands the wait to the broker (a retry).
PARENT_POLL_SECONDS = 2.0


def wait_for_parent(log: CheckpointLog, parent: str, seconds: float) -> bool:
    """Poll the log for ``parent`` for up to ``seconds``; True once it is there."""
    deadline = time.monotonic() + seconds
    while parent not in log:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def parent_wait(retries: int) -> float:
    """Seconds before retrying a commit whose parent is not in the log yet."""
    return float(min(5.0, 0.25 * 2 ** min(retries, 5)))


def _source_bytes(store_url: str, path: str | None, staging_key: str | None) -> bytes:
    if (path is None) == (staging_key is None):
        raise ValueError("a commit names its bytes by exactly one of path or staging_key")
    if path is not None:
        if not Path(path).is_absolute():
            raise ValueError(f"commit path {path!r} must be absolute (shared storage)")
        check_allowed(path, settings.allowed_roots)
        if not Path(path).is_file():
            raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
        return read_stable(path)
    assert staging_key is not None
    return open_store(store_url).get(staging_key)


@app.task(
    name="chkq.commit",
    bind=True,
    base=ChkqTask,
    autoretry_for=(TransientStoreError, FileChangedError),
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=MAX_RETRIES,
)
def commit(
    self: ChkqTask,
    store_url: str,
    run: str,
    path: str | None = None,
    *,
    staging_key: str | None = None,
    parent: str | None = None,
    parent_head: bool = False,
    step: int | None = None,
    label: str | None = None,
    name: str | None = None,
    model: str | None = None,
    expect_id: str | None = None,
) -> dict[str, Any]:
    """Commit the checkpoint at ``path`` (or ``staging_key``) to run ``run`` of the store.

    ``name`` is the file's name relative to its run directory, kept in the
    record's meta so that ``chkq log restore`` can put it back; ``expect_id``
    (the SHA-256 the watcher saw) guards against a file changed since.
    """
    self.check_deliveries()
    meta: dict[str, Any] = {}
    if name is not None:
        meta["name"] = check_relative_name(name)
    if model is not None:
        meta["model"] = model
    if urlsplit(store_url).scheme == "file":
        check_allowed(urlsplit(store_url).path, settings.allowed_roots)
    log = CheckpointLog(open_store(store_url), run)
    with Timer("chkq.commit", run, store=store_url, source=path or staging_key) as timer:
        try:
            if parent is not None and not wait_for_parent(log, parent, PARENT_POLL_SECONDS):
                raise ParentNotCommittedError(
                    f"parent {parent} is not a checkpoint of run {run!r} (yet)")
            data = _source_bytes(store_url, path, staging_key)
            record = commit_bytes(log, data, parent=parent, parent_head=parent_head, step=step,
                                  label=label, meta=meta or None, expect_id=expect_id)
        except ParentNotCommittedError as exc:
            raise self.retry(exc=exc, countdown=parent_wait(self.request.retries or 0),
                             max_retries=PARENT_RETRIES) from None
        timer.result = {"id": record.id[:12], "bytes": len(data), "kind": record.kind,
                        "stored": record.stored_size}
    if staging_key is not None:
        log.store.delete(staging_key)
    return asdict(record)
