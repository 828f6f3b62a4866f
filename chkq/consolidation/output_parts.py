"""A consolidated output's bytes as parts of an object assembled in a store.

For a plan whose extensible datasets are all of a fixed-size type, the
output's layout is fixed once the skeleton is written: the skeleton's bytes
(metadata, fixed datasets, filtered chunks encoded again, holes), and over
them each source's raw rows and moved filtered chunks at the addresses the
skeleton allocated (:mod:`chkq.consolidation.encoded_parts` lays out the
filtered ones). So the
output is a sequence of *pieces* — a range of one source file's bytes, or a
range of the skeleton's — that any node can produce without the others:
:func:`output_pieces` lists them from the plan alone, :func:`cut_parts`
groups them into the parts of one upload (a part that is one long source
range is copied by the store itself; any other is built from ranged reads
and sent), and :func:`build_part` produces a built part's bytes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import h5py
from h5py import h5d, h5f

from chkq.consolidation.checkpoint_files import stored_chunks
from chkq.consolidation.encoded_parts import check_moved, moved_pieces
from chkq.consolidation.plan import DatasetPlan, Plan
from chkq.consolidation.skeleton import dataset_mode
from chkq.errors import BadMessageError

#: The smallest part of a multipart upload but the last (S3's limit).
MIN_PART = 5 << 20
#: The most one part may hold (S3's limit for a part and for a ranged copy).
MAX_PART = 5 << 30
#: The most parts one upload may have (S3's limit).
MAX_PARTS = 10_000
#: Bytes of one source range copied by the store as one part: copies spread over the nodes.
COPY_PART_BYTES = 1 << 30
#: The skeleton, as the source of a piece.
SKELETON = -1


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of the output at ``offset``, taken from ``start`` in ``source``.

    ``source`` is a file index of the plan, or :data:`SKELETON` (the
    planner's skeleton, whose bytes are read at the same offset).
    """

    offset: int
    length: int
    source: int
    start: int

    def head(self, length: int) -> Piece:
        return Piece(self.offset, length, self.source, self.start)

    def tail(self, length: int) -> Piece:
        """The piece without its first ``length`` bytes."""
        return Piece(self.offset + length, self.length - length, self.source,
                     self.start + length)

    def to_record(self) -> list[int]:
        return [self.offset, self.length, self.source, self.start]


