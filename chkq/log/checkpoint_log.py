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
chains without head copies.  This was chosen over the alternatives after
measuring them for 64 MiB checkpoints with 1 % scattered changes: deltas
against the last keyframe load fast but grow by about 1 % per step (16 % at
depth 16, breaking the 2 % bar), and FSFS-style skip-deltas still need about
log2(depth) decodes per load and store deltas spanning up to 2^k steps.

A bounded LRU cache of verified checkpoint bytes makes committing N+1 right
after N (or loading a recent ancestor) free of store reads.

Outputs
-------
A model's checkpoints consolidated into one HDF5 file are history too: the
file is published create-if-absent (by default at ``outputs/<MODEL>.h5``)
and then recorded by :meth:`CheckpointLog.record_output` in an output entry,
``outputs/<MODEL>.json``, written once like every other object of the log
and signed like name entries.  One entry per model: recording another output
of a model that has one is refused, recording the same one again (a
redelivered task) returns the entry already there.  Outputs are read as
untrusted too (:meth:`CheckpointLog.output`), and their bytes only in pieces
checked against the entry's size and SHA-256 (:meth:`CheckpointLog.read_output`).
gc never touches ``outputs/``, and an output does not keep any payload alive:
the checkpoints it was made from are governed by their records alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import stat
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal

from chkq.errors import (
    CheckpointCorruptionError,
    CheckpointNotFoundError,
    LogKeyError,
    OutputCorruptionError,
    OutputEntryError,
    OutputExistsError,
    SymlinkInStoreError,
    UnknownParentError,
)
from chkq.log import delta as codec
from chkq.log import gc as _gc
from chkq.log import verify as _verify
from chkq.log.keys import RunKeys
from chkq.log.records import (
    MAX_CHECKPOINT_ENV,
    MAX_OBJECT_BYTES,
    MAX_OUTPUT_ENTRY_BYTES,
    CheckpointRecord,
    NameEntry,
    OutputEntry,
    check_relative_name,
    checkpoint_id,
    choose_entries,
    corruption_reason,
    default_writer,
    max_checkpoint_bytes,
    validate_run_id,
)
from chkq.log.signing import LogTrust
from chkq.log.verify import ProgressCallback, VerifyReport
from chkq.lru import LRU
from chkq.stores.base import CheckpointStore, InvalidKeyError, validate_key

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_GC_AGE", "CheckpointLog"]

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MiB
OUTPUT_PIECE_BYTES = 8 * MiB
"""Bytes of an output object read per request by :meth:`CheckpointLog.read_output`."""
DEFAULT_GC_AGE = 24 * 3600.0
"""Default age (s) below which ``gc`` leaves unreferenced payloads alone."""


