"""A consolidation job's protocol: task ids, its state in Redis, and the link's proof.

Everything a job's steps record lives here, in the result backend's Redis,
where only workers (and clients, for submission) write — never in the run
directory, whose owner is not trusted:

===============================  =============================================
key                              what
===============================  =============================================
``chkq-job-JOB-plan``            the plan (JSON), written once by ``chkq.plan``
``chkq-job-JOB-copied``          hash: copy unit -> its result (digests)
``chkq-job-JOB-merged``          the output's stamp once merged and durable
``chkq-job-JOB-verified``        hash: verify unit -> output stamp it verified
``chkq-job-JOB-run``             a large run's checkpoints, for its scan units
``chkq-job-JOB-scanned``         hash: scan unit -> what it found in its files
``chkq-job-JOB-failed``          the failure, as data (step, type, message)
``chkq-job-JOB``                 the submission (model, directory, time)
``chkq-job-done-JOB``            the result once the output was linked
``chkq-job-cancelled-JOB``       who cancelled the job, and when
===============================  =============================================

Every record is sealed (:func:`_seal`) and every read goes through one
verifying reader (:func:`_unseal`). With message signing configured, the
seal is an HMAC-SHA256, keyed by a key derived from the signing private key
(:func:`chkq.config.security.record_key`), over the record's Redis key, its
hash field (a unit number, or none) and its bytes: a record written by
someone who has the Redis password but not the signing key, or moved to
another key, job or unit, is refused with :class:`ForgedRecordError`
naming the key. Without signing the seal is empty and Redis access alone
writes job state. Paths read from records are checked again where they are
used (:func:`check_recorded_path`), whoever wrote them.

``chkq.link`` publishes only when :func:`prove` finds nothing missing:
the plan exists for this directory and model, every copy unit and the
merge are recorded, and every verify unit (the whole-output check
included) verified the output *as it is now* (inode, size, mtime, ctime).
A duplicated, early, replayed or forged link message therefore cannot
publish an unverified file or delete a checkpoint.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import signature
from celery.exceptions import ChordError
from celery.result import AsyncResult

from chkq.access import check_allowed
from chkq.config.celery_app import get_app, get_settings
from chkq.config.security import record_key
from chkq.consolidation.discovery import Checkpoint, checkpoint_pattern
from chkq.consolidation.temporaries import check_job_id
from chkq.errors import (
    BadMessageError,
    BadNameError,
    ChkqError,
    JobNotFoundError,
    JobStateGoneError,
)
from chkq.lru import LRU

if TYPE_CHECKING:
    # Plans are read and written by workers only: a client does without their modules.
    from chkq.consolidation.plan import Plan

#: The steps of a job, in order (``link`` has the job's own id).
STEPS = ("plan", "copy", "merge", "verify", "link")


class JobState(StrEnum):
    """Where a job is in its life."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    CANCELLED = "CANCELLED"


class Phase(StrEnum):
    """What a job is doing (or why it stopped)."""

    QUEUED = "queued"
    FETCHING = "fetching"
    PLANNING = "planning"
    COPYING = "copying"
    MERGING = "merging"
    VERIFYING = "verifying"
    LINKING = "linking"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


def task_id(job: str, step: str, unit: int | None = None) -> str:
    """The id of one step of a job: ``JOB-plan``, ``JOB-copy-3``... (link: ``JOB``)."""
    return job if step == "link" else f"{job}-{step}" + ("" if unit is None else f"-{unit}")


def fail_signature(out_dir: str, model: str, job: str, queue: str | None = None) -> Any:
    """The errback every step of a job carries: ``chkq.fail`` with the job's arguments.

    ``queue``: the queue of the worker whose scratch directory holds the job's
    files (a job from an object store), where its failure must be cleaned up.
    """
    sig = signature("chkq.fail", args=(out_dir, model, job), app=get_app())
    return sig if queue is None else sig.set(queue=queue)


def consolidation_signature(out_dir: str, model: str, job: str, cleanup: bool,
                            allow_gaps: bool = False, queue: str | None = None) -> Any:
    """The message that starts a job: ``chkq.plan`` with ``chkq.fail`` as errback.

    ``allow_gaps`` travels only when set, so that the message of an ordinary
    job is the one every worker version accepts. ``queue`` places the job on
    one worker (see :func:`fail_signature`).
    """
    kwargs: dict[str, bool] = {"cleanup": cleanup}
    if allow_gaps:
        kwargs["allow_gaps"] = True
    sig = signature(
        "chkq.plan", args=(out_dir, model, job), kwargs=kwargs, app=get_app()
    ).set(task_id=task_id(job, "plan"), link_error=[fail_signature(out_dir, model, job, queue)])
    return sig if queue is None else sig.set(queue=queue)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a header task raised, when ``exc`` is the ChordError wrapping it."""
    return failing_task(exc, None)[1]


def failing_task(exc: BaseException, task: str | None) -> tuple[str | None, BaseException]:
    """The task that really failed, and its exception, when ``exc`` is a ChordError.

    Celery reports a failed chord header only as a ChordError naming the
    header task's id; its result holds the real exception.
    """
    seen = 0
    while isinstance(exc, ChordError) and seen < 4:
        words = str(exc).split()
        if len(words) < 2 or words[0] != "Dependency":
            break
        inner = AsyncResult(words[1], app=get_app()).result
        if not isinstance(inner, BaseException):
            break
        task, exc, seen = words[1], inner, seen + 1
    return task, exc


class ForgedRecordError(ChkqError, ValueError):
    """A job record in Redis that this deployment's workers and clients did not write."""


