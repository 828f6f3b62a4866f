"""The checkpoint log: a content-addressed, delta-compressed, write-once log of one run.

Writes are create-if-absent only, so any number of processes on any number of
machines can commit to one log without locks:

* A commit writes the payload first, the record second and, for a named
  file, its name entry third, so no record points to a missing payload and
  no entry to a missing record.  The record is the commit point: whoever
  creates it first wins; the others read it back and return the same id.
  Re-committing bytes already in the log still writes the caller's entry,
  so names and annotations of a re-commit are kept.
* Payload keys are derived from the content (id, kind, base), so racing
  writers of one checkpoint write the *same* key and leave nothing behind.
  A writer whose payload lost (another writer recorded the same bytes with a
  different base — possible only with different parents) deletes its own
  payload after checking that the winning record names a different key; no
  record can ever name it afterwards, because records are write-once.
* A payload without a record is left only by a writer that died between
  the two writes; :meth:`CheckpointLog.gc` removes those once they are older
  than a threshold.  It first moves the payload aside (a copy under
  ``trash/``, kept in memory too), deletes it, and only then reads the record
  again; if a commit recorded the payload in between, gc puts it back.  A
  writer that finds such an orphan (``put_if_absent`` says "exists") and then
  wins the record checks that the payload is still there and writes it again
  if gc removed it in between.  Whatever the interleaving, one of the two
  sees the other (see :meth:`CheckpointLog.gc`).
* The stores turn a conditional write that comes back "exists" only because
  the client retried its *own* successful write into success (write ids, see
  :mod:`chkq.stores.s3`), so a lost response never loses data.

Reads never write.  Records and entries are validated when read (types of
every field, the payload key derived from the content, nesting depth and
size, name components a file system can hold, the declared size against
:data:`MAX_CHECKPOINT_ENV`); a malformed one is reported by key
(:attr:`CheckpointLog.malformed`) and the rest of the run still lists, loads
and restores.  A listing that meets a symbolic link in a local store is
reported the same way.

Store content is written by whoever can write to the store.  Payloads are
decompressed only up to the size their record declares, so a planted frame
cannot expand beyond it.  Which checkpoint a *name* stands for is the name
entry's word: with trusted log keys (:mod:`chkq.log.signing`) only signed
records and entries are used and a name's latest entry is its content;
without, a name whose entries name different checkpoints is a *conflict*
(:attr:`CheckpointLog.conflicts`): no entry wins, restore refuses the name
and verify reports it, since a planted entry could claim any creation time.

Fast resume
-----------
History is stored as parent-chained deltas (a 1 % change costs about 1.2 %)
with a full keyframe at least every ``max_chain + 1`` checkpoints.  Walking a
chain costs one full decode per delta (about 25x a plain read at depth 16),
so each delta checkpoint also gets a *head copy*: its full bytes, written
when it is committed and deleted as soon as a child is committed on it (or
by ``gc`` when that child's writer died before deleting it).  Loading a head
is then a single read, decompression and SHA-256, whatever its depth, while
the history keeps only one full copy per *head* beyond the keyframes.  The
copy is a cache, never a record's payload: it can be deleted at any time and
a load falls back to the chain.  Because a load prefers the copy, damage to
a head's chain can hide behind it: :meth:`CheckpointLog.verify` decodes
chains without head copies.

A bounded LRU cache of verified checkpoint bytes makes committing N+1 right
after N (or loading a recent ancestor) free of store reads.

Outputs
-------
A model's consolidated file is recorded by :meth:`CheckpointLog.record_output`
in an output entry, written once and signed like name entries (see
:mod:`chkq.log.records`); gc never touches ``outputs/``.
"""

from __future__ import annotations

import json
import logging
import stat
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal

