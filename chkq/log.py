"""The checkpoint log: a content-addressed, delta-compressed, write-once log.

Layout of one run in a store (``<id>`` is the SHA-256 of a checkpoint's bytes)::

    runs/<run>/records/<id>.json               the record (small JSON)
    runs/<run>/payloads/<id>.full.zst          a whole checkpoint (zstd frame)
    runs/<run>/payloads/<id>.delta.<base>.zst  a zstd patch-from delta against <base>
    runs/<run>/heads/<id>.zst                  full copy of a delta checkpoint that is a head
    runs/<run>/names/<digest>.json             a name entry: file name -> checkpoint id
    runs/<run>/trash/<payload file name>       a payload gc moved aside (see gc)

Format versions
---------------
Every record and name entry carries ``"format"``.  Format 1 (before name
entries) kept a committed file's name and model in the record's ``meta``
(``meta.name``, ``meta.model``); since a record describes *content*, a
second file with the same bytes was lost.  Format 2 keeps names in entries
of their own, ``names/<digest>.json``, one per (name, id, annotations), so
the same bytes under two names are two entries and a restore brings back
both.  Format-1 records that name a file are still read, as entries of
their own (:attr:`NameEntry.legacy`); objects of a format above
:data:`LOG_FORMAT` are reported as malformed rather than guessed at.

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
every field, the payload key derived from the content); a malformed one is
reported by key (:attr:`CheckpointLog.malformed`) and the rest of the run
still lists, loads and restores.

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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any, Literal

from chkq import delta as codec
from chkq.errors import (
    BadNameError,
    CheckpointCorruptionError,
    CheckpointNotFoundError,
    UnknownParentError,
)
from chkq.stores.base import CheckpointStore, InvalidKeyError, validate_key

__all__ = [
    "DEFAULT_GC_AGE",
    "LOG_FORMAT",
    "CheckpointLog",
    "CheckpointRecord",
    "NameEntry",
    "VerifyReport",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MiB
DEFAULT_GC_AGE = 24 * 3600.0
"""Default age (s) below which ``gc`` leaves unreferenced payloads alone."""

LOG_FORMAT = 2
"""Format written by this version: 2 = names in entries of their own (see module docs)."""
RECORD_FORMAT = LOG_FORMAT
_HEX = frozenset("0123456789abcdef")
_NONE = type(None)


def _is_id(text: object) -> bool:
    return isinstance(text, str) and len(text) == 64 and set(text) <= _HEX


def checkpoint_id(data: bytes) -> str:
    """Return the id of a checkpoint: the hex SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def default_writer() -> str:
    """Who commits from this process, as kept in name entries: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def check_relative_name(name: str) -> str:
    """Return ``name`` if it is a safe relative path inside a run directory.

    Names come from untrusted input (task messages, store contents) and
    become paths under a restore directory, so anything that could leave it
    is refused.

    Raises
    ------
    ValueError
        For an empty or absolute name, ``.``/``..``/empty components, a
        backslash or a NUL character.
    """
    if not isinstance(name, str):
        raise BadNameError(f"invalid checkpoint name {name!r}: not a string")
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "//" in name or name.endswith("/") or "\\" in name or "\x00" in name:
        raise BadNameError(f"invalid checkpoint name {name!r}: expected a relative path "
                         "inside the run directory")
    return name


def _json_object(raw: str | bytes, what: str, fields: Any, required: Any) -> dict[str, Any]:
    """Parse a stored record or entry: a JSON object of a known format with typed fields.

    Raises
    ------
    ValueError
        Saying what is wrong.
    """
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    _check_format(obj)
    _check_types(obj, fields, required)
    return obj


def _check_format(obj: dict[str, Any]) -> None:
    version = obj.get("format", 1)
    if type(version) is not int or version < 1:
        raise ValueError(f"bad format {version!r}")
    if version > LOG_FORMAT:
        raise ValueError(f"format {version} is newer than this chkq reads ({LOG_FORMAT})")


def _check_types(obj: dict[str, Any], spec: dict[str, tuple[type, ...]],
                 required: frozenset[str]) -> None:
    """Check each known field of ``obj`` against its allowed types (bool is not int)."""
    for name in required:
        if name not in obj:
            raise ValueError(f"field {name!r} missing")
    for name, types in spec.items():
        if name not in obj:
            continue
        value = obj[name]
        is_bool = isinstance(value, bool)
        if (is_bool and bool not in types) or not isinstance(value, types):
            wanted = " or ".join("null" if t is _NONE else t.__name__ for t in types)
            raise ValueError(f"field {name!r} is {type(value).__name__}, expected {wanted}")


_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "parent": (str, _NONE), "kind": (str,), "base": (str, _NONE),
    "depth": (int,), "payload": (str,), "stored_size": (int,), "full_size": (int,),
    "step": (int, _NONE), "label": (str, _NONE), "meta": (dict,), "fork": (dict, _NONE),
    "created": (int, float), "format": (int,),
}
_RECORD_REQUIRED = frozenset({"id", "kind", "depth", "payload", "stored_size", "full_size"})


@dataclass(frozen=True)
class CheckpointRecord:
    """The immutable description of one committed checkpoint (its content, not its names).

    Attributes
    ----------
    id
        Hex SHA-256 of the checkpoint's full bytes.
    parent
        Id of the checkpoint this one was committed on (or forked from).
    kind
        ``"full"`` (payload holds the whole checkpoint) or ``"delta"``.
    base
        For a delta, the id of the checkpoint it is encoded against.
    depth
        Number of deltas between this checkpoint and its full keyframe.
    payload
        Store key of the payload.
    stored_size
        Bytes of the payload.
    full_size
        Bytes of the checkpoint.
    step, label, meta
        The first committer's annotations (``meta`` is a JSON object); the
        annotations of every named commit are in its :class:`NameEntry`.
    fork
        For a checkpoint made by :meth:`CheckpointLog.fork`:
        ``{"source": <id>, "edit": <description or None>}``.
    created
        POSIX time at which the record was written.
    format
        Log format the record was written in (see module docs).
    """

    id: str
    parent: str | None
    kind: Literal["full", "delta"]
    base: str | None
    depth: int
    payload: str
    stored_size: int
    full_size: int
    step: int | None = None
    label: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    fork: dict[str, Any] | None = None
    created: float = 0.0
    format: int = RECORD_FORMAT

    def __hash__(self) -> int:
        return hash(self.id)

    def to_json(self) -> bytes:
        """Serialise as small, human-readable JSON."""
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CheckpointRecord:
        """Parse and validate :meth:`to_json` output (unknown fields are ignored).

        Every field's type is checked, so that one record with, say, a string
        ``depth`` is reported as malformed instead of failing later, deep in
        a listing or a load.

        Raises
        ------
        ValueError
            If the text is not a valid record; the message says what is wrong.
        """
        obj = _json_object(raw, "record", _RECORD_FIELDS, _RECORD_REQUIRED)
        obj.setdefault("format", 1)
        obj.setdefault("parent", None)
        obj.setdefault("base", None)
        names = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in obj.items() if k in names})
        if not _is_id(record.id) or record.kind not in ("full", "delta"):
            raise ValueError("record has a malformed id or kind")
        if record.parent is not None and not _is_id(record.parent):
            raise ValueError("record has a malformed parent")
        if record.kind == "delta" and not (_is_id(record.base) and record.depth >= 1):
            raise ValueError("delta record without a valid base and depth")
        if record.kind == "full" and (record.base is not None or record.depth != 0):
            raise ValueError("full record with a base or a depth")
        if record.stored_size < 0 or record.full_size < 0:
            raise ValueError("record has a negative size")
        return record


_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "id": (str,), "model": (str, _NONE), "step": (int, _NONE),
    "label": (str, _NONE), "writer": (str, _NONE), "meta": (dict,), "created": (int, float),
    "format": (int,),
}
_ENTRY_REQUIRED = frozenset({"name", "id"})


@dataclass(frozen=True)
class NameEntry:
    """One committed file of a run: its name, the checkpoint it holds, and annotations.

    Entries are write-once, like records, under a key derived from their
    content (:meth:`digest`), so committing the same file again (a
    redelivered task) writes nothing new, while the same bytes under another
    name, or with other annotations, are an entry of their own.

    Attributes
    ----------
    name
        Path relative to the run directory (``run_chk00003/thread_0001.h5``).
    id
        The checkpoint id of the file's bytes.
    model
        The model (run name of the simulation) the file belongs to, if known.
    step, label, meta
        The annotations of this commit.
    writer
        Who committed it (``host:pid`` by default); not part of the key.
    created
        POSIX time of the commit; the latest entry of a name is its current content.
    legacy
        True for an entry read from a format-1 record's ``meta.name``.
    """

    name: str
    id: str
    model: str | None = None
    step: int | None = None
    label: str | None = None
    writer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    legacy: bool = False

    def digest(self) -> str:
        """Hex SHA-256 of what makes the entry distinct (writer and time excluded)."""
        identity = {"name": self.name, "id": self.id, "model": self.model, "step": self.step,
                    "label": self.label, "meta": self.meta}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> bytes:
        """Serialise as small JSON (``legacy`` is never stored)."""
        obj = {"format": LOG_FORMAT, **asdict(self)}
        del obj["legacy"]
        return (json.dumps(obj, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NameEntry:
        """Parse and validate :meth:`to_json` output.

        Raises
        ------
        ValueError
            If the text is not a valid entry.
        """
        obj = _json_object(raw, "entry", _ENTRY_FIELDS, _ENTRY_REQUIRED)
        names = set(cls.__dataclass_fields__) - {"legacy"}
        entry = cls(**{k: v for k, v in obj.items() if k in names})
        if not _is_id(entry.id):
            raise ValueError("entry has a malformed checkpoint id")
        check_relative_name(entry.name)
        return entry

    def model_matches(self, model: str) -> bool:
        """Whether the file belongs to ``model``.

        The entry's own model decides; an entry without one (committed by
        hand) belongs to the model its name says, ``MODEL_chkNNNNN[.h5]`` or
        ``MODEL_chkNNNNN/...`` as slug names checkpoints, and to no model
        otherwise.
        """
        if self.model is not None:
            return self.model == model
        return model_of_name(self.name) == model


def model_of_name(name: str) -> str | None:
    """The model a slug-style checkpoint name belongs to, or None."""
    first = name.split("/", 1)[0]
    found = re.fullmatch(r"(.+)_chk\d{5}(\.h5)?", first)
    return found.group(1) if found else None


@dataclass
class VerifyReport:
    """What :meth:`CheckpointLog.verify` found.

    Attributes
    ----------
    store, run
        What was checked.
    read_data
        Whether payloads were decoded along their chains.
    records, names, head_copies, payloads
        Counts of readable records, readable name entries, head copies
        checked and payload objects present.
    decoded, decoded_bytes
        Checkpoints rebuilt and verified (``read_data``), and their bytes.
    problems
        ``(key, why)`` for everything wrong: a missing or undecodable
        payload, a head copy that does not decode to its record's id, a
        malformed record or entry, a dangling reference.
    orphans
        Keys nothing refers to (left by crashed writers; ``gc`` removes them).
    """

    store: str
    run: str
    read_data: bool
    records: int = 0
    names: int = 0
    head_copies: int = 0
    payloads: int = 0
    decoded: int = 0
    decoded_bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found (orphans are not problems)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        summary = asdict(self)
        summary["ok"] = self.ok
        summary["problems"] = [{"key": k, "problem": why} for k, why in self.problems]
        return summary


ProgressCallback = Callable[[str, int, int], None]
"""``progress(phase, done, total)``, called as verification goes on."""


class _LRUCache:
    """Thread-safe LRU of checkpoint bytes, bounded by total size."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._items[key] = value
            self._size += len(value)
            while self._size > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self._size -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can name a run: one non-empty key component.

    Raises
    ------
    ValueError
        If it is empty, contains ``/``, a backslash or NUL, or is ``.``/``..``.
    """
    if not isinstance(run_id, str) or not run_id or "/" in run_id:
        raise BadNameError(f"invalid run id {run_id!r}: must be a non-empty name without '/'")
    try:
        validate_key(run_id)
    except InvalidKeyError as exc:
        raise BadNameError(f"invalid run id {run_id!r}: {exc}") from None
    return run_id


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
    """

    def __init__(
        self,
        store: CheckpointStore,
        run_id: str,
        max_chain: int = 16,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        *,
        head_copies: bool = True,
    ) -> None:
        if max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        self.store = store
        self.run_id = validate_run_id(run_id)
        self.max_chain = max_chain
        self.head_copies = head_copies
        self._root = f"runs/{run_id}/"
        self._cache = _LRUCache(cache_bytes)
        self._records: dict[str, CheckpointRecord] = {}
        self.malformed: dict[str, str] = {}
        """Store keys of records and entries that could not be read, with why
        (filled by :meth:`manifest` and :meth:`entries`)."""

    def __repr__(self) -> str:
        return f"CheckpointLog({self.store!r}, {self.run_id!r})"

    # keys ---------------------------------------------------------------

    @property
    def root(self) -> str:
        """Key prefix of everything of this run: ``runs/<run>/``."""
        return self._root

    def record_key(self, checkpoint: str) -> str:
        """Store key of a checkpoint's record."""
        return f"{self._root}records/{checkpoint}.json"

    def payload_key(self, checkpoint: str, kind: str, base: str | None) -> str:
        """Store key of a payload, derived from its content only."""
        if kind == "full":
            return f"{self._root}payloads/{checkpoint}.full.zst"
        return f"{self._root}payloads/{checkpoint}.delta.{base}.zst"

    def head_copy_key(self, checkpoint: str) -> str:
        """Store key of the full copy kept while a delta checkpoint is a head."""
        return f"{self._root}heads/{checkpoint}.zst"

    def entry_key(self, entry: NameEntry) -> str:
        """Store key of a name entry, derived from its content."""
        return f"{self._root}names/{entry.digest()}.json"

    def trash_key(self, payload_key: str) -> str:
        """Where gc keeps a payload it is removing until the removal is settled."""
        return f"{self._root}trash/{payload_key.rsplit('/', 1)[1]}"

    # reading ------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the store holds anything of this run (records first: the common case)."""
        return bool(self.store.list(f"{self._root}records/") or self.store.list(self._root))

    def _fetch_record(self, checkpoint: str) -> CheckpointRecord | None:
        cached = self._records.get(checkpoint)
        if cached is not None:
            return cached
        key = self.record_key(checkpoint)
        try:
            raw = self.store.get(key)
        except KeyError:
            return None
        try:
            record = CheckpointRecord.from_json(raw)
        except (ValueError, TypeError) as exc:
            raise self._corruption(checkpoint, key, f"malformed record: {exc}") from exc
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
            self.malformed[self.record_key(checkpoint)] = _why(exc)
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
        prefix = f"{self._root}records/"
        ids = []
        for key in self.store.list(prefix):
            name = key[len(prefix) :]
            if name.endswith(".json") and _is_id(name[:-5]):
                ids.append(name[:-5])
        return ids

    def manifest(self) -> list[CheckpointRecord]:
        """Every readable checkpoint's record, oldest first.

        Malformed records are left out and noted in :attr:`malformed`.
        """
        ids = self.ids()
        prefix = f"{self._root}records/"
        for key in list(self.malformed):
            if key.startswith(prefix):
                del self.malformed[key]
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
            raw = self.store.get(key)
        except KeyError:
            return None
        try:
            entry = NameEntry.from_json(raw)
        except (ValueError, TypeError) as exc:
            self.malformed[key] = f"malformed name entry: {exc}"
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
        prefix = f"{self._root}names/"
        for key in list(self.malformed):
            if key.startswith(prefix):
                del self.malformed[key]
        keys = [k for k in self.store.list(prefix) if k.endswith(".json")]
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
        """The run's files: each name's latest entry (``model``: only that model's)."""
        latest: dict[str, NameEntry] = {}
        for entry in self.entries(records):
            if model is None or entry.model_matches(model):
                latest[entry.name] = entry
        return dict(sorted(latest.items()))

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
            raw = self.store.get(key)
        except KeyError:
            return None
        try:
            data = codec.decompress_full(raw)
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
            return self.store.get(record.payload)
        except KeyError:
            raise self._corruption(record.id, record.payload, "payload missing") from None

    def _decode_full(self, record: CheckpointRecord) -> bytes:
        try:
            return codec.decompress_full(self._payload(record))
        except codec.DeltaError as exc:
            raise self._corruption(record.id, record.payload, str(exc)) from exc

    def _decode_delta(self, record: CheckpointRecord, base: bytes) -> bytes:
        try:
            return codec.decode(self._payload(record), base)
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
        ``model``, ``step``, ``label`` and ``meta``, is kept and restored.

        Raises
        ------
        ValueError
            If ``parent`` is not a checkpoint of this run, or ``name`` is not
            a safe relative path.
        """
        entry = None
        if name is not None:
            entry = NameEntry(
                name=check_relative_name(name), id="0" * 64, model=model, step=step,
                label=label, writer=writer or default_writer(), meta=dict(meta or {}),
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
        self.store.put_if_absent(self.entry_key(final), final.to_json())

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
        data = bytes(data)
        with ThreadPoolExecutor(1) as pool:
            full_future = pool.submit(codec.compress_full, data)
            checkpoint = checkpoint_id(data)
            if self._fetch_record(checkpoint) is not None:
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
            if parent_record is not None and parent_record.depth < self.max_chain:
                try:
                    delta_payload = codec.encode(data, self.load(parent_record.id))
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
        record_json = record.to_json()
        created_payload = self.store.put_if_absent(key, payload)
        recorded_parent = parent
        if self.store.put_if_absent(self.record_key(checkpoint), record_json):
            if not created_payload and not self.store.exists(key):
                # An old orphan we reused was removed by a concurrent gc before it
                # could see our record (see gc): write it again.
                log.warning("payload %s vanished (concurrent gc?): writing it again", key)
                self.store.put_if_absent(key, payload)
            self._records[checkpoint] = record
            if kind == "delta" and self.head_copies:
                self.store.put_if_absent(self.head_copy_key(checkpoint), full_payload)
        else:
            winner = self._fetch_record(checkpoint)
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
        """Delete payloads no record points to, and stale head copies.

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

        Returns
        -------
        list[str]
            The deleted keys.
        """
        now = time.time()
        records = self.manifest()
        referenced = {r.payload for r in records}
        deleted: list[str] = []
        self._settle_trash(now, older_than)
        prefix = f"{self._root}payloads/"
        for key in self.store.list(prefix):
            checkpoint = key[len(prefix) :].split(".", 1)[0]
            if key in referenced or not _is_id(checkpoint):
                continue
            try:
                age = now - self.store.modified(key)
            except KeyError:
                continue
            if age < older_than or self._names_payload(checkpoint, key):
                continue
            if self._remove_orphan(checkpoint, key):
                deleted.append(key)
        parents = {r.parent for r in records}
        heads = {r.id for r in records if r.id not in parents}
        prefix = f"{self._root}heads/"
        for key in self.store.list(prefix):
            checkpoint = key[len(prefix) :].split(".", 1)[0]
            if not _is_id(checkpoint) or checkpoint in heads:
                continue
            try:
                age = now - self.store.modified(key)
            except KeyError:
                continue
            if checkpoint in self._records or age >= older_than:
                self.store.delete(key)
                deleted.append(key)
        return deleted

    def _names_payload(self, checkpoint: str, key: str) -> bool:
        """Read the record afresh: does it name ``key``? (malformed: assume it might)."""
        self._records.pop(checkpoint, None)
        try:
            current = self._fetch_record(checkpoint)
        except CheckpointCorruptionError:
            return True
        return current is not None and current.payload == key

    def _remove_orphan(self, checkpoint: str, key: str) -> bool:
        """Move an orphan payload aside, delete it, look again; True if it stays deleted."""
        try:
            data = self.store.get(key)
        except KeyError:
            return False
        trash = self.trash_key(key)
        self.store.put(trash, data)
        self.store.delete(key)
        if self._names_payload(checkpoint, key):
            log.warning("payload %s was recorded while gc removed it: putting it back", key)
            self.store.put_if_absent(key, data)
            self.store.delete(trash)
            return False
        self.store.delete(trash)
        return True

    def _settle_trash(self, now: float, older_than: float) -> None:
        """Finish what a gc that died mid-removal left under ``trash/``."""
        prefix = f"{self._root}trash/"
        for trash in self.store.list(prefix):
            name = trash[len(prefix) :]
            checkpoint = name.split(".", 1)[0]
            key = f"{self._root}payloads/{name}"
            if _is_id(checkpoint) and self._names_payload(checkpoint, key) \
                    and not self.store.exists(key):
                try:
                    self.store.put_if_absent(key, self.store.get(trash))
                except KeyError:
                    continue
                log.warning("restored recorded payload %s from gc's trash", key)
                self.store.delete(trash)
                continue
            try:
                age = now - self.store.modified(trash)
            except KeyError:
                continue
            if age >= older_than:
                self.store.delete(trash)

    def verify(self, *, read_data: bool = False,
               progress: ProgressCallback | None = None) -> VerifyReport:
        """Check the run in the store without writing anything.

        Checks that every record is well formed and its payload exists,
        that every delta's base and every parent has a record, that every
        head copy decodes to its record's id, and that every name entry is
        well formed and names a recorded checkpoint.  With ``read_data``,
        every checkpoint is also rebuilt along its delta chain — never from
        a head copy or the cache, so damage a head copy hides is found — and
        checked against its id.  Keys nothing refers to are listed as
        orphans (not problems: crashed writers leave them, ``gc`` removes them).

        Parameters
        ----------
        read_data
            Decode every payload (reads the whole run once).
        progress
            Called as ``progress(phase, done, total)``.
        """
        report = VerifyReport(store=self.store.url, run=self.run_id, read_data=read_data)
        problems = report.problems
        keys = self.store.list(self._root)
        groups: dict[str, list[str]] = {}
        for key in keys:
            group = key[len(self._root):].split("/", 1)[0]
            groups.setdefault(group, []).append(key)
        for group in sorted(set(groups) - {"records", "payloads", "heads", "names", "trash"}):
            report.orphans.extend(groups[group])
        report.orphans.extend(groups.get("trash", []))

        def tick(phase: str, done: int, total: int) -> None:
            if progress is not None:
                progress(phase, done, total)

        records: dict[str, CheckpointRecord] = {}
        record_keys = groups.get("records", [])
        bad_ids: set[str] = set()
        for done, key in enumerate(record_keys, 1):
            stem = key[len(self._root) + len("records/"):]
            if not (stem.endswith(".json") and _is_id(stem[:-5])):
                report.orphans.append(key)
                continue
            checkpoint = stem[:-5]
            self._records.pop(checkpoint, None)
            try:
                record = self._fetch_record(checkpoint)
            except CheckpointCorruptionError as exc:
                problems.append((key, _why(exc)))
                bad_ids.add(checkpoint)
                continue
            if record is not None:
                records[checkpoint] = record
            tick("records", done, len(record_keys))
        report.records = len(records)

        payloads = set(groups.get("payloads", []))
        report.payloads = len(payloads)
        missing: set[str] = set()
        for record in records.values():
            if record.payload not in payloads and not self.store.exists(record.payload):
                missing.add(record.id)
                problems.append((record.payload, f"payload of checkpoint {record.id} missing"))
            if record.parent is not None and record.parent not in records \
                    and record.parent not in bad_ids:
                problems.append((self.record_key(record.id),
                                 f"parent {record.parent} has no record"))
            if record.kind == "delta":
                assert record.base is not None
                base = records.get(record.base)
                if base is None and record.base not in bad_ids:
                    problems.append((self.record_key(record.id),
                                     f"delta base {record.base} has no record"))
                elif base is not None and base.depth + 1 != record.depth:
                    problems.append((self.record_key(record.id),
                                     f"depth {record.depth} but its base has depth "
                                     f"{base.depth}"))
        referenced = {r.payload for r in records.values()}
        for key in sorted(payloads - referenced):
            if key[len(self._root) + len("payloads/"):].split(".", 1)[0] not in bad_ids:
                report.orphans.append(key)

        parents = {r.parent for r in records.values()}
        head_keys = groups.get("heads", [])
        for done, key in enumerate(head_keys, 1):
            checkpoint = key[len(self._root) + len("heads/"):].removesuffix(".zst")
            record = records.get(checkpoint)
            if record is None or checkpoint in parents or record.kind != "delta":
                report.orphans.append(key)
                continue
            report.head_copies += 1
            why = self._check_head_copy(key, record)
            if why is not None:
                problems.append((key, why))
            tick("head copies", done, len(head_keys))

        entry_keys = groups.get("names", [])
        for done, key in enumerate(entry_keys, 1):
            entry = self._read_entry(key)
            if entry is None:
                if key in self.malformed:
                    problems.append((key, self.malformed[key]))
                continue
            report.names += 1
            if entry.id not in records and entry.id not in bad_ids:
                problems.append((key, f"name {entry.name!r} points to checkpoint {entry.id}, "
                                 "which has no record"))
            tick("names", done, len(entry_keys))

        if read_data:
            self._verify_chains(records, missing, report, tick)
        report.orphans.sort()
        return report

    def _check_head_copy(self, key: str, record: CheckpointRecord) -> str | None:
        try:
            raw = self.store.get(key)
        except KeyError:
            return None
        try:
            data = codec.decompress_full(raw)
        except codec.DeltaError as exc:
            return f"head copy of checkpoint {record.id} does not decode: {exc}"
        if checkpoint_id(data) != record.id:
            return f"head copy does not decode to its record's id {record.id}"
        return None

    def _verify_chains(self, records: dict[str, CheckpointRecord], missing: set[str],
                       report: VerifyReport, tick: Callable[[str, int, int], None]) -> None:
        """Rebuild every checkpoint from its keyframe, depth first, each payload read once."""
        children: dict[str, list[CheckpointRecord]] = {}
        for record in records.values():
            if record.kind == "delta":
                assert record.base is not None
                children.setdefault(record.base, []).append(record)
        stack: list[tuple[CheckpointRecord, bytes | None]] = [
            (r, None) for r in sorted(records.values(), key=lambda r: r.id, reverse=True)
            if r.kind == "full"
        ]
        reached: set[str] = set()
        total = len(records)
        while stack:
            record, base = stack.pop()
            reached.add(record.id)
            try:
                if base is None:
                    data = self._verified(record, self._decode_full(record), cache=False)
                else:
                    data = self._verified(record, self._decode_delta(record, base), cache=False)
            except CheckpointCorruptionError as exc:
                if record.id not in missing:
                    report.problems.append(
                        (record.payload, f"checkpoint {record.id}: {_why(exc)}"))
                for child in _descendants(children, record.id):
                    reached.add(child.id)
                    report.problems.append(
                        (child.payload, f"checkpoint {child.id} cannot be rebuilt: its base "
                         f"{record.id} is damaged"))
                continue
            report.decoded += 1
            report.decoded_bytes += len(data)
            tick("data", len(reached), total)
            for child in children.get(record.id, []):
                stack.append((child, data))
        for record in records.values():
            if record.id not in reached and record.kind == "delta":
                report.problems.append(
                    (record.payload, f"checkpoint {record.id} cannot be rebuilt: its delta "
                     "chain does not reach a full payload"))

    def clear_cache(self) -> None:
        """Forget cached checkpoint bytes and records (e.g. to measure cold loads)."""
        self._cache.clear()
        self._records.clear()


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "why", None) or exc)


def _descendants(children: dict[str, list[CheckpointRecord]], root: str
                 ) -> list[CheckpointRecord]:
    found: list[CheckpointRecord] = []
    todo = list(children.get(root, []))
    while todo:
        record = todo.pop()
        found.append(record)
        todo.extend(children.get(record.id, []))
    return found
