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
"""

from __future__ import annotations

import sys

from chkq.errors import DeltaError  # noqa: F401 (re-exported)

if sys.version_info >= (3, 14):
    from compression import zstd
    from compression.zstd import CompressionParameter, DecompressionParameter, ZstdDict
else:
    from backports import zstd
    from backports.zstd import CompressionParameter, DecompressionParameter, ZstdDict

__all__ = [
    "MAX_WINDOW_LOG",
    "DeltaError",
    "compress_full",
    "decode",
    "decompress_full",
    "encode",
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


def decode(delta: bytes, base: bytes) -> bytes:
    """Rebuild the bytes encoded by :func:`encode` against the same ``base``.

    Raises
    ------
    DeltaError
        If the frame is damaged or was not made against ``base``.
    """
    try:
        return zstd.decompress(
            delta,
            zstd_dict=ZstdDict(base, is_raw=True).as_prefix,
            options={DecompressionParameter.window_log_max: MAX_WINDOW_LOG},
        )
    except zstd.ZstdError as exc:
        raise DeltaError(f"cannot decode delta: {exc}") from exc


def compress_full(data: bytes, *, level: int = FULL_LEVEL) -> bytes:
    """Compress a whole checkpoint as one checksummed zstd frame."""
    return zstd.compress(
        data,
        options={
            CompressionParameter.compression_level: level,
            CompressionParameter.checksum_flag: 1,
        },
    )


def decompress_full(payload: bytes) -> bytes:
    """Inverse of :func:`compress_full`.

    Raises
    ------
    DeltaError
        If the frame is damaged.
    """
    try:
        return zstd.decompress(payload)
    except zstd.ZstdError as exc:
        raise DeltaError(f"cannot decompress payload: {exc}") from exc
