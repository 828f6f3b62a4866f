"""Datasets whose filters store exactly a template's parameters, and where none can be made.

Chunks moved or encoded for the output must decode like the template's:
a dataset created to encode them (a part file's, or one held in memory)
must store the template's filters with the same parameters. Creating one
with the template's creation properties runs each filter's "set local"
step again, which some plugins use to rewrite their parameters; so the
caller's parameters that give the stored ones are sought
(:func:`recreation_plist`), and where none do, the template's dataset is
copied as stored into a small file image (:func:`pipeline_image`).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
from h5py import h5d, h5f, h5p, h5s, h5t, h5z

from chkq.consolidation.h5types import chunk_options, set_chunk_options
from chkq.errors import BadCheckpointError
from chkq.rundir import fd_path

#: Seconds the trial of a pipeline copied from the template may take (:func:`pipeline_image`).
TRIAL_SECONDS = 60

Filter = tuple[int, int, tuple[int, ...]]

#: The caller's parameters of filters whose "set local" step rewrites them, from the
#: stored ones: bitshuffle and SZ/SZ3 put what they derive (versions, element size, rank
#: and chunk shape) before them; SPERR keeps the first, packs the second (its mode for
#: missing values) into a word of its own (bits 6 to 9) and adds the chunk shape. Tried first,
#: so that :func:`recreation_plist` needs no failing attempt for these.
_CALLER_PARAMETERS: dict[int, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    32008: lambda values: values[3:],                                    # bitshuffle
    32017: lambda values: values[2 + values[0]:] if values else values,  # SZ
    32024: lambda values: values[2 + values[0]:] if values else values,  # SZ3
    32028: lambda values: ((values[1], values[0] >> 6 & 0xF) if len(values) > 1  # SPERR
                           else values),
}


def stored_filters(dcpl: h5p.PropDCID) -> list[Filter]:
    """Each filter of a pipeline as stored: its id, flags and parameters (``cd_values``)."""
    return [(int(code), int(flags), tuple(int(v) for v in values))
            for code, flags, values, _name in (dcpl.get_filter(i)
                                               for i in range(dcpl.get_nfilters()))]


def _with_filters(dcpl: h5p.PropDCID, filters: list[Filter]) -> h5p.PropDCID:
    """A copy of ``dcpl`` whose pipeline is ``filters``, in order, as the caller's parameters."""
    copy = dcpl.copy()
    copy.remove_filter(h5z.FILTER_ALL)
    for code, flags, values in filters:
        copy.set_filter(code, flags, values)
    return copy


def _created_filters(fid: h5f.FileID, tid: h5t.TypeID, space: h5s.SpaceID,
                     dcpl: h5p.PropDCID) -> list[Filter] | None:
    """The pipeline HDF5 stores for a dataset created with ``dcpl`` (None if it refuses it)."""
    try:
        dsid = h5d.create(fid, None, tid, space, dcpl=dcpl)
    except (ValueError, RuntimeError, OSError, KeyError, TypeError):
        return None
    try:
        return stored_filters(dsid.get_create_plist())
    finally:
        dsid.close()


def _local_rest(code: int, values: tuple[int, ...]) -> tuple[int, ...]:
    """The caller's part of a filter's stored parameters, where its set-local step is known."""
    known = _CALLER_PARAMETERS.get(code)
    return values if known is None else tuple(known(values))


