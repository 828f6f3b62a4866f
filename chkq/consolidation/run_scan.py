"""Finding a run's checkpoints and scanning its files, and the records scan tasks leave of both.

A large run is scanned by several tasks at once, :data:`SCAN_FILES` files
each (:func:`scan_units`); each records what it found
(:func:`scans_to_record`), from which planning reads the run back
(:func:`scans_from_record`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkq.consolidation.checkpoint_files import FileScan, check_same_structure, scan_file
from chkq.consolidation.discovery import (
    Checkpoint,
    check_numbering,
    find_checkpoints,
    no_checkpoints,
)
from chkq.consolidation.record_dimensions import record_padding
from chkq.consolidation.stamps import FileStamp, check_same, stamp_of
from chkq.errors import BadCheckpointError, BadMessageError
from chkq.lru import LRU
from chkq.rundir import RunDir

#: Files per scan unit when a run's files are scanned by several tasks at once.
SCAN_FILES = 256

#: Scans this process made with ``reuse``, by path and stamp (:func:`scan_files`).
_SCANNED: LRU[tuple[str, FileStamp], ScannedFile] = LRU(16384)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off while a run's files are scanned or planned.

    Scanning and planning thousands of files allocate a few dozen long-lived
    objects per file (scans, paths, records, h5py ids), which trigger full
    collections that walk the worker's whole heap again and again without
    finding garbage: a tenth of a large run's scan time. Reference counting
    still frees everything; the collector runs again as soon as the block
    ends (only if it was on before).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class ScannedFile:
    """A checkpoint file as planning saw it: its stamp (taken first), then its skeleton."""

    scan: FileScan
    stamp: FileStamp


def find_run(directory: Path, model: str, run: RunDir | None = None, *,
             allow_gaps: bool = False, through: int | None = None) -> list[Checkpoint]:
    """The run's checkpoints, each holding at least one file, with no gap in their numbers.

    ``run``: the directory, already open (planning reads the run through one descriptor).
    ``through``: only the checkpoints numbered up to it (a run still being written,
    consolidated as far as it is complete).

    Raises
    ------
    NoCheckpointsError
        If the run has no checkpoints (a FileNotFoundError).
    CheckpointGapError
        If numbers are missing between the first and last checkpoint and
        ``allow_gaps`` is false (a ValueError).
    BadCheckpointError
        If a checkpoint directory holds no ``.h5`` file (a ValueError).
    """
    checkpoints = [c for c in find_checkpoints(directory, model, run)
                   if through is None or c.number <= through]
    if not checkpoints:
        raise no_checkpoints(directory, model, run)
    for checkpoint in checkpoints:
        if not checkpoint.files:
            raise BadCheckpointError(
                f"checkpoint directory {str(checkpoint.path)!r} holds no .h5 file")
    check_numbering(checkpoints, model, allow_gaps=allow_gaps)
    return checkpoints


def scan_units(count: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[first, stop)`` of a run's ``count`` files, one per scan unit."""
    return [(first, min(count, first + SCAN_FILES)) for first in range(0, count, SCAN_FILES)]


@collector_paused()
def scans_to_record(scanned: list[ScannedFile]) -> dict[str, Any]:
    """A scan unit's result as JSON-ready data, for the job's records.

    Each distinct skeleton is written once; each file then gives its path,
    the index of its skeleton, its extensible datasets' row counts (in the
    skeleton's order), its stamp and where plain chunks are: a few hundred
    bytes a file.
    """
    skeletons: list[dict[str, str]] = []
    files: list[list[Any]] = []
    for s in scanned:
        if s.scan.objects not in skeletons:
            skeletons.append(s.scan.objects)
        files.append([str(s.scan.path), skeletons.index(s.scan.objects),
                      list(s.scan.rows.values()), s.stamp.as_list(),
                      [s.scan.plain_chunks.get(name) for name in s.scan.rows], s.scan.digest,
                      list(s.scan.memory), list(s.scan.access)])
    return {"skeletons": skeletons, "files": files}


