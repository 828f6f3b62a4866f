"""Encoding whole chunks of shuffle + deflate datasets with ISA-L, in HDF5's own format.

HDF5's deflate filter calls zlib's ``compress2``, slow enough to be most of
a gzip run's time. ISA-L writes the same format (a zlib stream, which HDF5's
filter and every other reader inflate) many times faster, with the same
ratio on checkpoint data (figures in docs/performance.md). Chunks
encoded here are written with ``write_direct_chunk`` into a dataset whose
filter pipeline (shuffle, deflate and its level) stays as the template
declares it, so the file is unchanged but for the compressed bytes.

Only encoding is done here. Rows are read, and the output verified,
through HDF5's own filters: a mistake in this module shows up as a
mismatch between the rows copied and the rows HDF5 reads back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from h5py import h5d, h5p, h5z
from isal import isal_zlib

#: ISA-L's levels (0-3) for HDF5's deflate levels 1-9: the faster, the lower.
_ISAL_LEVEL = {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2, 7: 3, 8: 3, 9: 3}


@dataclass(frozen=True)
class ChunkEncoder:
    """Encodes a chunk of rows the way a dataset's shuffle + deflate pipeline would.

    Attributes
    ----------
    element_size
        Bytes per element of the dataset's type (the shuffle's byte planes).
    shuffle
        Whether the pipeline shuffles bytes before deflating.
    level
        The ISA-L level standing for the dataset's deflate level.
    tile
        The chunk's shape beyond the first axis (the dataset's trailing
        shape when chunks span whole rows; smaller when they tile it).
    trailing
        The dataset's shape beyond the first axis.
    """

    element_size: int
    shuffle: bool
    level: int
    tile: tuple[int, ...] = ()
    trailing: tuple[int, ...] = ()

    @classmethod
    def for_dataset(cls, dsid: h5d.DatasetID) -> ChunkEncoder | None:
        """The encoder of ``dsid``'s chunks, or None if its pipeline is not [shuffle,] deflate.

        Any other filter (fletcher32, szip, plugins) or a deflate level of 0
        leave the dataset to HDF5. Chunks may tile the trailing axes: each
        tile is encoded on its own, an edge tile padded with zeros beyond
        the dataset's extent (bytes no reader sees), as HDF5 stores it.
        """
        dcpl = dsid.get_create_plist()
        if dcpl.get_layout() != h5d.CHUNKED:
            return None
        chunk, shape = dcpl.get_chunk(), dsid.shape
        filters = [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())]
        codes = [code for code, _, _ in filters]
        if codes not in ([h5z.FILTER_DEFLATE], [h5z.FILTER_SHUFFLE, h5z.FILTER_DEFLATE]):
            return None
        deflate_values = filters[-1][2]
        level = int(deflate_values[0]) if deflate_values else 6
        if level not in _ISAL_LEVEL:
            return None
        shuffle = codes[0] == h5z.FILTER_SHUFFLE
        shuffle_values = filters[0][2] if shuffle else ()
        element_size = int(shuffle_values[0]) if shuffle_values else int(
            dsid.get_type().get_size())
        return cls(element_size=element_size, shuffle=shuffle, level=_ISAL_LEVEL[level],
                   tile=tuple(int(c) for c in chunk[1:]), trailing=tuple(shape[1:]))

    def encode_rows(self, rows: np.ndarray) -> Iterator[tuple[tuple[int, ...], bytes]]:
        """Each chunk of one row of chunks: its offset along the trailing axes, its stored bytes.

        ``rows`` holds a chunk's rows across the whole trailing shape; the
        chunks come in row-major order of the trailing grid.
        """
        if self.tile == self.trailing:
            yield (0,) * len(self.tile), self.encode(rows)
            return
        grid = [math.ceil(t / c) for t, c in zip(self.trailing, self.tile, strict=True)]
        for coords in np.ndindex(*grid):
            start = tuple(c * t for c, t in zip(coords, self.tile, strict=True))
            part = rows[(slice(None), *(slice(s, s + t) for s, t in zip(start, self.tile,
                                                                        strict=True)))]
            if part.shape[1:] != self.tile:
                padded = np.zeros((len(rows), *self.tile), dtype=rows.dtype)
                padded[(slice(None), *(slice(0, n) for n in part.shape[1:]))] = part
                part = padded
            yield start, self.encode(part)

    def encode(self, rows: np.ndarray) -> bytes:
        """The stored bytes of a whole chunk holding ``rows`` (C-contiguous)."""
        raw: np.ndarray = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        count = raw.size // self.element_size
        if self.shuffle and self.element_size > 1 and count > 1:
            raw = raw.reshape(count, self.element_size).T.copy()
        return isal_zlib.compress(raw.data, self.level)


#: Filters that change values (HDF5 filter ids registered with the HDF Group), by name.
_LOSSY_FILTERS = {32013: "ZFP", 32017: "SZ", 32019: "JPEG", 32022: "BitGroom",
                  32023: "Granular BitRound", 32024: "SZ3"}
#: The short mode word ZFP's stream header gives its reversible (lossless) mode.
_ZFP_REVERSIBLE_MODE = 2176
#: Scale types of HDF5's scale-offset filter (first parameter): integers, else floats.
_SCALEOFFSET_INT = 2
#: SZ and SZ3, whose stored parameters are the dataset's rank, its type code and shape,
#: then the caller's: an error-bound mode and eight words of error bounds (four doubles).
_SZ_FILTERS = (32017, 32024)
_SZ_BOUND_WORDS = 8


def _zero_error_bounds(values: tuple[int, ...]) -> bool:
    """Whether SZ or SZ3 parameters, as stored, set every error bound to 0 (values kept)."""
    if not values:
        return False
    bounds = values[2 + values[0]:][1:1 + _SZ_BOUND_WORDS]
    return len(bounds) == _SZ_BOUND_WORDS and not any(bounds)


def lossy_filter(dcpl: h5p.PropDCID) -> str | None:
    """The name of the first filter in ``dcpl``'s pipeline that does not restore values exactly.

    None if every filter restores them (:func:`lossy_filters`).
    """
    found = lossy_filters(dcpl)
    return next(iter(found.values())) if found else None


def lossy_filters(dcpl: h5p.PropDCID) -> dict[int, str]:
    """The filters of ``dcpl``'s pipeline that do not restore values exactly, by index: names.

    A lossy filter's output depends on where chunk boundaries fall (it
    approximates each chunk's values as a whole), so rows decoded and
    encoded again at other boundaries come back different. Lossy: ZFP but
    in its reversible mode (read from the stream header the filter stores
    as its parameters: a mode it does not spell shortly counts as lossy),
    SZ and SZ3 but with every error bound 0, JPEG, BitGroom and Granular
    BitRound, and HDF5's scale-offset
    filter on floating-point values or on integers with a fixed bit count
    (which drops higher bits).
    """
    found: dict[int, str] = {}
    for i in range(dcpl.get_nfilters()):
        code, _, values, _ = dcpl.get_filter(i)
        if code == h5z.FILTER_SCALEOFFSET:
            if not values or values[0] != _SCALEOFFSET_INT:
                found[i] = "scale-offset on floating-point values"
            elif len(values) > 1 and values[1] != 0:
                found[i] = "scale-offset with a fixed bit count"
        elif code == 32013:
            if len(values) < 4 or values[3] >> 20 != _ZFP_REVERSIBLE_MODE:
                found[i] = "ZFP (fixed-rate, fixed-precision or fixed-accuracy mode)"
        elif code in _SZ_FILTERS:
            if not _zero_error_bounds(values):
                found[i] = _LOSSY_FILTERS[code]
        elif code in _LOSSY_FILTERS:
            found[i] = _LOSSY_FILTERS[code]
    return found
