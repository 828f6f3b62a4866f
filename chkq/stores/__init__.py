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

if TYPE_CHECKING:
    from chkq.stores.base import CheckpointStore, InvalidKeyError, TransientStoreError
    from chkq.stores.gcs import GCSStore
    from chkq.stores.local import LocalDirectoryStore
    from chkq.stores.memory import MemoryStore
    from chkq.stores.s3 import S3Store
    from chkq.stores.url import open_store

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

#: Every name's module, imported on first use: a module of the package (the retry
#: policy the settings read) loads without the stores themselves.
_LAZY = {"S3Store": "chkq.stores.s3", "GCSStore": "chkq.stores.gcs",
         "CheckpointStore": "chkq.stores.base", "InvalidKeyError": "chkq.stores.base",
         "TransientStoreError": "chkq.stores.base", "LocalDirectoryStore": "chkq.stores.local",
         "MemoryStore": "chkq.stores.memory", "open_store": "chkq.stores.url"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chkq.stores' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
