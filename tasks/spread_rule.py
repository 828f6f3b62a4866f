"""When a store job is spread over every node, its output assembled in the store.

A job spread over the nodes needs no node to hold the run; one kept on one
node is faster for a small run, or where the store cannot copy a range
itself. The rule is read here, once, at the stage step: its answer is kept
in the job's store record, and ``chkq status`` shows it.
"""

from __future__ import annotations

import logging

import h5py

from chkq.config.celery_app import get_settings
from chkq.consolidation.mirror import LIST_BLOCK_BYTES, LIST_CACHE_BYTES
from chkq.consolidation.output_parts import filtered_datasets, template_refusal
from chkq.errors import OutputWriteError
from chkq.staging import StoreRun, check_room
from chkq.staging.listing import checkpoint_member
from chkq.stores.fileobj import ObjectFile
from chkq.stores.url import open_store

log = logging.getLogger("chkq.tasks")


def spread_over_nodes(run: StoreRun, destination: tuple[str, str]) -> bool:
    """Whether a store job is spread over every node, its output assembled in the store.

    Only a run of plain objects (a log's checkpoints are delta-compressed:
    no byte of them is a row) published to the store it is in, whose store
    takes parts from many nodes, whose template's extensible datasets are
    all of a fixed-size type, raw or filtered (read from its metadata), and
    which is at least ``CHKQ_SPREAD_BYTES`` or does not fit in this worker's scratch. A store
    that cannot copy ranges itself (GCS) is spread only when the run does
    not fit: every byte then passes through the nodes, once each. So is a
    run with filtered datasets: whether its chunks can be copied as they
    are stored (each file's rows starting on the output's chunk grid) is
    learnt only once planned, and a run whose chunks must almost all be
    encoded again cannot be spread (the staging node would encode them),
    where one node consolidates it when it fits.
    """
    settings = get_settings()
    if run.run_id is not None or destination[0] != run.store_url or not run.objects:
        return False
    try:
        check_room(run, run.objects, settings.scratch_root)
        fits = True
    except OutputWriteError:
        fits = False
    store = open_store(run.store_url, timeouts=settings.core().timeouts)
    if not store.supports_shared_uploads or (fits and (
            run.size < settings.spread_bytes or not store.copies_ranges)):
        return False
    numbered = [(checkpoint_member(run.model, o.name) or (0, False))[0] for o in run.objects]
    last = max(numbered)
    template = next(o for o, n in zip(run.objects, numbered, strict=True) if n == last)
    filtered: list[str] = []
    try:
        with h5py.File(ObjectFile(store, template.key, block_size=LIST_BLOCK_BYTES,
                                  cache_blocks=LIST_CACHE_BYTES // LIST_BLOCK_BYTES), "r") as f:
            why = template_refusal(f)
            filtered = filtered_datasets(f) if why is None and fits else []
    except (OSError, ValueError, KeyError) as exc:
        why = f"its template {run.url_of(template.name)} cannot be read in place ({exc})"
    if filtered:
        # Only the plan knows whether the files' chunks line up with the output's (else
        # they are encoded again, on the staging node, up to a bound): a run this node can
        # consolidate is not risked on it.
        why = (f"dataset /{filtered[0]} is filtered, and a filtered run is spread only when "
               "it does not fit in one node's scratch")
    if why is not None:
        log.info("store run %s is consolidated on one node: %s", run.source, why)
        return False
    return True
