"""Writers of a shared upload's parts in other processes (spawned: importable, picklable).

Each takes the store's URL, the upload's token as its record and its jobs as plain data,
and hands back plain data, as a task on another machine would.
"""

from __future__ import annotations

import random
from typing import Any

from chkq.stores import open_store
from chkq.stores.base import ObjectVersion
from chkq.stores.shared_upload import PartRecord, SharedUpload


def built(seed: int, size: int) -> bytes:
    """The bytes a ``put`` job of ``seed`` and ``size`` writes."""
    return random.Random(seed).randbytes(size)


def write_parts(url: str, token: dict[str, Any], jobs: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """Put or copy each job's part of the upload; the parts' records."""
    store = open_store(url)
    upload = SharedUpload.from_record(token)
    records = []
    for job in jobs:
        if job["kind"] == "put":
            part = store.put_part(upload, job["number"], built(job["seed"], job["size"]),
                                  job["offset"])
        else:
            part = store.copy_part(upload, job["number"], job["source"],
                                   ObjectVersion(*job["pinned"]), job["start"],
                                   job["length"], job["offset"])
        records.append(part.to_record())
    return records


def complete_parts(url: str, token: dict[str, Any], records: list[dict[str, Any]]) -> bool:
    """Complete the upload from the parts' records."""
    store = open_store(url)
    parts = sorted((PartRecord.from_record(r) for r in records), key=lambda p: p.number)
    return store.complete_shared_upload(SharedUpload.from_record(token), parts)