@collector_paused()
def scans_from_record(record: Any) -> list[ScannedFile]:
    """The scans :func:`scans_to_record` wrote.

    Raises
    ------
    ValueError
        If the record is malformed.
    """
    try:
        skeletons = [{str(k): str(v) for k, v in objects.items()}
                     for objects in record["skeletons"]]
        scanned = []
        for (path, index, rows, stamp, chunks, digest, (need, needy),
             (mode, uid, gid)) in record["files"]:
            objects = skeletons[index]
            names = [n for n, kind in objects.items() if kind.startswith("extensible ")]
            if len(rows) != len(names) or not all(type(r) is int for r in rows):
                raise ValueError("row counts do not match the skeleton")
            plain = {name: [int(x) for x in found]
                     for name, found in zip(names, chunks, strict=True) if found is not None}
            scan = FileScan(Path(path), objects, dict(zip(names, rows, strict=True)), plain,
                            str(digest), (int(need), str(needy)),
                            (int(mode), int(uid), int(gid)))
            scanned.append(ScannedFile(scan, FileStamp(*(int(x) for x in stamp))))
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
        raise BadMessageError(f"malformed scan record: {exc}") from None
    return scanned


def checkpoints_to_record(checkpoints: list[Checkpoint]) -> list[list[Any]]:
    """The run's checkpoints as JSON-ready data: number, path and files of each."""
    return [[c.number, str(c.path), [str(f) for f in c.files]] for c in checkpoints]


def checkpoints_from_record(record: Any) -> list[Checkpoint]:
    """The checkpoints :func:`checkpoints_to_record` wrote (ValueError if malformed)."""
    try:
        return [Checkpoint(int(number), Path(path), tuple(Path(f) for f in files))
                for number, path, files in record]
    except (TypeError, ValueError) as exc:
        raise BadMessageError(f"malformed checkpoint record: {exc}") from None


def run_files(checkpoints: list[Checkpoint]) -> list[Path]:
    """Every file of the run, in row order."""
    return [path for checkpoint in checkpoints for path in checkpoint.files]


def scan_files(paths: list[Path], out_dir: str | Path,
               run: RunDir | None = None, *, reuse: bool = False,
               digest: bool = True) -> list[ScannedFile]:
    """Stamp and scan each file of the run in ``out_dir``; the stamp is checked after the scan.

    Each file is opened once through the run directory's descriptor
    (``run``, else ``out_dir``, resolved already, opened here), no link
    followed at any level; its stamp
    is the opened descriptor's, and HDF5 reads that descriptor. A file that
    changed while it was scanned is refused, so the rows the scan counted
    belong to the version every later open is checked against.

    ``reuse``: a file whose stamp is the one this process scanned it with
    before keeps that scan, unopened by HDF5 (a followed run's next version
    scans only its new checkpoints). The stamp is the same proof of an
    unchanged file that every later open of the job relies on.

    ``digest``: whether small files' rows are digested (:func:`scan_file`);
    a run of metadata mirrors (:mod:`chkq.consolidation.mirror`) holds no rows to digest.

    Raises
    ------
    ValueError
        If a file is incomplete, unreadable, not HDF5, or a symbolic link
        (or reached through one).
    CheckpointChangedError
        If a file changed while it was scanned.
    """
    if run is None:
        with RunDir.open(out_dir, exact=True) as opened:
            return scan_files(paths, out_dir, opened, reuse=reuse, digest=digest)
    scanned = []
    with collector_paused():
        for path in paths:
            fd = run.open_file(path)
            try:
                stamp = stamp_of(path, os.fstat(fd))
                known = _SCANNED.get((str(path), stamp)) if reuse and digest else None
                if known is not None:
                    scanned.append(known)
                    continue
                scan = scan_file(path, fd=fd) if digest else scan_file(path, digest=False, fd=fd)
                st = os.fstat(fd)
                check_same(path, stamp, st, "changed while it was being planned")
            finally:
                os.close(fd)
            scan.access = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            scanned.append(ScannedFile(scan, stamp))
            if reuse and digest:
                _SCANNED.put((str(path), stamp), scanned[-1])
    return scanned


def discover_and_scan(out_dir: Path, model: str, *, allow_gaps: bool = False
                      ) -> tuple[list[Checkpoint], list[FileScan]]:
    """Find the run's checkpoints and scan every file here, refusing a bad run.

    For a check before a job is sent: the files' rows are not digested.

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`find_run`, or if a file is incomplete, unreadable, not
        HDF5, or differs in structure.
    """
    checkpoints = find_run(out_dir, model, allow_gaps=allow_gaps)
    scans = [scan_file(path, digest=False) for path in run_files(checkpoints)]
    check_same_structure(scans)
    record_padding(checkpoints[-1].files[0], scans)
    return checkpoints, scans