def _candidates(code: int, values: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Parameters that may give ``values`` once a filter's "set local" step has run on them.

    The caller's part where the filter is known, then the stored values
    themselves (most filters leave their parameters as they are), then
    every other suffix and prefix of them (a set-local step adds what it
    derives before or after the caller's parameters), each also followed by
    a 0 (an option it leaves at its default and does not store).
    """
    found = [_local_rest(code, values), values]
    found += [values[k:] for k in range(1, len(values) + 1)]
    found += [values[:k] for k in range(len(values) - 1, -1, -1)]
    found += [(*part, 0) for part in found]
    return list(dict.fromkeys(found))


def recreation_plist(source: h5d.DatasetID, where: str) -> h5p.PropDCID:
    """Creation properties under which HDF5 creates a dataset whose filters are ``source``'s.

    A dataset created with ``source``'s own creation properties gets its
    filters' parameters through each filter's "set local" step again; some
    (bitshuffle, SZ, SZ3) rewrite them there (adding versions, the element
    size, the chunk shape before the caller's parameters), so the parameters
    would be applied twice and chunks written under them would not decode
    with ``source``'s. For each filter, in order, parameters are sought
    whose "set local" result is ``source``'s stored ones, by creating
    datasets in a file held in memory and reading back what HDF5 stored
    (the library's own step decides, not a model of it).

    Raises
    ------
    BadCheckpointError
        If no such parameters are found, naming ``where`` (the dataset) and the filter.
    """
    dcpl = source.get_create_plist()
    want = stored_filters(dcpl)
    if not want:
        return dcpl
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fapl_core(backing_store=False)
    scratch = h5f.create(f"chkq-filters-{secrets.token_hex(8)}".encode(), h5f.ACC_EXCL,
                         fapl=fapl)
    try:
        tid = source.get_type()
        extent = source.get_space()
        space = h5s.create_simple((0, *extent.shape[1:]), extent.get_simple_extent_dims(True))
        chosen = [(code, flags, _local_rest(code, values)) for code, flags, values in want]
        if chosen == want and _created_filters(scratch, tid, space, dcpl) == want:
            return dcpl
        # One filter's parameters may make HDF5 refuse the whole pipeline, hiding whether
        # another's are right: each pass fixes what it can, until nothing changes.
        for _ in want:
            for index, (code, flags, values) in enumerate(want):
                got = _created_filters(scratch, tid, space, _with_filters(dcpl, chosen))
                if got is not None and len(got) == len(want) and got[index] == want[index]:
                    continue
                for candidate in _candidates(code, values):
                    trial = [*chosen[:index], (code, flags, candidate), *chosen[index + 1:]]
                    got = _created_filters(scratch, tid, space, _with_filters(dcpl, trial))
                    if got is not None and len(got) == len(want) and got[index] == want[index]:
                        chosen = trial
                        break
            result = _with_filters(dcpl, chosen)
            got = _created_filters(scratch, tid, space, result)
            if got == want:
                return result
        wrong = next((i for i in range(len(want)) if got is None or len(got) != len(want)
                      or got[i] != want[i]), 0)
        raise BadCheckpointError(
            f"{where} uses filter {want[wrong][0]} ({filter_label(dcpl, wrong)}) with "
            f"parameters {list(want[wrong][2])} that the installed plugin's set-local step "
            "does not produce (another version of the plugin wrote them, or they were set "
            "without it): chkq cannot write chunks that decode like the template's")
    finally:
        scratch.close()


def core_file(image: bytes | None = None) -> h5f.FileID:
    """A new HDF5 file held in memory (``image`` its first contents), never written to disk."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fapl_core(backing_store=False)
    name = f"chkq-pipeline-{secrets.token_hex(8)}".encode()
    if image is None:
        return h5f.create(name, h5f.ACC_EXCL, fapl=fapl)
    fapl.set_file_image(image)
    return h5f.open(name, h5f.ACC_RDWR, fapl=fapl)


def pipeline_image(source: Path, fd: int | None, name: str, scratch: int, where: str,
                   want: list[Filter], label: Callable[[int], str]) -> bytes:
    """An HDF5 file image holding ``/data``: dataset ``name`` of ``source``, stored alike, no rows.

    For pipelines no dataset created anew gets (:func:`recreation_plist`
    finds no parameters: another version of a plugin wrote them, or another
    implementation, as netCDF-C's own Blosc filter does). ``H5Ocopy`` copies
    a dataset's object header as stored, its filters' parameters (``want``)
    and chunk options included, without running any filter's set-local
    step; the copy goes to the new, empty file open as ``scratch`` (the
    caller removes it), is shrunk to no rows there (which frees its chunks)
    and copied again into a file held in memory, whose image is a few KiB
    whatever the dataset's size. Copy tasks grow it to encode their chunks
    (:func:`open_pipeline`). HDF5 and a plugin given parameters another
    implementation wrote may fail or corrupt memory on them, so all this,
    and the encoding and decoding of one chunk of zeros, runs in a process
    of its own (:mod:`chkq.consolidation.pipeline_trial`) reading
    ``source`` open as ``fd`` (by name if None): a pipeline it cannot
    encode with is refused now, not in a copy task. ``label(i)`` names
    filter ``i`` in messages.

    Raises
    ------
    BadCheckpointError
        If the filters cannot encode and decode a chunk, naming ``where`` (the dataset).
    """
    opened = str(source) if fd is None else fd_path(fd)
    passed = (scratch,) if fd is None else (fd, scratch)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "chkq.consolidation.pipeline_trial", opened, name,
             fd_path(scratch)],
            capture_output=True, timeout=TRIAL_SECONDS, check=False, pass_fds=passed)
        why = (done.stderr.decode(errors="replace").strip().splitlines()
               or [f"exit status {done.returncode}"])[-1]
        image = done.stdout if done.returncode == 0 else b""
    except subprocess.TimeoutExpired:
        image, why = b"", f"no result in {TRIAL_SECONDS} s"
    if not image:
        named = " and ".join(f"filter {code} ({label(i)}) with parameters {list(values)}"
                             for i, (code, _, values) in enumerate(want))
        raise BadCheckpointError(
            f"{where} uses {named}, which the installed plugins cannot encode a chunk of "
            f"zeros with and decode again ({why}): chkq cannot write chunks that decode like "
            "the template's")
    check = core_file(image)
    try:
        open_pipeline(check, want, where)
    finally:
        check.close()
    return image


def open_pipeline(fid: h5f.FileID, want: list[Filter], where: str) -> h5d.DatasetID:
    """Dataset ``/data`` of a :func:`pipeline_image`, checked to store the filters ``want``.

    Raises
    ------
    BadCheckpointError
        If its filters are not ``want`` (the image is not the one planned for ``where``).
    """
    dsid = h5d.open(fid, b"data")
    got = stored_filters(dsid.get_create_plist())
    if got != want:
        raise BadCheckpointError(f"{where}: the planned copy of its pipeline stores the "
                                 f"filters {got}, not its own {want}")
    return dsid


def filter_label(dcpl: h5p.PropDCID, index: int) -> str:
    """The name a pipeline gives its filter ``index`` ("unnamed" if none)."""
    label = dcpl.get_filter(index)[3]
    text = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
    return text or "unnamed"


def create_extensible(group: h5py.Group, name: str, source: h5py.Dataset,
                      rows: int, filter_edges: bool = False) -> h5py.Dataset:
    """Create ``name`` in ``group`` like ``source`` (type, creation properties), ``rows`` long.

    Used for part files, whose chunks the merge step moves into the output
    as they are stored: so the new dataset's filters must store exactly
    ``source``'s parameters (:func:`recreation_plist`), which is checked.
    With ``filter_edges``, edge chunks are filtered like the others even
    where ``source`` stores them unfiltered (which of the output's chunks
    are edge chunks is decided by the output's extent, not this dataset's).

    Raises
    ------
    BadCheckpointError
        If the filters' parameters cannot be made ``source``'s.
    """
    where = f"dataset {source.name!r}"
    dcpl = recreation_plist(source.id, where)
    if filter_edges and chunk_options(dcpl):
        dcpl = dcpl.copy()
        set_chunk_options(dcpl, 0)
    maxshape = tuple(h5s.UNLIMITED if m is None else m for m in source.maxshape)
    space = h5s.create_simple((rows, *source.shape[1:]), maxshape)
    dsid = h5d.create(group.id, name.encode(), source.id.get_type(), space, dcpl=dcpl)
    got = stored_filters(dsid.get_create_plist())
    want = stored_filters(source.id.get_create_plist())
    if got != want:
        raise BadCheckpointError(f"{where}: HDF5 stored the filters {got} for a copy of it, "
                                 f"not its own {want}")
    return h5py.Dataset(dsid)
