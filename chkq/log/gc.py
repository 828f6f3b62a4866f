"""Garbage collection of a run: payloads no record points to, stale head copies, trash.

A payload without a record is what a writer leaves when it dies
between its two writes.  Age comes from the store's object
timestamps (:meth:`CheckpointStore.modified`); payloads younger than
``older_than`` seconds are left alone, because their writer may be
about to write the record.

A commit of the same bytes may find such an old payload ("exists")
and record it at any moment, so an orphan is removed in four steps:
its bytes are read and kept under ``trash/`` (in case gc dies), the
payload is deleted, the record is read *again*, and if it now names
the payload the bytes are put back; the trash copy goes last.  A
committer checks that a payload it reused still exists after writing
its record, and writes it again if not.  With linearizable stores
(S3, GCS, POSIX), either the committer's record is written before
gc's second look — gc sees it and puts the payload back — or after
it, and then the committer's own check comes after gc's delete and
rewrites the payload: under every interleaving a recorded payload
exists when both are done.  Trash left by a gc that died is settled
by the next one.  Head copies of checkpoints that have children
(left by a writer that died before removing them) or no record are
deleted too; they are caches, not history.

Consolidated outputs and their entries (``outputs/``) are history that no
record refers to: gc never lists, reads or deletes anything there, however
old, recorded or not.  Nor does an output keep anything else alive: the
payloads and head copies of the checkpoints it was made from are kept or
removed by the rules above alone.

Why no interleaving loses data, in short: gc deletes a payload only after
having seen, *after* its delete, that no record names it; a committer that
reused a payload checks, *after* writing its record, that the payload is
still there.  Of two linearizable operations one comes first, so one of the
two always sees the other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from chkq.errors import CheckpointCorruptionError
from chkq.log import delta as codec
from chkq.log.reader import LogReader

__all__ = ["collect"]

logger = logging.getLogger(__name__)


def _aged(log: LogReader, group: str, now: float, skip: Callable[[str], bool]
          ) -> Iterator[tuple[str, str, float]]:
    """(key, checkpoint, age in seconds) of each key of ``group`` that names a checkpoint,
    is not ``skip``-ped and still exists (a key deleted meanwhile is passed over)."""
    for key in log.list_keys(log.keys.group(group)):
        checkpoint = log.keys.parse(key).checkpoint
        if checkpoint is None or skip(key):
            continue
        try:
            modified = log.store.modified(key)
        except KeyError:
            continue
        yield key, checkpoint, now - modified


def collect(log: LogReader, older_than: float,
            young: list[tuple[str, float]] | None = None) -> list[str]:
    """Delete payloads no record points to, and stale head copies (see the module docs).

    ``young``, when given, receives ``(key, age in seconds)`` of each payload no
    record points to that was kept because it is younger than ``older_than``, so
    that a user who saw ``log verify`` report it knows why it is still there.

    Returns
    -------
    list[str]
        The deleted keys.
    """
    now = time.time()
    records = log.manifest()
    referenced = {r.payload for r in records}
    deleted: list[str] = []
    _settle_trash(log, now, older_than)
    for key, checkpoint, age in _aged(log, "payloads", now, skip=referenced.__contains__):
        if age < older_than:
            if young is not None:
                young.append((key, age))
            continue
        if _names_payload(log, checkpoint, key):
            continue
        if _remove_orphan(log, checkpoint, key):
            deleted.append(key)
    parents = {r.parent for r in records}
    recorded = {r.id for r in records}
    heads = {r.id for r in records if r.id not in parents}
    for key, checkpoint, age in _aged(log, "heads", now,
                                      skip=lambda key: log.keys.parse(key).checkpoint in heads):
        if checkpoint in recorded or age >= older_than:
            log.store.delete(key)
            deleted.append(key)
    return deleted


def _names_payload(log: LogReader, checkpoint: str, key: str) -> bool:
    """Read the record afresh: does it name ``key``? (malformed: assume it might)."""
    log.forget_records(checkpoint)
    try:
        current = log.fetch_record(checkpoint)
    except CheckpointCorruptionError:
        return True
    return current is not None and current.payload == key


def _remove_orphan(log: LogReader, checkpoint: str, key: str) -> bool:
    """Move an orphan payload aside, delete it, look again; True if it stays deleted.

    An object larger than any payload of a checkpoint within the size limit can
    be no record's payload (and a commit checks what it finds at its key), so
    it is deleted without being read whole.
    """
    bound = codec.compress_bound(log.max_checkpoint)
    try:
        data = log.store.get_at_most(key, bound)
    except KeyError:
        return False
    if len(data) > bound:
        logger.warning("payload %s is larger than any checkpoint's payload: deleted", key)
        log.store.delete(key)
        return True
    trash = log.keys.trash(key)
    log.store.put(trash, data)
    log.store.delete(key)
    if _names_payload(log, checkpoint, key):
        logger.warning("payload %s was recorded while gc removed it: putting it back", key)
        log.store.put_if_absent(key, data)
        log.store.delete(trash)
        return False
    log.store.delete(trash)
    return True


def _settle_trash(log: LogReader, now: float, older_than: float) -> None:
    """Finish what a gc that died mid-removal left under ``trash/``."""
    for trash in log.list_keys(log.keys.group("trash")):
        checkpoint = log.keys.parse(trash).checkpoint
        key = log.keys.payload_of_trash(trash)
        if checkpoint is not None and _names_payload(log, checkpoint, key) \
                and not log.store.exists(key):
            try:
                log.store.put_if_absent(key, log.store.get(trash))
            except KeyError:
                continue
            logger.warning("restored recorded payload %s from gc's trash", key)
            log.store.delete(trash)
            continue
        try:
            age = now - log.store.modified(trash)
        except KeyError:
            continue
        if age >= older_than:
            log.store.delete(trash)

