"""Opening a store from its URL."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from chkq.stores.base import CheckpointStore

__all__ = ["open_store"]

SCHEMES = ("file", "memory", "s3", "gs")


def open_store(url: str) -> CheckpointStore:
    """Return the store named by ``url``.

    Parameters
    ----------
    url
        ``file:///abs/dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``
        or ``memory://name``.  S3 and GCS settings (endpoint, region,
        credentials, emulator) come from the environment, so that a URL is
        all a worker on another machine needs.

    Raises
    ------
    ValueError
        For an unknown scheme, a relative or host-qualified ``file`` URL, or
        a missing bucket; the message names the URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unsupported store URL {url!r}: expected one of "
            + ", ".join(f"{s}://..." for s in SCHEMES)
        )
    if parts.query or parts.fragment:
        raise ValueError(f"store URL {url!r} must not have a query or fragment")
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(
                f"file store URL {url!r} must name an absolute path, as file:///abs/dir"
            )
        from chkq.stores.local import LocalDirectoryStore

        return LocalDirectoryStore(unquote(parts.path))
    if scheme == "memory":
        from chkq.stores.memory import MemoryStore

        name = (parts.netloc + parts.path).strip("/")
        if not name:
            raise ValueError(f"memory store URL {url!r} needs a name, as memory://name")
        return MemoryStore(name)
    if not parts.netloc:
        raise ValueError(f"store URL {url!r} needs a bucket, as {scheme}://bucket/prefix")
    prefix = unquote(parts.path).strip("/")
    if scheme == "s3":
        from chkq.stores.s3 import S3Store

        return S3Store(parts.netloc, prefix)
    from chkq.stores.gcs import GCSStore

    return GCSStore(parts.netloc, prefix)
