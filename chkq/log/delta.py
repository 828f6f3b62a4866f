"""The delta codec: zstd "patch-from" with the base checkpoint as a raw prefix.

A delta is a plain zstd frame compressed with the base bytes loaded as a
raw-content prefix (``ZstdDict(base, is_raw=True).as_prefix``) and long
distance matching, with a window covering base and target, so that
unchanged regions anywhere in a large checkpoint become cheap matches into
the base.  (The ``zstandard`` package's raw dictionaries do not find these
matches; the standard-library API of Python 3.14, or its ``backports.zstd``
backport on older Pythons, does.)  Frames carry zstd's content checksum, so
a damaged payload usually fails in decoding before the SHA-256 check.

Full payloads are zstd frames too (:func:`compress_full`), at a fast level:
checkpoints are mostly numbers, and the commit rate matters more than a few
percent of space.

Payloads are store content, so a frame may be a decompression bomb (32 KiB
that expand to 1 GiB): every decoder here takes the number of bytes the
caller expects and never produces more than one byte beyond it (zstd's
streaming decompressor with ``max_length``), so memory is bounded by what the
record declares, not by what the frame says.  A payload holds exactly one
frame; trailing data is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from chkq.errors import DeltaError  # noqa: F401 (re-exported)

if sys.version_info >= (3, 14):
    from compression import zstd
    from compression.zstd import (
        CompressionParameter,
        DecompressionParameter,
        ZstdDecompressor,
        ZstdDict,
    )
else:
    from backports import zstd
    from backports.zstd import (
        CompressionParameter,
        DecompressionParameter,
        ZstdDecompressor,
        ZstdDict,
    )

__all__ = [
    "MAX_WINDOW_LOG",
    "DeltaError",
    "compress_bound",
    "compress_full",
    "decode",
    "decompress_full",
    "encode",
    "iter_full",
]

MAX_WINDOW_LOG = 31
"""zstd's largest window on 64-bit builds: base plus target must fit in 2 GiB."""

MIN_WINDOW_LOG = 27
DELTA_LEVEL = 1
FULL_LEVEL = 1


def _window_log(total: int) -> int:
    return max(MIN_WINDOW_LOG, max(total - 1, 1).bit_length())


def encode(new: bytes, base: bytes, *, level: int = DELTA_LEVEL) -> bytes:
    """Return a delta that rebuilds ``new`` from ``base``.

    Parameters
    ----------
    new
        The bytes to encode.
    base
        The bytes the decoder will have; both must fit in zstd's 2 GiB window.
    level
        zstd compression level (1 is fast and, for patch-from, about as small).

    Raises
    ------
    DeltaError
        If ``len(base) + len(new)`` exceeds the largest zstd window; callers
        then store the bytes whole.
    """
    window = _window_log(len(base) + len(new))
    if window > MAX_WINDOW_LOG:
        raise DeltaError(
            f"cannot delta-encode {len(new)} bytes against {len(base)}: "
            f"beyond zstd's {1 << MAX_WINDOW_LOG}-byte window"
        )
    options: dict[int, int] = {
        CompressionParameter.compression_level: level,
        CompressionParameter.window_log: window,
        CompressionParameter.enable_long_distance_matching: 1,
        CompressionParameter.checksum_flag: 1,
    }
    return zstd.compress(new, options=options, zstd_dict=ZstdDict(base, is_raw=True).as_prefix)


def decode(delta: bytes, base: bytes, size: int) -> bytes:
    """Rebuild the ``size`` bytes encoded by :func:`encode` against the same ``base``.

    Raises
    ------
    DeltaError
        If the frame is damaged, was not made against ``base``, or does not
        decode to exactly ``size`` bytes (never more than ``size + 1`` are
        produced).
    """
    try:
        decompressor = ZstdDecompressor(
            zstd_dict=ZstdDict(base, is_raw=True).as_prefix,
            options={DecompressionParameter.window_log_max: MAX_WINDOW_LOG},
        )
        return _bounded(decompressor, delta, size)
    except zstd.ZstdError as exc:
        raise DeltaError(f"cannot decode delta: {exc}") from exc


def _bounded(decompressor: ZstdDecompressor, frame: bytes, size: int) -> bytes:
    """Decompress one whole frame that must hold exactly ``size`` bytes."""
    data = decompressor.decompress(frame, max_length=size + 1)
    if len(data) > size:
        raise DeltaError(f"payload expands beyond its declared {size} bytes")
    _check_end(decompressor)
    if len(data) != size:
        raise DeltaError(f"payload holds {len(data)} bytes, its record declares {size}")
    return data


def _check_end(decompressor: ZstdDecompressor) -> None:
    if not decompressor.eof:
        raise DeltaError("payload is truncated (the zstd frame does not end)")
    if decompressor.unused_data:
        raise DeltaError("payload has data after its zstd frame")


def compress_bound(size: int) -> int:
    """Most bytes a zstd frame of ``size`` bytes takes (zstd's ``ZSTD_COMPRESSBOUND``, plus
    room for the frame header and checksum): a larger head copy is not one."""
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < 128 << 10 else 0) + 64


def compress_full(data: bytes, *, level: int = FULL_LEVEL) -> bytes:
    """Compress a whole checkpoint as one checksummed zstd frame."""
    return zstd.compress(
        data,
        options={
            CompressionParameter.compression_level: level,
            CompressionParameter.checksum_flag: 1,
        },
    )


def decompress_full(payload: bytes, size: int) -> bytes:
    """Inverse of :func:`compress_full` for a checkpoint of ``size`` bytes.

    Raises
    ------
    DeltaError
        If the frame is damaged or does not hold exactly ``size`` bytes (at
        most ``size + 1`` are ever produced).
    """
    try:
        return _bounded(ZstdDecompressor(), payload, size)
    except zstd.ZstdError as exc:
        raise DeltaError(f"cannot decompress payload: {exc}") from exc


def iter_full(payload: bytes, size: int, block: int = 16 << 20) -> Iterator[bytes]:
    """The bytes of a full frame of ``size`` bytes, in blocks of at most ``block``.

    For checks that only hash the bytes (a head copy's), so that memory stays
    one block whatever the declared size.

    Raises
    ------
    DeltaError
        As :func:`decompress_full`, when the block that shows it is reached.
    """
    decompressor = ZstdDecompressor()
    produced = 0
    data = payload
    try:
        while not decompressor.eof:
            if not data and decompressor.needs_input:
                break
            chunk = decompressor.decompress(data, max_length=min(block, size + 1 - produced))
            data = b""
            produced += len(chunk)
            if produced > size:
                raise DeltaError(f"payload expands beyond its declared {size} bytes")
            if not chunk:
                break
            yield chunk
    except zstd.ZstdError as exc:
        raise DeltaError(f"cannot decompress payload: {exc}") from exc
    _check_end(decompressor)
    if produced != size:
        raise DeltaError(f"payload holds {produced} bytes, its record declares {size}")
