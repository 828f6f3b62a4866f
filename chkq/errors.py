"""Exceptions raised by the chkq core library."""

from __future__ import annotations


class CheckpointCorruptionError(Exception):
    """Stored bytes do not match the checkpoint id they claim to rebuild.

    Raised by :class:`chkq.CheckpointLog` when a load rebuilds bytes whose
    SHA-256 differs from the checkpoint id, naming the checkpoint and the
    payload at fault, and by consolidation when an output row differs from
    the checkpoint file it came from.
    """


class OutputMismatchError(ValueError):
    """A row read back from the written output differs from its checkpoint file."""


class CheckpointChangedError(ValueError):
    """A checkpoint file changed (size, time or inode) after the job was planned."""
