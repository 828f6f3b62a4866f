"""A store job's sources deleted on cleanup, as pinned and no other version."""

from __future__ import annotations

from chkq.core_settings import CoreSettings
from chkq.errors import (
    TransientStoreError,
)
from chkq.log import NameEntry
from chkq.staging.listing import StoreRun, open_run_log, open_run_store
from chkq.stores.base import CheckpointStore, ObjectVersion

__all__ = ["delete_sources"]


def delete_sources(run: StoreRun, *, core: CoreSettings | None = None) -> list[str]:
    """Delete the run's source files from the store, each only if it is the version pinned.

    Plain objects: each object of :attr:`StoreRun.objects` still of its
    listed version is deleted; one that changed or is gone is left alone
    and warned of. A log run: payloads and records are never deleted (other
    names, and the run's history, may need them); the run's names of
    these files that stand for the pinned checkpoints are deleted (a signed
    tombstone entry each, so an entry planted again stays deleted), so that
    the names no longer restore, while every checkpoint stays loadable by
    id. Entries that name other checkpoints and names kept in records of
    the old format are left and warned of.

    Returns
    -------
    list of str
        Warnings: what was left in place, and why.
    """
    store = open_run_store(run.store_url, core)
    if run.run_id is not None:
        return _delete_entries(store, run, core)
    warnings = []
    for obj in run.objects:
        try:
            current = store.version(obj.key)
        except KeyError:
            warnings.append(f"{run.url_of(obj.name)}: already gone")
            continue
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(obj.name)}: not deleted: {exc}")
            continue
        if current != ObjectVersion(obj.size, obj.version):
            warnings.append(f"{run.url_of(obj.name)}: changed since the job was planned; "
                            "not deleted")
            continue
        try:
            store.delete(obj.key)
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(obj.name)}: not deleted: {exc}")
    return warnings


def _delete_entries(store: CheckpointStore, run: StoreRun,
                    core: CoreSettings | None) -> list[str]:
    assert run.run_id is not None
    log = open_run_log(store, run.run_id, core, cache_bytes=0)
    pinned = {(obj.name, obj.version) for obj in run.objects}
    names = {obj.name for obj in run.objects}
    warnings = []
    others: dict[str, NameEntry] = {}
    for entry in log.entries():
        if entry.name not in names:
            continue
        if (entry.name, entry.id) not in pinned:
            others[entry.name] = entry
            continue
        if entry.legacy:
            warnings.append(f"{run.url_of(entry.name)}: named in its record (old format); "
                            "the name is kept")
            continue
        try:
            log.delete_name(entry.name, entry.id)
        except (TransientStoreError, OSError) as exc:
            warnings.append(f"{run.url_of(entry.name)}: name entry not deleted: {exc}")
    for name, entry in sorted(others.items()):
        warnings.append(f"{run.url_of(name)}: also names checkpoint {entry.id[:12]}, not the "
                        "one consolidated; that entry is kept")
    return warnings
