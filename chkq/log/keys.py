"""A run's key layout in its store, and the one parser of those keys.

Layout of one run (``<id>`` is the SHA-256 of a checkpoint's bytes)::

    runs/<run>/records/<id>.json               the record (small JSON)
    runs/<run>/payloads/<id>.full.zst          a whole checkpoint (zstd frame)
    runs/<run>/payloads/<id>.delta.<base>.zst  a zstd patch-from delta against <base>
    runs/<run>/heads/<id>.zst                  full copy of a delta checkpoint that is a head
    runs/<run>/names/<name>.<seq>.json         entry number <seq> of a file name's history
                                               (<name> is the SHA-256 of the file name)
    runs/<run>/names/<digest>.json             a name entry of the older, unnumbered format
    runs/<run>/trash/<payload file name>       a payload gc moved aside
    runs/<run>/outputs/<MODEL>.json            an output entry: a consolidated file of MODEL
    runs/<run>/outputs/<MODEL>.h5              that file, where consolidation publishes it
                                               by default (an entry may name another key)

Every key is derived from content (ids, kinds, bases, entry digests, models), so
racing writers of the same thing write the same key.  Keys read back from a
listing are store content: :meth:`RunKeys.parse` is the only place they are
taken apart.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from chkq.log.records import check_output_model, is_id

__all__ = ["GROUPS", "ParsedKey", "RunKeys", "name_digest"]

SEQ_DIGITS = 10
"""Digits of an entry's number in its key: listed keys sort in history order."""


def name_digest(name: str) -> str:
    """The hex SHA-256 of a file name: the part of its entries' keys that names it."""
    return hashlib.sha256(name.encode()).hexdigest()

GROUPS = ("records", "payloads", "heads", "names", "trash", "outputs")
"""The top-level folders of a run; anything else under it is an orphan.  Nothing under
``outputs/`` is ever an orphan, and gc never deletes anything there."""


@dataclass(frozen=True)
class ParsedKey:
    """A key of a run, taken apart.

    Attributes
    ----------
    group
        Its first component below the run (``records``, ``payloads``, ...).
    name
        The rest of the key after ``group/``.
    checkpoint
        The checkpoint id ``name`` starts with (up to the first dot), if it is one.
    """

    group: str
    name: str
    checkpoint: str | None

    @property
    def nested(self) -> bool:
        """Whether the key lies in a subdirectory of its group (no key of a run does)."""
        return "/" in self.name


class RunKeys:
    """The keys of one run: ``runs/<run_id>/...``."""

    def __init__(self, run_id: str) -> None:
        self.root = f"runs/{run_id}/"

    def group(self, group: str) -> str:
        """Prefix of one of :data:`GROUPS`."""
        return f"{self.root}{group}/"

    def record(self, checkpoint: str) -> str:
        """Key of a checkpoint's record."""
        return f"{self.root}records/{checkpoint}.json"

    def payload(self, checkpoint: str, kind: str, base: str | None) -> str:
        """Key of a payload, derived from its content only."""
        if kind == "full":
            return f"{self.root}payloads/{checkpoint}.full.zst"
        return f"{self.root}payloads/{checkpoint}.delta.{base}.zst"

    def head_copy(self, checkpoint: str) -> str:
        """Key of the full copy kept while a delta checkpoint is a head."""
        return f"{self.root}heads/{checkpoint}.zst"

    def entry(self, digest: str) -> str:
        """Key of the name entry with content digest ``digest``."""
        return f"{self.root}names/{digest}.json"

    def numbered_entry(self, name: str, seq: int) -> str:
        """Key of entry number ``seq`` (from 1) of the file name ``name``'s history."""
        return f"{self.root}names/{name_digest(name)}.{seq:0{SEQ_DIGITS}d}.json"

    def name_history(self, name: str) -> str:
        """Prefix of every numbered entry of ``name``."""
        return f"{self.root}names/{name_digest(name)}."

    def entry_seq(self, key: str) -> int | None:
        """The number if ``key`` is exactly a numbered entry's key, else None."""
        parsed = self.parse(key)
        parts = parsed.name.split(".")
        if parsed.group != "names" or parsed.nested or len(parts) != 3 or parts[2] != "json" \
                or parsed.checkpoint is None or len(parts[1]) != SEQ_DIGITS \
                or not parts[1].isdigit() or not parts[1].isascii():
            return None
        return int(parts[1])

    def output_entry(self, model: str) -> str:
        """Key of the entry recording the consolidated output of ``model``."""
        return f"{self.root}outputs/{check_output_model(model)}.json"

    def output(self, model: str) -> str:
        """Default key of the consolidated output object of ``model``."""
        return f"{self.root}outputs/{check_output_model(model)}.h5"

    def trash(self, payload_key: str) -> str:
        """Where gc keeps a payload it is removing until the removal is settled."""
        return f"{self.root}trash/{self.parse(payload_key).name}"

    def payload_of_trash(self, trash_key: str) -> str:
        """The payload key a trash key was moved from."""
        return f"{self.root}payloads/{self.parse(trash_key).name}"

    def parse(self, key: str) -> ParsedKey:
        """Take a key of this run apart.

        Raises
        ------
        ValueError
            If ``key`` is not under this run.
        """
        if not key.startswith(self.root):
            raise ValueError(f"key {key!r} is not under {self.root!r}")
        group, _, name = key[len(self.root):].partition("/")
        stem = name.split(".", 1)[0]
        return ParsedKey(group, name, stem if is_id(stem) else None)

    def record_id(self, key: str) -> str | None:
        """The checkpoint id if ``key`` is exactly a record's key, else None."""
        parsed = self.parse(key)
        if parsed.group == "records" and parsed.checkpoint is not None \
                and parsed.name == f"{parsed.checkpoint}.json":
            return parsed.checkpoint
        return None

    def output_entry_model(self, key: str) -> str | None:
        """The model if ``key`` is exactly an output entry's key, else None."""
        parsed = self.parse(key)
        if parsed.group != "outputs" or parsed.nested or not parsed.name.endswith(".json"):
            return None
        model = parsed.name[: -len(".json")]
        try:
            check_output_model(model)
        except ValueError:
            return None
        return model

    def head_copy_id(self, key: str) -> str | None:
        """The checkpoint id if ``key`` is exactly a head copy's key, else None."""
        parsed = self.parse(key)
        if parsed.group == "heads" and parsed.checkpoint is not None \
                and parsed.name == f"{parsed.checkpoint}.zst":
            return parsed.checkpoint
        return None
