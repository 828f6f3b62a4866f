"""The records of a job's steps and life, as its workers and clients write and read them.

Everything a job's steps record lives in the result backend's Redis, where only
workers (and clients, for submission) write — never in the run directory,
whose owner is not trusted. Each record is sealed (:mod:`chkq.jobs.sealed`)
under its key (:mod:`chkq.jobs.keys`); paths read from records are checked
again where they are used (:mod:`chkq.jobs.paths`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from chkq.consolidation.temporaries import check_job_id
from chkq.errors import (
    BadMessageError,
    BadNameError,
    ForgedRecordError,
    JobNotFoundError,
    JobStateGoneError,
)
from chkq.jobs import keys
from chkq.jobs.paths import check_plan_paths
from chkq.jobs.sealed import SealedStore
from chkq.lru import LRU

if TYPE_CHECKING:
    from chkq.consolidation.plan import Plan

#: The steps of a job, in order (``link`` has the job's own id).
STEPS = ("plan", "copy", "merge", "verify", "link")

#: How many job ids ``chkq status`` can list.
RECENT_LIMIT = 200

#: Plans this process parsed, newest last: a plan is written once and never changes, and
#: a run of thousands of files has a plan of megabytes that every task would parse again.
PLAN_CACHE = 4
_PLANS: LRU[str, Plan] = LRU(PLAN_CACHE)


def task_id(job: str, step: str, unit: int | None = None) -> str:
    """The id of one step of a job: ``JOB-plan``, ``JOB-copy-3``... (link: ``JOB``)."""
    return job if step == "link" else f"{job}-{step}" + ("" if unit is None else f"-{unit}")


def check_target(job: str, named: tuple[str, str], recorded: tuple[Any, Any]) -> None:
    """Refuse a message that names another directory and model than the job's records."""
    if named != recorded:
        raise BadMessageError(f"the message for job {job} names {named[0]!r}/{named[1]!r}, but "
                              f"the job consolidates {recorded[0]!r}/{recorded[1]!r}")


def _checked_dict(key: str, value: Any, kind: str, required: str | None) -> Any:
    """``value`` read from ``key`` if it is None or a dict (with a text ``required``),
    else the :class:`ForgedRecordError` that refuses it (kept if it is one already)."""
    if value is None or isinstance(value, ForgedRecordError) or (isinstance(value, dict) and (
            required is None or isinstance(value.get(required), str))):
        return value
    return ForgedRecordError(f"job record {key} is not {kind}: refused")


