"""Reading a run's log: every object validated as untrusted store content, nothing written.

:class:`LogReader` is what everything that reads a log builds on: garbage
collection and verification use it directly, :class:`~chkq.log.CheckpointLog`
adds commit and load.  Records, name entries and output entries are checked
field by field (:mod:`chkq.log.records`), against the signatures of trusted
log keys (:mod:`chkq.log.signing`) and against the key their content gives
(:mod:`chkq.log.keys`); a malformed one is noted in :attr:`LogReader.malformed`
by key and the rest of the run still reads.  A listing that meets a symbolic
link in a local store is noted the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from chkq import environment
from chkq.errors import (
    CheckpointCorruptionError,
    CheckpointNotFoundError,
    OutputCorruptionError,
    OutputEntryError,
    SymlinkInStoreError,
)
from chkq.log import delta as codec
from chkq.log.keys import RunKeys
from chkq.log.names import NameEntry, choose_entries, live
from chkq.log.records import (
    MAX_CHECKPOINT_ENV,
    MAX_OBJECT_BYTES,
    MAX_OUTPUT_ENTRY_BYTES,
    CheckpointRecord,
    OutputEntry,
    check_relative_name,
    checkpoint_id,
    corruption_reason,
    validate_run_id,
)
from chkq.log.seen import SeenNames
from chkq.log.signing import LogTrust
from chkq.stores.base import CheckpointStore, InvalidKeyError, validate_key

__all__ = ["OUTPUT_PIECE_BYTES", "LogReader"]

MiB = 1 << 20
OUTPUT_PIECE_BYTES = 8 * MiB
"""Bytes of an output object read per request by :meth:`LogReader.read_output`."""


class LogReader:
    """One run's log in a store, read and validated.

    Parameters
    ----------
    store
        Where the log lives.
    run_id
        The run's name (one key component); its keys are under ``runs/<run_id>/``.
    trust
        Keys objects are checked against (:mod:`chkq.log.signing`); default:
        the environment's (``CHKQ_LOG_SIGNING_KEY``, ``CHKQ_LOG_TRUSTED_KEYS``, read by
        :meth:`chkq.log.signing.LogTrust.from_env`).
    max_checkpoint
        Largest checkpoint read, in bytes; default ``CHKQ_LOG_MAX_CHECKPOINT_BYTES``
        (4 GiB; :func:`chkq.environment.max_checkpoint_bytes`). A record declaring more is
        refused, and no payload is
        decompressed beyond its record's size.
    seen
        Where this reader keeps the newest entry it saw of each name, to
        notice names rolled back or brought back (:mod:`chkq.log.seen`).
    """

    def __init__(self, store: CheckpointStore, run_id: str, *, trust: LogTrust | None = None,
                 max_checkpoint: int | None = None, seen: SeenNames | None = None) -> None:
        self.store = store
        self.run_id = validate_run_id(run_id)
        self.trust = LogTrust.from_env() if trust is None else trust
        self.max_checkpoint = environment.max_checkpoint_bytes() if max_checkpoint is None \
            else max_checkpoint
        self.keys = RunKeys(self.run_id)
        """The run's key layout (:mod:`chkq.log.keys`)."""
        self._records: dict[str, CheckpointRecord] = {}
        self.malformed: dict[str, str] = {}
        """Store keys of records and entries that could not be read, with why
        (filled by :meth:`manifest` and :meth:`entries`)."""
        self.conflicts: dict[str, list[NameEntry]] = {}
        """Names whose entries name different checkpoints and no trusted key
        decides between them (filled by :meth:`files`), oldest entry first."""
        self.seen = seen
        """What this reader saw of the run before (:class:`~chkq.log.seen.SeenNames`), if kept."""
        self.rollbacks: dict[str, str] = {}
        """Names whose newest entry in the store is older than one :attr:`seen` before,
        with why (filled by :meth:`files`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r}, {self.run_id!r})"

    def forget_records(self, checkpoint: str | None = None) -> None:
        """Drop validated records kept from earlier reads (one, or all): the next read is fresh."""
        if checkpoint is None:
            self._records.clear()
        else:
            self._records.pop(checkpoint, None)

    def remember(self, record: CheckpointRecord) -> None:
        """Keep ``record`` (one this process wrote) as read."""
        self._records[record.id] = record

    @property
    def root(self) -> str:
        """Key prefix of everything of this run: ``runs/<run>/``."""
        return self.keys.root

    def list_keys(self, prefix: str) -> list[str]:
        """The store's keys under ``prefix``; a link in the way is noted in
        :attr:`malformed` (under the prefix) and lists nothing."""
        try:
            keys = self.store.list(prefix)
        except SymlinkInStoreError as exc:
            self.malformed[prefix] = f"not listed: {exc}"
            return []
        self.malformed.pop(prefix, None)
        return keys

    def _refusal(self, raw: bytes, kind: str) -> str | None:
        """Why a parsed, well-formed object must not be used (signature), or None."""
        if not self.trust.enforcing:
            return None
        return self.trust.refusal(json.loads(raw), kind, self.run_id)

    def exists(self) -> bool:
        """Whether the store holds anything of this run (records first: the common case)."""
        return bool(self.list_keys(self.keys.group("records")) or self.store.list(self.keys.root))

    def fetch_record(self, checkpoint: str) -> CheckpointRecord | None:
        """The valid record of ``checkpoint``, or None if the run has none.

        Raises
        ------
        CheckpointCorruptionError
            If the object at its key is malformed, refused for its signature or
            declares more than :attr:`max_checkpoint` bytes.
        """
        cached = self._records.get(checkpoint)
        if cached is not None:
            return cached
        key = self.keys.record(checkpoint)
        try:
            raw = self.store.get_at_most(key, MAX_OBJECT_BYTES)
        except KeyError:
            return None
        try:
            record = CheckpointRecord.from_json(raw)
        except (ValueError, TypeError) as exc:
            raise self.corruption(checkpoint, key, f"malformed record: {exc}") from exc
        refused = self._refusal(raw, "record")
        if refused is not None:
            raise self.corruption(checkpoint, key, f"record refused: {refused}")
        if record.full_size > self.max_checkpoint:
            raise self.corruption(
                checkpoint, key, f"record refused: it declares {record.full_size} bytes, above "
                f"the {self.max_checkpoint}-byte limit ({MAX_CHECKPOINT_ENV})")
        if record.id != checkpoint:
            raise self.corruption(checkpoint, key,
                                   f"malformed record: it names checkpoint {record.id}")
        if record.payload != self.keys.payload(record.id, record.kind, record.base):
            raise self.corruption(checkpoint, key,
                                   f"malformed record: payload key {record.payload!r} is not "
                                   "the one its content gives")
        self._records[checkpoint] = record
        return record

    def _read_record(self, checkpoint: str) -> CheckpointRecord | None:
        """:meth:`fetch_record`, noting a malformed record instead of raising."""
        try:
            return self.fetch_record(checkpoint)
        except CheckpointCorruptionError as exc:
            self.malformed[self.keys.record(checkpoint)] = corruption_reason(exc)
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
        record = self.fetch_record(checkpoint)
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
        found = (self.keys.record_id(key) for key in self.list_keys(self.keys.group("records")))
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

    def read_entry(self, key: str) -> NameEntry | None:
        """The valid name entry at ``key``, or None (unusable: noted in :attr:`malformed`)."""
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
        if key != self.entry_key_of(entry):
            self.malformed[key] = "malformed name entry: its key is not the one its content gives"
            return None
        return entry

    def entry_key_of(self, entry: NameEntry) -> str:
        """The key ``entry`` belongs at: its number in its name's history, or its digest."""
        if entry.seq is not None:
            return self.keys.numbered_entry(entry.name, entry.seq)
        return self.keys.entry(entry.digest())

    def name_history(self, name: str) -> list[NameEntry]:
        """The readable numbered entries of ``name``, lowest number first (tombstones too)."""
        keys = [k for k in self.list_keys(self.keys.name_history(name))
                if self.keys.entry_seq(k) is not None]
        found = (self.read_entry(k) for k in keys)
        return [e for e in found if e is not None and e.name == name]

    def entries(self, records: list[CheckpointRecord] | None = None) -> list[NameEntry]:
        """Every readable name entry of the run since its name was last deleted, oldest first.

        As :meth:`history`, without tombstones and the entries a tombstone of
        their name deleted.
        """
        by_name: dict[str, list[NameEntry]] = {}
        for entry in self.history(records):
            by_name.setdefault(entry.name, []).append(entry)
        kept = [e for found in by_name.values() for e in live(found)]
        return sorted(kept, key=lambda e: (e.created, e.name, e.id))

    def history(self, records: list[CheckpointRecord] | None = None) -> list[NameEntry]:
        """Every readable name entry of the run, tombstones included, oldest first.

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
        keys = [k for k in self.list_keys(prefix) if k.endswith(".json")]
        if len(keys) > 8:
            with ThreadPoolExecutor(8) as pool:
                found = list(pool.map(self.read_entry, keys))
        else:
            found = [self.read_entry(k) for k in keys]
        entries = [e for e in found if e is not None]
        seen = {(e.name, e.id) for e in entries}
        for record in self.manifest() if records is None else records:
            name = record.meta.get("name") if record.format < 2 else None
            if not isinstance(name, str) or (name, record.id) in seen:
                continue
            try:
                check_relative_name(name)
            except ValueError as exc:
                self.malformed[self.keys.record(record.id)] = f"malformed record: {exc}"
                continue
            model = record.meta.get("model")
            entries.append(NameEntry(
                name=name, id=record.id, model=model if isinstance(model, str) else None,
                step=record.step, label=record.label, created=record.created, legacy=True))
        return sorted(entries, key=lambda e: (e.created, e.name, e.id))

    def files(self, model: str | None = None,
              records: list[CheckpointRecord] | None = None) -> dict[str, NameEntry]:
        """The run's files (``model``: only that model's), each name with the entry it restores.

        With trusted keys every entry read is a trusted writer's: a name's
        newest numbered entry is its content, and a name whose newest entry
        is a tombstone is gone (see :mod:`chkq.log.names`).  With a record of
        what this reader saw (:attr:`seen`), a name whose newest entry is
        older than one seen before is left out and kept in :attr:`rollbacks`.
        Without trusted keys, any tenant of the store could have written any
        entry with any number or creation time: a name whose entries name
        different checkpoints is left out and kept in :attr:`conflicts`
        (restore refuses both kinds, verify reports them).
        """
        by_name: dict[str, list[NameEntry]] = {}
        for entry in self.history(records):
            by_name.setdefault(entry.name, []).append(entry)
        self.rollbacks = self.check_freshness(by_name)
        wanted: dict[str, list[NameEntry]] = {}
        for name, found in by_name.items():
            kept = [e for e in found if model is None or e.model_matches(model)]
            if kept and name not in self.rollbacks:
                wanted[name] = kept
        chosen, self.conflicts = choose_entries(wanted, decided=self.trust.enforcing)
        return dict(sorted(chosen.items()))

    def check_freshness(self, by_name: dict[str, list[NameEntry]]) -> dict[str, str]:
        """Names rolled back or brought back against :attr:`seen`, with why (signed logs only)."""
        if self.seen is None or not self.trust.enforcing:
            return {}
        return self.seen.check(by_name)

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

    def output_at(self, key: str) -> OutputEntry | None:
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
        return self.output_at(self.keys.output_entry(model))

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
        for key in self.list_keys(prefix):
            if self.keys.output_entry_model(key) is None:
                continue
            try:
                entry = self.output_at(key)
            except OutputEntryError as exc:
                self.malformed[key] = str(getattr(exc, "why", exc))
                continue
            if entry is not None:
                found.append(entry)
        return sorted(found, key=lambda e: e.model)

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
                raise self.corruption(checkpoint, self.keys.record(parent), "parent cycle")
            seen.add(parent)
            try:
                chain.append(self.record(parent))
            except KeyError:
                raise self.corruption(
                    chain[-1].id, self.keys.record(parent), "parent record missing"
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

    def _payload(self, record: CheckpointRecord) -> bytes:
        try:
            payload = self.store.get_at_most(record.payload, record.stored_size)
        except KeyError:
            raise self.corruption(record.id, record.payload, "payload missing") from None
        if len(payload) > record.stored_size:
            raise self.corruption(record.id, record.payload,
                                   f"payload is larger than its record's {record.stored_size} "
                                   "bytes")
        return payload

    def payload_holds(self, key: str, data: bytes, base: bytes | None) -> bool:
        """Whether the payload already at ``key`` decodes to ``data`` (against ``base``)."""
        try:
            found = self.store.get_at_most(key, codec.compress_bound(len(data)))
            rebuilt = codec.decompress_full(found, len(data)) if base is None \
                else codec.decode(found, base, len(data))
        except (KeyError, codec.DeltaError):
            return False
        return rebuilt == data

    def decode(self, record: CheckpointRecord, base: bytes | None = None) -> bytes:
        """The bytes ``record``'s payload decodes to (against ``base`` for a delta), unchecked.

        Raises
        ------
        CheckpointCorruptionError
            If the payload is missing, larger than its record says or does not decode.
        """
        try:
            if base is None:
                return codec.decompress_full(self._payload(record), record.full_size)
            return codec.decode(self._payload(record), base, record.full_size)
        except codec.DeltaError as exc:
            raise self.corruption(record.id, record.payload, str(exc)) from exc

    def verified(self, record: CheckpointRecord, data: bytes) -> bytes:
        """``data`` if it hashes to ``record``'s id; CheckpointCorruptionError otherwise."""
        if checkpoint_id(data) != record.id:
            raise self.corruption(
                record.id, record.payload, "rebuilt bytes do not match the SHA-256 id"
            )
        return data

    def corruption(self, checkpoint: str, key: str, why: str) -> CheckpointCorruptionError:
        error = CheckpointCorruptionError(
            f"checkpoint {checkpoint} of run {self.run_id!r} in {self.store.url}: "
            f"{key}: {why}"
        )
        error.checkpoint = checkpoint  # type: ignore[attr-defined]
        error.key = key  # type: ignore[attr-defined]
        error.why = why  # type: ignore[attr-defined]
        return error