@dataclass(frozen=True)
class OutputPart:
    """Part ``number`` (from 1) of the output: bytes ``[offset, offset + length)``."""

    number: int
    pieces: tuple[Piece, ...]

    @property
    def offset(self) -> int:
        return self.pieces[0].offset

    @property
    def length(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def copied(self) -> bool:
        """Whether the store copies this part itself: one range of one source."""
        return len(self.pieces) == 1 and self.pieces[0].source != SKELETON

    @property
    def needs_skeleton(self) -> bool:
        """Whether building it reads the skeleton, which only the planning node holds."""
        return any(p.source == SKELETON for p in self.pieces)

    def to_record(self) -> list[list[int]]:
        return [p.to_record() for p in self.pieces]


def eligible(plan: Plan) -> str | None:
    """Why the plan's output cannot be assembled from pieces, or None if it may.

    Every extensible dataset must be of a fixed-size type (raw, or filtered:
    :mod:`chkq.consolidation.encoded_parts` lays out its chunks), with no rows
    padded; whether each file stores a raw one in plain chunks is learnt
    from its chunk index (:func:`chunk_maps`).
    """
    for d in plan.datasets:
        if d.mode not in ("raw", "chunks"):
            return f"dataset /{d.name} is of variable length (its rows go through HDF5)"
        if d.padding:
            return f"dataset /{d.name} has rows padded with its fill value"
    return None


def template_refusal(template: h5py.File) -> str | None:
    """Why a run with this template cannot be assembled from parts, or None if it may.

    Read from the template's metadata only (the first look, before anything
    is fetched): every extensible dataset must be of a fixed-size type, raw
    or filtered (:func:`chkq.consolidation.skeleton.dataset_mode`); the plan
    decides the rest (:func:`eligible`).
    """
    found: list[str] = []

    def visit(name: str, obj: object) -> None:
        if (not found and isinstance(obj, h5py.Dataset) and obj.maxshape
                and obj.maxshape[0] is None and dataset_mode(obj.id) == "whole"):
            found.append(f"dataset /{name} is of variable length")

    template.visititems(visit)
    return found[0] if found else None


def filtered_datasets(template: h5py.File) -> list[str]:
    """The template's extensible datasets of a fixed-size type that are filtered (``chunks``)."""
    found: list[str] = []

    def visit(name: str, obj: object) -> None:
        if (isinstance(obj, h5py.Dataset) and obj.maxshape and obj.maxshape[0] is None
                and dataset_mode(obj.id) == "chunks"):
            found.append(name)

    template.visititems(visit)
    return found


def _grid(d: DatasetPlan) -> tuple[int, int]:
    """Chunks per row of chunks, and bytes of one row of one chunk, of ``d``."""
    tile = d.chunk[1:]
    per_row = math.prod(-(-t // c) for t, c in zip(d.trailing, tile, strict=True))
    return per_row, math.prod(tile) * d.element_size


def chunk_map(plan: Plan, dataset: int, file_index: int, fid: h5f.FileID) -> list[int]:
    """One file's dataset as plain chunks: rows per chunk, then each chunk's offset, row-major.

    Each chunk must be stored, unfiltered, spanning the output's chunk in
    every dimension but the first, and of its full size: a run of rows of
    one of its chunks is then one byte range, as in the output's chunk that
    holds them (whatever either's rows per chunk). Empty for a file that
    provides no rows.

    Raises
    ------
    BadMessageError
        Naming the file and dataset, if a chunk is missing, filtered or of
        another shape or size.
    """
    d = plan.datasets[dataset]
    start, stop = d.rows_of(file_index)
    if stop == start:
        return []
    where = f"dataset /{d.name} of {plan.files[file_index][0]}"
    dsid = h5d.open(fid, d.name.encode())
    dcpl = dsid.get_create_plist()
    chunk = list(dcpl.get_chunk()) if dcpl.get_layout() == h5d.CHUNKED else []
    if chunk[1:] != list(d.chunk[1:]) or dcpl.get_nfilters():
        raise BadMessageError(f"{where} is not stored unfiltered in chunks of the output's "
                              f"{tuple(d.chunk[1:])} in its trailing dimensions")
    per_row, tile_row = _grid(d)
    size = tile_row * chunk[0]
    shape = dsid.shape
    offsets = [chunk[0]]
    for coords, info in stored_chunks(dsid, tuple(chunk), shape):
        if (info is None or info.byte_offset is None or info.size != size
                or info.filter_mask):
            raise BadMessageError(f"{where}: chunk {coords} is not stored as {size} plain bytes")
        offsets.append(int(info.byte_offset))
    if shape[0] != stop - start:
        raise BadMessageError(f"{where} holds {shape[0]} rows where {stop - start} were planned")
    return offsets


def chunk_maps(plan: Plan, open_file: Callable[[int], h5f.FileID]) -> list[list[list[int]]]:
    """Every file's :func:`chunk_map` of every dataset, ``[dataset][file]``.

    ``open_file(index)`` opens file ``index`` of the plan (the caller checks
    it is the file planned); each is opened once and closed. A ``chunks``
    dataset has no map: the chunks the plan moves from each file are checked
    against the file's chunk index instead
    (:func:`chkq.consolidation.encoded_parts.check_moved`).
    """
    maps: list[list[list[int]]] = [[] for _ in plan.datasets]
    claimed = [Counter(d.chunk_files) for d in plan.datasets]
    for f in range(len(plan.files)):
        fid = open_file(f)
        try:
            for i, d in enumerate(plan.datasets):
                if d.mode == "chunks":
                    if check_moved(plan, i, f, fid) != claimed[i][f]:
                        raise BadMessageError(
                            f"dataset /{d.name}: the plan moves chunks of "
                            f"{plan.files[f][0]} into rows it does not provide")
                    maps[i].append([])
                else:
                    maps[i].append(chunk_map(plan, i, f, fid))
        finally:
            fid.close()
    return maps


def _dataset_pieces(d: DatasetPlan, file_index: int, chunks: list[int]) -> list[Piece]:
    """Where file ``file_index``'s rows of ``d`` go, as source ranges, adjacent ones merged.

    ``chunks``: the file's :func:`chunk_map` of ``d``.
    """
    per_chunk = d.chunk[0]
    per_row, tile_row = _grid(d)
    base, stop = d.rows_of(file_index)
    found: list[Piece] = []
    row = 0
    while row < stop - base:
        source_chunk, source_within = divmod(row, chunks[0]) if chunks else (0, 0)
        out_chunk, out_within = divmod(base + row, per_chunk)
        count = min(stop - base - row, chunks[0] - source_within, per_chunk - out_within)
        for j in range(per_row):
            piece = Piece(d.chunk_offsets[out_chunk * per_row + j] + out_within * tile_row,
                          count * tile_row, file_index,
                          chunks[1 + source_chunk * per_row + j] + source_within * tile_row)
            last = found[-1] if found else None
            if (last is not None and last.offset + last.length == piece.offset
                    and last.start + last.length == piece.start):
                found[-1] = Piece(last.offset, last.length + piece.length, file_index,
                                  last.start)
            else:
                found.append(piece)
        row += count
    return found


def output_pieces(plan: Plan, size: int, maps: list[list[list[int]]]) -> list[Piece]:
    """Every byte of the ``size``-byte output, in order: source ranges, and the skeleton between.

    ``maps[dataset][file]`` is that file's :func:`chunk_map` of a raw
    dataset; a ``chunks`` dataset's moved chunks are the plan's
    (:func:`chkq.consolidation.encoded_parts.moved_pieces`).

    Raises
    ------
    BadMessageError
        If the plan is not :func:`eligible`, or its copies overlap or leave the output.
    """
    why = eligible(plan)
    if why is None:
        why = next((f"dataset /{d.name}'s chunks were not laid out" for d in plan.datasets
                    if d.mode == "chunks" and d.total and not d.chunk_files), None)
    if why is not None:
        raise BadMessageError(f"job {plan.job_id}'s output cannot be assembled from parts: {why}")
    copies = sorted([*(p for i, d in enumerate(plan.datasets) if d.mode == "raw"
                       for f in range(len(plan.files)) for p in _dataset_pieces(d, f, maps[i][f])),
                     *(Piece(*moved) for moved in moved_pieces(plan))], key=lambda p: p.offset)
    pieces: list[Piece] = []
    at = 0
    for p in copies:
        if p.offset < at or p.offset + p.length > size:
            raise BadMessageError(f"job {plan.job_id}'s plan copies bytes {p.offset}-"
                                  f"{p.offset + p.length} of its {size}-byte output twice or "
                                  "past its end: refused")
        if p.offset > at:
            pieces.append(Piece(at, p.offset - at, SKELETON, at))
        pieces.append(p)
        at = p.offset + p.length
    if at < size:
        pieces.append(Piece(at, size - at, SKELETON, at))
    return pieces


def cut_parts(pieces: list[Piece], part_bytes: int, *,
              copy_part_bytes: int = COPY_PART_BYTES) -> list[OutputPart]:
    """The parts of one upload of the output ``pieces`` make, numbered from 1.

    A source range of at least a minimum part is copied by the store, in
    parts of at most ``copy_part_bytes``; everything else is gathered into
    built parts of ``part_bytes`` (raised so that there are at most
    :data:`MAX_PARTS`). Every part but the last holds at least
    :data:`MIN_PART` bytes: a built part that would be shorter before a
    copied range takes the range's first bytes.
    """
    total = sum(p.length for p in pieces)
    build = max(part_bytes, MIN_PART, math.ceil(total / (MAX_PARTS // 2)))
    copy_bytes = min(max(copy_part_bytes, build), MAX_PART)
    parts: list[list[Piece]] = []
    current: list[Piece] = []
    held = 0

    def close() -> None:
        nonlocal current, held
        if current:
            parts.append(current)
        current, held = [], 0

    for piece in pieces:
        top_up = MIN_PART - held if current and held < MIN_PART else 0
        if piece.source != SKELETON and piece.length - top_up >= MIN_PART:
            if top_up:
                current.append(piece.head(top_up))
                piece = piece.tail(top_up)
            close()
            count = math.ceil(piece.length / copy_bytes)
            for i in range(count):
                lo, hi = piece.length * i // count, piece.length * (i + 1) // count
                parts.append([piece.tail(lo).head(hi - lo)])
            continue
        while piece.length:
            take = min(piece.length, build - held)
            current.append(piece.head(take))
            held += take
            piece = piece.tail(take)
            if held == build:
                close()
    close()
    if len(parts) > MAX_PARTS:
        raise BadMessageError(f"an output of {total:,} bytes would take {len(parts):,} parts, "
                              f"more than a store's {MAX_PARTS:,}")
    return [OutputPart(n, tuple(p)) for n, p in enumerate(parts, start=1)]


#: Bytes between two ranges of one source that one read takes in rather than two reads.
READ_GAP = 1 << 20


def part_reads(part: OutputPart, gap: int = READ_GAP) -> list[tuple[int, int, int]]:
    """``(source, start, length)`` of the reads that give a built part's source bytes.

    Ranges of one source less than ``gap`` bytes apart are read at once
    (h5py's chunks tile a row's columns: a part's pieces are then short
    ranges, close together), each read at most the part's length plus a gap.
    """
    reads: list[list[int]] = []
    limit = part.length + gap
    for source, start, length in sorted((p.source, p.start, p.length) for p in part.pieces
                                        if p.source != SKELETON):
        last = reads[-1] if reads else None
        if (last is not None and last[0] == source and start - (last[1] + last[2]) <= gap
                and start + length - last[1] <= limit):
            last[2] = max(last[2], start + length - last[1])
        else:
            reads.append([source, start, length])
    return [(source, start, length) for source, start, length in reads]


def build_part(part: OutputPart, read: Callable[[int, int, int], bytes]) -> bytes:
    """The bytes of ``part``, each piece from ``read(source, start, length)``.

    Raises
    ------
    BadMessageError
        If a read gives fewer bytes than asked (a source shorter than planned).
    """
    out = bytearray()
    for piece in part.pieces:
        data = read(piece.source, piece.start, piece.length)
        if len(data) != piece.length:
            what = "the skeleton" if piece.source == SKELETON else f"file {piece.source}"
            raise BadMessageError(f"bytes {piece.start}-{piece.start + piece.length} of {what} "
                                  f"gave {len(data)} bytes: shorter than planned")
        out += data
    return bytes(out)


def parts_from_record(record: object, size: int) -> list[OutputPart]:
    """The parts a job record lists, checked to cover ``[0, size)`` in order (untrusted)."""
    if not isinstance(record, list):
        raise BadMessageError(f"parts record is not a list: {type(record).__name__}")
    parts, at = [], 0
    for number, entry in enumerate(record, start=1):
        if not isinstance(entry, list) or not entry:
            raise BadMessageError(f"part {number} of the record is not a list of pieces")
        pieces = []
        for item in entry:
            if (not isinstance(item, list) or len(item) != 4
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise BadMessageError(f"part {number} has a malformed piece {item!r}")
            offset, length, source, start = item
            if offset != at or length <= 0 or start < 0 or source < SKELETON:
                raise BadMessageError(f"part {number}'s piece {item!r} does not follow byte {at}")
            pieces.append(Piece(offset, length, source, start))
            at += length
        parts.append(OutputPart(number, tuple(pieces)))
    if at != size:
        raise BadMessageError(f"the parts record covers {at} bytes of a {size}-byte output")
    return parts
