"""The checkpoint log: a content-addressed, delta-compressed, write-once log.

Layout of one run in a store (``<id>`` is the SHA-256 of a checkpoint's bytes)::

    runs/<run>/records/<id>.json               the record (small JSON)
    runs/<run>/payloads/<id>.full.zst          a whole checkpoint (zstd frame)
    runs/<run>/payloads/<id>.delta.<base>.zst  a zstd patch-from delta against <base>
    runs/<run>/heads/<id>.zst                  full copy of a delta checkpoint that is a head

Writes are create-if-absent only, so any number of processes on any number of
machines can commit to one log without locks:

* A commit writes the payload first and the record second, so no record ever
  points to a missing payload.  The record is the commit point: whoever
  creates it first wins; the others read it back and return the same id.
* Payload keys are derived from the content (id, kind, base), so racing
  writers of one checkpoint write the *same* key and leave nothing behind.
  A writer whose payload lost (another writer recorded the same bytes with a
  different base — possible only with different parents) deletes its own
  payload after checking that the winning record names a different key; no
  record can ever name it afterwards, because records are write-once.
* A payload without a record is left only by a writer that died between
  the two writes; :meth:`CheckpointLog.gc` removes those once they are older
  than a threshold, re-checking the record just before deleting.  A writer
  that finds such an orphan (``put_if_absent`` says "exists") and then wins
  the record checks that the payload is still there and writes it again if
  a concurrent gc removed it in between.
* The stores turn a conditional write that comes back "exists" only because
  the client retried its *own* successful write into success (write ids, see
  :mod:`chkq.stores.s3`), so a lost response never loses data.

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
a load falls back to the chain.  This was chosen over the alternatives after
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
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from chkq import delta as codec
from chkq.errors import CheckpointCorruptionError
from chkq.stores.base import CheckpointStore, InvalidKeyError, validate_key

__all__ = ["DEFAULT_GC_AGE", "CheckpointLog", "CheckpointRecord"]

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MiB
DEFAULT_GC_AGE = 24 * 3600.0
"""Default age (s) below which ``gc`` leaves unreferenced payloads alone."""

RECORD_FORMAT = 1
_HEX = frozenset("0123456789abcdef")


def _is_id(text: str) -> bool:
    return len(text) == 64 and set(text) <= _HEX


def checkpoint_id(data: bytes) -> str:
    """Return the id of a checkpoint: the hex SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class CheckpointRecord:
    """The immutable description of one committed checkpoint.

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
        The caller's annotations (``meta`` is a JSON object).
    fork
        For a checkpoint made by :meth:`CheckpointLog.fork`:
        ``{"source": <id>, "edit": <description or None>}``.
    created
        POSIX time at which the record was written.
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

    def __hash__(self) -> int:
        return hash(self.id)

    def to_json(self) -> bytes:
        """Serialise as small, human-readable JSON."""
        return (json.dumps({"format": RECORD_FORMAT, **asdict(self)}, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CheckpointRecord:
        """Parse :meth:`to_json` output (unknown fields are ignored).

        Raises
        ------
        ValueError
            If the text is not a valid record.
        """
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError("record is not a JSON object")
        names = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in obj.items() if k in names})
        if not _is_id(record.id) or record.kind not in ("full", "delta"):
            raise ValueError("record has a malformed id or kind")
        if record.kind == "delta" and not (record.base and _is_id(record.base)):
            raise ValueError("delta record without a valid base")
        return record


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
        raise ValueError(f"invalid run id {run_id!r}: must be a non-empty name without '/'")
    try:
        validate_key(run_id)
    except InvalidKeyError as exc:
        raise ValueError(f"invalid run id {run_id!r}: {exc}") from None
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

    def __repr__(self) -> str:
        return f"CheckpointLog({self.store!r}, {self.run_id!r})"

    # keys ---------------------------------------------------------------

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

    # reading ------------------------------------------------------------

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
            raise self._corruption(checkpoint, key, f"unreadable record: {exc}") from exc
        if record.id != checkpoint:
            raise self._corruption(checkpoint, key, f"record names checkpoint {record.id}")
        self._records[checkpoint] = record
        return record

    def record(self, checkpoint: str) -> CheckpointRecord:
        """Return the record of ``checkpoint``.

        Raises
        ------
        KeyError
            If the run has no such checkpoint.
        """
        try:
            validate_key(checkpoint)
        except InvalidKeyError:
            raise KeyError(checkpoint) from None
        record = self._fetch_record(checkpoint)
        if record is None:
            raise KeyError(checkpoint)
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
        """Every checkpoint's record, oldest first."""
        ids = self.ids()
        missing = [i for i in ids if i not in self._records]
        if len(missing) > 8:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(self._fetch_record, missing))
        records = [r for r in map(self._fetch_record, ids) if r is not None]
        return sorted(records, key=lambda r: (r.created, r.id))

    def __iter__(self) -> Iterator[CheckpointRecord]:
        return iter(self.manifest())

    def __len__(self) -> int:
        return len(self.ids())

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
            If a payload is missing or damaged, or the rebuilt bytes do not
            hash to the id; the message names the checkpoint and the payload.
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
            try:
                whole = codec.decompress_full(self._payload(top))
            except codec.DeltaError as exc:
                raise self._corruption(top.id, top.payload, str(exc)) from exc
            data = self._verified(top, whole)
        for item in reversed(chain):
            data = self._verified(item, self._decode_delta(item, data))
        return data

    def _payload(self, record: CheckpointRecord) -> bytes:
        try:
            return self.store.get(record.payload)
        except KeyError:
            raise self._corruption(record.id, record.payload, "payload missing") from None

    def _decode_delta(self, record: CheckpointRecord, base: bytes) -> bytes:
        try:
            return codec.decode(self._payload(record), base)
        except codec.DeltaError as exc:
            raise self._corruption(record.id, record.payload, str(exc)) from exc

    def _verified(self, record: CheckpointRecord, data: bytes) -> bytes:
        if checkpoint_id(data) != record.id:
            raise self._corruption(
                record.id, record.payload, "rebuilt bytes do not match the SHA-256 id"
            )
        self._cache.put(record.id, data)
        return data

    def _corruption(self, checkpoint: str, key: str, why: str) -> CheckpointCorruptionError:
        error = CheckpointCorruptionError(
            f"checkpoint {checkpoint} of run {self.run_id!r} in {self.store.url}: "
            f"{key}: {why}"
        )
        error.checkpoint = checkpoint  # type: ignore[attr-defined]
        error.key = key  # type: ignore[attr-defined]
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
    ) -> str:
        """Store a checkpoint and return its id.

        With a parent, the payload is a delta against the parent unless the
        parent's chain already holds ``max_chain`` deltas or the delta is not
        smaller than the whole checkpoint compressed.  Committing bytes that
        are already in the log (from any process) returns their id and
        changes nothing, whatever the parent and annotations.

        Raises
        ------
        ValueError
            If ``parent`` is not a checkpoint of this run.
        """
        return self._commit(data, parent, step=step, label=label, meta=meta, fork=None)

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
            fork={"source": source_id, "edit": edit},
        )

    def _commit(
        self,
        data: bytes,
        parent: str | None,
        *,
        step: int | None,
        label: str | None,
        meta: dict[str, Any] | None,
        fork: dict[str, Any] | None,
    ) -> str:
        data = bytes(data)
        with ThreadPoolExecutor(1) as pool:
            full_future = pool.submit(codec.compress_full, data)
            checkpoint = checkpoint_id(data)
            if self._fetch_record(checkpoint) is not None:
                self._cache.put(checkpoint, data)
                return checkpoint
            parent_record = None
            if parent is not None:
                if parent not in self:
                    raise ValueError(f"unknown parent checkpoint {parent!r} in run {self.run_id!r}")
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
        about to write the record.  Just before deleting, the record of the
        payload's checkpoint is read again: a payload that a record names is
        never deleted.  Head copies of checkpoints that have children (left
        by a writer that died before removing them) or no record are
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
        prefix = f"{self._root}payloads/"
        for key in self.store.list(prefix):
            checkpoint = key[len(prefix) :].split(".", 1)[0]
            if key in referenced or not _is_id(checkpoint):
                continue
            try:
                age = now - self.store.modified(key)
            except KeyError:
                continue
            if age < older_than:
                continue
            self._records.pop(checkpoint, None)
            current = self._fetch_record(checkpoint)
            if current is not None and current.payload == key:
                continue
            self.store.delete(key)
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

    def clear_cache(self) -> None:
        """Forget cached checkpoint bytes and records (e.g. to measure cold loads)."""
        self._cache.clear()
        self._records.clear()
