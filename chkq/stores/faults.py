"""A store wrapper that injects faults into any store's operations: :class:`FaultyStore`.

For tests of code built on a store (the checkpoint log, a user's own
tools): it wraps a real store and, per rule, fails the n-th matching
operation before it reaches the store, performs it and then loses the
answer (the store acted, the caller sees an error, as when a response is
lost on the network), delays it, or runs a callback first (another writer
acting at that exact moment).  Every call is recorded, so a test can also
assert which objects were read.  Network faults below the store interface
(lost HTTP responses that the store's own retries absorb) are the business
of a proxy in front of the server, not of this wrapper.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from chkq.stores.base import (
    CheckpointStore,
    ObjectChecksums,
    ObjectVersion,
    PartRecord,
    PartsUpload,
    SharedUpload,
    StrayUpload,
    TransientStoreError,
)

__all__ = ["OPERATIONS", "FaultyStore", "Rule"]

T = TypeVar("T")

OPERATIONS = frozenset({"put", "put_if_absent", "get", "get_at_most", "exists", "list",
                        "delete", "modified", "available", "version", "versions",
                        "get_range_pinned", "checksums",
                        "upload", "upload_write", "upload_complete", "upload_abort",
                        "stray_uploads", "abort_upload",
                        "shared_begin", "shared_part", "shared_complete", "shared_abort"})
"""Names of the operations a rule can match (``list``, ``versions`` and ``stray_uploads``
match on their prefix). An upload from parts goes to the inner store's own
:meth:`upload`: ``upload`` starts it, each write or copy is an ``upload_write``, then
``upload_complete`` or ``upload_abort``, all matched on the upload's key. A shared upload
is ``shared_begin``, a ``shared_part`` for each part put or copied, ``shared_complete`` or
``shared_abort``, matched on its key too."""

Action = Literal["fail", "lose", "delay", "call"]
KeyMatch = str | Callable[[str], bool]


@dataclass
class Rule:
    """One injected fault: what it matches, when it fires, what it does.

    Attributes
    ----------
    operations
        Operation names it matches (see :data:`OPERATIONS`).
    match
        A substring of the key (or listing prefix), or a predicate on it.
    nth
        Fires on the ``nth`` matching call, counted from when the rule was added.
    times
        How many matching calls from the ``nth`` on it fires for (``None``: all).
    action
        ``"fail"`` raises ``error`` instead of calling the store; ``"lose"``
        calls the store, then raises ``error``; ``"delay"`` sleeps
        ``seconds`` first; ``"call"`` runs ``callback(operation, key)`` first.
    """

    operations: frozenset[str]
    match: KeyMatch
    nth: int
    times: int | None
    action: Action
    error: BaseException | None = None
    seconds: float = 0.0
    callback: Callable[[str, str], None] | None = None
    seen: int = 0
    fired: int = 0

    def matches(self, operation: str, key: str) -> bool:
        """Whether the call ``operation`` on ``key`` is one this rule counts."""
        if operation not in self.operations:
            return False
        return self.match(key) if callable(self.match) else self.match in key


class FaultyStore(CheckpointStore):
    """A store that forwards to ``inner``, with faults injected by rule.

    Parameters
    ----------
    inner
        The real store; it does the work and keeps the objects.

    Attributes
    ----------
    calls
        Every ``(operation, key)`` made through this wrapper, in order (for
        ``list``, the prefix), whether or not a rule fired.
    """

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self._rules: list[Rule] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"

    # adding rules ------------------------------------------------------------------

    def fail(self, operations: str | set[str], match: KeyMatch = "", *, nth: int = 1,
             times: int | None = 1, error: BaseException | None = None) -> Rule:
        """Make the ``nth`` matching call raise ``error`` without reaching the store.

        The default error is a :class:`~chkq.stores.base.TransientStoreError`
        naming the store, operation and key, as a store whose retries ran out.
        """
        return self._add(operations, match, nth, times, "fail", error=error)

    def lose_response(self, operations: str | set[str], match: KeyMatch = "", *,
                      nth: int = 1, times: int | None = 1,
                      error: BaseException | None = None) -> Rule:
        """Let the ``nth`` matching call act on the store, then raise ``error`` to the caller."""
        return self._add(operations, match, nth, times, "lose", error=error)

    def delay(self, operations: str | set[str], seconds: float, match: KeyMatch = "", *,
              nth: int = 1, times: int | None = None) -> Rule:
        """Sleep ``seconds`` before each matching call from the ``nth`` on."""
        return self._add(operations, match, nth, times, "delay", seconds=seconds)

    def before(self, operations: str | set[str], callback: Callable[[str, str], None],
               match: KeyMatch = "", *, nth: int = 1, times: int | None = 1) -> Rule:
        """Run ``callback(operation, key)`` just before the ``nth`` matching call.

        The callback may act on the inner store (another writer committing
        at that moment) or raise, which the caller then sees.
        """
        return self._add(operations, match, nth, times, "call", callback=callback)

    def clear(self) -> None:
        """Remove every rule (the call record is kept)."""
        with self._lock:
            self._rules.clear()

    def _add(self, operations: str | set[str], match: KeyMatch, nth: int, times: int | None,
             action: Action, **options: object) -> Rule:
        names = frozenset({operations} if isinstance(operations, str) else operations)
        unknown = names - OPERATIONS
        if unknown:
            raise ValueError(f"unknown store operation(s) {sorted(unknown)}; "
                             f"known: {sorted(OPERATIONS)}")
        if nth < 1:
            raise ValueError(f"nth counts from 1, got {nth}")
        rule = Rule(names, match, nth, times, action, **options)  # type: ignore[arg-type]
        with self._lock:
            self._rules.append(rule)
        return rule

    # running operations ------------------------------------------------------------

    def _due(self, operation: str, key: str) -> list[Rule]:
        with self._lock:
            self.calls.append((operation, key))
            due = []
            for rule in self._rules:
                if not rule.matches(operation, key):
                    continue
                rule.seen += 1
                if rule.seen >= rule.nth and (rule.times is None or rule.fired < rule.times):
                    rule.fired += 1
                    due.append(rule)
            return due

    def _error(self, rule: Rule, operation: str, key: str) -> BaseException:
        if rule.error is not None:
            return rule.error
        what = "response lost after the store acted" if rule.action == "lose" else "injected"
        return TransientStoreError(f"store {self.url}: {operation} {key}: {what}")

    def _run(self, operation: str, key: str, call: Callable[[], T]) -> T:
        due = self._due(operation, key)
        for rule in due:
            if rule.action == "delay":
                time.sleep(rule.seconds)
            elif rule.action == "call" and rule.callback is not None:
                rule.callback(operation, key)
            elif rule.action == "fail":
                raise self._error(rule, operation, key)
        result = call()
        for rule in due:
            if rule.action == "lose":
                raise self._error(rule, operation, key)
        return result

    def _put(self, key: str, data: bytes) -> None:
        self._run("put", key, lambda: self.inner.put(key, data))

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self._run("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    def _get(self, key: str) -> bytes:
        return self._run("get", key, lambda: self.inner.get(key))

    def _get_at_most(self, key: str, limit: int) -> bytes:
        return self._run("get_at_most", key, lambda: self.inner.get_at_most(key, limit))

    def _exists(self, key: str) -> bool:
        return self._run("exists", key, lambda: self.inner.exists(key))

    def _list(self, prefix: str) -> builtins.list[str]:
        return self._run("list", prefix, lambda: self.inner.list(prefix))

    def _delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def _modified(self, key: str) -> float:
        return self._run("modified", key, lambda: self.inner.modified(key))

    def _version(self, key: str) -> ObjectVersion:
        return self._run("version", key, lambda: self.inner.version(key))

    def _versions(self, prefix: str) -> dict[str, ObjectVersion]:
        return self._run("versions", prefix, lambda: self.inner.versions(prefix))

    def _get_range_pinned(self, key: str, pinned: ObjectVersion, start: int,
                          length: int) -> bytes | None:
        return self._run("get_range_pinned", key,
                         lambda: self.inner.get_range_pinned(key, pinned, start, length))

    def _available(self) -> bool:
        def check() -> bool:
            self.inner.check_available()
            return True

        return self._run("available", "", check)

    def _checksums(self, key: str) -> ObjectChecksums:
        return self._run("checksums", key, lambda: self.inner.checksums(key))

    def upload_part_size(self, requested: int | None = None) -> int | None:
        return self.inner.upload_part_size(requested)

    def _upload(self, key: str, *, part_size: int | None, checksum: bool) -> PartsUpload:
        inner = self._run("upload", key,
                          lambda: self.inner.upload(key, part_size=part_size, checksum=checksum))
        return _FaultyUpload(self, key, inner)

    def _stray_uploads(self, prefix: str) -> builtins.list[StrayUpload]:
        return self._run("stray_uploads", prefix, lambda: self.inner.stray_uploads(prefix))

    def _abort_upload(self, stray: StrayUpload) -> None:
        self._run("abort_upload", stray.key, lambda: self.inner.abort_upload(stray))

    @property
    def supports_shared_uploads(self) -> bool:
        return self.inner.supports_shared_uploads

    def _begin_shared_upload(self, key: str) -> SharedUpload:
        return self._run("shared_begin", key, lambda: self.inner.begin_shared_upload(key))

    def _put_part(self, upload: SharedUpload, number: int, data: bytes,
                  offset: int) -> PartRecord:
        return self._run("shared_part", upload.key,
                         lambda: self.inner.put_part(upload, number, data, offset))

    def _copy_part(self, upload: SharedUpload, number: int, source_key: str,
                   pinned: ObjectVersion, start: int, length: int, offset: int) -> PartRecord:
        return self._run("shared_part", upload.key, lambda: self.inner.copy_part(
            upload, number, source_key, pinned, start, length, offset))

    def _complete_shared_upload(self, upload: SharedUpload,
                                parts: builtins.list[PartRecord]) -> bool:
        return self._run("shared_complete", upload.key,
                         lambda: self.inner.complete_shared_upload(upload, parts))

    def _abort_shared_upload(self, upload: SharedUpload) -> None:
        self._run("shared_abort", upload.key, lambda: self.inner.abort_shared_upload(upload))

    def shared_upload_checksums(self, parts: builtins.list[PartRecord]) -> ObjectChecksums:
        return self.inner.shared_upload_checksums(parts)


class _FaultyUpload(PartsUpload):
    """The inner store's upload, each of its steps passed through the wrapper's rules."""

    store: FaultyStore

    def __init__(self, store: FaultyStore, key: str, inner: PartsUpload) -> None:
        super().__init__(store, key)
        self.inner = inner
        self.part_size = inner.part_size

    def _write(self, data: bytes) -> None:
        self.store._run("upload_write", self.key, lambda: self.inner.write(data))

    def _write_hashed(self, data: bytes, sha256: bytes) -> None:
        self.store._run("upload_write", self.key, lambda: self.inner.write(data, sha256=sha256))

    def _copy(self, source: str, start: int, length: int) -> None:
        self.store._run("upload_write", self.key,
                        lambda: self.inner.copy(source, start, length))

    def _complete(self) -> bool:
        def complete() -> bool:
            self.inner.access = self.access
            try:
                self.inner.complete()
            except FileExistsError:
                return False
            self.version = self.inner.version
            return True

        return self.store._run("upload_complete", self.key, complete)

    def _abort(self) -> None:
        self.store._run("upload_abort", self.key, self.inner.abort)