class JobRecords(SealedStore):
    """A job's records in one Redis database (see :class:`chkq.jobs.sealed.SealedStore`).

    ``allowed_roots`` are the directories this process may touch: a plan read
    back names a run directory inside them, or is refused.
    """

    def __init__(self, client: Any, secret: bytes | None, ttl: int | None,
                 allowed_roots: Any = None) -> None:
        super().__init__(client, secret, ttl)
        self.allowed_roots = allowed_roots

    def _dict(self, job: str, what: str, kind: str, required: str | None = None
              ) -> dict[str, Any] | None:
        key = keys.job_record(job, what)
        value = _checked_dict(key, self.get(key), kind, required)
        if isinstance(value, ForgedRecordError):
            raise value
        return value

    def _set_once(self, job: str, what: str, value: Any) -> Any:
        """Record ``value`` unless a value is recorded; return the recorded one (checked)."""
        key = keys.job_record(job, what)
        self.set(key, value, nx=True)
        return self.get(key)

    # ------------------------------------------------------------ what a job reads

    def record_run(self, job: str, out_dir: str, model: str, checkpoints: list[Any]
                   ) -> list[Any]:
        """Record the checkpoints a job's scan units read, unless some are; return the recorded.

        ``checkpoints`` is JSON-ready data
        (``chkq.consolidation.run_scan.checkpoints_to_record``).
        """
        self._set_once(job, "run", {"out_dir": out_dir, "model": model,
                                    "checkpoints": checkpoints})
        recorded = self.recorded_run(job, out_dir, model)
        assert recorded is not None
        return recorded

    def recorded_run(self, job: str, out_dir: str, model: str) -> list[Any] | None:
        """The checkpoints recorded for ``job``'s scan units (as recorded), or None.

        The caller checks the paths where it uses them
        (:func:`chkq.jobs.paths.check_recorded_checkpoints`).

        Raises
        ------
        BadMessageError
            If the message names another directory or model than the record.
        ForgedRecordError
            If the record is not the job's own.
        """
        record = self._dict(job, "run", "a list of checkpoints")
        if record is None:
            return None
        check_target(job, (out_dir, model), (record.get("out_dir"), record.get("model")))
        checkpoints: list[Any] = record.get("checkpoints") or []
        return checkpoints

    def record_store_job(self, job: str, record: dict[str, Any]) -> dict[str, Any]:
        """Record where a job from an object store reads and publishes, unless recorded."""
        self._set_once(job, "store", record)
        recorded = self.store_job_record(job)
        assert recorded is not None
        return recorded

    def store_job_record(self, job: str) -> dict[str, Any] | None:
        """The store record of ``job`` (:meth:`record_store_job`), or None for a directory job."""
        return self._dict(job, "store", "a store job")

    def record_fetched(self, job: str, unit: int, files: list[Any]) -> None:
        """Record what fetch unit ``unit`` of a store job left in its run directory.

        ``files``: one entry a file (``chkq.staging.FetchedFile``:
        name, size, SHA-256, identity). Planning proceeds only from these records.
        """
        self.hset(keys.job_record(job, "fetched"), {str(unit): files})

    def fetched(self, job: str) -> dict[int, Any]:
        """What each fetch unit that finished fetched, by unit."""
        return self.hgetall_units(keys.job_record(job, "fetched"))

    def record_assembly(self, job: str, record: dict[str, Any]) -> dict[str, Any]:
        """Record how a spread store job's output is assembled, unless recorded; return it.

        ``record``: the shared upload the parts go to, the output's size and
        its parts (``chkq.consolidation.output_parts``).
        """
        self._set_once(job, "assembly", record)
        recorded = self.assembly(job)
        assert recorded is not None
        return recorded

    def assembly(self, job: str) -> dict[str, Any] | None:
        """The assembly record of ``job`` (:meth:`record_assembly`), or None."""
        return self._dict(job, "assembly", "an output's assembly")

    def record_part(self, job: str, unit: int, part: Any) -> None:
        """Record what the store said of part ``unit`` of a spread job's output, once sent."""
        self.hset(keys.job_record(job, "parts"), {str(unit): part})

    def parts(self, job: str) -> dict[int, Any]:
        """What each part sent so far is, by unit."""
        return self.hgetall_units(keys.job_record(job, "parts"))

    def record_staged(self, job: str, record: dict[str, Any]) -> dict[str, Any]:
        """Record the object a spread job with ``--verify-data`` completed at its staging key,
        unless recorded; return the recorded one (its key, size, version, proof)."""
        self._set_once(job, "staged", record)
        recorded = self.staged(job)
        assert recorded is not None
        return recorded

    def staged(self, job: str) -> dict[str, Any] | None:
        """The staged object of ``job`` (:meth:`record_staged`), or None."""
        return self._dict(job, "staged", "a staged output")

    def record_publish(self, job: str, record: dict[str, Any]) -> dict[str, Any]:
        """Record the upload that copies a staged output to its key, unless recorded;
        return the recorded one (its token and copied parts)."""
        self._set_once(job, "publish", record)
        recorded = self._dict(job, "publish", "an output's publish")
        assert recorded is not None
        return recorded

    def publish_record(self, job: str) -> dict[str, Any] | None:
        """The upload :meth:`record_publish` recorded for ``job``, or None."""
        return self._dict(job, "publish", "an output's publish")

    def record_scanned(self, job: str, unit: int, record: dict[str, Any]) -> None:
        """Record what scan unit ``unit`` found (``run_scan.scans_to_record``)."""
        self.hset(keys.job_record(job, "scanned"), {str(unit): record})

    def scanned(self, job: str, units: int) -> list[dict[str, Any]] | None:
        """The records of scan units ``0...units-1``, in order, if all are recorded; else None."""
        records = self.hgetall_units(keys.job_record(job, "scanned"))
        if any(unit not in records for unit in range(units)):
            return None
        return [records[unit] for unit in range(units)]

    # ------------------------------------------------------------ the plan

    def store_plan(self, plan: Plan) -> Plan:
        """Record ``plan`` as its job's plan unless one is recorded; return the recorded one."""
        if self.set_text(keys.job_record(plan.job_id, "plan"), plan.to_json(), nx=True):
            return plan
        recorded = self.recorded_plan(plan.job_id)
        assert recorded is not None
        return recorded

    def recorded_plan(self, job: str) -> Plan | None:
        """The plan recorded for ``job``, or None (fetched and checked once per process).

        Raises
        ------
        ForgedRecordError
            If the recorded plan is not the job's own.
        BadMessageError
            If it names a path that is not one of its run's checkpoints.
        """
        key = keys.job_record(job, "plan")
        cached = _PLANS.get(job)
        if cached is not None:
            if self.client.exists(key):
                return cached
            _PLANS.pop(job)
            return None
        plan = self._read_plan(job)
        if plan is not None:
            _PLANS.put(job, check_plan_paths(plan, job, f"the plan of job {job} ({key})",
                                             self.allowed_roots))
        return plan

    def layout_plan(self, job: str) -> Plan | None:
        """The plan of ``job`` as a layout, for a worker that touches none of its files.

        A store job spread over the nodes is planned in one worker's scratch
        directory and assembled by any: the plan then names another node's
        paths, so it is read without the check that they lie in this worker's
        directories (and never cached with the plans that passed it). Nothing
        it names may be opened.
        """
        return self._read_plan(job)

    def _read_plan(self, job: str) -> Plan | None:
        key = keys.job_record(job, "plan")
        text = self.get_text(key)
        if text is None:
            return None
        from chkq.consolidation.plan import Plan

        try:
            return Plan.from_json(text)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise ForgedRecordError(f"job record {key} is not a plan: {exc}; refused") from None

    def load_plan(self, job: str, out_dir: str, model: str) -> Plan:
        """The plan of ``job``, checked against the message's directory and model.

        Raises
        ------
        JobStateGoneError
            If the job has no plan (never planned, failed, cancelled or expired).
        BadMessageError
            If the message names another directory or model than the plan.
        ForgedRecordError
            If the recorded plan is not the job's own.
        """
        plan = self.recorded_plan(job)
        if plan is None:
            raise JobStateGoneError(f"consolidation job {job} has no recorded plan: it failed, "
                                    "was cancelled, or its records expired")
        check_target(job, (out_dir, model), (plan.out_dir, plan.model))
        return plan

    # ------------------------------------------------------------ what its steps did

    def record_copied(self, job: str, unit: int, result: Any) -> None:
        """Record that copy unit ``unit`` finished, with what verification needs of it."""
        self.hset(keys.job_record(job, "copied"), {str(unit): result})

    def copied(self, job: str) -> dict[int, Any]:
        """Results of the copy units that finished, by unit."""
        return self.hgetall_units(keys.job_record(job, "copied"))

    def record_merge_items(self, job: str, items: list[int], moved: int) -> None:
        """Record that the merge's items ``items`` are in the output (fsynced), ``moved`` bytes."""
        self.hset(keys.job_record(job, "merge-items"), {str(item): moved for item in items})

    def merge_items_done(self, job: str) -> set[int]:
        """The merge's items recorded as in the output (:meth:`record_merge_items`)."""
        return set(self.hgetall_units(keys.job_record(job, "merge-items")))

    def record_merged(self, job: str, stamp: list[int]) -> None:
        """Record that the output is merged and durable, with its stamp."""
        self.set(keys.job_record(job, "merged"), stamp)

    def merged(self, job: str) -> list[int] | None:
        """The output's stamp when it was merged, or None if it was not."""
        stamp = self.get(keys.job_record(job, "merged"))
        return None if stamp is None else list(stamp)

    def record_verified(self, job: str, unit: int, stamp: list[int]) -> None:
        """Record that verify unit ``unit`` checked the output of stamp ``stamp``."""
        self.hset(keys.job_record(job, "verified"), {str(unit): stamp})

    def verified(self, job: str) -> dict[int, Any]:
        """Stamps of the output each finished verify unit checked, by unit."""
        return self.hgetall_units(keys.job_record(job, "verified"))

    def forget_progress(self, job: str) -> None:
        """Drop a finished or failed job's plan and step records (its result stays)."""
        self.client.delete(*keys.job_records(job, keys.PROGRESS_RECORDS))

    # ------------------------------------------------------------ submitted, failed, finished

    def record_submitted(self, job: str, model: str, out_dir: str) -> None:
        """Remember a submitted job so that ``chkq status`` can list it."""
        self.set(keys.job_record(job, "info"), {"job": job, "model": model, "out_dir": out_dir,
                                                "submitted": time.time()})
        self.client.lpush(keys.RECENT_JOBS, job)
        self.client.ltrim(keys.RECENT_JOBS, 0, RECENT_LIMIT - 1)

    def job_info(self, job: str) -> dict[str, Any] | None:
        """What was recorded when ``job`` was submitted, or None."""
        return self._dict(job, "info", "a submission")

    def job_records_of(self, jobs: list[str], what: str, kind: str,
                       required: str | None = None) -> dict[str, Any]:
        """The ``what`` record of each of ``jobs`` (one ``MGET``): a dict, None, or the
        :class:`ForgedRecordError` that refuses it (as :meth:`job_info` would raise)."""
        names = [keys.job_record(job, what) for job in jobs]
        return {job: _checked_dict(key, value, kind, required)
                for job, key, value in zip(jobs, names, self.get_many(names), strict=True)}

    def recent_jobs(self, limit: int = 20) -> list[str]:
        """Ids of the most recently submitted jobs, newest first."""
        return [j.decode() if isinstance(j, bytes) else j
                for j in self.client.lrange(keys.RECENT_JOBS, 0, limit - 1)]

    def record_follow(self, job: str, entry: dict[str, Any]) -> None:
        """Remember that ``job`` publishes a version of a follow (which follow, which version).

        ``entry`` holds ``follow`` (the follow's id), ``version``, ``through``
        and, once the follow has ended after this version, ``ended`` and
        ``outcome``: what ``chkq status`` shows of a follow is read from these.
        """
        self.set(keys.job_record(job, "follow"), entry)

    def follow_record(self, job: str) -> dict[str, Any] | None:
        """What :meth:`record_follow` recorded for ``job``, or None (no follow's version)."""
        return self._dict(job, "follow", "a follow's version", required="follow")

    def record_failed(self, job: str, task: str | None, exc: BaseException) -> None:
        """Record a job's failure as data: the failing task and step, exception type and message.

        The first failure recorded stays (later ones are consequences of it);
        a failure record that is not the job's own is replaced.
        """
        step = STEPS[-1] if task == job else (task or "").removeprefix(f"{job}-").split("-")[0]
        entry = {"task": task, "step": step or "job", "type": type(exc).__name__,
                 "message": str(exc)}
        key = keys.job_record(job, "failed")
        if self.set(key, entry, nx=True):
            return
        try:
            self.failure(job)
        except ForgedRecordError:
            self.set(key, entry)

    def failure(self, job: str) -> dict[str, Any] | None:
        """The recorded failure of ``job`` (task, step, type, message), or None."""
        entry = self._dict(job, "failed", "a failure", required="type")
        if entry is not None and not isinstance(entry.get("step"), str):
            raise ForgedRecordError(f"job record {keys.job_record(job, 'failed')} is not a "
                                    "failure: refused")
        return entry

    def record_finished(self, job: str, result: dict[str, Any]) -> None:
        """Remember that ``job`` linked its output (kept as long as results are)."""
        self.set(keys.job_record(job, "done"), result)

    def finished_result(self, job: str) -> dict[str, Any] | None:
        """The result of ``job`` if it already finished, else None.

        Raises
        ------
        ForgedRecordError
            If the done marker is not the job's own: no one reports success from it.
        """
        return self._dict(job, "done", "a job's result", required="output")

    def record_cancelled(self, job: str, by: str = "chkq cancel") -> dict[str, Any]:
        """Remember that ``job`` was cancelled (kept as long as results are); return the entry.

        Tasks of the job that a worker picks up later can check :meth:`cancelled`
        and stop before touching anything.
        """
        entry = {"job": job, "cancelled": time.time(), "by": by}
        self.set(keys.job_record(job, "cancelled"), entry)
        return entry

    def cancelled(self, job: str) -> dict[str, Any] | None:
        """What :meth:`record_cancelled` recorded for ``job``, or None if it was not cancelled."""
        return self._dict(job, "cancelled", "a cancellation")

    def forget_refused(self, job: str) -> list[str]:
        """Delete the job's done and cancelled markers that are not its own; return their keys.

        For the failure path, so that no client or status is left reading a
        planted marker of a job that failed.
        """
        gone = []
        for what, read in (("done", self.finished_result), ("cancelled", self.cancelled)):
            try:
                read(job)
            except ForgedRecordError:
                key = keys.job_record(job, what)
                self.client.delete(key)
                gone.append(key)
        return gone

    # ------------------------------------------------------------ finding jobs

    def find_jobs(self, prefix: str, limit: int = 10) -> list[str]:
        """Ids of recorded jobs that start with ``prefix`` (at most ``limit``, sorted).

        Lets people type a job id's first digits, as with git commits.
        """
        found: set[str] = set()
        for key in self.client.scan_iter(match=keys.job_pattern(prefix), count=1000):
            parsed = keys.parse(key)
            if parsed is not None:
                found.add(parsed.job)
                if len(found) > limit:
                    break
        return sorted(found)[:limit]

    def resolve_job(self, text: str) -> str:
        """The full id of the job ``text`` names: the id itself, or its first 8 or more digits.

        Raises
        ------
        BadNameError
            If ``text`` is not 8 to 32 lowercase hex digits, or names several jobs.
        JobNotFoundError
            If no recorded job starts with it.
        """
        check_job_id(text)
        if len(text) == 32:
            return text
        found = self.find_jobs(text)
        if not found:
            raise JobNotFoundError(f"no job {text}... in the result backend (never submitted, "
                                   "or expired)")
        if len(found) > 1:
            raise BadNameError(f"job id prefix {text} is ambiguous: it starts "
                               + ", ".join(found[:5]) + ("..." if len(found) > 5 else ""))
        return found[0]
