"""Object stores for the checkpoint log.

A store is a minimal key/value object store with atomic replace and atomic
create-if-absent (see :class:`CheckpointStore`).  Backends: a local or
shared directory, Amazon S3 (and S3-compatible services), Google Cloud
Storage, and an in-process store for tests.  The cloud backends are imported
lazily, so that using the local store does not import boto3 or
google-cloud-storage.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from chkq.stores.base import CheckpointStore, InvalidKeyError, TransientStoreError
from chkq.stores.local import LocalDirectoryStore
from chkq.stores.memory import MemoryStore
from chkq.stores.url import open_store

if TYPE_CHECKING:
    from chkq.stores.gcs import GCSStore
    from chkq.stores.s3 import S3Store

__all__ = [
    "CheckpointStore",
    "GCSStore",
    "InvalidKeyError",
    "LocalDirectoryStore",
    "MemoryStore",
    "S3Store",
    "TransientStoreError",
    "open_store",
]

_LAZY = {"S3Store": "chkq.stores.s3", "GCSStore": "chkq.stores.gcs"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chkq.stores' has no attribute {name!r}")
    return getattr(import_module(module), name)
