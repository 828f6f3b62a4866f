"""Checking a run in its store without writing: what :meth:`CheckpointLog.verify` does.

Everything a restore depends on is checked: every record is well formed (and,
with trusted keys, signed) and its payload exists; every parent and delta base
is recorded with a consistent depth; every head copy decodes, block by block
and bounded by its record's size, to its record's id; every name entry is well
formed and names a recorded checkpoint, and no name's entries disagree (a
conflict, when no trusted key decides); every output entry is well formed (and
signed), names checkpoints of the run under the names their name entries give,
and its output object exists with the entry's size. With ``read_data`` every
output object is also read, in pieces, and checked against its entry's
SHA-256, and every checkpoint is rebuilt from its keyframe along its delta
chain — never from a head copy or the cache, since a load prefers the head
copy and would hide damage to the chain — each payload read once, depth
first, so that memory holds one chain.
Keys nothing refers to are orphans, not problems: crashed writers leave them
and gc removes them.  Nothing under ``outputs/`` is an orphan: an object there
that no entry records (its publisher died before recording it, or it is being
recorded) is listed as an unrecorded output, which gc never removes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from chkq.errors import CheckpointCorruptionError, OutputCorruptionError, OutputEntryError
from chkq.log import delta as codec
from chkq.log.keys import GROUPS
from chkq.log.names import NameEntry, choose_entries, newest
from chkq.log.reader import LogReader
from chkq.log.records import CheckpointRecord, OutputEntry, corruption_reason, format_created

__all__ = ["ProgressCallback", "VerifyReport", "verify"]


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
    outputs, outputs_read, output_bytes
        Readable output entries, output objects read whole and checked
        against their entry's SHA-256 (``read_data``), and their bytes.
    problems
        ``(key, why)`` for everything wrong: a missing or undecodable
        payload, a head copy that does not decode to its record's id, a
        malformed record or entry, a dangling reference, an output object
        missing or not what its entry says.
    orphans
        Keys nothing refers to (left by crashed writers; ``gc`` removes them).
    unrecorded_outputs
        Keys under ``outputs/`` that are neither an output entry nor an
        object one records (a publisher died before recording it); neither
        problems nor orphans: gc leaves them.
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
    outputs: int = 0
    outputs_read: int = 0
    output_bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    unrecorded_outputs: list[str] = field(default_factory=list)

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


def verify(log: LogReader, *, read_data: bool = False,
           progress: ProgressCallback | None = None) -> VerifyReport:
    """Check the run in the store without writing anything.

    Checks that every record is well formed and its payload exists,
    that every delta's base and every parent has a record, that every
    head copy decodes to its record's id, that every name entry is
    well formed and names a recorded checkpoint, and that every output
    entry is well formed, names recorded checkpoints under their names and
    has its object, of its size.  With ``read_data``, every checkpoint is
    also rebuilt along its delta chain — never from a head copy or the
    cache, so damage a head copy hides is found — and checked against its
    id, and every output object is read and checked against its SHA-256.
    Keys nothing refers to are listed as orphans (not problems: crashed
    writers leave them, ``gc`` removes them).

    Parameters
    ----------
    read_data
        Decode every payload (reads the whole run once).
    progress
        Called as ``progress(phase, done, total)``.
    """
    report = VerifyReport(store=log.store.url, run=log.run_id, read_data=read_data)
    problems = report.problems
    keys = log.store.list(log.keys.root)
    groups: dict[str, list[str]] = {}
    for key in keys:
        group = log.keys.parse(key).group
        groups.setdefault(group, []).append(key)
    for group in sorted(set(groups) - set(GROUPS)):
        report.orphans.extend(groups[group])
    report.orphans.extend(groups.get("trash", []))
    for group in ("records", "payloads", "heads", "names", "outputs"):
        if group not in groups:
            prefix = log.keys.group(group)
            log.list_keys(prefix)
            why = log.malformed.get(prefix)
            if why is not None:
                problems.append((prefix, why))

    def tick(phase: str, done: int, total: int) -> None:
        if progress is not None:
            progress(phase, done, total)

    records: dict[str, CheckpointRecord] = {}
    record_keys = groups.get("records", [])
    bad_ids: set[str] = set()
    for done, key in enumerate(record_keys, 1):
        checkpoint = log.keys.record_id(key)
        if checkpoint is None:
            if log.keys.parse(key).nested:
                problems.append((key, "not a record: records are not kept in "
                                 "subdirectories"))
            else:
                report.orphans.append(key)
            continue
        log.forget_records(checkpoint)
        try:
            record = log.fetch_record(checkpoint)
        except CheckpointCorruptionError as exc:
            problems.append((key, corruption_reason(exc)))
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
        if record.payload not in payloads and not log.store.exists(record.payload):
            missing.add(record.id)
            problems.append((record.payload, f"payload of checkpoint {record.id} missing"))
        if record.parent is not None and record.parent not in records \
                and record.parent not in bad_ids:
            problems.append((log.keys.record(record.id),
                             f"parent {record.parent} has no record"))
        if record.kind == "delta":
            assert record.base is not None
            base = records.get(record.base)
            if base is None and record.base not in bad_ids:
                problems.append((log.keys.record(record.id),
                                 f"delta base {record.base} has no record"))
            elif base is not None and base.depth + 1 != record.depth:
                problems.append((log.keys.record(record.id),
                                 f"depth {record.depth} but its base has depth "
                                 f"{base.depth}"))
    referenced = {r.payload for r in records.values()}
    for key in sorted(payloads - referenced):
        if log.keys.parse(key).checkpoint not in bad_ids:
            report.orphans.append(key)

    parents = {r.parent for r in records.values()}
    head_keys = groups.get("heads", [])
    for done, key in enumerate(head_keys, 1):
        checkpoint = log.keys.head_copy_id(key)
        record = records.get(checkpoint) if checkpoint is not None else None
        if checkpoint is None or record is None or checkpoint in parents or record.kind != "delta":
            report.orphans.append(key)
            continue
        report.head_copies += 1
        why = _check_head_copy(log, key, record)
        if why is not None:
            problems.append((key, why))
        tick("head copies", done, len(head_keys))

    entry_keys = groups.get("names", [])
    read_entries: dict[str, list[NameEntry]] = {}
    for done, key in enumerate(entry_keys, 1):
        if log.keys.parse(key).nested:
            problems.append((key, "not a name entry: entries are not kept in "
                             "subdirectories"))
            continue
        entry = log.read_entry(key)
        if entry is None:
            if key in log.malformed:
                problems.append((key, log.malformed[key]))
            continue
        report.names += 1
        read_entries.setdefault(entry.name, []).append(entry)
        if not entry.deleted and entry.id not in records and entry.id not in bad_ids:
            problems.append((key, f"name {entry.name!r} points to checkpoint {entry.id}, "
                             "which has no record"))
        tick("names", done, len(entry_keys))

    for found in read_entries.values():
        found.sort(key=lambda e: (e.created, e.id))
    listed = set(entry_keys)
    for name, found in sorted(read_entries.items()):
        top = newest(found)
        for seq in range(1, (top.seq or 0) + 1 if top is not None else 1):
            key = log.keys.numbered_entry(name, seq)
            if key not in listed:
                problems.append((key, f"entry #{seq} of name {name!r} is missing from the "
                                 f"store, below its newest #{top.seq if top else 0}: removed "
                                 "by someone"))
    for name, why in sorted(log.check_freshness(read_entries).items()):
        problems.append((log.keys.name_history(name), f"rolled back: {why}"))
    _, conflicts = choose_entries(read_entries, decided=log.trust.enforcing)
    for name, found in sorted(conflicts.items()):
        ids = ", ".join(f"{e.id} (created {format_created(e.created)})" for e in found)
        for entry in found:
            problems.append((log.entry_key_of(entry),
                             f"conflict: name {name!r} has entries for different "
                             f"checkpoints: {ids}; restore refuses it"))

    pairs = {(e.name, e.id) for found in read_entries.values() for e in found if not e.deleted}
    pairs.update((r.meta["name"], r.id) for r in records.values()
                 if r.format < 2 and isinstance(r.meta.get("name"), str))
    _verify_outputs(log, groups.get("outputs", []), set(records) | bad_ids, pairs, report,
                    read_data=read_data, tick=tick)
    if read_data:
        _verify_chains(log, records, missing, report, tick)
    report.orphans.sort()
    return report


def _verify_outputs(log: LogReader, keys: list[str], recorded: set[str],
                    pairs: set[tuple[str, str]], report: VerifyReport, *, read_data: bool,
                    tick: Callable[[str, int, int], None]) -> None:
    """Check every output entry, and its object (read whole with ``read_data``)."""
    entries: list[tuple[str, OutputEntry]] = []
    for key in keys:
        if log.keys.output_entry_model(key) is None:
            continue
        try:
            entry = log.output_at(key)
        except OutputEntryError as exc:
            report.problems.append((key, str(getattr(exc, "why", exc))))
            continue
        if entry is not None:
            entries.append((key, entry))
    report.outputs = len(entries)
    named = {entry.key for _, entry in entries}
    report.unrecorded_outputs.extend(
        k for k in keys if log.keys.output_entry_model(k) is None and k not in named)
    for done, (key, entry) in enumerate(entries, 1):
        for checkpoint, name in zip(entry.checkpoints, entry.names, strict=True):
            if checkpoint not in recorded:
                report.problems.append((key, f"output of model {entry.model!r} was made "
                                        f"from checkpoint {checkpoint}, which has no record"))
            elif (name, checkpoint) not in pairs:
                report.problems.append((key, f"output of model {entry.model!r} says file "
                                        f"{name!r} is checkpoint {checkpoint}, but no name "
                                        "entry of the run says so"))
        why = _check_output_object(log, entry, read_data=read_data, report=report)
        if why is not None:
            report.problems.append((entry.key, why))
        tick("outputs", done, len(entries))


def _check_output_object(log: LogReader, entry: OutputEntry, *, read_data: bool,
                         report: VerifyReport) -> str | None:
    """Why the output object is not what its entry says, or None (counted in ``report``)."""
    if not read_data:
        try:
            size = log.store.size(entry.key)
        except KeyError:
            return f"output object of model {entry.model!r} missing"
        if size != entry.size:
            return (f"output object of model {entry.model!r} is {size} bytes, its entry "
                    f"says {entry.size}")
        return None
    try:
        read = sum(len(block) for block in log.read_output(entry))
    except OutputCorruptionError as exc:
        return str(getattr(exc, "why", exc))
    report.outputs_read += 1
    report.output_bytes += read
    return None


def _check_head_copy(log: LogReader, key: str, record: CheckpointRecord) -> str | None:
    try:
        raw = log.store.get_at_most(key, codec.compress_bound(record.full_size))
    except KeyError:
        return None
    digest = hashlib.sha256()
    try:
        for block in codec.iter_full(raw, record.full_size):
            digest.update(block)
    except codec.DeltaError as exc:
        return f"head copy of checkpoint {record.id} does not decode: {exc}"
    if digest.hexdigest() != record.id:
        return f"head copy does not decode to its record's id {record.id}"
    return None


def _verify_chains(log: LogReader, records: dict[str, CheckpointRecord], missing: set[str],
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
            data = log.verified(record, log.decode(record, base))
        except CheckpointCorruptionError as exc:
            if record.id not in missing:
                report.problems.append(
                    (record.payload, f"checkpoint {record.id}: {corruption_reason(exc)}"))
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


def _descendants(children: dict[str, list[CheckpointRecord]], root: str
                 ) -> list[CheckpointRecord]:
    found: list[CheckpointRecord] = []
    todo = list(children.get(root, []))
    while todo:
        record = todo.pop()
        found.append(record)
        todo.extend(children.get(record.id, []))
    return found
