"""Store URLs: parsed and percent-decoded here, exactly once, and nowhere else.

A store URL arrives in task messages, which are untrusted input. If one
piece of code checked the URL's path while another opened a differently
decoded path (``file:///allowed/%2E%2E/outside`` is ``/allowed/%2E%2E/outside``
before decoding and ``/outside`` after), a check could approve one
directory while the store used another. So :func:`parse_store_url` is the
only place that splits and decodes a URL: it returns a :class:`StoreLocation`
whose ``local_root`` (for ``file://``) is the decoded path resolved with
``realpath`` (no symbolic link, no ``..`` left), and that same object is
what gets checked against ``CHKQ_ALLOWED_ROOTS`` and what opens the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from chkq.errors import BadNameError
from chkq.stores.base import CheckpointStore
from chkq.stores.retry import StoreTimeouts

__all__ = ["StoreLocation", "open_store", "parse_store_url"]

SCHEMES = ("file", "memory", "s3", "gs")

LOCAL_HOSTS = ("", "localhost")
"""Hosts a ``file://`` URL may name: a file URL for another host is not ours to open."""


@dataclass(frozen=True)
class StoreLocation:
    """Where a store URL points, after one parse and one decode.

    Attributes
    ----------
    url
        The URL as given (for messages).
    scheme
        ``file``, ``memory``, ``s3`` or ``gs`` (lower case).
    local_root
        For ``file`` URLs, the decoded absolute path resolved with
        ``os.path.realpath`` (symbolic links and ``..`` gone); None otherwise.
        This is the directory the store uses, and the one to check against
        the allowed roots.
    bucket
        The bucket of ``s3``/``gs`` URLs, or the name of a ``memory`` store.
    prefix
        The decoded key prefix of ``s3``/``gs`` URLs ("" otherwise).
    """

    url: str
    scheme: str
    local_root: Path | None = None
    bucket: str = ""
    prefix: str = ""

    def open(self, *, must_exist: bool = False,
             timeouts: StoreTimeouts | None = None) -> CheckpointStore:
        """Return the store at this location.

        Parameters
        ----------
        must_exist
            For a ``file`` store, refuse to create its directory: every
            operation on a store whose directory is missing raises
            FileNotFoundError naming the store (what read-only commands
            want). Without it the directory is created on the first write,
            and reads of a missing directory find nothing. Ignored by the
            other schemes.
        timeouts
            Waits of an S3 or GCS store (default: the environment's); ignored by the others.
        """
        if self.scheme == "file":
            from chkq.stores.local import LocalDirectoryStore

            assert self.local_root is not None
            return LocalDirectoryStore(self.local_root, must_exist=must_exist)
        if self.scheme == "memory":
            from chkq.stores.memory import MemoryStore

            return MemoryStore(self.bucket)
        if self.scheme == "s3":
            from chkq.stores.s3 import S3Store

            return S3Store(self.bucket, self.prefix, timeouts=timeouts)
        from chkq.stores.gcs import GCSStore

        return GCSStore(self.bucket, self.prefix, timeouts=timeouts)


def _local_path(url: str, netloc: str, raw_path: str) -> Path:
    """Decode and resolve the path of a ``file`` URL (see :func:`parse_store_url`)."""
    if netloc.lower() not in LOCAL_HOSTS:
        raise BadNameError(
            f"file store URL {url!r} names host {netloc!r}: only file:///abs/dir "
            "(or file://localhost/abs/dir) is a local directory"
        )
    # Bytes, then the file system's decoding: the exact inverse of Path.as_uri(),
    # so that any file name (not only UTF-8 ones) round-trips.
    decoded = unquote_to_bytes(raw_path)
    if b"\x00" in decoded:
        raise BadNameError(f"file store URL {url!r} contains a NUL byte")
    if not decoded.startswith(b"/"):
        raise BadNameError(
            f"file store URL {url!r} must name an absolute path, as file:///abs/dir")
    return Path(os.path.realpath(os.fsdecode(decoded)))


def parse_store_url(url: str) -> StoreLocation:
    """Split and decode a store URL, once, into a :class:`StoreLocation`.

    Parameters
    ----------
    url
        ``file:///abs/dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``
        or ``memory://name``.

    Raises
    ------
    ValueError
        For a value that is not a string, an unknown scheme, a query or
        fragment, a NUL byte, a ``file`` URL naming a host other than
        localhost or a relative path, or a missing bucket; the message names
        the URL.
    """
    if not isinstance(url, str):
        raise BadNameError(f"a store URL must be a string, got {type(url).__name__}")
    if "\x00" in url:
        raise BadNameError(f"store URL {url!r} contains a NUL byte")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise BadNameError(
            f"unsupported store URL {url!r}: expected one of "
            + ", ".join(f"{s}://..." for s in SCHEMES)
        )
    if parts.query or parts.fragment:
        raise BadNameError(f"store URL {url!r} must not have a query or fragment")
    if scheme == "file":
        return StoreLocation(url, scheme, local_root=_local_path(url, parts.netloc, parts.path))
    if scheme == "memory":
        name = (parts.netloc + parts.path).strip("/")
        if not name:
            raise BadNameError(f"memory store URL {url!r} needs a name, as memory://name")
        return StoreLocation(url, scheme, bucket=name)
    if not parts.netloc:
        raise BadNameError(f"store URL {url!r} needs a bucket, as {scheme}://bucket/prefix")
    prefix = unquote(parts.path, errors="strict")
    if "\x00" in prefix:
        raise BadNameError(f"store URL {url!r} contains a NUL byte")
    return StoreLocation(url, scheme, bucket=parts.netloc, prefix=prefix.strip("/"))


def open_store(url: str, *, must_exist: bool = False,
               timeouts: StoreTimeouts | None = None) -> CheckpointStore:
    """Return the store named by ``url``.

    Parameters
    ----------
    url
        ``file:///abs/dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``
        or ``memory://name``.  S3 and GCS settings (endpoint, region,
        credentials, emulator) come from the environment, so that a URL is
        all a worker on another machine needs.  Opening a store never
        writes anything.
    must_exist
        See :meth:`StoreLocation.open`: read-only commands pass True, so
        that a mistyped ``file://`` directory is an error, not an empty log.
    timeouts
        Waits of an S3 or GCS store; default: the environment's ``CHKQ_STORE_*``
        (:meth:`chkq.stores.retry.StoreTimeouts.from_env`).

    Raises
    ------
    ValueError
        As :func:`parse_store_url`.
    """
    return parse_store_url(url).open(must_exist=must_exist, timeouts=timeouts)
