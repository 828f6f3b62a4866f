"""Every Redis key chkq writes in the result backend, built and parsed in one place.

A key is ``chkq:`` followed by fields joined by ``:``. No field contains the
separator: job ids are hex digits, record names and kinds are lowercase words
with ``-``, task ids are a job id with step names and unit numbers, node names
(``celery@host``) are hash fields, never key fields. So :func:`parse` reads
any key back unambiguously, and a listing of one job's records, or of every
job, is a single pattern.

===================================  ==============================================
key                                  what
===================================  ==============================================
``chkq:job:JOB:info``                the submission (model, directory, time)
``chkq:job:JOB:done``                the result once the output was linked
``chkq:job:JOB:cancelled``           who cancelled the job, and when
``chkq:job:JOB:failed``              the failure, as data (step, type, message)
``chkq:job:JOB:store``               where a store job reads and publishes
``chkq:job:JOB:follow``              the follow whose version the job publishes, and its end
``chkq:job:JOB:fetched``             hash: fetch unit -> what it fetched
``chkq:job:JOB:run``                 a large run's checkpoints, for its scan units
``chkq:job:JOB:scanned``             hash: scan unit -> what it found in its files
``chkq:job:JOB:plan``                the plan (JSON), written once by ``chkq.plan``
``chkq:job:JOB:copied``              hash: copy unit -> its result (digests)
``chkq:job:JOB:merge-items``         hash: merge item -> bytes it moved
``chkq:job:JOB:merged``              the output's stamp once merged and durable
``chkq:job:JOB:verified``            hash: verify unit -> output stamp it verified (rows read)
``chkq:job:JOB:assembly``            a spread store job's upload, output size and parts
``chkq:job:JOB:parts``               hash: part unit -> what the store said of it
``chkq:job:JOB:staged``              a ``--verify-data`` spread job's object at its staging key
``chkq:job:JOB:publish``             the upload that copies that object to the output's key
``chkq:jobs``                        list: the most recently submitted job ids
``chkq:rate:KIND``                   hash: node -> its bytes per second at KIND
``chkq:deliveries:TASK:N[:rR]``      how often one task message was delivered
===================================  ==============================================

Two more live in the broker's database, beside kombu's queues:

===================================  ==============================================
``chkq:ring:QUEUE``                  list: one token per message sent to QUEUE, which
                                     wakes an idle consumer (any queue name)
``chkq:popped:CONSUMER``             the last message one consumer took, and its call
===================================  ==============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "chkq"
SEP = ":"

#: Records of one job that describe its progress (dropped when it ends).
PROGRESS_RECORDS = ("fetched", "run", "scanned", "plan", "copied", "merge-items", "merged",
                    "verified", "assembly", "parts", "staged", "publish")
#: Records of one job that outlive it (as long as results are kept).
LIFE_RECORDS = ("info", "done", "cancelled", "failed", "store", "party", "follow")
RECORDS = LIFE_RECORDS + PROGRESS_RECORDS

RECENT_JOBS = f"{PREFIX}{SEP}jobs"

_JOB = re.compile(r"[0-9a-f]{32}")
_WORD = re.compile(r"[a-z][a-z-]*")


def _join(*fields: str) -> str:
    for text in fields:
        if SEP in text or not text:
            raise ValueError(f"{text!r} cannot be a field of a chkq key")
    return SEP.join((PREFIX, *fields))


def job_record(job: str, what: str) -> str:
    """The key of one record of ``job`` (``what``: one of :data:`RECORDS`)."""
    if what not in RECORDS:
        raise ValueError(f"{what!r} is not a job record")
    return _join("job", job, what)


def job_records(job: str, names: tuple[str, ...] = RECORDS) -> list[str]:
    """The keys of several records of ``job``."""
    return [job_record(job, what) for what in names]


def job_pattern(prefix: str = "") -> str:
    """A SCAN pattern matching the submission record of every job whose id starts so."""
    return _join("job", f"{prefix}*", "info")


def ring(queue: str) -> str:
    """The broker list whose tokens tell consumers of ``queue`` that a message waits."""
    return f"{PREFIX}{SEP}ring{SEP}{queue}"


def popped(consumer: str) -> str:
    """The broker key naming the last message that ``consumer`` took from a queue."""
    return _join("popped", consumer)


def rate(kind: str) -> str:
    """The hash of each node's measured rate at ``kind`` of work."""
    return _join("rate", kind)


def deliveries(task_id: str, retries: int = 0, replaced: int = 0) -> str:
    """The counter of deliveries of one task message.

    A task that replaced itself (``Task.replace``) hands its id on: ``replaced``
    (the replacement's nesting) keeps the two messages' counts apart.
    """
    fields = ["deliveries", task_id, str(retries)] + ([f"r{replaced}"] if replaced else [])
    return _join(*fields)


@dataclass(frozen=True)
class JobKey:
    """A job record's key, read back: the job's id and the record's name."""

    job: str
    what: str


def parse(key: str | bytes) -> JobKey | None:
    """The job and record a key names, or None if it is not a job record's key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    fields = text.split(SEP)
    if len(fields) != 4 or fields[:2] != [PREFIX, "job"]:
        return None
    job, what = fields[2], fields[3]
    if not _JOB.fullmatch(job) or not _WORD.fullmatch(what) or what not in RECORDS:
        return None
    return JobKey(job, what)
