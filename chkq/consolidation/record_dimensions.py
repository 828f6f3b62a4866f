"""Records of one dimension kept aligned: datasets that share one, and the rows a file lacks.

netCDF-4 record variables of one unlimited dimension may differ in length
within a file; concatenated as they are, a shorter one's later records
would shift against the others'. So, as ``ncrcat`` does, each file but
the run's last gives its shorter ones fill-value rows up to the longest
(:func:`record_padding`), checked to be exact before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from h5py import h5a, h5d, h5ds, h5f, h5i

from chkq.consolidation.checkpoint_files import UNWRITTEN_SLACK, FileScan, open_checkpoint_id
from chkq.consolidation.h5types import element_count, has_reference, is_variable
from chkq.consolidation.rowio import fill_element
from chkq.consolidation.vlen import is_vlen_string, string_fill
from chkq.errors import BadCheckpointError

#: How netCDF-4 names a dimension scale that is not a variable (its length means nothing:
#: netCDF-C leaves it at 0 and takes an unlimited dimension's length from its variables).
_NETCDF_PHONY_SCALE = b"This is a netCDF dimension but not a netCDF variable"


def record_groups(fid: h5f.FileID, names: list[str]) -> dict[str, list[str]]:
    """Extensible datasets that share an extensible dimension scale on their first axis.

    Keyed by the scale's name; the members are the datasets attached to it
    on axis 0 (``DIMENSION_LIST``) and the scale itself when it is one of
    ``names`` and a variable (not netCDF-4's stand-in for a dimension
    without a coordinate variable). Their rows are records of one dimension:
    row ``i`` of each belongs with row ``i`` of the others (netCDF-4's
    unlimited dimensions, ``h5py``'s ``dims``). An attachment HDF5 cannot
    read is left out (the output keeps the template's attributes as they are).
    """
    extensible = set(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
        scales: list[h5d.DatasetID] = []
        try:
            if h5ds.get_num_scales(dsid, 0) > 0:
                h5ds.iterate(dsid, 0, scales.append)
        except (ValueError, RuntimeError, OSError, KeyError, TypeError):
            continue
        for scale in scales:
            scale_name = (h5i.get_name(scale) or b"").decode("utf-8", "surrogateescape")
            scale_name = scale_name.lstrip("/")
            if scale_name not in extensible:
                continue
            members = groups.setdefault(scale_name, [])
            if not members and not _phony_scale(scale):
                members.append(scale_name)
            if name not in members:
                members.append(name)
    return {scale: members for scale, members in groups.items() if len(members) > 1}


def _phony_scale(scale: h5d.DatasetID) -> bool:
    """Whether a dimension scale is netCDF-4's stand-in for a dimension with no variable."""
    try:
        if not h5a.exists(scale, b"NAME"):
            return False
        attr = h5a.open(scale, b"NAME")
        value = np.zeros((), dtype=f"S{max(1, attr.get_type().get_size())}")
        attr.read(value, mtype=attr.get_type())
    except (ValueError, RuntimeError, OSError, KeyError, TypeError):
        return False
    return bytes(value).startswith(_NETCDF_PHONY_SCALE)


def record_padding(reference: Path, scans: list[FileScan], template: int | None = None,
                   open_file: Callable[[int], int] | None = None) -> dict[str, dict[int, int]]:
    """Rows of fill value each file's shorter records of a dimension get, keeping records aligned.

    A netCDF-4 file may hold record variables of different lengths (the
    unlimited dimension's length is the longest's; readers see the missing
    records of the others as their fill value). Concatenated one by one, a
    shorter variable in any file but the run's last would have its later
    records shifted against the other variables of its dimension. So, as
    ``ncrcat`` does, in every file but the last each dataset of a record
    group (:func:`record_groups`, the template's, open as ``template``) is
    given as many rows as the group's longest there: the rows it lacks are
    its fill value (:func:`chkq.consolidation.rowio.read_padded`). The run's
    last file keeps its rows as they are (readers of the output see its
    missing records as the fill value, as in the file).

    ``open_file(i)`` opens file ``i`` of ``scans`` as planned (its stamp
    checked) and returns a descriptor, closed here once the file is
    checked; without it, files are opened by path.

    Returns
    -------
    Per dataset, per file index, the rows of fill value that file provides
    after its own (only where there are any).

    Raises
    ------
    BadCheckpointError
        Naming the file, the dimension and each dataset's rows where padding
        cannot be exact: a dataset of variable-length data or references, one
        with no fill value (or another than the template's), or more padding
        than :data:`UNWRITTEN_SLACK` bytes in one file.
    """
    fid = open_checkpoint_id(reference, template)
    try:
        groups = record_groups(fid, scans[0].extensible)
        fills: dict[str, bytes] = {}
        padding: dict[str, dict[int, int]] = {}
        for index, scan in enumerate(scans[:-1]):
            for scale, members in groups.items():
                counts = {name: scan.rows.get(name, 0) for name in members}
                longest = max(counts.values())
                for name, count in counts.items():
                    if count == longest:
                        continue
                    shown = ", ".join(f"'/{n}' {c}" for n, c in counts.items())
                    where = (f"checkpoint file {str(scan.path)!r} holds records of dimension "
                             f"'/{scale}' in datasets of different lengths ({shown} rows)")
                    if name not in fills:
                        fills[name] = _padding_fill(fid, name, where)
                    padding.setdefault(name, {})[index] = longest - count
        files_padded = sorted({f for pads in padding.values() for f in pads})
    finally:
        fid.close()
    for index in files_padded:
        scan = scans[index]
        pads = {name: rows[index] for name, rows in padding.items() if index in rows}
        _check_padding(scan, pads, fills, open_file(index) if open_file else None)
    return padding


def _padding_fill(fid: h5f.FileID, name: str, where: str) -> bytes:
    """The template's fill value of dataset ``name``, which its missing records get."""
    dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
    tid = dsid.get_type()
    if (is_variable(tid) and not is_vlen_string(tid)) or has_reference(tid):
        raise BadCheckpointError(
            f"{where}: '/{name}' holds variable-length data other than strings, or "
            "references, which chkq cannot give fill-value records to keep them aligned "
            "with the others")
    try:
        return _fill_bytes(dsid)
    except ValueError as exc:
        raise BadCheckpointError(
            f"{where}: '/{name}' cannot be given fill-value records to keep it aligned with "
            f"the others: {exc}") from None


def _fill_bytes(dsid: h5d.DatasetID) -> bytes:
    """A dataset's fill value: its bytes, or the string a variable-length string one has.

    Raises
    ------
    ValueError
        As :func:`chkq.consolidation.rowio.fill_element`.
    """
    if is_vlen_string(dsid.get_type()):
        return b"string:" + string_fill(dsid)
    return fill_element(dsid)


def _check_padding(scan: FileScan, pads: dict[str, int], fills: dict[str, bytes],
                   fd: int | None) -> None:
    """Refuse padding file ``scan`` cannot give exactly: another fill value, or too many bytes."""
    fid = open_checkpoint_id(scan.path, fd)
    try:
        total = 0
        for name, rows in pads.items():
            dsid = h5d.open(fid, name.encode("utf-8", "surrogateescape"))
            total += rows * dsid.get_type().get_size() * element_count(dsid.shape[1:])
            try:
                mine = _fill_bytes(dsid)
            except ValueError as exc:
                mine = str(exc).encode()
            if mine != fills[name]:
                raise BadCheckpointError(
                    f"dataset '/{name}' of checkpoint file {str(scan.path)!r} lacks {rows} "
                    "records of its dimension, which would be its fill value, but its fill "
                    "value is not the template's: chkq cannot align its records exactly")
        if total > UNWRITTEN_SLACK:
            raise BadCheckpointError(
                f"checkpoint file {str(scan.path)!r} lacks {total} bytes of records its "
                f"dimensions' longest datasets have (at most {UNWRITTEN_SLACK} bytes of rows "
                "may be unwritten in a file): the file is damaged or forged")
    finally:
        fid.close()
        if fd is not None:
            os.close(fd)


def padded_offsets(name: str, scans: list[FileScan],
                   padding: dict[str, dict[int, int]]) -> list[int]:
    """:func:`chkq.consolidation.plan.offsets_of`, each file's fill-value records included."""
    pads = padding.get(name, {})
    offsets = [0]
    for index, scan in enumerate(scans):
        offsets.append(offsets[-1] + scan.rows[name] + pads.get(index, 0))
    return offsets
