"""The objects of a run's log as stored: records and name entries, their format and checks.

A record describes a checkpoint's *content* (id, payload, sizes, parent);
a name entry says which checkpoint a file name of the run stands for, with
its annotations. Both are small JSON objects, written once; everything read
back is untrusted and validated here field by field (types, nesting depth,
size, name lengths a file system can hold) before anything acts on it.
:class:`~chkq.log.names.NameEntry` is in :mod:`chkq.log.names`.

Format versions
---------------
Every record and name entry carries ``"format"``.  Format 1 (before name
entries) kept a committed file's name and model in the record's ``meta``
(``meta.name``, ``meta.model``); since a record describes *content*, a
second file with the same bytes was lost.  Format 2 keeps names in entries
of their own, ``names/<digest>.json``, one per (name, id, annotations), so
the same bytes under two names are two entries and a restore brings back
both.  Format 3 numbers each name's entries (:mod:`chkq.log.names`); records
and output entries are still written in format 2.  Format-1 records that
name a file are still read, as entries of their own (``NameEntry.legacy``);
objects of a format above :data:`LOG_FORMAT` are reported as malformed rather than guessed at.

Output entries
--------------
An :class:`OutputEntry` records one consolidated output of a model of the
run: the store key of the published HDF5 file, its size and SHA-256, and the
checkpoints (with their file names) it was made from, in run order.  It is
kept at ``outputs/<MODEL>.json``, written once, and read back as untrusted
like every other object here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from chkq import environment
from chkq.errors import BadNameError
from chkq.stores.base import InvalidKeyError, validate_key

MAX_CHECKPOINT_ENV = environment.LOG_MAX_CHECKPOINT_BYTES.name
DEFAULT_MAX_CHECKPOINT_BYTES: int = environment.LOG_MAX_CHECKPOINT_BYTES.default
"""Largest checkpoint a log commits or reads unless ``CHKQ_LOG_MAX_CHECKPOINT_BYTES`` says."""
MAX_OBJECT_BYTES = 1 << 20
"""Largest record or name entry read (they are a few hundred bytes)."""
MAX_OUTPUT_ENTRY_BYTES = 16 << 20
"""Largest output entry written or read (about 150 bytes per checkpoint it was made from)."""
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095

LOG_FORMAT = 3
"""Newest format this version reads and writes: 3 = numbered name entries (see module docs)."""
RECORD_FORMAT = 2
"""Format of records and output entries written by this version."""
_HEX = frozenset("0123456789abcdef")
NULL = type(None)


def is_id(text: object) -> bool:
    """Whether ``text`` is a checkpoint id: 64 lowercase hex digits."""
    return isinstance(text, str) and len(text) == 64 and set(text) <= _HEX


def checkpoint_id(data: bytes) -> str:
    """Return the id of a checkpoint: the hex SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def max_checkpoint_bytes(environ: dict[str, str] | None = None) -> int:
    """The configured cap on a checkpoint's size (``CHKQ_LOG_MAX_CHECKPOINT_BYTES``).

    Raises
    ------
    ValueError
        If the variable is not a positive whole number of bytes.
    """
    return environment.max_checkpoint_bytes(environ)


