"""Committing checkpoint files to a log, and bringing a run back from it.

Core operations (no Celery) used by the commit task, the ``chkq log``
commands and the watcher. A checkpoint file is committed under the name it
has in its run directory (``meta["name"]``, e.g. ``run_chk00003.h5`` or
``run_chk00003/thread_0001.h5``), which is how ``restore`` puts it back.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

from chkq.fsutil import write_durably
from chkq.log import CheckpointLog, CheckpointRecord, checkpoint_id


class FileChangedError(OSError):
    """A checkpoint file changed while it was read (it was still being written)."""


class ParentNotCommittedError(LookupError):
    """The parent named for a commit is not (yet) in the log."""


def read_stable(path: str | Path) -> bytes:
    """Read a whole file, refusing one that changes while it is read.

    Size and modification time are compared before and after the read; a
    simulation still writing the file makes them differ.

    Raises
    ------
    FileChangedError
        If the file changed during the read.
    """
    before = os.stat(path)
    with open(path, "rb") as fh:
        data = fh.read()
    after = os.stat(path)
    if (before.st_size, before.st_mtime_ns, before.st_ino) != (
        after.st_size, after.st_mtime_ns, after.st_ino
    ) or len(data) != after.st_size:
        raise FileChangedError(f"checkpoint file {str(path)!r} changed while it was read")
    return data


def check_relative_name(name: str) -> str:
    """Return ``name`` if it is a safe relative path inside a run directory."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "\\" in name or "\x00" in name:
        raise ValueError(f"invalid checkpoint name {name!r}: expected a relative path "
                         "inside the run directory")
    return name


def resolve_id(log: CheckpointLog, ref: str) -> str:
    """Turn a full id or a unique prefix (at least 6 hex digits) into a checkpoint id.

    Raises
    ------
    KeyError
        If no checkpoint, or more than one, matches.
    """
    if len(ref) == 64 and ref in log:
        return ref
    if len(ref) < 6:
        raise KeyError(f"checkpoint id {ref!r} is too short (give at least 6 hex digits)")
    matches = [i for i in log.ids() if i.startswith(ref)]
    if len(matches) != 1:
        what = "no checkpoint" if not matches else f"{len(matches)} checkpoints"
        raise KeyError(f"{what} of run {log.run_id!r} match id {ref!r}")
    return matches[0]


def single_head(log: CheckpointLog) -> str | None:
    """The run's one head (None for an empty run); ValueError if it has several."""
    heads = log.heads()
    if len(heads) > 1:
        raise ValueError(
            f"run {log.run_id!r} has {len(heads)} heads; name the parent with --parent ID"
        )
    return heads[0].id if heads else None


def commit_bytes(
    log: CheckpointLog,
    data: bytes,
    *,
    parent: str | None = None,
    parent_head: bool = False,
    step: int | None = None,
    label: str | None = None,
    meta: dict[str, Any] | None = None,
    expect_id: str | None = None,
) -> CheckpointRecord:
    """Commit ``data``; return its record.

    Raises
    ------
    ParentNotCommittedError
        If ``parent`` is not in the log yet (its commit may still be running).
    FileChangedError
        If ``expect_id`` is given and the bytes are not that checkpoint.
    """
    if expect_id is not None and checkpoint_id(data) != expect_id:
        raise FileChangedError(
            f"the checkpoint's bytes no longer have id {expect_id} (the file changed)")
    if parent_head:
        parent = single_head(log)
    if parent is not None and parent not in log:
        raise ParentNotCommittedError(
            f"parent {parent} is not a checkpoint of run {log.run_id!r} (yet)")
    checkpoint = log.commit(data, parent, step=step, label=label, meta=meta)
    return log.record(checkpoint)


def restore_run(log: CheckpointLog, out_dir: str | Path, model: str | None = None
                ) -> list[Path]:
    """Write every checkpoint of the run back under its original name in ``out_dir``.

    Only checkpoints committed with a ``name`` (by ``chkq watch`` or
    ``chkq log commit``) are restored; with ``model``, only that model's. A
    file that already exists with the same bytes is kept; one with other
    bytes is an error (nothing is overwritten). Files appear atomically.

    Raises
    ------
    FileExistsError
        If a file to restore exists with other content.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    latest: dict[str, CheckpointRecord] = {}
    for record in log.manifest():
        name = record.meta.get("name") if record.meta else None
        if not isinstance(name, str):
            continue
        if model is not None and record.meta.get("model") not in (None, model):
            continue
        latest[check_relative_name(name)] = record
    written = []
    for name, record in sorted(latest.items()):
        target = directory / name
        data = log.load(record.id)
        if target.exists():
            if checkpoint_id(target.read_bytes()) == record.id:
                written.append(target)
                continue
            raise FileExistsError(f"{str(target)!r} exists with other content; not overwritten")
        target.parent.mkdir(parents=True, exist_ok=True)
        write_durably(target, data, exclusive=True)
        written.append(target)
    return written