def _key(job: str, what: str) -> str:
    return f"chkq-job-{job}-{what}"


def record_key_of(job: str, what: str) -> str:
    """The Redis key of one of a job's step records (``run``, ``plan``...), for messages."""
    return _key(job, what)


def _info_key(job: str) -> str:
    return f"chkq-job-{job}"


def _done_key(job: str) -> str:
    return f"chkq-job-done-{job}"


def _cancelled_key(job: str) -> str:
    return f"chkq-job-cancelled-{job}"


def _client() -> Any:
    return get_app().backend.client


# ------------------------------------------------------------ sealed records

#: The first word of every record: the format, so that a value of another kind is refused.
SEAL_FORMAT = b"chkq1"
_UNSEALED = b"-"

#: Record keys derived in this process, by signing key file: derived once (a PEM parse).
_RECORD_KEYS: dict[str, bytes | None] = {}


def _secret() -> bytes | None:
    """This process's job-record key, or None when message signing is off."""
    settings = get_settings()
    if settings.security_key is None:
        return None
    if settings.security_key not in _RECORD_KEYS:
        _RECORD_KEYS[settings.security_key] = record_key(settings)
    return _RECORD_KEYS[settings.security_key]


def records_authenticated() -> bool:
    """True when job records are sealed with a key (message signing is configured)."""
    return _secret() is not None


def _code(secret: bytes, key: str, field: str, payload: bytes) -> bytes:
    """The HMAC-SHA256 (hex) binding ``payload`` to its Redis key and hash field."""
    message = b"\0".join((SEAL_FORMAT, key.encode(), field.encode(), payload))
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


def _seal(key: str, field: str, payload: str) -> bytes:
    """``payload`` (JSON text) as stored under ``key`` (and hash field ``field``)."""
    data = payload.encode()
    secret = _secret()
    code = _UNSEALED if secret is None else _code(secret, key, field, data)
    return SEAL_FORMAT + b" " + code + b" " + data


def _shown(key: str, field: str) -> str:
    return f"{key}[{field}]" if field else key


def _unseal(key: str, field: str, raw: bytes | str) -> str:
    """The JSON text of a record read from ``key`` (``field``), once its seal is checked.

    Raises
    ------
    ForgedRecordError
        If the value is not a sealed record, or (signing on) its code does not
        match: it was written without the key, or copied from another key,
        job or unit.
    """
    data = raw if isinstance(raw, bytes) else raw.encode()
    head, _, rest = data.partition(b" ")
    code, space, payload = rest.partition(b" ")
    where = _shown(key, field)
    if head != SEAL_FORMAT or not space:
        raise ForgedRecordError(f"job record {where} is not a record chkq wrote: refused")
    secret = _secret()
    if secret is not None and not hmac.compare_digest(code, _code(secret, key, field, payload)):
        raise ForgedRecordError(
            f"job record {where} does not carry this deployment's authentication code: it "
            "was written by someone with access to Redis but without the signing key "
            "(CHKQ_SECURITY_KEY), or moved from another key, and is refused as not the "
            "job's own")
    try:
        return payload.decode()
    except UnicodeDecodeError:
        raise ForgedRecordError(f"job record {where} is not UTF-8 text: refused") from None