class CheckpointLog:
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
    ) -> None:
        if max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        self.store = store
        self.run_id = validate_run_id(run_id)
        self.max_chain = max_chain
        self.head_copies = head_copies
        self.trust = LogTrust.from_env() if trust is None else trust
        self.max_checkpoint = max_checkpoint_bytes() if max_checkpoint is None \
            else max_checkpoint
        self.keys = RunKeys(self.run_id)
        """The run's key layout (:mod:`chkq.log.keys`)."""
        self._root = self.keys.root
        self._cache: LRU[str, bytes] = LRU(cache_bytes, len)
        self._records: dict[str, CheckpointRecord] = {}
        self.malformed: dict[str, str] = {}
        """Store keys of records and entries that could not be read, with why
        (filled by :meth:`manifest` and :meth:`entries`)."""
        self.conflicts: dict[str, list[NameEntry]] = {}
        """Names whose entries name different checkpoints and no trusted key
        decides between them (filled by :meth:`files`), oldest entry first."""

    def __repr__(self) -> str:
        return f"CheckpointLog({self.store!r}, {self.run_id!r})"

    # keys ---------------------------------------------------------------

    @property
    def root(self) -> str:
        """Key prefix of everything of this run: ``runs/<run>/``."""
        return self._root

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
        """Store key of a name entry, derived from its content."""
        return self.keys.entry(entry.digest())

    def trash_key(self, payload_key: str) -> str:
        """Where gc keeps a payload it is removing until the removal is settled."""
        return self.keys.trash(payload_key)

    def output_entry_key(self, model: str) -> str:
        """Store key of the entry recording ``model``'s consolidated output."""
        return self.keys.output_entry(model)

    def output_key(self, model: str) -> str:
        """Default store key of ``model``'s consolidated output object."""
        return self.keys.output(model)

    def _list(self, prefix: str) -> list[str]:
        """The store's keys under ``prefix``; a link in the way is noted in
        :attr:`malformed` (under the prefix) and lists nothing."""
        try:
            keys = self.store.list(prefix)
        except SymlinkInStoreError as exc:
            self.malformed[prefix] = f"not listed: {exc}"
            return []
        self.malformed.pop(prefix, None)
        return keys

    # signing ------------------------------------------------------------

    def _signed(self, raw: bytes, kind: str) -> bytes:
        """``raw`` (a record's or entry's JSON) with a signature, if this log signs."""
        if self.trust.signer is None:
            return raw
        obj = self.trust.sign(json.loads(raw), kind, self.run_id)
        return (json.dumps(obj, indent=1) + "\n").encode()

    def _refusal(self, raw: bytes, kind: str) -> str | None:
        """Why a parsed, well-formed object must not be used (signature), or None."""
        if not self.trust.enforcing:
            return None
        return self.trust.refusal(json.loads(raw), kind, self.run_id)

    # reading ------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the store holds anything of this run (records first: the common case)."""
        return bool(self._list(self.keys.group("records")) or self.store.list(self._root))

    def _fetch_record(self, checkpoint: str) -> CheckpointRecord | None:
        cached = self._records.get(checkpoint)
        if cached is not None:
            return cached
        key = self.record_key(checkpoint)
        try:
            raw = self.store.get_at_most(key, MAX_OBJECT_BYTES)
        except KeyError:
            return None
        try:
            record = CheckpointRecord.from_json(raw)
        except (ValueError, TypeError) as exc:
            raise self._corruption(checkpoint, key, f"malformed record: {exc}") from exc
        refused = self._refusal(raw, "record")
        if refused is not None:
            raise self._corruption(checkpoint, key, f"record refused: {refused}")
        if record.full_size > self.max_checkpoint:
            raise self._corruption(
                checkpoint, key, f"record refused: it declares {record.full_size} bytes, above "
                f"the {self.max_checkpoint}-byte limit ({MAX_CHECKPOINT_ENV})")
        if record.id != checkpoint:
            raise self._corruption(checkpoint, key,
                                   f"malformed record: it names checkpoint {record.id}")
        if record.payload != self.payload_key(record.id, record.kind, record.base):
            raise self._corruption(checkpoint, key,
                                   f"malformed record: payload key {record.payload!r} is not "
                                   "the one its content gives")
        self._records[checkpoint] = record
        return record

    def _read_record(self, checkpoint: str) -> CheckpointRecord | None:
        """:meth:`_fetch_record`, noting a malformed record instead of raising."""
        try:
            return self._fetch_record(checkpoint)
        except CheckpointCorruptionError as exc:
            self.malformed[self.record_key(checkpoint)] = corruption_reason(exc)
            return None

    def record(self, checkpoint: str) -> CheckpointRecord:
        """Return the record of ``checkpoint``.

        Raises
        ------
        KeyError
            If the run has no such checkpoint.
        CheckpointCorruptionError
            If its record is malformed.
        """
        try:
            validate_key(checkpoint)
        except InvalidKeyError:
            raise CheckpointNotFoundError(checkpoint) from None
        record = self._fetch_record(checkpoint)
        if record is None:
            raise CheckpointNotFoundError(checkpoint)
        return record

    def __contains__(self, checkpoint: object) -> bool:
        if not isinstance(checkpoint, str):
            return False
        try:
            self.record(checkpoint)
        except KeyError:
            return False
        return True

    def ids(self) -> list[str]:
        """Ids of every checkpoint in the run (sorted by id, not by age)."""
        found = (self.keys.record_id(key) for key in self._list(self.keys.group("records")))
        return [ident for ident in found if ident is not None]

    def manifest(self) -> list[CheckpointRecord]:
        """Every readable checkpoint's record, oldest first.

        Malformed records are left out and noted in :attr:`malformed`.
        """
        prefix = self.keys.group("records")
        for key in list(self.malformed):
            if key.startswith(prefix) and key != prefix:
                del self.malformed[key]
        ids = self.ids()
        missing = [i for i in ids if i not in self._records]
        if len(missing) > 8:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(self._read_record, missing))
        records = [r for r in map(self._read_record, ids) if r is not None]
        return sorted(records, key=lambda r: (r.created, r.id))

    def __iter__(self) -> Iterator[CheckpointRecord]:
        return iter(self.manifest())

    def __len__(self) -> int:
        return len(self.ids())

    def _read_entry(self, key: str) -> NameEntry | None:
        try:
            raw = self.store.get_at_most(key, MAX_OBJECT_BYTES)
        except KeyError:
            return None
        try:
            entry = NameEntry.from_json(raw)
        except (ValueError, TypeError) as exc:
            self.malformed[key] = f"malformed name entry: {exc}"
            return None
        refused = self._refusal(raw, "name")
        if refused is not None:
            self.malformed[key] = f"name entry refused: {refused}"
            return None
        if key != self.entry_key(entry):
            self.malformed[key] = "malformed name entry: its key is not the one its content gives"
            return None
        return entry

    def entries(self, records: list[CheckpointRecord] | None = None) -> list[NameEntry]:
        """Every readable name entry of the run, oldest first.

        Format-1 records that carry ``meta.name`` count as entries too
        (``legacy``), unless a format-2 entry says the same.  Malformed
        entries are left out and noted in :attr:`malformed`.

        Parameters
        ----------
        records
            The run's manifest, if the caller already has it.
        """
        prefix = self.keys.group("names")
        for key in list(self.malformed):
            if key.startswith(prefix) and key != prefix:
                del self.malformed[key]
        keys = [k for k in self._list(prefix) if k.endswith(".json")]
        if len(keys) > 8:
            with ThreadPoolExecutor(8) as pool:
                found = list(pool.map(self._read_entry, keys))
        else:
            found = [self._read_entry(k) for k in keys]
        entries = [e for e in found if e is not None]
        seen = {(e.name, e.id) for e in entries}
        for record in self.manifest() if records is None else records:
            name = record.meta.get("name") if record.format < 2 else None
            if not isinstance(name, str) or (name, record.id) in seen:
                continue
            try:
                check_relative_name(name)
            except ValueError as exc:
                self.malformed[self.record_key(record.id)] = f"malformed record: {exc}"
                continue
            model = record.meta.get("model")
            entries.append(NameEntry(
                name=name, id=record.id, model=model if isinstance(model, str) else None,
                step=record.step, label=record.label, created=record.created, legacy=True))
        return sorted(entries, key=lambda e: (e.created, e.name, e.id))

    def files(self, model: str | None = None,
              records: list[CheckpointRecord] | None = None) -> dict[str, NameEntry]:
        """The run's files (``model``: only that model's), each name with the entry it restores.

        A name whose entries all name one checkpoint gets its latest entry.
        When they name different checkpoints, trusted signatures decide: with
        trusted keys every entry read is a trusted writer's and the latest
        one is the name's content; without, any tenant of the store could
        have written any of them with any creation time, so the name is left
        out and kept in :attr:`conflicts` (restore refuses it, verify reports it).
        """
        by_name: dict[str, list[NameEntry]] = {}
        for entry in self.entries(records):
            if model is None or entry.model_matches(model):
                by_name.setdefault(entry.name, []).append(entry)
        chosen, self.conflicts = choose_entries(by_name, decided=self.trust.enforcing)
        return dict(sorted(chosen.items()))

    # outputs ------------------------------------------------------------

    def _parse_output(self, key: str, raw: bytes) -> OutputEntry:
        """The output entry ``raw`` read from ``key``, checked as untrusted content.

        Raises
        ------
        OutputEntryError
            Naming ``key``: malformed, refused for its signature, or filed
            under another model's key.
        """
        try:
            entry = OutputEntry.from_json(raw)
        except (ValueError, TypeError) as exc:
            raise self._output_error(key, f"malformed output entry: {exc}") from None
        refused = self._refusal(raw, "output")
        if refused is not None:
            raise self._output_error(key, f"output entry refused: {refused}")
        if key != self.keys.output_entry(entry.model):
            raise self._output_error(key, f"malformed output entry: it records model "
                                     f"{entry.model!r}, whose entry is not this key")
        return entry

    def _output_error(self, key: str, why: str) -> OutputEntryError:
        error = OutputEntryError(f"run {self.run_id!r} in {self.store.url}: {key}: {why}")
        error.key = key  # type: ignore[attr-defined]
        error.why = why  # type: ignore[attr-defined]
        return error

    def _read_output(self, key: str) -> OutputEntry | None:
        """The entry at ``key`` (None if there is none); OutputEntryError if it is unusable."""
        try:
            raw = self.store.get_at_most(key, MAX_OUTPUT_ENTRY_BYTES)
        except KeyError:
            return None
        except SymlinkInStoreError as exc:
            raise self._output_error(key, f"not read: {exc}") from None
        if len(raw) > MAX_OUTPUT_ENTRY_BYTES:
            raise self._output_error(key, f"malformed output entry: larger than "
                                     f"{MAX_OUTPUT_ENTRY_BYTES} bytes")
        return self._parse_output(key, raw)

    def output(self, model: str) -> OutputEntry | None:
        """The recorded consolidated output of ``model``, or None if there is none.

        Raises
        ------
        OutputEntryError
            If the entry at the model's key is malformed or (with trusted
            log keys) not signed by a trusted writer; the message names the key.
        BadNameError
            If ``model`` cannot name an output.
        """
        return self._read_output(self.keys.output_entry(model))

    def outputs(self) -> list[OutputEntry]:
        """Every readable output entry of the run, by model.

        Unusable entries are left out and noted in :attr:`malformed`, like
        malformed records and name entries.
        """
        prefix = self.keys.group("outputs")
        for key in list(self.malformed):
            if key.startswith(prefix) and key != prefix:
                del self.malformed[key]
        found = []
        for key in self._list(prefix):
            if self.keys.output_entry_model(key) is None:
                continue
            try:
                entry = self._read_output(key)
            except OutputEntryError as exc:
                self.malformed[key] = str(getattr(exc, "why", exc))
                continue
            if entry is not None:
                found.append(entry)
        return sorted(found, key=lambda e: e.model)

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
        if self.trust.enforcing and self.trust.signer is None:
            raise LogKeyError(
                "trusted log keys are configured (CHKQ_LOG_TRUSTED_KEYS) but no signing key "
                "(CHKQ_LOG_SIGNING_KEY): the output entry would be refused by every reader; "
                f"not recording the output of model {entry.model!r} in run {self.run_id!r}")
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
                existing = self._read_output(key)
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

    def read_output(self, entry: OutputEntry, piece: int = OUTPUT_PIECE_BYTES
                    ) -> Iterator[bytes]:
        """The bytes of a recorded output object, in pieces of at most ``piece`` bytes.

        Each piece is one ranged read (:meth:`CheckpointStore.get_range`), so
        memory holds one piece whatever the file's size.  The whole object is
        checked against the entry — no more and no fewer than ``entry.size``
        bytes, and their SHA-256 — only when the last piece has been read:
        what a consumer got is verified only once the iterator finishes
        without an error.

        Raises
        ------
        OutputCorruptionError
            If the object is missing, shorter or longer than its entry says,
            or its SHA-256 is not the entry's; the message names its key.
        """
        if piece <= 0:
            raise ValueError(f"piece must be positive, got {piece}")

        def bad(why: str) -> OutputCorruptionError:
            error = OutputCorruptionError(
                f"output of model {entry.model!r} of run {self.run_id!r} in "
                f"{self.store.url}: {entry.key}: {why}")
            error.key = entry.key  # type: ignore[attr-defined]
            error.why = why  # type: ignore[attr-defined]
            return error

        digest = hashlib.sha256()
        done = 0
        try:
            while done < entry.size:
                block = self.store.get_range(entry.key, done, min(piece, entry.size - done))
                if not block:
                    raise bad(f"object is {done} bytes, its entry says {entry.size}")
                digest.update(block)
                done += len(block)
                yield block
            if self.store.get_range(entry.key, entry.size, 1):
                raise bad(f"object is larger than the {entry.size} bytes its entry says")
        except KeyError:
            raise bad("output object missing") from None
        if digest.hexdigest() != entry.sha256:
            raise bad(f"object's SHA-256 {digest.hexdigest()[:16]}... is not its entry's "
                      f"{entry.sha256[:16]}... (changed or damaged since it was recorded)")

    def outputs_of(self, checkpoint: str) -> list[tuple[OutputEntry, int]]:
        """The outputs made from ``checkpoint``, each with its first position in the entry."""
        return [(entry, entry.checkpoints.index(checkpoint)) for entry in self.outputs()
                if checkpoint in entry.checkpoints]

    def lineage(self, checkpoint: str) -> list[CheckpointRecord]:
        """Records from the root ancestor down to ``checkpoint`` (parent links)."""
        chain = [self.record(checkpoint)]
        seen = {checkpoint}
        while chain[-1].parent is not None:
            parent = chain[-1].parent
            if parent in seen:
                raise self._corruption(checkpoint, self.record_key(parent), "parent cycle")
            seen.add(parent)
            try:
                chain.append(self.record(parent))
            except KeyError:
                raise self._corruption(
                    chain[-1].id, self.record_key(parent), "parent record missing"
                ) from None
        return chain[::-1]

    def children(self, checkpoint: str) -> list[CheckpointRecord]:
        """Records committed or forked on ``checkpoint``, oldest first."""
        self.record(checkpoint)
        return [r for r in self.manifest() if r.parent == checkpoint]

    def heads(self) -> list[CheckpointRecord]:
        """Tips: records nothing was committed on, oldest first."""
        records = self.manifest()
        parents = {r.parent for r in records}
        return [r for r in records if r.id not in parents]

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
        key = self.head_copy_key(record.id)
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
                raise self._corruption(record.id, chain[-1].payload, "delta chain has a cycle")
            seen.add(base)
            base_record = self._fetch_record(base)
            if base_record is None:
                raise self._corruption(
                    chain[-1].id, chain[-1].payload, f"base record {base} missing"
                )
            chain.append(base_record)
        if data is None:
            top = chain.pop()
            data = self._verified(top, self._decode_full(top))
        for item in reversed(chain):
            data = self._verified(item, self._decode_delta(item, data))
        return data

    def _payload(self, record: CheckpointRecord) -> bytes:
        try:
            payload = self.store.get_at_most(record.payload, record.stored_size)
        except KeyError:
            raise self._corruption(record.id, record.payload, "payload missing") from None
        if len(payload) > record.stored_size:
            raise self._corruption(record.id, record.payload,
                                   f"payload is larger than its record's {record.stored_size} "
                                   "bytes")
        return payload

    def _decode_full(self, record: CheckpointRecord) -> bytes:
        try:
            return codec.decompress_full(self._payload(record), record.full_size)
        except codec.DeltaError as exc:
            raise self._corruption(record.id, record.payload, str(exc)) from exc

    def _decode_delta(self, record: CheckpointRecord, base: bytes) -> bytes:
        try:
            return codec.decode(self._payload(record), base, record.full_size)
        except codec.DeltaError as exc:
            raise self._corruption(record.id, record.payload, str(exc)) from exc

    def _verified(self, record: CheckpointRecord, data: bytes, *, cache: bool = True) -> bytes:
        if checkpoint_id(data) != record.id:
            raise self._corruption(
                record.id, record.payload, "rebuilt bytes do not match the SHA-256 id"
            )
        if cache:
            self._cache.put(record.id, data)
        return data

    def _corruption(self, checkpoint: str, key: str, why: str) -> CheckpointCorruptionError:
        error = CheckpointCorruptionError(
            f"checkpoint {checkpoint} of run {self.run_id!r} in {self.store.url}: "
            f"{key}: {why}"
        )
        error.checkpoint = checkpoint  # type: ignore[attr-defined]
        error.key = key  # type: ignore[attr-defined]
        error.why = why  # type: ignore[attr-defined]
        return error

    # writing ------------------------------------------------------------

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
        key = self.entry_key(final)
        raw = self._signed(final.to_json(), "name")
        if not self.store.put_if_absent(key, raw) and self._read_entry(key) is None:
            # Something that is not a valid entry (planted, damaged, unsigned) holds the
            # key our content gives: no valid writer wrote it, so ours replaces it.
            log.warning("name entry %s is not a valid entry: writing it again", key)
            self.malformed.pop(key, None)
            self.store.put(key, raw)

    def _existing_record(self, checkpoint: str) -> tuple[CheckpointRecord | None, bool]:
        """The valid record of ``checkpoint`` if any, and whether an invalid one holds its key."""
        try:
            return self._fetch_record(checkpoint), False
        except CheckpointCorruptionError as exc:
            log.warning("%s: replacing it with this commit's record", exc)
            return None, True

    def _payload_holds(self, key: str, data: bytes, base: bytes | None) -> bool:
        """Whether the payload already at ``key`` decodes to ``data`` (against ``base``)."""
        try:
            found = self.store.get_at_most(key, codec.compress_bound(len(data)))
            rebuilt = codec.decompress_full(found, len(data)) if base is None \
                else codec.decode(found, base, len(data))
        except (KeyError, codec.DeltaError):
            return False
        return rebuilt == data

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
        if self.trust.enforcing and self.trust.signer is None:
            raise LogKeyError(
                "trusted log keys are configured (CHKQ_LOG_TRUSTED_KEYS) but no signing key "
                "(CHKQ_LOG_SIGNING_KEY): what this process wrote would be refused by every "
                f"reader; not committing to run {self.run_id!r}")
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
        key = self.payload_key(checkpoint, kind, base)
        record = CheckpointRecord(
            id=checkpoint, parent=parent, kind=kind, base=base, depth=depth, payload=key,
            stored_size=len(payload), full_size=len(data), step=step, label=label,
            meta=dict(meta or {}), fork=fork, created=time.time(),
        )
        record_json = self._signed(record.to_json(), "record")
        created_payload = self.store.put_if_absent(key, payload)
        if not created_payload and not self._payload_holds(
                key, data, parent_data if kind == "delta" else None):
            # The key our content gives holds something else (planted or damaged): the
            # record about to name it must name these bytes.
            log.warning("payload %s does not decode to checkpoint %s: writing it again",
                        key, checkpoint)
            self.store.put(key, payload)
            created_payload = True
        recorded_parent = parent
        record_key = self.record_key(checkpoint)
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
            self._records[checkpoint] = record
            if kind == "delta" and self.head_copies:
                self.store.put_if_absent(self.head_copy_key(checkpoint), full_payload)
        else:
            if winner is not None and winner.payload != key and created_payload:
                self.store.delete(key)
            recorded_parent = winner.parent if winner is not None else None
        self._write_entry(entry, checkpoint)
        if recorded_parent is not None:
            self.store.delete(self.head_copy_key(recorded_parent))
        self._cache.put(checkpoint, data)
        return checkpoint

    # maintenance --------------------------------------------------------

    def gc(self, older_than: float = DEFAULT_GC_AGE) -> list[str]:
        """Delete payloads no record points to, and stale head copies; return the keys.

        Payloads younger than ``older_than`` seconds are left alone (their
        writer may be about to record them); no interleaving with commits can
        delete a recorded payload (see :mod:`chkq.log.gc`).
        """
        return _gc.collect(self, older_than)

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
        self._records.clear()
