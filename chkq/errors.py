"""Every exception chkq raises on purpose, under one root, :class:`ChkqError`.

Each also derives from the built-in exception a caller would expect
(``ValueError`` for bad input, ``LookupError`` for something missing,
``OSError`` for the filesystem and stores, ``RuntimeError`` for a job that
could not finish), so ``except ValueError`` keeps working while ``except
ChkqError`` catches everything chkq means to report. All are raised with
one message that names the thing at fault, which is what a task stores in
the result backend and what ``chkq`` prints after ``error:``.
"""

from __future__ import annotations


class ChkqError(Exception):
    """Root of chkq's own exceptions."""


# ------------------------------------------------------------------ consolidation


class CheckpointCorruptionError(ChkqError):
    """Stored bytes do not match the checkpoint id they claim to rebuild.

    Raised by :class:`chkq.CheckpointLog` when a load rebuilds bytes whose
    SHA-256 differs from the checkpoint id, naming the checkpoint and the
    payload at fault.
    """


class OutputMismatchError(ChkqError, ValueError):
    """The written output differs from its checkpoints (a row) or its template (structure)."""


class CheckpointChangedError(ChkqError, ValueError):
    """A checkpoint file changed (size, times, inode) or was replaced after planning."""


class SymlinkInRunError(CheckpointChangedError, OSError):
    """A symbolic link stands where a run's file or directory is opened (none is followed).

    Also an ``OSError``, like the failed ``open`` it reports, so that cleanup
    code that tolerates filesystem errors tolerates it too.
    """


class UnprovenJobError(ChkqError, RuntimeError):
    """A job's records do not prove its output: it is not published."""


class PoisonMessageError(ChkqError, RuntimeError):
    """A task message was delivered too many times: it keeps killing its worker."""


class JobInterruptedError(ChkqError, RuntimeError):
    """A step of a job was terminated from outside (revoked, or cancelled on a broker loss)."""


class JobCancelledError(ChkqError, RuntimeError):
    """The job was cancelled (``chkq cancel``) before it finished."""


class JobLostError(ChkqError, RuntimeError):
    """The broker no longer knows the job (Redis restarted without persistence).

    Also raised when the broker stayed unreachable for longer than the grace
    period of ``ConsolidationJob.wait_for_output``.
    """


# ------------------------------------------------------------------ checkpoint log and stores


class FileChangedError(ChkqError, OSError):
    """A checkpoint file changed while it was read (it was still being written)."""


class ParentNotCommittedError(ChkqError, LookupError):
    """The parent named for a commit is not (yet) in the log."""


class NothingToRestoreError(ChkqError, LookupError):
    """The run has no files to restore (or none of the model asked for)."""


class DeltaError(ChkqError, ValueError):
    """A delta cannot be made (inputs too large) or decoded (corrupt or wrong base)."""


class LogKeyError(ChkqError, ValueError):
    """A log signing or trusted key file that cannot be used; the message names the file."""


class InvalidKeyError(ChkqError, ValueError):
    """A store key is not a clean ``/``-separated relative name."""


class TransientStoreError(ChkqError, OSError):
    """A store operation kept failing with transient errors after all retries.

    Callers (e.g. Celery commit tasks) may retry later; nothing was left
    half-written, because every store write is atomic.
    """


class StoreNotFoundError(ChkqError, LookupError):
    """The store itself (its bucket or directory) does not exist."""


class SymlinkInStoreError(ChkqError, PermissionError):
    """A symbolic link stands where a store expects a directory or an object."""
