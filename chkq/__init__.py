"""chkq: distributed checkpoint workers.

The core library (this package) works without Celery: checkpoint discovery,
the HDF5 consolidation steps, object stores, the checkpoint log and its delta
codec.  ``consolidate_checkpoints`` and ``submit_consolidation`` run those
steps as a Celery canvas; they are imported lazily from :mod:`chkq.workers.client`
so that importing the core never imports Celery.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from chkq.errors import CheckpointCorruptionError, ChkqError

__version__ = "0.1.0"

_LAZY = {
    "consolidate_checkpoints": "chkq.workers.client",
    "submit_consolidation": "chkq.workers.client",
    "submit_commit": "chkq.workers.commit_client",
    "CommitOptions": "chkq.log.transfer",
    "CheckpointLog": "chkq.log",
    "CheckpointRecord": "chkq.log",
    "CheckpointStore": "chkq.stores",
    "LocalDirectoryStore": "chkq.stores",
    "S3Store": "chkq.stores",
    "GCSStore": "chkq.stores",
    "MemoryStore": "chkq.stores",
    "open_store": "chkq.stores",
}

__all__ = ["CheckpointCorruptionError", "ChkqError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chkq' has no attribute {name!r}")
    return getattr(import_module(module), name)