def printable(text: str) -> str:
    """``text`` with control and format characters escaped (``\\n``, ``\\x1b``, ``\\u202e``).

    Names and keys come from store content and run directories; printed raw,
    a terminal would act on them.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def format_created(created: float) -> str:
    """A record's or entry's ``created`` as UTC ISO 8601 (clamped: stored times are untrusted)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(0.0, min(created, 2.5e11))))


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
        backslash or a NUL character, a component longer than a file system
        name (255 bytes) or a name longer than a path (4095 bytes).
    """
    if not isinstance(name, str):
        raise BadNameError(f"invalid checkpoint name {name!r}: not a string")
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "//" in name or name.endswith("/") or "\\" in name or "\x00" in name:
        raise BadNameError(f"invalid checkpoint name {name!r}: expected a relative path "
                         "inside the run directory")
    try:
        encoded = [p.encode() for p in parts]
    except UnicodeEncodeError:
        raise BadNameError(f"invalid checkpoint name {name!r}: not encodable") from None
    if any(len(p) > NAME_MAX_BYTES for p in encoded) or len(name.encode()) > PATH_MAX_BYTES:
        raise BadNameError(f"invalid checkpoint name {name[:80]!r}...: a component is longer "
                         f"than {NAME_MAX_BYTES} bytes or the name than {PATH_MAX_BYTES}")
    return name


def json_object(raw: str | bytes, what: str, fields: Any, required: Any,
                 limit: int = MAX_OBJECT_BYTES) -> dict[str, Any]:
    """Parse a stored record or entry: a JSON object of a known format with typed fields.

    Raises
    ------
    ValueError
        Saying what is wrong.
    """
    if len(raw) > limit:
        raise ValueError(f"{what} of {len(raw)} bytes is larger than {limit}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
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
            wanted = " or ".join("null" if t is NULL else t.__name__ for t in types)
            raise ValueError(f"field {name!r} is {type(value).__name__}, expected {wanted}")


_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "parent": (str, NULL), "kind": (str,), "base": (str, NULL),
    "depth": (int,), "payload": (str,), "stored_size": (int,), "full_size": (int,),
    "step": (int, NULL), "label": (str, NULL), "meta": (dict,), "fork": (dict, NULL),
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
        obj = json_object(raw, "record", _RECORD_FIELDS, _RECORD_REQUIRED)
        obj.setdefault("format", 1)
        obj.setdefault("parent", None)
        obj.setdefault("base", None)
        names = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in obj.items() if k in names})
        if not is_id(record.id) or record.kind not in ("full", "delta"):
            raise ValueError("record has a malformed id or kind")
        if record.parent is not None and not is_id(record.parent):
            raise ValueError("record has a malformed parent")
        if record.kind == "delta" and not (is_id(record.base) and record.depth >= 1):
            raise ValueError("delta record without a valid base and depth")
        if record.kind == "full" and (record.base is not None or record.depth != 0):
            raise ValueError("full record with a base or a depth")
        if record.stored_size < 0 or record.full_size < 0:
            raise ValueError("record has a negative size")
        return record


_BAD_MODEL = re.compile(r"[/\\\x00]")


def check_output_model(model: object) -> str:
    """Return ``model`` if it can name a run's output: one file name, as consolidation takes.

    The model becomes a key component (``outputs/<MODEL>.json``) and a file
    name (``<MODEL>.h5`` in a restore directory).

    Raises
    ------
    BadNameError
        If it is not a string, is empty, contains ``/``, a backslash, NUL or
        ``..``, starts with ``.``, or holds a character a file name cannot.
    """
    if not isinstance(model, str) or not model:
        raise BadNameError(f"invalid model name {model!r}: it must be a non-empty file name")
    if _BAD_MODEL.search(model) or ".." in model or model.startswith(".") \
            or not model.isprintable():
        raise BadNameError(f"invalid model name {model!r}: it must not contain '/', '\\', "
                           "'..', NUL or control characters, or start with '.'")
    try:
        encoded = f"{model}.json".encode()
    except UnicodeEncodeError:
        raise BadNameError(f"invalid model name {model!r}: not encodable") from None
    if len(encoded) > NAME_MAX_BYTES:
        raise BadNameError(f"invalid model name {model[:80]!r}...: longer than a file name")
    return model


def output_key_problem(key: object) -> str | None:
    """Why ``key`` cannot be an output object's store key, or None if it can.

    An output may lie anywhere in the store except where a run's log keeps
    something else: below ``runs/<run>/`` only directly in ``outputs/``,
    and never at a name ending in ``.json`` there (the entries' names), so
    that neither gc nor verify of any run takes it for one of its objects.
    """
    if not isinstance(key, str):
        return "not a string"
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        return str(exc)
    if not key.isprintable():
        return "it holds control characters"
    parts = key.split("/")
    if parts[0] == "runs" and len(parts) >= 3:
        if parts[2] != "outputs" or len(parts) != 4:
            return (f"it lies in group {parts[2]!r} of run {parts[1]!r}, where outputs do "
                    "not belong (only directly under runs/<run>/outputs/)")
        if key.endswith(".json"):
            return "it has the name of an output entry (.json)"
    return None


_OUTPUT_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,), "key": (str,), "size": (int,), "sha256": (str,),
    "checkpoints": (list,), "names": (list,), "created": (int, float),
    "writer": (str, NULL), "job": (str, NULL), "format": (int,),
}
_OUTPUT_REQUIRED = frozenset({"model", "key", "size", "sha256", "checkpoints", "names"})


@dataclass(frozen=True)
class OutputEntry:
    """One consolidated output of a run: which file, and what it was made from.

    Written once at ``runs/<run>/outputs/<MODEL>.json`` (see
    :meth:`CheckpointLog.record_output`) after the output object itself was
    published create-if-absent, so an entry never names an object that was
    not there when it was written.  Every value is checked when an entry is
    made, so one that exists is well formed.

    Attributes
    ----------
    model
        The model whose checkpoints were consolidated (one file name).
    key
        Store key of the output object (by default ``runs/<run>/outputs/<MODEL>.h5``).
    size, sha256
        Bytes and hex SHA-256 of the output object.
    checkpoints
        Ids of the checkpoints it was made from, in run order (an id can
        recur: two files of the run may have the same bytes).
    names
        The run's file names of those checkpoints, in the same order.
    created
        POSIX time of the record, as its writer says.
    writer
        Who recorded it (``host:pid`` by default).
    job
        Id of the consolidation job that made it.
    """

    model: str
    key: str
    size: int
    sha256: str
    checkpoints: tuple[str, ...]
    names: tuple[str, ...]
    created: float = 0.0
    writer: str | None = None
    job: str | None = None

    def __post_init__(self) -> None:
        check_output_model(self.model)
        problem = output_key_problem(self.key)
        if problem is not None:
            raise ValueError(f"output key {self.key!r} cannot be used: {problem}")
        if type(self.size) is not int or self.size < 0:
            raise ValueError(f"output size {self.size!r} is not a number of bytes")
        if not is_id(self.sha256):
            raise ValueError(f"output sha256 {self.sha256!r} is not 64 lowercase hex digits")
        checkpoints, names = tuple(self.checkpoints), tuple(self.names)
        object.__setattr__(self, "checkpoints", checkpoints)
        object.__setattr__(self, "names", names)
        if not checkpoints:
            raise ValueError("an output is made from at least one checkpoint")
        if not all(is_id(c) for c in checkpoints):
            raise ValueError("output names a checkpoint id that is not 64 lowercase hex digits")
        if len(names) != len(checkpoints):
            raise ValueError(f"output has {len(names)} names for {len(checkpoints)} "
                             "checkpoints")
        for name in names:
            check_relative_name(name)
        if len(set(names)) != len(names):
            raise ValueError("output names a file of the run twice")
        if isinstance(self.created, bool) or not isinstance(self.created, (int, float)):
            raise ValueError(f"output created {self.created!r} is not a time")
        for what in ("writer", "job"):
            value = getattr(self, what)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"output {what} {value!r} is not a string")

    def identity(self) -> dict[str, Any]:
        """What makes two records of an output the same output.

        Who recorded it, when, and in which job are left out: a redelivered
        or repeated consolidation that published the same bytes from the
        same checkpoints records the same output.
        """
        return {"model": self.model, "key": self.key, "size": self.size,
                "sha256": self.sha256, "checkpoints": list(self.checkpoints),
                "names": list(self.names)}

    def same_output(self, other: OutputEntry) -> bool:
        """Whether ``other`` records the same output (see :meth:`identity`)."""
        return self.identity() == other.identity()

    def to_json(self) -> bytes:
        """Serialise as JSON (checkpoint and name lists included)."""
        obj = {"format": RECORD_FORMAT, **asdict(self)}
        obj["checkpoints"], obj["names"] = list(self.checkpoints), list(self.names)
        return (json.dumps(obj, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> OutputEntry:
        """Parse and validate :meth:`to_json` output (unknown fields are ignored).

        Raises
        ------
        ValueError
            If the text is not a valid output entry; the message says what is wrong.
        """
        obj = json_object(raw, "output entry", _OUTPUT_FIELDS, _OUTPUT_REQUIRED,
                           limit=MAX_OUTPUT_ENTRY_BYTES)
        for name in ("checkpoints", "names"):
            if not all(isinstance(item, str) for item in obj[name]):
                raise ValueError(f"field {name!r} holds something that is not a string")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in obj.items() if k in names})

    def line(self) -> str:
        """One line for people: model, key, size, SHA-256 prefix, checkpoints, job."""
        return printable(
            f"output {self.model} key={self.key} size={self.size} sha256={self.sha256[:16]} "
            f"checkpoints={len(self.checkpoints)} created={format_created(self.created)} "
            f"job={self.job or ''}")


def model_of_name(name: str) -> str | None:
    """The model a slug-style checkpoint name belongs to, or None."""
    first = name.split("/", 1)[0]
    found = re.fullmatch(r"(.+)_chk\d{5}(\.h5)?", first)
    return found.group(1) if found else None



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


def corruption_reason(exc: BaseException) -> str:
    """The reason a load or read failed, without the message's checkpoint and key prefix."""
    return str(getattr(exc, "why", None) or exc)
