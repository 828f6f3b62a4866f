"""Name entries: which checkpoint a file name of a run stands for, and how a name's entries decide.

A record describes a checkpoint's *content*; a :class:`NameEntry` says that a
file of the run, under its name, holds that content, with the annotations of
its commit.  Entries are small JSON objects, written once and read back as
untrusted (see :mod:`chkq.log.records` for the checks every object gets).

Each name has a numbered history: its entries since format 3 carry ``seq``
(1, 2, ...) and sit at ``names/<SHA-256 of the name>.<seq>.json``; a writer
takes the number after the newest it finds, create-if-absent, so no two
entries of a name share a number.  Deleting a name writes one more entry, a
*tombstone* (``deleted``).  With trusted log keys the newest signed entry is
the name's content (a tombstone: the name is gone), so a replanted older
entry is superseded, never chosen.  What a store tenant can still do is
delete the newest entries; :class:`chkq.log.seen.SeenNames` is how a reader
notices that against the history it saw before.
"""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from chkq.log.records import (
    LOG_FORMAT,
    NULL,
    check_relative_name,
    is_id,
    json_object,
    model_of_name,
)

__all__ = ["NameEntry", "choose_entries", "live", "newest"]

_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "id": (str,), "model": (str, NULL), "step": (int, NULL),
    "label": (str, NULL), "writer": (str, NULL), "meta": (dict,), "created": (int, float),
    "format": (int,), "mode": (int, NULL), "seq": (int, NULL), "deleted": (bool,),
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
        POSIX time of the commit, as its writer says.
    mode
        The file's permission bits when committed (None for entries written
        before modes were kept); restore gives the file ``mode & 0o777``.
    legacy
        True for an entry read from a format-1 record's ``meta.name``.
    seq
        Its number in the name's history (from 1); None for an entry of the
        unnumbered format 2.
    deleted
        True for a tombstone: the name was deleted (``id`` is the checkpoint
        it named until then).
    """

    name: str
    id: str
    model: str | None = None
    step: int | None = None
    label: str | None = None
    writer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    mode: int | None = None
    legacy: bool = False
    seq: int | None = None
    deleted: bool = False

    def digest(self) -> str:
        """Hex SHA-256 of what makes the entry distinct (writer, time and number excluded)."""
        identity: dict[str, Any] = {
            "name": self.name, "id": self.id, "model": self.model, "step": self.step,
            "label": self.label, "meta": self.meta}
        if self.mode is not None:
            identity["mode"] = self.mode
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> bytes:
        """Serialise as small JSON (``legacy`` is never stored)."""
        obj = {"format": LOG_FORMAT if self.seq is not None else 2, **asdict(self)}
        del obj["legacy"]
        for optional in ("mode", "seq"):
            if obj[optional] is None:
                del obj[optional]
        if not self.deleted:
            del obj["deleted"]
        return (json.dumps(obj, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NameEntry:
        """Parse and validate :meth:`to_json` output.

        Raises
        ------
        ValueError
            If the text is not a valid entry.
        """
        obj = json_object(raw, "entry", _ENTRY_FIELDS, _ENTRY_REQUIRED)
        names = set(cls.__dataclass_fields__) - {"legacy"}
        entry = cls(**{k: v for k, v in obj.items() if k in names})
        if not is_id(entry.id):
            raise ValueError("entry has a malformed checkpoint id")
        if entry.seq is not None and entry.seq < 1:
            raise ValueError(f"entry has a number below 1: {entry.seq!r}")
        if entry.deleted and entry.seq is None:
            raise ValueError("a deletion without a number")
        if entry.mode is not None and not 0 <= entry.mode <= 0o7777:
            raise ValueError(f"entry has a mode out of range: {entry.mode!r}")
        check_relative_name(entry.name)
        return entry

    @property
    def file_mode(self) -> int:
        """Permission bits a restored copy gets: the committed ones, never setuid, setgid
        or sticky; 0600 when the entry kept none."""
        return 0o600 if self.mode is None else stat.S_IMODE(self.mode) & 0o777

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



def newest(found: list[NameEntry]) -> NameEntry | None:
    """The entry of highest number among a name's numbered entries, or None if none is."""
    numbered = [e for e in found if e.seq is not None]
    return max(numbered, key=lambda e: e.seq or 0) if numbered else None


def live(found: list[NameEntry]) -> list[NameEntry]:
    """A name's entries since its last deletion (tombstones left out), in the given order."""
    gone = max((e.seq or 0 for e in found if e.deleted), default=None)
    if gone is None:
        return list(found)
    return [e for e in found if not e.deleted and (e.seq or 0) > gone]


def choose_entries(by_name: dict[str, list[NameEntry]], *, decided: bool
                   ) -> tuple[dict[str, NameEntry], dict[str, list[NameEntry]]]:
    """Each name's entry, and the names in conflict (entries oldest first, tombstones included).

    With ``decided`` (trusted keys vouch for every entry's writer) the newest
    numbered entry is the name's content, or its latest unnumbered entry if
    it has none; a name whose newest entry is a tombstone is left out.
    Without, a name's live entries (:func:`live`) conflict when they name
    different checkpoints.
    """
    chosen: dict[str, NameEntry] = {}
    conflicts: dict[str, list[NameEntry]] = {}
    for name, found in by_name.items():
        top = newest(found) if decided else None
        if top is not None:
            if not top.deleted:
                chosen[name] = top
            continue
        current = live(found)
        if not current:
            continue
        if len({e.id for e in current}) > 1 and not decided:
            conflicts[name] = current
        else:
            chosen[name] = current[-1]
    return chosen, conflicts