from chkq.errors import (
    CheckpointCorruptionError,
    LogKeyError,
    OutputCorruptionError,
    OutputEntryError,
    OutputExistsError,
    UnknownParentError,
)
from chkq.log import delta as codec
from chkq.log import gc as _gc
from chkq.log import verify as _verify
from chkq.log.names import NameEntry, newest
from chkq.log.reader import OUTPUT_PIECE_BYTES, LogReader
from chkq.log.records import (
    MAX_CHECKPOINT_ENV,
    MAX_OUTPUT_ENTRY_BYTES,
    CheckpointRecord,
    OutputEntry,
    check_relative_name,
    checkpoint_id,
    default_writer,
)
from chkq.log.seen import SeenNames
from chkq.log.signing import LogTrust
from chkq.log.verify import ProgressCallback, VerifyReport
from chkq.lru import LRU
from chkq.stores.base import CheckpointStore

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_GC_AGE", "OUTPUT_PIECE_BYTES", "CheckpointLog"]

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MiB
DEFAULT_GC_AGE = 24 * 3600.0
"""Default age (s) below which ``gc`` leaves unreferenced payloads alone."""


class CheckpointLog(LogReader):
    """One run's checkpoints in a store, as a write-once, content-addressed log.

    Parameters
    ----------
    store
        Where the log lives.
    run_id
        The run's name (one key component); its keys are under ``runs/<run_id>/``.
    max_chain
        Longest run of deltas before a full keyframe is stored.
    cache_bytes
        Bound of the LRU cache of rebuilt checkpoints.
    head_copies
        Write a full copy of each delta head for fast resume (see module docs).
    trust
        Keys objects are signed with and checked against
        (:mod:`chkq.log.signing`); default: the environment's
        (``CHKQ_LOG_SIGNING_KEY``, ``CHKQ_LOG_TRUSTED_KEYS``).
    max_checkpoint
        Largest checkpoint committed or read, in bytes; default
        ``CHKQ_LOG_MAX_CHECKPOINT_BYTES`` (4 GiB). A record declaring more is
        refused, and no payload is decompressed beyond its record's size.
    seen
        Where this reader keeps the newest entry it saw of each name (see
        :mod:`chkq.log.seen`); None keeps nothing.
    """

    def __init__(
        self,
        store: CheckpointStore,
        run_id: str,
        max_chain: int = 16,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        *,
        head_copies: bool = True,
        trust: LogTrust | None = None,
        max_checkpoint: int | None = None,
        seen: SeenNames | None = None,
    ) -> None:
        if max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        super().__init__(store, run_id, trust=trust, max_checkpoint=max_checkpoint, seen=seen)
        self.max_chain = max_chain
        self.head_copies = head_copies
        self._cache: LRU[str, bytes] = LRU(cache_bytes, len)

    # keys: the same as :attr:`keys` (:class:`~chkq.log.keys.RunKeys`), kept for callers

    def record_key(self, checkpoint: str) -> str:
        """Store key of a checkpoint's record."""
        return self.keys.record(checkpoint)

    def payload_key(self, checkpoint: str, kind: str, base: str | None) -> str:
        """Store key of a payload, derived from its content only."""
        return self.keys.payload(checkpoint, kind, base)

    def head_copy_key(self, checkpoint: str) -> str:
        """Store key of the full copy kept while a delta checkpoint is a head."""
        return self.keys.head_copy(checkpoint)

    def entry_key(self, entry: NameEntry) -> str:
        """Store key of a name entry (:meth:`entry_key_of`)."""
        return self.entry_key_of(entry)

    def trash_key(self, payload_key: str) -> str:
        """Where gc keeps a payload it is removing until the removal is settled."""
        return self.keys.trash(payload_key)

    def output_entry_key(self, model: str) -> str:
        """Store key of the entry recording ``model``'s consolidated output."""
        return self.keys.output_entry(model)

    def output_key(self, model: str) -> str:
        """Default store key of ``model``'s consolidated output object."""
        return self.keys.output(model)

    def _signed(self, raw: bytes, kind: str) -> bytes:
        """``raw`` (a record's or entry's JSON) with a signature, if this log signs."""
        if self.trust.signer is None:
            return raw
        obj = self.trust.sign(json.loads(raw), kind, self.run_id)
        return (json.dumps(obj, indent=1) + "\n").encode()

    def load(self, checkpoint: str) -> bytes:
        """Return the verified bytes of ``checkpoint``.

        Raises
        ------
        KeyError
            If the run has no such checkpoint.
        CheckpointCorruptionError
            If a record is malformed, a payload is missing or damaged, or the
            rebuilt bytes do not hash to the id; the message names the
            checkpoint and the object at fault.
        """
        cached = self._cache.get(checkpoint)
        if cached is not None:
            return cached
        record = self.record(checkpoint)
        if record.kind == "delta" and self.head_copies:
            data = self._load_head_copy(record)
            if data is not None:
                self._cache.put(record.id, data)
                return data
        return self._rebuild(record)

    def _load_head_copy(self, record: CheckpointRecord) -> bytes | None:
        key = self.keys.head_copy(record.id)
        try:
            raw = self.store.get_at_most(key, codec.compress_bound(record.full_size))
        except KeyError:
            return None
        try:
            data = codec.decompress_full(raw, record.full_size)
        except codec.DeltaError as exc:
            warnings.warn(f"ignoring damaged head copy {key}: {exc}", stacklevel=3)
            return None
        if checkpoint_id(data) != record.id:
            warnings.warn(f"ignoring head copy {key}: wrong SHA-256", stacklevel=3)
            return None
        return data

    def _rebuild(self, record: CheckpointRecord) -> bytes:
        chain = [record]
        seen = {record.id}
        data: bytes | None = None
        while chain[-1].kind == "delta":
            base = chain[-1].base
            assert base is not None
            data = self._cache.get(base)
            if data is not None:
                break
            if base in seen:
                raise self.corruption(record.id, chain[-1].payload, "delta chain has a cycle")
            seen.add(base)
            base_record = self.fetch_record(base)
            if base_record is None:
                raise self.corruption(
                    chain[-1].id, chain[-1].payload, f"base record {base} missing"
                )
            chain.append(base_record)
        if data is None:
            top = chain.pop()
            data = self._cached(top, self.decode(top))
        for item in reversed(chain):
            data = self._cached(item, self.decode(item, data))
        return data

    def _cached(self, record: CheckpointRecord, data: bytes) -> bytes:
        """:meth:`verified` ``data``, kept in the cache of checkpoint bytes."""
        self._cache.put(record.id, self.verified(record, data))
        return data

    def commit(
        self,
        data: bytes,
        parent: str | None = None,
        *,
        step: int | None = None,
        label: str | None = None,
        meta: dict[str, Any] | None = None,
        name: str | None = None,
        model: str | None = None,
        writer: str | None = None,
        mode: int | None = None,
    ) -> str:
        """Store a checkpoint and return its id.

        With a parent, the payload is a delta against the parent unless the
        parent's chain already holds ``max_chain`` deltas or the delta is not
        smaller than the whole checkpoint compressed.  Committing bytes that
        are already in the log (from any process) returns their id and
        changes no payload or record, whatever the parent and annotations.

        With ``name`` (the file's path relative to its run directory), a
        :class:`NameEntry` is written too — also when the bytes were already
        in the log — so that every name of the same bytes, with its own
        ``model``, ``step``, ``label`` and ``meta``, is kept and restored;
        ``mode`` (the file's permission bits) is what a restored copy gets.

        Raises
        ------
        ValueError
            If ``parent`` is not a checkpoint of this run, ``name`` is not
            a safe relative path, or ``data`` is larger than :attr:`max_checkpoint`.
        """
        if len(data) > self.max_checkpoint:
            raise ValueError(f"checkpoint of {len(data)} bytes is larger than the "
                             f"{self.max_checkpoint}-byte limit ({MAX_CHECKPOINT_ENV})")
        entry = None
        if name is not None:
            entry = NameEntry(
                name=check_relative_name(name), id="0" * 64, model=model, step=step,
                label=label, writer=writer or default_writer(), meta=dict(meta or {}),
                mode=None if mode is None else stat.S_IMODE(mode),
            )
            entry.to_json()
        return self._commit(data, parent, step=step, label=label, meta=meta, fork=None,
                            entry=entry)

    def fork(
        self,
        source_id: str,
        data: bytes,
        *,
        label: str | None = None,
        edit: str | None = None,
    ) -> str:
        """Commit ``data`` as a derived checkpoint of ``source_id``.

        The record names the source as parent and keeps the edit description
        in ``fork``; storage is as for :meth:`commit` (a delta if it pays).
        """
        return self._commit(
            data, source_id, step=None, label=label, meta=None,
            fork={"source": source_id, "edit": edit}, entry=None,
        )

    def _write_entry(self, entry: NameEntry | None, checkpoint: str) -> None:
        if entry is None:
            return
        final = replace(entry, id=checkpoint, created=time.time())
        self._append(final, lambda top: top is None or top.deleted
                     or top.digest() != final.digest())

    def _append(self, entry: NameEntry, wanted: Callable[[NameEntry | None], bool]
                ) -> NameEntry | None:
        """Write ``entry`` as the next number of its name's history, if ``wanted(newest)``.

        The number is one above the highest key of the name's history
        (unreadable objects included: a planted one is skipped, never
        replaced); a writer that finds its number taken looks again.
        Returns the entry written, or None when ``wanted`` declined.
        """
        for _ in range(64):
            prefix = self.keys.name_history(entry.name)
            taken = [n for n in map(self.keys.entry_seq, self.list_keys(prefix)) if n]
            top = newest(self.name_history(entry.name))
            if not wanted(top):
                return None
            final = replace(entry, seq=max(taken, default=0) + 1)
            raw = self._signed(final.to_json(), "name")
            if self.store.put_if_absent(self.keys.numbered_entry(final.name, final.seq or 0), raw):
                return final
        raise OutputExistsError(f"name {entry.name!r} of run {self.run_id!r}: its next entry "
                                "number was taken 64 times in a row; not written")

    def delete_name(self, name: str, checkpoint: str, *, writer: str | None = None
                    ) -> NameEntry | None:
        """Delete file name ``name`` while it stands for ``checkpoint``: write its tombstone.

        The history is kept: a tombstone is one more numbered entry, so an
        entry saved earlier and planted again is superseded, never chosen
        (see :mod:`chkq.log.names`).  Returns the tombstone, or None if the
        name's newest entry is already a deletion or names another checkpoint
        (a newer commit of the name is not deleted).

        Raises
        ------
        LogKeyError
            If trusted log keys are configured but no signing key.
        """
        self._check_signer(f"not deleting name {name!r} in run {self.run_id!r}")
        tombstone = NameEntry(name=check_relative_name(name), id=checkpoint, deleted=True,
                              writer=writer or default_writer(), created=time.time())
        return self._append(tombstone, lambda top: top is None
                            or (not top.deleted and top.id == checkpoint))

    def _check_signer(self, what: str) -> None:
        if self.trust.enforcing and self.trust.signer is None:
            raise LogKeyError(
                "trusted log keys are configured (CHKQ_LOG_TRUSTED_KEYS) but no signing key "
                "(CHKQ_LOG_SIGNING_KEY): what this process wrote would be refused by every "
                f"reader; {what}")

    def _existing_record(self, checkpoint: str) -> tuple[CheckpointRecord | None, bool]:
        """The valid record of ``checkpoint`` if any, and whether an invalid one holds its key."""
        try:
            return self.fetch_record(checkpoint), False
        except CheckpointCorruptionError as exc:
            log.warning("%s: replacing it with this commit's record", exc)
            return None, True

    def _commit(
        self,
        data: bytes,
        parent: str | None,
        *,
        step: int | None,
        label: str | None,
        meta: dict[str, Any] | None,
        fork: dict[str, Any] | None,
        entry: NameEntry | None,
    ) -> str:
        self._check_signer(f"not committing to run {self.run_id!r}")
        data = bytes(data)
        with ThreadPoolExecutor(1) as pool:
            full_future = pool.submit(codec.compress_full, data)
            checkpoint = checkpoint_id(data)
            existing, invalid_record = self._existing_record(checkpoint)
            if existing is not None:
                self._cache.put(checkpoint, data)
                self._write_entry(entry, checkpoint)
                return checkpoint
            parent_record = None
            if parent is not None:
                if parent not in self:
                    raise UnknownParentError(
                        f"unknown parent checkpoint {parent!r} in run {self.run_id!r}")
                parent_record = self.record(parent)
            delta_payload = None
            parent_data = None
            if parent_record is not None and parent_record.depth < self.max_chain:
                parent_data = self.load(parent_record.id)
                try:
                    delta_payload = codec.encode(data, parent_data)
                except codec.DeltaError as exc:
                    log.info("storing %s whole: %s", checkpoint, exc)
            full_payload = full_future.result()
        if delta_payload is not None and len(delta_payload) < len(full_payload):
            assert parent_record is not None
            kind: Literal["full", "delta"] = "delta"
            base: str | None = parent_record.id
            depth = parent_record.depth + 1
            payload = delta_payload
        else:
            kind, base, depth, payload = "full", None, 0, full_payload
        key = self.keys.payload(checkpoint, kind, base)
        record = CheckpointRecord(
            id=checkpoint, parent=parent, kind=kind, base=base, depth=depth, payload=key,
            stored_size=len(payload), full_size=len(data), step=step, label=label,
            meta=dict(meta or {}), fork=fork, created=time.time(),
        )
        record_json = self._signed(record.to_json(), "record")
        created_payload = self.store.put_if_absent(key, payload)
        if not created_payload and not self.payload_holds(
                key, data, parent_data if kind == "delta" else None):
            # The key our content gives holds something else (planted or damaged): the
            # record about to name it must name these bytes.
            log.warning("payload %s does not decode to checkpoint %s: writing it again",
                        key, checkpoint)
            self.store.put(key, payload)
            created_payload = True
        recorded_parent = parent
        record_key = self.keys.record(checkpoint)
        winner = None
        if invalid_record:
            self.store.put(record_key, record_json)
            won = True
        else:
            won = self.store.put_if_absent(record_key, record_json)
            if not won:
                winner, invalid_record = self._existing_record(checkpoint)
                if invalid_record:
                    self.store.put(record_key, record_json)
                    won = True
        if won:
            if not created_payload and not self.store.exists(key):
                # An old orphan we reused was removed by a concurrent gc before it
                # could see our record (see gc): write it again.
                log.warning("payload %s vanished (concurrent gc?): writing it again", key)
                self.store.put_if_absent(key, payload)
            self.remember(record)
            if kind == "delta" and self.head_copies:
                self.store.put_if_absent(self.keys.head_copy(checkpoint), full_payload)
        else:
            if winner is not None and winner.payload != key and created_payload:
                self.store.delete(key)
            recorded_parent = winner.parent if winner is not None else None
        self._write_entry(entry, checkpoint)
        if recorded_parent is not None:
            self.store.delete(self.keys.head_copy(recorded_parent))
        self._cache.put(checkpoint, data)
        return checkpoint

    def record_output(self, entry: OutputEntry) -> OutputEntry:
        """Record a published consolidated output, create-if-absent; return the stored entry.

        The output object must already be in the store at ``entry.key`` with
        ``entry.size`` bytes (its SHA-256 is the caller's word: it hashed the
        bytes it published), and every checkpoint it names must be one of
        the run's.  ``created`` and ``writer`` are filled in when unset.

        Returns
        -------
        OutputEntry
            The entry written, or the one already recorded if it records the
            same output (:meth:`OutputEntry.same_output`: a redelivered or
            repeated record), whoever wrote it.

        Raises
        ------
        OutputExistsError
            If the model already has an entry recording another output, or an
            unusable one; the message names the entry's key and the recorded
            output's key. Nothing is replaced.
        OutputCorruptionError
            If the output object is missing or not ``entry.size`` bytes.
        UnknownParentError
            If a checkpoint the entry names is not in the run.
        LogKeyError
            If trusted log keys are configured but no signing key.
        """
        self._check_signer(f"not recording the output of model {entry.model!r} in run "
                           f"{self.run_id!r}")
        final = replace(entry, created=entry.created or time.time(),
                        writer=entry.writer or default_writer())
        key = self.keys.output_entry(final.model)
        raw = self._signed(final.to_json(), "output")
        if len(raw) > MAX_OUTPUT_ENTRY_BYTES:
            raise ValueError(f"output entry of model {final.model!r} would be {len(raw)} bytes, "
                             f"above the {MAX_OUTPUT_ENTRY_BYTES} a reader takes")
        known = set(self.ids())
        unknown = [c for c in dict.fromkeys(final.checkpoints) if c not in known]
        if unknown:
            raise UnknownParentError(
                f"output of model {final.model!r} names {len(unknown)} checkpoint(s) that are "
                f"not in run {self.run_id!r} (first: {unknown[0]}); not recorded")
        try:
            size = self.store.size(final.key)
        except KeyError:
            raise OutputCorruptionError(
                f"output object {final.key} of model {final.model!r} is not in "
                f"{self.store.url}; publish it before recording it") from None
        if size != final.size:
            raise OutputCorruptionError(
                f"output object {final.key} of model {final.model!r} is {size} bytes, not the "
                f"{final.size} its entry would say; not recorded")
        for _ in range(3):
            if self.store.put_if_absent(key, raw):
                return final
            try:
                existing = self.output_at(key)
            except OutputEntryError as exc:
                raise OutputExistsError(
                    f"output entry {key} exists but cannot be used "
                    f"({getattr(exc, 'why', exc)}); not replaced: remove it to record the "
                    f"output {final.key} of model {final.model!r}") from None
            if existing is None:
                continue
            if existing.same_output(final):
                return existing
            raise OutputExistsError(
                f"output entry {key} already records another output of model "
                f"{final.model!r}: {existing.key} ({existing.size} bytes, sha256 "
                f"{existing.sha256[:16]}, job {existing.job or '?'}); not replaced, so "
                f"{final.key} is not recorded")
        raise OutputExistsError(f"output entry {key} keeps vanishing while it is recorded")

    def gc(self, older_than: float = DEFAULT_GC_AGE,
           young: list[tuple[str, float]] | None = None) -> list[str]:
        """Delete payloads no record points to, and stale head copies; return the keys.

        Payloads younger than ``older_than`` seconds are left alone (their
        writer may be about to record them), and listed with their age in
        ``young`` when it is given; no interleaving with commits can delete a
        recorded payload (see :mod:`chkq.log.gc`).
        """
        return _gc.collect(self, older_than, young)

    def verify(self, *, read_data: bool = False,
               progress: ProgressCallback | None = None) -> VerifyReport:
        """Check the run in the store without writing anything (see :mod:`chkq.log.verify`).

        Parameters
        ----------
        read_data
            Also rebuild every checkpoint along its delta chain (reads the whole run once).
        progress
            Called as ``progress(phase, done, total)``.
        """
        return _verify.verify(self, read_data=read_data, progress=progress)

    def clear_cache(self) -> None:
        """Forget cached checkpoint bytes and records (e.g. to measure cold loads)."""
        self._cache.clear()
        self.forget_records()
