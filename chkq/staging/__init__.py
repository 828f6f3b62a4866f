"""A run whose checkpoints are objects in a store, fetched into a local run directory.

A run may keep its checkpoints in an object store instead of a shared
file system: plain objects under a key prefix (``s3://bucket/prefix/``,
``gs://bucket/prefix/``, ``file:///dir/``) named as a run directory's files
(``MODEL_chkNNNNN.h5`` or ``MODEL_chkNNNNN/<name>.h5``), or the named files of
one run of a checkpoint log. :func:`find_store_run` lists them once and pins
each (its size and the store's version, or a log entry's checkpoint id);
:func:`fetch_objects` writes them into a local directory laid out exactly as
a run directory, so that the consolidation code runs on it unchanged, and
refuses any byte that is not of the pinned version.

Store contents are untrusted: the names chosen are the ones discovery would
see in a run directory (:func:`chkq.consolidation.discovery.checkpoint_pattern`
and its rules for checkpoint directories), so that other objects are ignored
as a run directory's other files are, and no name can put a file outside the
directory it is fetched into. A ``file://`` store is a directory: its
checkpoints are found by :func:`chkq.consolidation.discovery.find_checkpoints`
itself, which refuses symbolic links.
"""

from chkq.staging.cleanup import delete_sources
from chkq.staging.fetching import FETCH_BYTES, FetchedFile, check_room, fetch_objects
from chkq.staging.listing import (
    SourceObject,
    StoreRun,
    checkpoint_member,
    default_output_key,
    find_store_run,
)

__all__ = [
    "FETCH_BYTES",
    "FetchedFile",
    "SourceObject",
    "StoreRun",
    "check_room",
    "checkpoint_member",
    "default_output_key",
    "delete_sources",
    "fetch_objects",
    "find_store_run",
]
