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


class BadNameError(ChkqError, ValueError):
    """A name cannot name what it must: a model, job id, path, run id, checkpoint name or
    store URL with a separator, ``..``, NUL, no bucket, an unknown scheme..."""


class RunNotFoundError(ChkqError, FileNotFoundError):
    """The run's output directory does not exist."""


class RunNotADirectoryError(ChkqError, NotADirectoryError):
    """The run's output directory is not a directory."""


class OutputExistsError(ChkqError, FileExistsError):
    """``MODEL.h5`` exists (or appeared while the job ran): it is never overwritten.

    Also raised when a job's temporary output was replaced by another file.
    """


class OutputNotWritableError(ChkqError, PermissionError):
    """The output directory cannot be written (read-only filesystem, no permission)."""


class RunNotReadableError(ChkqError, PermissionError):
    """A run directory or checkpoint directory that chkq may not list (no permission)."""


class OutputWriteError(ChkqError, OSError):
    """Writing the output failed (e.g. the disk is full), naming the file and filesystem.

    Keeps the ``errno`` of the failure (``ENOSPC``, ``EDQUOT``, ``EIO``...).
    """


class NoCheckpointsError(ChkqError, FileNotFoundError):
    """The run directory holds no checkpoint of the model."""


class CheckpointGapError(ChkqError, ValueError):
    """Checkpoint numbers are missing between the first and the last one found."""


class BadCheckpointError(ChkqError, ValueError):
    """A checkpoint cannot be consolidated exactly, naming the file and object at fault.

    Incomplete, unreadable or non-HDF5 files, files whose structure differs,
    symbolic links, virtual or external datasets, a filter nothing decodes,
    rows declared but not stored, references chkq cannot re-point.
    """


class BadMessageError(ChkqError, ValueError):
    """A task message or a job record is malformed or names what its job does not."""


class ForgedRecordError(ChkqError, ValueError):
    """A job record in Redis that this deployment's workers and clients did not write."""


class BadMessageTypeError(BadMessageError, TypeError):
    """A task message's argument has the wrong type (also a TypeError, as Python's own)."""


class JobStateGoneError(ChkqError, FileNotFoundError):
    """A job's records or temporary output are gone (it failed, was cancelled, or expired)."""


class JobNotFoundError(ChkqError, LookupError):
    """No job with this id (or prefix) is in the result backend."""


class JobFailedError(ChkqError, RuntimeError):
    """A job failed with something that is not an exception (a malformed result)."""


class WaitTimeoutError(ChkqError, TimeoutError):
    """A job did not finish within the time its client waited (the job goes on)."""


class EmbeddedClusterError(ChkqError, RuntimeError):
    """The embedded cluster's worker or broker stopped while a job ran."""


class ConfigurationError(ChkqError, ValueError):
    """A setting (an environment variable) has a value chkq cannot use."""


class CheckpointCorruptionError(ChkqError, ValueError):
    """Stored bytes do not match the checkpoint id they claim to rebuild.

    Raised by :class:`chkq.CheckpointLog` when a load rebuilds bytes whose
    SHA-256 differs from the checkpoint id, naming the checkpoint and the
    payload at fault.
    """


class UploadAbortedError(ChkqError, RuntimeError):
    """An upload shared by many processes was aborted (``chkq gc``, a store's lifecycle rule)."""


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


class MergeError(ChkqError, OSError):
    """A piece of the merge could not change the job's temporary output (said plainly)."""


class JobCancelledError(ChkqError, RuntimeError):
    """The job was cancelled (``chkq cancel``) before it finished."""


class RunBusyError(ChkqError, RuntimeError):
    """Another consolidation of the same run is queued or running: a second is refused."""


class JobLostError(ChkqError, RuntimeError):
    """The broker no longer knows the job (Redis restarted without persistence).

    Also raised when the broker stayed unreachable for longer than the grace
    period of ``ConsolidationJob.wait_for_output``.
    """


# ------------------------------------------------------------------ checkpoint log and stores


class FileChangedError(ChkqError, OSError):
    """A checkpoint file changed while it was read (it was still being written)."""


class CheckpointNotFoundError(ChkqError, KeyError):
    """No checkpoint of the run has this id (or none, or several, start with this prefix)."""


class SourceNotFoundError(ChkqError, FileNotFoundError):
    """A checkpoint file to commit does not exist here, or is not a regular file."""


class ParentNotCommittedError(ChkqError, LookupError):
    """The parent named for a commit is not (yet) in the log."""


class UnknownParentError(ParentNotCommittedError, ValueError):
    """The parent named for a commit is no checkpoint of the run (also a ValueError)."""


class AmbiguousParentError(ChkqError, ValueError):
    """The run has several heads: the parent of a commit must be named."""


class NothingToRestoreError(ChkqError, LookupError):
    """The run has no files to restore (or none of the model asked for)."""


class OutputEntryError(ChkqError, ValueError):
    """A run's output entry cannot be used: malformed, refused for its signature, or naming
    an output object where none may lie; the message names the entry's key."""


class OutputCorruptionError(ChkqError, ValueError):
    """A recorded output object is missing, or its size or SHA-256 is not its entry's; the
    message names the object's key."""


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


class StoredBytesMismatchError(ChkqError, OSError):
    """An object's stored bytes are not the local bytes they were sent from (corrupted on
    the way or by the store), as the store's own checksums or a read-back show."""


class StoreNotFoundError(ChkqError, LookupError):
    """The store itself (its bucket or directory) does not exist."""


class StoreAccessError(ChkqError, PermissionError):
    """A store refused the credentials chkq has, or chkq found none to send."""


class SymlinkInStoreError(ChkqError, PermissionError):
    """A symbolic link stands where a store expects a directory or an object."""


#: Failures that are the user's or the data's (a refused run, a changed or forged input, a
#: missing file or store object), not a bug in chkq: workers log them as one WARNING line
#: without a traceback; anything else keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ChkqError, ValueError, LookupError, FileNotFoundError, FileExistsError,
    NotADirectoryError, IsADirectoryError, PermissionError,
)


def is_user_error(kind: type[BaseException] | str) -> bool:
    """Whether exceptions of ``kind`` (a class, or the name of a built-in or chkq class) are
    the user's or the data's mistake rather than a bug (see :data:`USER_ERRORS`)."""
    if isinstance(kind, str):
        import builtins

        found = globals().get(kind, getattr(builtins, kind, None))
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            return False
        kind = found
    return issubclass(kind, USER_ERRORS)


class FollowError(ChkqError, ValueError):
    """A running simulation cannot be followed as asked: the last good version stays."""


class HistoryChangedError(FollowError):
    """A checkpoint a published version holds was rewritten (the simulation restarted)."""