def _parse(key: str, field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ForgedRecordError(f"job record {_shown(key, field)} is not valid JSON: "
                                "refused") from None


def _get(key: str) -> Any:
    """The value recorded under ``key`` (checked), or None if there is none."""
    raw = _client().get(key)
    return None if raw is None else _parse(key, "", _unseal(key, "", raw))


def _set(key: str, value: Any, *, nx: bool = False) -> bool:
    """Record ``value`` (JSON-ready) under ``key``; with ``nx`` only if absent (then: if set)."""
    return bool(_client().set(key, _seal(key, "", json.dumps(value)), nx=nx,
                              ex=get_settings().result_expires))


def _hset(job: str, what: str, unit: int, value: Any) -> None:
    client = _client()
    key = _key(job, what)
    client.hset(key, str(unit), _seal(key, str(unit), json.dumps(value)))
    client.expire(key, get_settings().result_expires)


def _hgetall(job: str, what: str) -> dict[int, Any]:
    """Every unit's record of a hash (each checked), by unit."""
    key = _key(job, what)
    records: dict[int, Any] = {}
    for raw_field, raw in _client().hgetall(key).items():
        name = raw_field.decode() if isinstance(raw_field, bytes) else str(raw_field)
        if not name.isdigit() or name != str(int(name)):
            raise ForgedRecordError(f"job record {_shown(key, name)} names no unit: refused")
        records[int(name)] = _parse(key, name, _unseal(key, name, raw))
    return records


def check_recorded_path(path: Any, out_dir: str, model: str, what: str) -> Path:
    """``path``, read from a job record, if it names a checkpoint file of ``model`` in ``out_dir``.

    By discovery's rules: ``OUT_DIR/MODEL_chkNNNNN.h5`` or
    ``OUT_DIR/MODEL_chkNNNNN/NAME.h5`` (``NAME`` not starting with a dot),
    spelled exactly (absolute, no ``..``, ``.`` or doubled ``/``).
    ``out_dir`` is a directory with its links resolved, checked against
    ``CHKQ_ALLOWED_ROOTS`` by the caller (once, not per file: a path spelled
    so lies lexically inside it, and discovery refuses checkpoints that are
    links and no open follows one).

    Raises
    ------
    ValueError
        Naming the path and the record it came from (``what``).
    """
    text = path if isinstance(path, str) else ""
    # Each component must match a checkpoint name, none of which is "", "." or "..".
    parts = text[len(out_dir) + 1:].split("/") if text.startswith(out_dir + "/") else []
    first = checkpoint_pattern(model).fullmatch(parts[0]) if parts else None
    if "\x00" in text or first is None:
        good = False
    elif len(parts) == 1:
        good = first.group(2) is not None
    else:
        good = (len(parts) == 2 and first.group(2) is None and parts[1].endswith(".h5")
                and not parts[1].startswith("."))
    if not good:
        raise BadMessageError(f"{what} names {path!r}, which is not a checkpoint file of model "
                         f"{model!r} in {out_dir!r}: refused")
    return Path(text)


def check_recorded_checkpoints(checkpoints: list[Checkpoint], out_dir: str, model: str,
                               what: str) -> list[Checkpoint]:
    """``checkpoints`` read from a job record, if each is one of ``model``'s in ``out_dir``.

    Every file passes :func:`check_recorded_path`; a checkpoint is its file
    (``MODEL_chkNNNNN.h5``) or the directory holding its files, and its
    number is the one in its name. ``out_dir`` must resolve inside
    ``CHKQ_ALLOWED_ROOTS`` (PermissionError if not).
    """
    check_allowed(out_dir, get_settings().allowed_roots)
    pattern = checkpoint_pattern(model)
    for checkpoint in checkpoints:
        match = pattern.fullmatch(checkpoint.path.name)
        files = [check_recorded_path(str(f), out_dir, model, what) for f in checkpoint.files]
        whole = checkpoint.path if match and match.group(2) else None
        good = (match is not None and int(match.group(1)) == checkpoint.number
                and str(checkpoint.path.parent) == out_dir and bool(files)
                and (files == [whole] if whole else all(f.parent == checkpoint.path
                                                        for f in files)))
        if not good:
            raise BadMessageError(f"{what} holds checkpoint {checkpoint.number!r} at "
                             f"{str(checkpoint.path)!r} with files {[str(f) for f in files]}, "
                             f"which is not a checkpoint of model {model!r} in {out_dir!r}: "
                             "refused")
    return checkpoints


def _check_plan_paths(plan: Plan, job: str) -> Plan:
    """``plan`` if every path it names is one of its run's checkpoints (ValueError if not)."""
    what = f"the plan of job {job} ({_key(job, 'plan')})"
    if plan.job_id != job:
        raise BadMessageError(f"{what} is the plan of job {plan.job_id!r}: refused")
    if not isinstance(plan.out_dir, str) or os.path.realpath(plan.out_dir) != plan.out_dir:
        raise BadMessageError(
            f"{what} names a run directory {plan.out_dir!r} that is not resolved: refused")
    check_allowed(plan.out_dir, get_settings().allowed_roots)
    try:
        named = {str(check_recorded_path(f[0], plan.out_dir, plan.model, what))
                 for f in plan.files}
    except (TypeError, IndexError):
        raise BadMessageError(f"{what} lists files malformed: refused") from None
    if plan.reference_file not in named:
        raise BadMessageError(f"{what} names a template {plan.reference_file!r} that is not one of "
                         "its files: refused")
    for entry in plan.checkpoints:
        folder = entry[1] if isinstance(entry, list) and len(entry) == 3 else None
        if not isinstance(folder, str) or os.path.normpath(folder) != folder or \
                not (Path(folder).parent == Path(plan.out_dir)
                     and checkpoint_pattern(plan.model).fullmatch(Path(folder).name)):
            raise BadMessageError(f"{what} names checkpoint {entry!r}, which is not one of model "
                             f"{plan.model!r} in {plan.out_dir!r}: refused")
    return plan


def store_plan(plan: Plan) -> Plan:
    """Record ``plan`` as its job's plan unless one is recorded; return the recorded one."""
    key = _key(plan.job_id, "plan")
    if _client().set(key, _seal(key, "", plan.to_json()), nx=True,
                     ex=get_settings().result_expires):
        return plan
    recorded = recorded_plan(plan.job_id)
    assert recorded is not None
    return recorded


#: Plans this process parsed, newest last: a plan is written once and never changes, and
#: a run of thousands of files has a plan of megabytes that every task would parse again.
PLAN_CACHE = 4
_PLANS: LRU[str, Plan] = LRU(PLAN_CACHE)


def recorded_plan(job: str) -> Plan | None:
    """The plan recorded for ``job``, or None (it is fetched and checked once per process).

    Raises
    ------
    ForgedRecordError
        If the recorded plan is not the job's own.
    ValueError
        If it names a path that is not one of its run's checkpoints.
    """
    key = _key(job, "plan")
    cached = _PLANS.get(job)
    if cached is not None:
        if _client().exists(key):
            return cached
        _PLANS.pop(job)
        return None
    raw = _client().get(key)
    if not raw:
        return None
    from chkq.consolidation.plan import Plan

    text = _unseal(key, "", raw)
    try:
        plan = Plan.from_json(text)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ForgedRecordError(f"job record {key} is not a plan: {exc}; refused") from None
    _PLANS.put(job, _check_plan_paths(plan, job))
    return plan


def load_plan(job: str, out_dir: str, model: str) -> Plan:
    """The plan of ``job``, checked against the message's directory and model.

    Raises
    ------
    FileNotFoundError
        If the job has no plan (never planned, failed, cancelled or expired).
    ValueError
        If the message names another directory or model than the plan.
    ForgedRecordError
        If the recorded plan is not the job's own.
    """
    plan = recorded_plan(job)
    if plan is None:
        raise JobStateGoneError(f"consolidation job {job} has no recorded plan: it failed, "
                                "was cancelled, or its records expired")
    _check_target(job, (out_dir, model), (plan.out_dir, plan.model))
    return plan


def _check_target(job: str, named: tuple[str, str], recorded: tuple[Any, Any]) -> None:
    """Refuse a message that names another directory and model than the job's records."""
    if named != recorded:
        raise BadMessageError(f"the message for job {job} names {named[0]!r}/{named[1]!r}, but the "
                         f"job consolidates {recorded[0]!r}/{recorded[1]!r}")


def output_stamp(plan: Plan) -> list[int]:
    """The stamp of the job's temporary output now, looked up from the planned run directory
    down without following a link at any level."""
    from chkq.consolidation.stamps import FileStamp

    with plan.open_run() as run:
        return FileStamp.of(run.lstat(plan.job.temp)).as_list()


def linked_output_stamp(plan: Plan) -> list[int] | None:
    """The stamp of ``MODEL.h5`` if it is the job's own temporary output, linked; else None."""
    from chkq.consolidation.stamps import FileStamp

    with plan.open_run() as run:
        try:
            stamp = FileStamp.of(run.lstat(plan.job.output)).as_list()
        except FileNotFoundError:
            return None
    return stamp if stamp[3] == plan.temp_inode else None


def record_run(job: str, out_dir: str, model: str, checkpoints: list[Any]) -> list[Any]:
    """Record the checkpoints a job's scan units read, unless some are; return the recorded ones.

    ``checkpoints`` is JSON-ready data (``chkq.consolidation.prepare.checkpoints_to_record``).
    """
    _set(_key(job, "run"), {"out_dir": out_dir, "model": model, "checkpoints": checkpoints},
         nx=True)
    recorded = recorded_run(job, out_dir, model)
    assert recorded is not None
    return recorded


def recorded_run(job: str, out_dir: str, model: str) -> list[Any] | None:
    """The checkpoints recorded for ``job``'s scan units (as recorded), or None.

    The caller checks the paths where it uses them
    (:func:`check_recorded_checkpoints`).

    Raises
    ------
    ValueError
        If the message names another directory or model than the record.
    ForgedRecordError
        If the record is not the job's own.
    """
    key = _key(job, "run")
    record = _get(key)
    if record is None:
        return None
    if not isinstance(record, dict):
        raise ForgedRecordError(f"job record {key} is not a list of checkpoints: refused")
    _check_target(job, (out_dir, model), (record.get("out_dir"), record.get("model")))
    checkpoints: list[Any] = record.get("checkpoints") or []
    return checkpoints


def record_store_job(job: str, record: dict[str, Any]) -> dict[str, Any]:
    """Record where a job from an object store reads and publishes, unless recorded; return it."""
    _set(_key(job, "store"), record, nx=True)
    recorded = store_job_record(job)
    assert recorded is not None
    return recorded


def store_job_record(job: str) -> dict[str, Any] | None:
    """The store record of ``job`` (:func:`record_store_job`), or None for a directory job."""
    record = _get(_key(job, "store"))
    if record is not None and not isinstance(record, dict):
        raise ForgedRecordError(f"job record {_key(job, 'store')} is not a store job: refused")
    return record


def record_scanned(job: str, unit: int, record: dict[str, Any]) -> None:
    """Record what scan unit ``unit`` found (``chkq.consolidation.prepare.scans_to_record``)."""
    _hset(job, "scanned", unit, record)


def scanned(job: str, units: int) -> list[dict[str, Any]] | None:
    """The records of scan units ``0...units-1``, in order, if all are recorded; else None."""
    records = _hgetall(job, "scanned")
    if any(unit not in records for unit in range(units)):
        return None
    return [records[unit] for unit in range(units)]


def record_copied(job: str, unit: int, result: Any) -> None:
    """Record that copy unit ``unit`` finished, with what verification needs of it."""
    _hset(job, "copied", unit, result)


def copied(job: str) -> dict[int, Any]:
    """Results of the copy units that finished, by unit."""
    return _hgetall(job, "copied")


def record_merge_items(job: str, items: list[int], moved: int) -> None:
    """Record that the merge's items ``items`` are in the output (fsynced), ``moved`` bytes."""
    if not items:
        return
    client = _client()
    key = _key(job, "merge-items")
    client.hset(key, mapping={str(item): _seal(key, str(item), json.dumps(moved))
                              for item in items})
    client.expire(key, get_settings().result_expires)


def merge_items_done(job: str) -> set[int]:
    """The merge's items recorded as in the output (:func:`record_merge_items`)."""
    return set(_hgetall(job, "merge-items"))


def record_merged(plan: Plan) -> None:
    """Record that the output is merged and durable, with its stamp."""
    _set(_key(plan.job_id, "merged"), output_stamp(plan))


def merged(job: str) -> list[int] | None:
    """The output's stamp when it was merged, or None if it was not."""
    stamp = _get(_key(job, "merged"))
    return None if stamp is None else list(stamp)


def record_verified(plan: Plan, unit: int, stamp: list[int]) -> None:
    """Record that verify unit ``unit`` checked the output of stamp ``stamp``."""
    _hset(plan.job_id, "verified", unit, stamp)


def verified(job: str) -> dict[int, Any]:
    """Stamps of the output each finished verify unit checked, by unit."""
    return _hgetall(job, "verified")


def verify_unit_count(plan: Plan) -> int:
    """Verify units of a job: one per batch of files, plus the whole-output check (last)."""
    return len(plan.verify_units) + 1


@dataclass
class Proof:
    """What a job's records lack for its output to be published, and what contradicts them.

    ``unfinished`` names the steps not recorded (an early, forged or replayed
    link sees these); ``contradicted`` what is recorded but no longer true
    of the output. The output is proven when both are empty.
    """

    unfinished: list[str] = field(default_factory=list)
    contradicted: list[str] = field(default_factory=list)

    @property
    def proven(self) -> bool:
        return not (self.unfinished or self.contradicted)


def prove(plan: Plan) -> Proof:
    """Check the job's records against each other and against its output as it is now."""
    job = plan.job_id
    proof = Proof()
    done = copied(job)
    missing = [u for u in range(len(plan.copy_units)) if u not in done]
    if missing:
        proof.unfinished.append(f"copy units {missing[:5]} did not finish")
    merged_stamp = merged(job)
    if merged_stamp is None:
        proof.unfinished.append("the merge did not finish")
    checks = verified(job)

    def same(stamp: list[int]) -> bool:
        return stamp == now
    try:
        now = output_stamp(plan)
    except FileNotFoundError:
        linked = linked_output_stamp(plan)
        if linked is None:
            proof.contradicted.append("the temporary output is gone")
            return proof
        # An earlier delivery of the link step linked it into place (and was stopped
        # before recording the job's end): the same file, whose ctime the links changed.
        now = linked

        def same(stamp: list[int]) -> bool:
            return stamp[:2] + stamp[3:] == now[:2] + now[3:]
    if now[3] != plan.temp_inode:
        proof.contradicted.append("the temporary output is not the file the job planned")
    if merged_stamp is not None and not same(merged_stamp):
        proof.contradicted.append("the output changed after it was merged")
    for unit in range(verify_unit_count(plan)):
        if unit not in checks:
            proof.unfinished.append(f"verify unit {unit} did not finish")
        elif not same(checks[unit]):
            proof.contradicted.append(f"verify unit {unit} checked another version of the output")
    return proof


def record_failed(job: str, task: str | None, exc: BaseException) -> None:
    """Record a job's failure as data: the failing task and step, exception type and message.

    The first failure recorded stays (later ones are consequences of it);
    a failure record that is not the job's own is replaced.
    """
    step = STEPS[-1] if task == job else (task or "").removeprefix(f"{job}-").split("-")[0]
    entry = {"task": task, "step": step or "job", "type": type(exc).__name__,
             "message": str(exc)}
    if _set(_key(job, "failed"), entry, nx=True):
        return
    try:
        failure(job)
    except ForgedRecordError:
        _set(_key(job, "failed"), entry)


def failure(job: str) -> dict[str, str] | None:
    """The recorded failure of ``job`` (task, step, type, message), or None."""
    entry = _get(_key(job, "failed"))
    if entry is not None and not (isinstance(entry, dict) and isinstance(entry.get("type"), str)
                                  and isinstance(entry.get("step"), str)):
        raise ForgedRecordError(f"job record {_key(job, 'failed')} is not a failure: refused")
    return entry


def forget_progress(job: str) -> None:
    """Drop a finished or failed job's plan and step records (its result stays)."""
    _client().delete(*(_key(job, what) for what in ("run", "scanned", "plan", "copied",
                                                        "merge-items", "merged", "verified")))


def forget_refused(job: str) -> list[str]:
    """Delete the job's done and cancelled markers that are not its own; return their keys.

    For the failure path, so that no client or status is left reading a
    planted marker of a job that failed.
    """
    gone = []
    for key, read in ((_done_key(job), finished_result), (_cancelled_key(job), cancelled)):
        try:
            read(job)
        except ForgedRecordError:
            _client().delete(key)
            gone.append(key)
    return gone


# ------------------------------------------------------------ submitted, finished, cancelled

RECENT_JOBS = "chkq-jobs"
RECENT_LIMIT = 200


def record_submitted(job: str, model: str, out_dir: str) -> None:
    """Remember a submitted job so that ``chkq status`` can list it."""
    client = _client()
    _set(_info_key(job), {"job": job, "model": model, "out_dir": out_dir,
                          "submitted": time.time()})
    client.lpush(RECENT_JOBS, job)
    client.ltrim(RECENT_JOBS, 0, RECENT_LIMIT - 1)


def job_info(job: str) -> dict[str, Any] | None:
    """What was recorded when ``job`` was submitted, or None."""
    info = _get(_info_key(job))
    if info is not None and not isinstance(info, dict):
        raise ForgedRecordError(f"job record {_info_key(job)} is not a submission: refused")
    return info


def recent_jobs(limit: int = 20) -> list[str]:
    """Ids of the most recently submitted jobs, newest first."""
    return [j.decode() if isinstance(j, bytes) else j
            for j in _client().lrange(RECENT_JOBS, 0, limit - 1)]


def record_finished(job: str, result: dict[str, Any]) -> None:
    """Remember that ``job`` linked its output (kept as long as results are)."""
    _set(_done_key(job), result)


def finished_result(job: str) -> dict[str, Any] | None:
    """The result of ``job`` if it already finished, else None.

    Raises
    ------
    ForgedRecordError
        If the done marker is not the job's own: no one reports success from it.
    """
    done = _get(_done_key(job))
    if done is not None and not (isinstance(done, dict) and isinstance(done.get("output"), str)):
        raise ForgedRecordError(f"job record {_done_key(job)} is not a job's result: refused")
    return done


def record_cancelled(job: str, by: str = "chkq cancel") -> dict[str, Any]:
    """Remember that ``job`` was cancelled (kept as long as results are); return the entry.

    Tasks of the job that a worker picks up later can check :func:`cancelled`
    and stop before touching anything.
    """
    entry = {"job": job, "cancelled": time.time(), "by": by}
    _set(_cancelled_key(job), entry)
    return entry


def cancelled(job: str) -> dict[str, Any] | None:
    """What :func:`record_cancelled` recorded for ``job``, or None if it was not cancelled."""
    entry = _get(_cancelled_key(job))
    if entry is not None and not isinstance(entry, dict):
        raise ForgedRecordError(f"job record {_cancelled_key(job)} is not a cancellation: "
                                "refused")
    return entry


def find_jobs(prefix: str, limit: int = 10) -> list[str]:
    """Ids of recorded jobs that start with ``prefix`` (at most ``limit``, sorted).

    Lets people type a job id's first digits, as with git commits.
    """
    found: set[str] = set()
    for key in _client().scan_iter(match=_info_key(prefix) + "*", count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        job = name.removeprefix("chkq-job-")
        if len(job) == 32 and all(c in "0123456789abcdef" for c in job):
            found.add(job)
            if len(found) > limit:
                break
    return sorted(found)[:limit]


# ------------------------------------------------------------ reading a job's state

@dataclass
class UnitState:
    """The stored state of one task of a job.

    Attributes
    ----------
    task_id
        Its id (``JOB-copy-3``...).
    state
        Celery state: PENDING (not started, or unknown), STARTED, PROGRESS,
        SUCCESS, FAILURE...
    done, total
        Rows done and to do, from a PROGRESS state or a result.
    error, error_type
        ``Type: message`` of the exception of a failed task, and its type.
    worker, pid
        The worker node (``celery@host``) and pool process that last recorded the
        task as started or in progress; None when not recorded or not a node name.
    worker_gone
        Why that worker is taken for gone (``not answering``...), or None: it
        runs the task, or nobody looked (see ``chkq.workers.status``).
    redelivery, redelivered_by
        For a task of a gone worker: when the broker hands its message to another
        worker, for people, and as seconds since the epoch when the broker's
        records give the moment (Redis), else None.
    """

    task_id: str
    state: str
    done: int | None = None
    total: int | None = None
    error: str | None = None
    error_type: str | None = None
    worker: str | None = None
    pid: int | None = None
    worker_gone: str | None = None
    redelivery: str | None = None
    redelivered_by: float | None = None


@dataclass
class JobStatus:
    """Everything ``chkq status JOB`` shows about one job."""

    job: str
    state: JobState
    phase: Phase
    model: str | None = None
    out_dir: str | None = None
    submitted: float | None = None
    output: str | None = None
    error: str | None = None
    failed_task: str | None = None
    plan: dict[str, Any] | None = None
    steps: dict[str, list[UnitState]] = field(default_factory=dict)
    finished: float | None = None
    seconds: float | None = None
    rows_written: int | None = None
    files_read: int | None = None
    bytes_written: int | None = None
    warnings: list[str] = field(default_factory=list)
    cancelled: float | None = None
    queue: str | None = None
    """For a job from an object store, the queue of the worker holding it (all its steps)."""

    @property
    def rows(self) -> tuple[int, int, int]:
        """Rows copied and verified so far, and the job's total."""
        total = int((self.plan or {}).get("rows") or 0)
        copied = sum(u.done or 0 for u in self.steps.get("copy", []))
        verified = sum(u.done or 0 for u in self.steps.get("verify", []))
        return copied, verified, total


def describe_error(exc: Any) -> str:
    """``Type: message`` of a stored exception (first line of the message)."""
    if isinstance(exc, BaseException):
        message = (str(exc) or "").splitlines()
        return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    if isinstance(exc, dict) and "exc_type" in exc:
        return f"{exc['exc_type']}: {exc.get('exc_message')}"
    return repr(exc)


def fetch_metas(task_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """Stored result metadata of ``task_ids`` (None: nothing stored), in one MGET per 1,000."""
    backend = get_app().backend
    metas: dict[str, dict[str, Any] | None] = {}
    for start in range(0, len(task_ids), 1000):
        batch = task_ids[start:start + 1000]
        raws = backend.client.mget([backend.get_key_for_task(t) for t in batch])
        for task_id, raw in zip(batch, raws, strict=True):
            metas[task_id] = backend.decode_result(raw) if raw else None
    return metas


#: What a worker node name may look like (``celery@host``, ``chkq-3@node12.site``).
_NODE_NAME = re.compile(r"[\w.+-]{1,100}@[\w.-]{1,155}")

#: States of a task that a worker runs now.
RUNNING_STATES = ("STARTED", "PROGRESS")


def _worker_of(result: dict[str, Any]) -> tuple[str | None, int | None]:
    """The worker node and pool pid a STARTED or PROGRESS meta names.

    The meta is untrusted input: a name that does not look like a node name
    is dropped, so nothing else is shown or asked for.
    """
    hostname, pid = result.get("hostname"), result.get("pid")
    if not isinstance(hostname, str) or not _NODE_NAME.fullmatch(hostname):
        return None, None
    return hostname, pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _unit(task_id: str, meta: dict[str, Any] | None) -> UnitState:
    if meta is None:
        return UnitState(task_id, "PENDING")
    state, result = meta.get("status", "PENDING"), meta.get("result")
    unit = UnitState(task_id, state)
    if state == "FAILURE":
        unit.error = describe_error(result)
        unit.error_type = unit.error.split(":", 1)[0]
    elif isinstance(result, dict):
        done = result.get("done", result.get("rows"))
        unit.done = int(done) if isinstance(done, int) else None
        total = result.get("total", result.get("rows"))
        unit.total = int(total) if isinstance(total, int) else None
        if state in RUNNING_STATES:
            unit.worker, unit.pid = _worker_of(result)
    return unit


def unit_states(task_ids: list[str]) -> dict[str, UnitState]:
    """The stored state of each of ``task_ids`` now (one read)."""
    return {t: _unit(t, meta) for t, meta in fetch_metas(task_ids).items()}


_HEX = re.compile(r"[0-9a-f]+")


def resolve_job(text: str) -> str:
    """The full id of the job ``text`` names: the id itself, or its first 8 or more digits.

    Raises
    ------
    ValueError
        If ``text`` is not 8 to 32 lowercase hex digits, or names several jobs.
    LookupError
        If no recorded job starts with it.
    """
    check_job_id(text)
    if len(text) == 32:
        return text
    found = find_jobs(text)
    if not found:
        raise JobNotFoundError(f"no job {text}... in the result backend (never submitted, or "
                          "expired)")
    if len(found) > 1:
        raise BadNameError(f"job id prefix {text} is ambiguous: it starts "
                         + ", ".join(found[:5]) + ("..." if len(found) > 5 else ""))
    return found[0]


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of a stored ``date_done`` (ISO text or datetime), or None."""
    if isinstance(value, datetime.datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _add_summary(status: JobStatus, done: dict[str, Any], link_meta: dict[str, Any] | None
                 ) -> None:
    """Fill in what a finished job wrote, how long it took, and its warnings."""
    status.rows_written = int(done.get("rows") or 0)
    status.files_read = int(done.get("files") or 0)
    status.warnings = [str(w) for w in done.get("warnings") or []]
    try:
        status.bytes_written = Path(str(done.get("output"))).stat().st_size
    except OSError:
        status.bytes_written = None
    status.finished = _timestamp((link_meta or {}).get("date_done"))
    if status.finished is not None and status.submitted is not None:
        status.seconds = max(0.0, status.finished - status.submitted)


def job_status(job: str) -> JobStatus:
    """Read the state of consolidation job ``job`` from the result backend.

    Raises
    ------
    LookupError
        If the backend knows nothing of ``job`` (never submitted, or expired).
    """
    check_job_id(job)
    info = job_info(job) or {}
    plan_id, stage_id = task_id(job, "plan"), task_id(job, "stage")
    first = fetch_metas([plan_id, task_id(job, "merge"), job, stage_id])
    plan_meta, merge_meta, link_meta = first[plan_id], first[task_id(job, "merge")], first[job]
    stored = store_job_record(job)
    plan = plan_meta.get("result") if plan_meta and plan_meta.get("status") == "SUCCESS" else None
    plan = plan if isinstance(plan, dict) else None
    if not info and plan_meta is None and link_meta is None:
        raise JobNotFoundError(f"no job {job} in the result backend (never submitted, or expired)")

    steps: dict[str, list[UnitState]] = {"plan": [_unit(plan_id, plan_meta)]}
    for step, count_key in (("copy", "copy_units"), ("verify", "verify_units")):
        count = int(plan.get(count_key) or 0) if plan else 0
        ids = [task_id(job, step, n) for n in range(count)]
        metas = fetch_metas(ids) if ids else {}
        steps[step] = [_unit(t, metas[t]) for t in ids]
    steps["merge"] = [_unit(task_id(job, "merge"), merge_meta)]

    status = JobStatus(job=job, state=JobState.PENDING, phase=Phase.QUEUED, model=info.get("model"),
                       out_dir=info.get("out_dir"), submitted=info.get("submitted"),
                       plan=plan, steps=steps,
                       queue=str(stored.get("queue")) if stored else None)
    done = finished_result(job)
    link = _unit(job, link_meta)
    causes = [(step, u) for step in ("plan", "copy", "merge", "verify") for u in steps[step]
              if u.state == "FAILURE"]
    real = [(s, u) for s, u in causes if u.error_type != "ChordError"]
    cancel = cancelled(job) if done is None else None
    recorded = failure(job) if done is None else None
    if done is not None:
        link = UnitState(job, "SUCCESS")
        status.state, status.phase = JobState.SUCCESS, Phase.DONE
        status.output = str(done.get("output"))
        _add_summary(status, done, link_meta)
    elif cancel is not None:
        status.state, status.phase = JobState.CANCELLED, Phase.CANCELLED
        status.cancelled = float(cancel.get("cancelled") or 0) or None
        status.error = f"cancelled {when(status.cancelled)}"
    elif recorded is not None or link.state == "FAILURE" or causes:
        status.state, status.phase = JobState.FAILURE, Phase.FAILED
        if recorded is not None:
            status.failed_task = recorded.get("task") or recorded["step"]
            message = (recorded.get("message") or "").splitlines()
            status.error = f"{recorded['type']}: {message[0]}" if message else recorded["type"]
        elif real:
            status.failed_task, status.error = real[0][1].task_id, real[0][1].error
        else:
            status.failed_task, status.error = job, link.error
        if link.state == "FAILURE" and status.failed_task != job:
            link = UnitState(job, "NOT RUN")
    elif plan_meta is None and (stored is not None or first[stage_id] is not None):
        status.state, status.phase = JobState.RUNNING, Phase.FETCHING
    else:
        status.state = JobState.RUNNING if plan_meta is not None else JobState.PENDING
        status.phase = _phase(steps, link)
    steps["link"] = [link]
    return status


def _phase(steps: dict[str, list[UnitState]], link: UnitState) -> Phase:
    """The step a running job is at."""
    if link.state in ("STARTED", "PROGRESS"):
        return Phase.LINKING
    for step in ("verify", "merge", "copy"):
        if any(u.state not in ("PENDING",) for u in steps[step]):
            if step == "copy" and all(u.state == "SUCCESS" for u in steps[step]):
                return Phase.MERGING
            return {"verify": Phase.VERIFYING, "merge": Phase.MERGING,
                    "copy": Phase.COPYING}[step]
    plan = steps["plan"][0]
    return Phase.PLANNING if plan.state in ("STARTED", "PROGRESS") else (
        Phase.COPYING if plan.state == "SUCCESS" else Phase.QUEUED)


def when(timestamp: float | None) -> str:
    """A time of the job's records, as ``chkq status`` shows it (local time, to the second)."""
    if timestamp is None:
        return "?"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")
