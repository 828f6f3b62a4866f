"""Following a running simulation: ``chkq.version`` publishes the next version of its output.

The first version of a followed run is an ordinary consolidation job of the
checkpoints completed so far (``chkq.plan`` with ``through``). Each later
one is one ``chkq.version`` task, whose id is its job's id: it extends the
published ``MODEL.h5`` with the checkpoints completed since, proves the new
version and renames it over the old (:mod:`chkq.consolidation.versions`),
then records the version as the job's result. The message names the job of
the version it extends; that job's record, written by a worker, says what
the published file must be and which checkpoint files it holds, so a
message cannot make a worker trust anything else.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from chkq.config.celery_app import get_app, get_settings
from chkq.consolidation.prepare import job_files
from chkq.consolidation.temporaries import check_job_id
from chkq.consolidation.versions import VERSION_KIND, publish_version
from chkq.errors import BadMessageTypeError, FollowError
from chkq.tasks.base import ChkqTask
from chkq.tasks.canvas import fail_signature
from chkq.tasks.consolidate import job_step
from chkq.tasks.parties import authorize_link, authorize_plan
from chkq.tasks.state import records

log = logging.getLogger("chkq.tasks")


def version_signature(out_dir: str, model: str, job: str, through: int,
                      previous: str | None, cleanup: bool = False,
                      party: dict[str, Any] | None = None, prepare_next: bool = False) -> Any:
    """The message of one version: ``chkq.version`` under the job's id, ``chkq.fail`` errback.

    ``prepare_next`` (a version that may not be the run's last) travels only when set.
    """
    kwargs: dict[str, Any] = {"through": through, "previous": previous, "cleanup": cleanup}
    if party is not None:
        kwargs["party"] = party
    if prepare_next:
        kwargs["prepare_next"] = True
    return version.si(out_dir, model, job, **kwargs).set(
        task_id=job, link_error=[fail_signature(out_dir, model, job)])


def previous_record(previous: str | None, out_dir: str, model: str) -> dict[str, Any] | None:
    """The record of job ``previous``'s version (None: no job named), checked to be this run's.

    A job that published a one-shot first version has no version record:
    its output's rows are then verified again before they are relied on.
    """
    if previous is None:
        return None
    done = records().finished_result(check_job_id(previous))
    if done is None:
        raise FollowError(f"job {previous} has not published a version: nothing to extend")
    if done.get("kind") != VERSION_KIND:
        return None
    if done.get("output") != str(job_files(out_dir, model, previous, extending=True).output):
        raise FollowError(f"job {previous} published a version of another run")
    return done


@get_app().task(name="chkq.version", bind=True, base=ChkqTask)
@job_step
def version(self: ChkqTask, out_dir: str, model: str, job: str, through: int,
            previous: str | None = None, cleanup: bool = False, party: Any = None,
            prepare_next: bool = False) -> dict[str, Any]:
    """Publish the version of ``MODEL.h5`` that holds the checkpoints up to ``through``.

    ``prepare_next``: then clone it for the next version, which takes the clone over.
    """
    if isinstance(through, bool) or not isinstance(through, int):
        raise BadMessageTypeError(f"through must be a checkpoint number, got {through!r}")
    if previous is not None and not isinstance(previous, str):
        raise BadMessageTypeError(f"previous must be a job id, got {previous!r}")
    for name, flag in (("cleanup", cleanup), ("prepare_next", prepare_next)):
        if not isinstance(flag, bool):
            raise BadMessageTypeError(f"{name} must be true or false, got {flag!r}")
    done = records().finished_result(job)
    if done is not None:
        return done
    authorize_plan(job, out_dir, model, cleanup, False, party, False)
    authorize_link(job, out_dir, model, cleanup, None)
    settings = get_settings()
    started = time.monotonic()
    result = publish_version(out_dir, model, job, through,
                             previous_record(previous, out_dir, model), cleanup=cleanup,
                             block_bytes=settings.block_bytes,
                             max_decoded_bytes=settings.max_decoded_bytes,
                             prepare_next=prepare_next)
    result["seconds"] = round(time.monotonic() - started, 3)
    result.setdefault("warnings", [])
    records().record_finished(job, result)
    log.info("job=%s published the version through checkpoint %d of %s (%d new rows, "
             "clone %s)", job, through, result["output"], result["new_rows"], result["clone"])
    return result
