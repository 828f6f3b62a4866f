"""The checkpoint log: a content-addressed, delta-compressed, write-once log on object stores.

One run's checkpoints live under ``runs/<run>/`` in a store; each is
identified by the SHA-256 of its bytes.  The package is cut by job:

- :mod:`chkq.log.records`: the stored objects (records, output entries), their
  format versions and the validation of everything read back;
- :mod:`chkq.log.names`: name entries, and how a name's entries decide its content;
- :mod:`chkq.log.keys`: a run's key layout and the one parser of its keys;
- :mod:`chkq.log.reader`: :class:`LogReader`, every validated read of a run
  (what gc and verify use);
- :mod:`chkq.log.checkpoint_log`: :class:`CheckpointLog`, a reader that also
  commits and loads;
- :mod:`chkq.log.gc`: garbage collection, with its argument that no
  interleaving with commits deletes a recorded payload;
- :mod:`chkq.log.verify`: the read-only check of a whole run;
- :mod:`chkq.log.signing`: signed records, name entries and output entries
  (Ed25519) for stores shared with others.

Committing files and restoring runs (name handling, writing files without
following links) is :mod:`chkq.log.transfer`.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chkq.log.checkpoint_log import DEFAULT_CACHE_BYTES, DEFAULT_GC_AGE, CheckpointLog
    from chkq.log.names import NameEntry
    from chkq.log.reader import LogReader
    from chkq.log.records import (
        LOG_FORMAT,
        MAX_CHECKPOINT_ENV,
        RECORD_FORMAT,
        CheckpointRecord,
        OutputEntry,
        check_output_model,
        check_relative_name,
        checkpoint_id,
        default_writer,
        format_created,
        max_checkpoint_bytes,
        model_of_name,
        printable,
        validate_run_id,
    )
    from chkq.log.signing import LogTrust
    from chkq.log.verify import ProgressCallback, VerifyReport

#: Where each name of the package lives: loaded on first use (PEP 562), so that a
#: module that needs one of them (:class:`LogTrust` for the settings) does not load
#: the whole log, its stores and their clients.
_HOMES: dict[str, str] = {
    "CheckpointLog": "chkq.log.checkpoint_log",
    "CheckpointRecord": "chkq.log.records",
    "DEFAULT_CACHE_BYTES": "chkq.log.checkpoint_log",
    "DEFAULT_GC_AGE": "chkq.log.checkpoint_log",
    "LOG_FORMAT": "chkq.log.records",
    "LogReader": "chkq.log.reader",
    "LogTrust": "chkq.log.signing",
    "MAX_CHECKPOINT_ENV": "chkq.log.records",
    "NameEntry": "chkq.log.names",
    "OutputEntry": "chkq.log.records",
    "ProgressCallback": "chkq.log.verify",
    "RECORD_FORMAT": "chkq.log.records",
    "VerifyReport": "chkq.log.verify",
    "check_output_model": "chkq.log.records",
    "check_relative_name": "chkq.log.records",
    "checkpoint_id": "chkq.log.records",
    "default_writer": "chkq.log.records",
    "format_created": "chkq.log.records",
    "max_checkpoint_bytes": "chkq.log.records",
    "model_of_name": "chkq.log.records",
    "printable": "chkq.log.records",
    "validate_run_id": "chkq.log.records",
}

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_GC_AGE",
    "LOG_FORMAT",
    "MAX_CHECKPOINT_ENV",
    "RECORD_FORMAT",
    "CheckpointLog",
    "CheckpointRecord",
    "LogReader",
    "LogTrust",
    "NameEntry",
    "OutputEntry",
    "ProgressCallback",
    "VerifyReport",
    "check_output_model",
    "check_relative_name",
    "checkpoint_id",
    "default_writer",
    "format_created",
    "max_checkpoint_bytes",
    "model_of_name",
    "printable",
    "validate_run_id",
]


def __getattr__(name: str) -> Any:
    """The package's name ``name``, imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
