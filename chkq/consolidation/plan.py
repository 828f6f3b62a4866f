"""The plan of a consolidation job: files, row offsets, and units of work.

The planner scans every checkpoint file once, checks the run, and decides
where each file's rows go in the output and how the copy and verification
are cut into tasks. The plan is kept where only workers write (the result
backend, see ``chkq.jobs``), never in the run directory, whose
owner is not trusted; tasks receive only the job's directory, model and id,
plus a unit number.

Cutting the work
----------------
There is one copy task per extensible dataset, a large dataset cut further
into chunk-aligned row ranges of about ``task_bytes``. A dataset HDF5 must
encode (compressed, checksummed, or of variable length) writes each range
to a part file. A run of more than ``task_files`` files (thousands of small
ones) is copied by batches of files instead, each task covering every
dataset chkq writes as raw bytes, so that no file is opened once per
dataset. Verification runs per file, small files batched up to
``task_bytes`` and ``task_files``.

Units are sized by bytes and by time: the ``task_bytes`` the planner is
given is at most what the slowest node recently moved in the task time
budget (:func:`unit_bytes`), so that a unit's duration is bounded by
construction and the workers' time limits (and the Redis visibility
timeout above them) can be minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.consolidation.stamps import FileStamp
from chkq.consolidation.temporaries import JobFiles
from chkq.errors import BadMessageError
from chkq.rundir import RunDir

if TYPE_CHECKING:  # the plan itself needs no HDF5: clients read it without h5py
    from chkq.consolidation.checkpoint_files import FileScan

PLAN_VERSION = 1
#: Fewest bytes a unit is cut to whatever the measured rate: a node measured absurdly
#: slow (a stall while it was timed) must not cut a job into millions of tasks.
MIN_UNIT_BYTES = 1024 * 1024
#: Library version bounds a plan may name (h5py's ``libver`` values).
LIBVER_NAMES = ("earliest", "v108", "v110", "v112", "v114", "v200", "latest")


@dataclass
class DatasetPlan:
    """Where one extensible dataset's rows come from and go to.

    Attributes
    ----------
    name
        Path of the dataset in every file.
    mode
        ``"raw"``: the output is allocated by the planner and copy tasks
        write its chunks' bytes at ``chunk_offsets`` (uncompressed data of a
        fixed size); ``"chunks"``: copy tasks write chunk-aligned row ranges
        to part files, whose encoded chunks the merge step moves into the
        output unchanged (filtered data of a fixed size); ``"whole"``: the
        merge step copies the rows from the checkpoint files into the
        output (variable-length data, references); no copy task has them.
    offsets
        Output row where each file's rows start, plus the total at the end.
    row_bytes
        Bytes of one row (of the file type).
    element_size
        Bytes of one element of the file type.
    chunk
        The output's chunk shape (the source's).
    chunk_offsets
        Raw mode: file offset of every chunk, in row-major chunk order.
        Chunks mode, in a job spread over the nodes only: the same, as the
        skeleton's chunk index gives it once every chunk is written into it
        (:mod:`chkq.consolidation.encoded_parts`).
    source_chunks
        Raw mode, by file: the file offsets of the source's chunks in row
        order when they hold plain rows with the output's rows per chunk
        (``chkq.consolidation.checkpoint_files.plain_chunks``), else an empty list.
    padding
        ``[file index, rows]`` for each file that provides more rows than it
        stores (records of a dimension its longest dataset has and this one
        lacks, ``chkq.consolidation.record_dimensions.record_padding``): its
        last ``rows`` output rows are the dataset's fill value.
    pipeline
        Chunks mode, when no dataset created anew stores the template's
        filter parameters: the base64 of a small HDF5 file image whose
        ``/data`` is an empty copy of the template's dataset
        (``chkq.consolidation.filter_pipelines.pipeline_image``), in which
        copy tasks encode their chunks; else empty.
    chunk_sizes, chunk_masks, chunk_files, chunk_starts
        Chunks mode, in a job spread over the nodes only, for every chunk in
        row-major order: its stored size and filter mask, and the file
        (index) whose stored chunk it is, moved unchanged, with that chunk's
        offset in the file; file -1 (offset 0) for a chunk encoded again by
        the planning node, whose bytes are the skeleton's.
    """

    name: str
    mode: str
    offsets: list[int]
    row_bytes: int
    chunk: list[int]
    trailing: list[int]
    element_size: int
    chunk_offsets: list[int] = field(default_factory=list)
    source_chunks: list[list[int]] = field(default_factory=list)
    padding: list[list[int]] = field(default_factory=list)
    pipeline: str = ""
    chunk_sizes: list[int] = field(default_factory=list)
    chunk_masks: list[int] = field(default_factory=list)
    chunk_files: list[int] = field(default_factory=list)
    chunk_starts: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def rows_of(self, file_index: int) -> tuple[int, int]:
        """Output rows [start, stop) that file ``file_index`` provides."""
        return self.offsets[file_index], self.offsets[file_index + 1]


@dataclass
class CopyUnit:
    """One copy task's work: output row ranges ``[dataset index, start, stop]``.

    A unit with ``part`` set holds one piece of a ``chunks`` dataset and
    writes it to the job's part file number ``part``.
    """

    pieces: list[list[int]]
    part: int | None = None


@dataclass
class Plan:
    """Everything the tasks of one consolidation job share.

    ``checkpoints`` holds ``[number, path, is_directory]``; ``files`` holds
    ``[path, size, mtime_ns, ctime_ns, inode, device]`` of every file in
    consolidation order, so that tasks can tell a file that changed since
    planning; ``reference_file`` is the final checkpoint's first file, the
    template of the output; ``temp_inode`` identifies the temporary output
    the planner created; ``out_dir_id`` is the run directory's device and
    inode; ``file_digests`` holds each file's
    ``chkq.consolidation.checkpoint_files.FileScan.digest`` ("" where the scan took none);
    ``libver`` holds the library version bounds (h5py's ``libver``) under
    which the output is written (``chkq.consolidation.skeleton.format_bounds``): every
    open of it for writing uses them.
    """

    job_id: str
    model: str
    out_dir: str
    cleanup: bool
    block_bytes: int
    checkpoints: list[list[Any]]
    files: list[list[Any]]
    reference_file: str
    datasets: list[DatasetPlan]
    copy_units: list[CopyUnit]
    verify_units: list[list[int]]
    temp_inode: int = 0
    file_digests: list[str] = field(default_factory=list)
    out_dir_id: list[int] = field(default_factory=list)
    libver: list[str] = field(default_factory=lambda: ["earliest", "latest"])
    version: int = PLAN_VERSION

    @property
    def job(self) -> JobFiles:
        return JobFiles(Path(self.out_dir), self.model, self.job_id)

    def open_run(self) -> RunDir:
        """The run directory, opened without following links and checked to be the planned one.

        ``out_dir_id`` (``[device, inode]`` of the directory the planner
        opened) makes a run directory moved or replaced since planning
        refused, not entered.
        """
        return RunDir.open(self.out_dir, identity=self.out_dir_id or None, exact=True)

    @property
    def total_rows(self) -> int:
        return sum(d.total for d in self.datasets)

    def stamp(self, file_index: int) -> FileStamp:
        """The recorded identity of file ``file_index``."""
        return FileStamp(*self.files[file_index][1:])

    def reference_index(self) -> int:
        """The index in :attr:`files` of the template, :attr:`reference_file`."""
        return next(i for i, f in enumerate(self.files) if f[0] == self.reference_file)

    def file_path(self, file_index: int) -> Path:
        return Path(self.files[file_index][0])

    def file_rows(self, file_index: int) -> int:
        """Rows file ``file_index`` contributes, over all datasets."""
        return sum(d.offsets[file_index + 1] - d.offsets[file_index] for d in self.datasets)

    def to_json(self) -> str:
        # Shallow dicts: dataclasses.asdict deep-copies every list, slow for large runs.
        fields = {**vars(self), "datasets": [vars(d) for d in self.datasets],
                  "copy_units": [vars(u) for u in self.copy_units]}
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        if raw.get("version") != PLAN_VERSION:
            raise BadMessageError(f"plan version {raw.get('version')!r} is not {PLAN_VERSION}")
        raw["datasets"] = [DatasetPlan(**d) for d in raw["datasets"]]
        raw["copy_units"] = [CopyUnit(**u) for u in raw["copy_units"]]
        libver = raw.get("libver", ["earliest", "latest"])
        if (not isinstance(libver, list) or len(libver) != 2
                or not all(bound in LIBVER_NAMES for bound in libver)):
            raise ValueError(f"plan's format bounds {libver!r} are not two of {LIBVER_NAMES}")
        return cls(**raw)


def offsets_of(name: str, scans: list[FileScan]) -> list[int]:
    """Cumulative row offsets of dataset ``name`` over the files, total last."""
    offsets = [0]
    for scan in scans:
        offsets.append(offsets[-1] + scan.rows[name])
    return offsets


def unit_bytes(task_bytes: int, rate: float | None, seconds: float) -> int:
    """Bytes of one unit: at most ``task_bytes`` and what ``rate`` moves in ``seconds``.

    Parameters
    ----------
    task_bytes
        The byte bound of a unit.
    rate
        Bytes per second of the slowest node at this kind of work, as
        measured on recent tasks; None (or not a positive number) when none
        was measured, and then the byte bound alone applies.
    seconds
        The time budget of one unit.

    Returns
    -------
    int
        The bytes per unit, never below :data:`MIN_UNIT_BYTES` (or
        ``task_bytes`` if that is smaller).
    """
    if rate is None or not rate > 0 or rate == float("inf"):
        return task_bytes
    return max(min(task_bytes, MIN_UNIT_BYTES), min(task_bytes, int(rate * seconds)))


def file_batches(sizes: list[int], max_bytes: int, max_files: int) -> list[list[int]]:
    """Cut files (by byte size) into consecutive batches ``[first, stop)``."""
    batches: list[list[int]] = []
    start, acc = 0, 0
    for index, size in enumerate(sizes):
        if index > start and (acc + size > max_bytes or index - start >= max_files):
            batches.append([start, index])
            start, acc = index, 0
        acc += size
    if sizes:
        batches.append([start, len(sizes)])
    return batches


def split_rows(start: int, stop: int, step: int, align: int) -> list[tuple[int, int]]:
    """Cut rows [start, stop) into ranges of about ``step`` rows on ``align`` boundaries."""
    step = max(align, (max(step, 1) // align) * align)
    cuts = [start]
    edge = (start // align + 1) * align if start % align else start + step
    while edge < stop:
        cuts.append(edge)
        edge += step
    cuts.append(stop)
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def dataset_ranges(d: DatasetPlan, task_bytes: int) -> list[tuple[int, int]]:
    """A dataset's rows cut into chunk-aligned ranges of about ``task_bytes``."""
    return split_rows(0, d.total, task_bytes // max(d.row_bytes, 1), d.chunk[0]) if d.total else []


def file_batch_units(
    datasets: list[DatasetPlan], raw: list[int], n_files: int, task_bytes: int, task_files: int
) -> list[CopyUnit]:
    """Raw-mode copy units for runs of many files: each a batch of files, all datasets."""
    units: list[CopyUnit] = []
    sizes = [sum((datasets[i].offsets[f + 1] - datasets[i].offsets[f]) * datasets[i].row_bytes
                 for i in raw) for f in range(n_files)]
    for first, stop in file_batches(sizes, task_bytes, task_files):
        pieces = [[i, datasets[i].offsets[first], datasets[i].offsets[stop]] for i in raw]
        pieces = [p for p in pieces if p[2] > p[1]]
        if sum(sizes[first:stop]) <= task_bytes:
            units += [CopyUnit(pieces)] if pieces else []
            continue
        small = [p for p in pieces if (p[2] - p[1]) * datasets[p[0]].row_bytes <= task_bytes // 4]
        units += [CopyUnit(small)] if small else []
        for i, a, b in (p for p in pieces if p not in small):
            d = datasets[i]
            units += [CopyUnit([[i, lo, hi]])
                      for lo, hi in split_rows(a, b, task_bytes // max(d.row_bytes, 1), d.chunk[0])]
    return units


def cut_copy_units(
    datasets: list[DatasetPlan], n_files: int, task_bytes: int, task_files: int
) -> list[CopyUnit]:
    """Cut the copy into units as the module docstring says."""
    raw = [i for i, d in enumerate(datasets) if d.mode == "raw"]
    if n_files > task_files:
        units = file_batch_units(datasets, raw, n_files, task_bytes, task_files)
    else:
        units = [CopyUnit([[i, lo, hi]]) for i in raw
                 for lo, hi in dataset_ranges(datasets[i], task_bytes)]
    for i, d in enumerate(datasets):
        if d.mode == "chunks":
            for lo, hi in dataset_ranges(d, task_bytes):
                units.append(CopyUnit([[i, lo, hi]], part=len(units)))
    return units


def cut_verify_units(plan_sizes: list[int], task_bytes: int, task_files: int) -> list[list[int]]:
    """Verification units: batches of files ``[first, stop)``."""
    return file_batches(plan_sizes, task_bytes, task_files)
