"""A Celery-free driver: one consolidation job, every step, in this process.

It calls the very functions the tasks call (plan, copy, merge, verify, the
whole-output check, link, cleanup), in the canvas's order, keeping the
job's records in memory instead of Redis. It exists for fast tests of the
core (no broker, no workers) and as a reading aid: this is the whole job.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.link import discard_job_files, link_output, remove_checkpoints
from chkq.consolidation.merge import merge_parts, remove_parts
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.prepare import DEFAULT_BLOCK_BYTES, DEFAULT_MAX_DECODED_BYTES, prepare
from chkq.consolidation.verify_rows import digests_by_dataset, verify_files


def consolidate_here(out_dir: str | Path, model: str, *, cleanup: bool = False,
                     block_bytes: int = DEFAULT_BLOCK_BYTES,
                     task_bytes: int = DEFAULT_BLOCK_BYTES, task_files: int = 64,
                     allow_gaps: bool = False,
                     max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                     through: int | None = None) -> Path:
    """Consolidate ``model``'s checkpoints in ``out_dir`` here and now; return the output.

    ``max_decoded_bytes`` bounds the run's filtered rows, decoded, as a
    worker's ``CHKQ_MAX_DECODED_BYTES`` does
    (:func:`chkq.consolidation.memory_bounds.check_decoded`). ``through``:
    only the checkpoints up to this number, as for :func:`prepare` (the
    first version of a followed run).

    Raises what the job would (subclasses of :class:`chkq.ChkqError`:
    NoCheckpointsError, OutputExistsError, CheckpointGapError unless
    ``allow_gaps``, BadCheckpointError...), having removed the job's
    temporaries.
    """
    job_id = uuid.uuid4().hex
    plan = prepare(out_dir, model, job_id, cleanup=cleanup, block_bytes=block_bytes,
                   task_bytes=task_bytes, task_files=task_files, allow_gaps=allow_gaps,
                   max_decoded_bytes=max_decoded_bytes, through=through)
    try:
        copies = {unit: copy_unit(plan, unit).digests for unit in range(len(plan.copy_units))}
        merge_parts(plan)
        remove_parts(plan)
        digests = digests_by_dataset(copies, plan)
        for first, stop in plan.verify_units:
            verify_files(plan, first, stop, digests)
        check_plan_output(plan)
        output = link_output(plan)
        if cleanup:
            remove_checkpoints(plan)
        return output
    finally:
        with contextlib.suppress(OSError):
            discard_job_files(plan.job)
