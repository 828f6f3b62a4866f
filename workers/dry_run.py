"""``chkq consolidate --dry-run``: what a consolidation would do, checked as planning checks it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from chkq.config.celery_app import get_settings
from chkq.consolidation.discovery import check_model_name
from chkq.workers.claims import refuse_if_running
from chkq.workers.client import precheck


@dataclass(frozen=True)
class DryRun:
    """What a consolidation would read and write, found without submitting anything.

    Attributes
    ----------
    source
        The run directory (or the store URL of a run in a store).
    output
        Where the output would be: ``DIR/MODEL.h5``, or its URL.
    checkpoints
        The checkpoints' numbers, in order.
    files
        Checkpoint files to be read, with their sizes in bytes.
    datasets
        For a run directory: each extensible dataset's path, its rows in the
        output and how it is moved (``raw``: chunk by chunk; ``chunks``:
        filtered chunks moved encoded; ``whole``: variable-length rows); empty
        for a run in a store, whose files are read only once fetched.
    warnings
        What a real run would warn about (a gap accepted with ``allow_gaps``).
    """

    source: str
    output: str
    checkpoints: list[int]
    files: list[tuple[str, int]]
    datasets: list[tuple[str, int, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Bytes of all the checkpoint files."""
        return sum(size for _, size in self.files)

    def lines(self) -> list[str]:
        """The dry run for people: the run, each dataset, then what would happen."""
        numbers = self.checkpoints
        span = f"{numbers[0]:05d}-{numbers[-1]:05d}" if len(numbers) > 1 else f"{numbers[0]:05d}"
        out = [f"would consolidate {len(numbers):,} checkpoints ({span}) of {self.source}: "
               f"{len(self.files):,} files, {self.bytes / 1e6:,.1f} MB",
               f"into {self.output}"]
        width = max((len(name) for name, _, _ in self.datasets), default=0)
        moves = {"raw": "fixed-size rows", "chunks": "filtered chunks",
                 "whole": "variable-length rows"}
        for name, rows, mode in self.datasets:
            out.append(f"  /{name.ljust(width)}  {rows:>15,} rows  ({moves.get(mode, mode)})")
        if not self.datasets:
            out.append("  (datasets are read once the files are fetched)")
        out.extend(f"warning: {w}" for w in self.warnings)
        out.append("dry run: nothing was submitted, written or deleted")
        return out


def dry_run(model_name: str, out_dir: str | Path | None = None, *, allow_gaps: bool = False,
            source: str | None = None, run: str | None = None, to: str | None = None
            ) -> DryRun:
    """Check a consolidation as its planning step would, and say what it would do.

    For a run directory, every file's structure is read (incomplete,
    unreadable, mismatched files and what chkq cannot copy exactly are
    refused, as they would be by the job); nothing is written, nothing is
    sent. For a run in a store (``source``), its objects are listed and the
    destination checked. With a broker configured, a run already being
    consolidated is refused too.

    Raises
    ------
    ChkqError
        Whatever the consolidation would be refused for, as
        :func:`consolidate_checkpoints`.
    """
    notes: list[str] = []
    if source is not None:
        from chkq.staging import find_store_run
        from chkq.tasks.from_store import check_destination_free, destination_of

        model = check_model_name(model_name)
        found = find_store_run(source, model, run, allow_gaps=allow_gaps)
        destination = destination_of(found, to)
        check_destination_free(found, destination)
        if get_settings().broker_url:
            refuse_if_running(model, source)
        numbers = sorted({int(o.name.split("_chk")[-1][:5]) for o in found.objects
                          if o.name.split("_chk")[-1][:5].isdigit()})
        store_url, key = destination
        return DryRun(source, f"{store_url.rstrip('/')}/{key}", numbers,
                      [(found.url_of(o.name), o.size) for o in found.objects],
                      warnings=list(found.warnings))
    from chkq.consolidation.prepare import surveyed_run
    from chkq.consolidation.run_scan import run_files

    directory, model = precheck(model_name, out_dir, scan=False, allow_gaps=allow_gaps,
                                notes=notes)
    if get_settings().broker_url:
        refuse_if_running(model, str(directory))
    settings = get_settings()
    with surveyed_run(directory, model, uuid.uuid4().hex, block_bytes=settings.block_bytes,
                      allow_gaps=allow_gaps,
                      max_decoded_bytes=settings.max_decoded_bytes) as survey:
        checkpoints, datasets = survey.checkpoints, survey.datasets
    paths = run_files(checkpoints)
    return DryRun(str(directory), str(directory / f"{model}.h5"),
                  [c.number for c in checkpoints],
                  [(str(p), p.stat().st_size) for p in paths],
                  [(d.name, d.total, d.mode) for d in datasets], notes)
