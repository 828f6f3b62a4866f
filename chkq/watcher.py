"""Watching a running simulation's output directory for complete checkpoint files.

A file is ready when it is complete — its root has ``trials_completed``,
which the simulation writes just before it closes the file, and no writer
holds it any more — and has not changed between two looks. Each writer's
files form a chain (``thread_0001.h5`` of checkpoint 3 follows
``thread_0001.h5`` of checkpoint 2; single-file checkpoints follow each
other); a chain is committed in order and stops at its first file that is
not ready, so none is skipped. What the log already holds (by name) is not
committed again, so a restarted watcher goes on where it stopped — but only
when the file's own SHA-256 is the checkpoint the log's entry names: an
entry planted in the store for a name the watcher has not committed yet
never makes it skip the real file. A commit that cannot be made now
(``enqueue`` raises :class:`CommitDeferred`) blocks its chain until the next
look, which tries it again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chkq.consolidation.completeness import is_complete
from chkq.consolidation.discovery import check_out_dir, find_checkpoints


class CommitDeferred(Exception):
    """Raised by an ``enqueue`` callback: this file could not be committed now; try later."""


@dataclass(frozen=True)
class CommitRequest:
    """One checkpoint file to commit, chained to its writer's previous file."""

    path: Path
    name: str
    number: int
    parent: str | None
    checkpoint_id: str


def file_id(path: Path, block: int = 16 * 1024 * 1024) -> str:
    """The checkpoint id (SHA-256) of the file at ``path``, read in bounded blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def chain_key(out_dir: Path, path: Path) -> str:
    """Which writer's chain ``path`` belongs to: its name inside a checkpoint directory."""
    return path.name if path.parent != out_dir else ""


class Watcher:
    """Finds checkpoint files ready to commit, in order, once each.

    Parameters
    ----------
    out_dir, model
        The run's output directory and model name.
    committed
        Names already in the log, mapped to their checkpoint ids.
    enqueue
        Called with each ready file, in chain order; raises
        :class:`CommitDeferred` if the file could not be committed now.

    Attributes
    ----------
    deferred
        Names whose last attempt was deferred and that are not committed yet.
    """

    def __init__(self, out_dir: str | Path, model: str, committed: dict[str, str],
                 enqueue: Callable[[CommitRequest], None]) -> None:
        self.out_dir = check_out_dir(out_dir)
        self.model = model
        self.done: dict[str, str] = dict(committed)
        self.enqueue = enqueue
        self._seen: dict[Path, tuple[int, int]] = {}
        self.deferred: set[str] = set()
        self._held: dict[Path, tuple[int, int, int, str]] = {}

    def _stable(self, path: Path) -> bool:
        st = os.stat(path)
        now = (st.st_size, st.st_mtime_ns)
        before = self._seen.get(path)
        self._seen[path] = now
        return before == now

    def _holds(self, path: Path, checkpoint: str) -> bool:
        """Whether the file at ``path`` has id ``checkpoint`` (hashed once per version)."""
        st = os.stat(path)
        version = (st.st_size, st.st_mtime_ns, st.st_ino)
        known = self._held.get(path)
        if known is None or known[:3] != version:
            known = (*version, file_id(path))
            self._held[path] = known
        return known[3] == checkpoint

    def poll(self) -> list[CommitRequest]:
        """Look once; enqueue and return the files that became ready."""
        sent: list[CommitRequest] = []
        tip: dict[str, str | None] = {}
        blocked: set[str] = set()
        for checkpoint in find_checkpoints(self.out_dir, self.model):
            for path in checkpoint.files:
                key = chain_key(self.out_dir, path)
                name = str(path.relative_to(self.out_dir))
                if name in self.done and self._holds(path, self.done[name]):
                    tip[key] = self.done[name]
                    continue
                self.done.pop(name, None)
                if key in blocked:
                    continue
                if not (is_complete(path) and self._stable(path)):
                    blocked.add(key)
                    continue
                st = os.stat(path)
                ident = file_id(path)
                self._held[path] = (st.st_size, st.st_mtime_ns, st.st_ino, ident)
                request = CommitRequest(path, name, checkpoint.number, tip.get(key), ident)
                try:
                    self.enqueue(request)
                except CommitDeferred:
                    self.deferred.add(name)
                    blocked.add(key)
                    continue
                self.deferred.discard(name)
                self.done[name] = ident
                tip[key] = ident
                sent.append(request)
        return sent
