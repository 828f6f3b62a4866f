"""The commit task: store one checkpoint in a run's log.

The message names the bytes — a path on shared storage or a staging key in
the store — never carries them. Transient store errors are retried with
backoff; a parent whose own commit is still running is waited for by
retrying; redelivery is harmless because committing the same bytes again
changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from chkq.commits import (
    FileChangedError,
    ParentNotCommittedError,
    check_relative_name,
    commit_bytes,
    read_stable,
)
from chkq.log import CheckpointLog
from chkq.stores import TransientStoreError, open_store
from config.celery_app import app
from tasks.base import ChkqTask, Timer

MAX_RETRIES = 30


def _source_bytes(store_url: str, path: str | None, staging_key: str | None) -> bytes:
    if (path is None) == (staging_key is None):
        raise ValueError("a commit names its bytes by exactly one of path or staging_key")
    if path is not None:
        if not Path(path).is_absolute():
            raise ValueError(f"commit path {path!r} must be absolute (shared storage)")
        if not Path(path).is_file():
            raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
        return read_stable(path)
    assert staging_key is not None
    return open_store(store_url).get(staging_key)


@app.task(
    name="chkq.commit",
    bind=True,
    base=ChkqTask,
    autoretry_for=(TransientStoreError, ParentNotCommittedError, FileChangedError),
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
    log = CheckpointLog(open_store(store_url), run)
    with Timer("chkq.commit", run, store=store_url, source=path or staging_key) as timer:
        data = _source_bytes(store_url, path, staging_key)
        record = commit_bytes(log, data, parent=parent, parent_head=parent_head, step=step,
                              label=label, meta=meta or None, expect_id=expect_id)
        timer.result = {"id": record.id[:12], "bytes": len(data), "kind": record.kind,
                        "stored": record.stored_size}
    if staging_key is not None:
        log.store.delete(staging_key)
    return asdict(record)
