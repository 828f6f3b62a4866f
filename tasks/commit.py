"""The commit task: store one checkpoint in a run's log.

The message names the bytes — a path on shared storage — never carries
them. Transient store errors are retried with backoff; a parent whose own
commit is still running is waited for by retrying; redelivery is harmless
because committing the same bytes again changes nothing.

A message is untrusted input, so before anything is read
or written: the store URL is parsed and decoded once
(:func:`chkq.stores.url.parse_store_url`) and the resolved directory of a
``file://`` store is checked against ``CHKQ_ALLOWED_ROOTS``; the checkpoint
path is resolved (links, ``..``) and checked the same way, and only a
regular file is read. The task never deletes anything: there is no staging
argument whose file it would remove after the commit.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chkq.access import resolve_allowed
from chkq.backoff import Backoff
from chkq.config.celery_app import get_app, get_settings
from chkq.errors import BadMessageError, BadMessageTypeError
from chkq.log import CheckpointLog
from chkq.log.transfer import (
    CommitOptions,
    FileChangedError,
    ParentNotCommittedError,
    commit_bytes,
    read_stable,
)
from chkq.stores import TransientStoreError
from chkq.stores.url import parse_store_url
from chkq.tasks.base import Checked, ChkqTask, task_lifecycle

MAX_RETRIES = 30
#: A parent still being committed is waited for by retries 0.25 s apart at first, then up
#: to 5 s apart, for about 10 minutes. Clients that know a whole chain send it as a Celery
#: chain instead (chkq.workers.commit_client.submit_commit_chain), which never waits.
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


#: Waits before retrying a commit whose parent is not in the log yet.
PARENT_BACKOFF = Backoff(0.25, 5.0)
#: Waits before retrying a commit that failed on a transient store error (Celery's own
#: jittered backoff, given this policy's numbers).
STORE_BACKOFF = Backoff(1.0, 30.0, jitter=True)


def parent_wait(retries: int) -> float:
    """Seconds before retrying a commit whose parent is not in the log yet."""
    return PARENT_BACKOFF.wait(retries)


def checkpoint_source(path: Any) -> Path:
    """Resolve and check the checkpoint path of a commit message; return the path to read.

    Raises
    ------
    TypeError, ValueError
        For a path that is not a string, is relative or holds a NUL byte.
    PermissionError
        If the resolved path (links and ``..`` followed) is outside
        ``CHKQ_ALLOWED_ROOTS``.
    """
    if path is None:
        raise BadMessageTypeError("commit path is missing")
    if not isinstance(path, str):
        raise BadMessageTypeError(f"commit path must be a string, got {type(path).__name__}")
    if "\x00" in path:
        raise BadMessageError(f"commit path {path!r} contains a NUL byte")
    if not Path(path).is_absolute():
        raise BadMessageError(f"commit path {path!r} must be absolute (shared storage)")
    return resolve_allowed(path, get_settings().allowed_roots)


def _commit_message(self: ChkqTask, store_url: str, run: str, path: str | None = None,
                    **options: Any) -> Checked:
    """A commit message checked: its options, store (and its directory) and checkpoint path.

    ``path`` has a default only so that this check, not Celery's argument
    binding, reports what is wrong with a message: the options first (an
    unknown one by its name), then a missing path.
    """
    wanted = CommitOptions.from_json(options)
    location = parse_store_url(store_url)
    if location.local_root is not None:
        resolve_allowed(location.local_root, get_settings().allowed_roots)
    source = checkpoint_source(path)
    core = get_settings().core()
    log = CheckpointLog(location.open(timeouts=core.timeouts), run, trust=core.trust,
                        max_checkpoint=core.max_checkpoint)
    return Checked(run, (log, source, wanted), {},
                   {"store": log.store.url, "source": str(source)})


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """A commit's end line: the checkpoint's short id, its size, kind and stored bytes."""
    return {"id": record["id"][:12], "bytes": record["full_size"], "kind": record["kind"],
            "stored": record["stored_size"]}


@get_app().task(
    name="chkq.commit",
    bind=True,
    base=ChkqTask,
    autoretry_for=(TransientStoreError, FileChangedError),
    retry_backoff=STORE_BACKOFF.first,
    retry_backoff_max=STORE_BACKOFF.most,
    retry_jitter=STORE_BACKOFF.jitter,
    max_retries=MAX_RETRIES,
)
@task_lifecycle(_commit_message, _summary)
def commit(self: ChkqTask, log: CheckpointLog, source: Path,
           wanted: CommitOptions) -> dict[str, Any]:
    """Commit the checkpoint file at ``path`` to run ``run`` of the store at ``store_url``.

    The message is ``(store_url, run, path, **options)``; ``options`` are
    the fields of :class:`chkq.log.transfer.CommitOptions` a message may
    carry (:meth:`~chkq.log.transfer.CommitOptions.to_json`): ``name``,
    kept (with ``model``) in a name entry of its own so that ``chkq log
    restore`` can put the file back under every name it was committed as,
    and ``expect_id`` (the SHA-256 the watcher saw), which guards against a
    file changed since, among them. Every argument is checked
    (:func:`_commit_message`: unknown names, types, ids, the resolved store
    directory and file against ``CHKQ_ALLOWED_ROOTS``) before anything is
    read or written; the source file is only read, never removed.
    """
    try:
        parent = wanted.parent
        if parent is not None and not wait_for_parent(log, parent, PARENT_POLL_SECONDS):
            raise ParentNotCommittedError(
                f"parent {parent} is not a checkpoint of run {log.run_id!r} (yet)")
        data, mode = read_stable(source)
        record = commit_bytes(log, data, wanted, mode=mode)
    except ParentNotCommittedError as exc:
        raise self.retry(exc=exc, countdown=parent_wait(self.request.retries or 0),
                         max_retries=PARENT_RETRIES) from None
    return asdict(record)
