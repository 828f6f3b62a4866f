"""The link's proof: a job's output is published only when its records prove all of it.

:func:`prove` finds nothing missing only when the plan exists for this
directory and model, every copy unit and the merge are recorded, and every
verify unit (the whole-output check included) verified the output *as it is
now* (inode, size, mtime, ctime). A duplicated, early, replayed or forged
link message therefore cannot publish an unverified file or delete a
checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chkq.consolidation.stamps import FileStamp

if TYPE_CHECKING:
    from chkq.consolidation.plan import Plan
    from chkq.jobs.records import JobRecords


def output_stamp(plan: Plan) -> list[int]:
    """The stamp of the job's temporary output now, looked up from the planned run directory
    down without following a link at any level."""
    with plan.open_run() as run:
        return FileStamp.of(run.lstat(plan.job.temp)).as_list()


def linked_output_stamp(plan: Plan) -> list[int] | None:
    """The stamp of ``MODEL.h5`` if it is the job's own temporary output, linked; else None."""
    with plan.open_run() as run:
        try:
            stamp = FileStamp.of(run.lstat(plan.job.output)).as_list()
        except FileNotFoundError:
            return None
    return stamp if stamp[3] == plan.temp_inode else None


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


def prove(records: JobRecords, plan: Plan) -> Proof:
    """Check the job's records against each other and against its output as it is now."""
    job = plan.job_id
    proof = Proof()
    done = records.copied(job)
    missing = [u for u in range(len(plan.copy_units)) if u not in done]
    if missing:
        proof.unfinished.append(f"copy units {missing[:5]} did not finish")
    merged_stamp = records.merged(job)
    if merged_stamp is None:
        proof.unfinished.append("the merge did not finish")
    checks = records.verified(job)

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
