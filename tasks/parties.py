"""Who a job runs for, checked where a job starts and again where it publishes and deletes.

With ``CHKQ_USER_KEYS_DIR`` set on a worker (:func:`chkq.config.security.user_keys_dir`),
a job's first message (``chkq.plan`` for a run directory, ``chkq.stage`` for
a store) must carry its submitter's credential (:mod:`chkq.identity`), and
the submitter must be able to do what the job does: read the run, write where
the output goes, delete what cleanup deletes. The accepted credential is
kept as the job's ``party`` record and checked again, against the job's own
records and the files as they are then, by ``chkq.link`` before it
publishes or deletes anything: a job record written by someone who holds the
signing key but not the user's key cannot widen what the job may do.

Without ``CHKQ_USER_KEYS_DIR`` nothing here refuses anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.config.celery_app import get_settings
from chkq.config.security import user_keys_dir
from chkq.identity import (
    NotPermittedError,
    Party,
    check_claim,
    check_destination,
    check_local_store,
    check_run_directory,
    issue_own,
    verify,
)
from chkq.jobs import keys
from chkq.stores.url import parse_store_url
from chkq.tasks.state import records

if TYPE_CHECKING:
    from chkq.staging import StoreRun
    from chkq.tasks.from_store import StoreJob

PLAN_TASK, STAGE_TASK = "chkq.plan", "chkq.stage"


@dataclass(frozen=True)
class Admitted:
    """A submitter whose credential verified, and the credential itself (to record)."""

    party: Party
    credential: dict[str, Any]


def plan_claim(job: str, out_dir: str, model: str, cleanup: bool,
               allow_gaps: bool) -> dict[str, Any]:
    """What a ``chkq.plan`` credential allows: one job on one run directory."""
    return {"job": job, "out_dir": out_dir, "model": model, "cleanup": cleanup,
            "allow_gaps": allow_gaps}


def stage_claim(job: str, source: str, model: str, run: str | None, to: str | None,
                cleanup: bool, allow_gaps: bool, verify_data: bool = False) -> dict[str, Any]:
    """What a ``chkq.stage`` credential allows: one job from one store to one destination.

    ``verify_data`` is claimed only when asked, so a credential without it
    (an older client's) still claims what it did; a message that adds or
    drops the flag then asks for something else than its credential allows.
    """
    claim = {"job": job, "source": source, "model": model, "run": run, "to": to,
             "cleanup": cleanup, "allow_gaps": allow_gaps}
    return {**claim, "verify_data": True} if verify_data else claim


def plan_credential(job: str, out_dir: str, model: str, cleanup: bool,
                    allow_gaps: bool) -> dict[str, Any] | None:
    """This process's user's credential for a directory job, or None without user keys."""
    return issue_own(PLAN_TASK, plan_claim(job, out_dir, model, cleanup, allow_gaps))


def stage_credential(job: str, source: str, model: str, run: str | None, to: str | None,
                     cleanup: bool, allow_gaps: bool,
                     verify_data: bool = False) -> dict[str, Any] | None:
    """This process's user's credential for a store job, or None without user keys."""
    return issue_own(STAGE_TASK, stage_claim(job, source, model, run, to, cleanup, allow_gaps,
                                             verify_data))


def _recorded(job: str) -> Any:
    return records().get(keys.job_record(job, "party"))


def _admit(job: str, credential: Any, task: str, keys_dir: Path) -> Admitted:
    """The submitter of ``job``: the message's credential, or the one its first step accepted.

    A message whose credential is not the recorded one is refused: a job
    runs for one party.
    """
    recorded = _recorded(job)
    if credential is None:
        credential = recorded
    if credential is None:
        raise NotPermittedError(
            f"job {job}: the {task} message carries no user credential, and this worker "
            "(CHKQ_USER_KEYS_DIR) runs jobs only for users who prove who they are: refused")
    if recorded is not None and recorded != credential:
        raise NotPermittedError(f"job {job} runs for user {recorded.get('user')!r}; a "
                                f"message with another credential is refused")
    max_age = None if recorded is not None else float(get_settings().result_expires)
    party, _ = verify(keys_dir, credential, task, max_age=max_age)
    return Admitted(party, credential)


def _keep(job: str, admitted: Admitted) -> None:
    records().set(keys.job_record(job, "party"), admitted.credential, nx=True)
    if _recorded(job) != admitted.credential:
        raise NotPermittedError(f"job {job} was claimed by another credential meanwhile")


def _check_plan_claim(claim: dict[str, Any], job: str, out_dir: str, model: str,
                      cleanup: bool, allow_gaps: bool) -> None:
    named = claim.get("out_dir")
    if not isinstance(named, str) or os.path.realpath(named) != out_dir:
        raise NotPermittedError(f"the {PLAN_TASK} message for job {job} names {out_dir!r}, "
                                f"its credential {named!r}: refused")
    check_claim({**claim, "out_dir": out_dir},
                plan_claim(job, out_dir, model, cleanup, allow_gaps), PLAN_TASK)


def authorize_plan(job: str, out_dir: str, model: str, cleanup: bool, allow_gaps: bool,
                   credential: Any, placed: bool) -> None:
    """Refuse a directory job its submitter may not run (before anything is read).

    ``placed``: the job is a store job's, on its worker's scratch directory
    (authorized by its stage step, whose credential must be recorded).
    """
    keys_dir = user_keys_dir()
    if keys_dir is None:
        return
    if placed:
        if _recorded(job) is None:
            raise NotPermittedError(f"store job {job} has no accepted user credential")
        return
    admitted = _admit(job, credential, PLAN_TASK, keys_dir)
    _check_plan_claim(admitted.credential["claim"], job, out_dir, model, cleanup, allow_gaps)
    check_run_directory(admitted.party, Path(out_dir), model, cleanup)
    _keep(job, admitted)


def authorize_stage(job: str, source: str, model: str, run: str | None, to: str | None,
                    cleanup: bool, allow_gaps: bool, credential: Any, *,
                    verify_data: bool = False) -> Admitted | None:
    """The submitter of a store job, if its message's credential allows it (None: no keys).

    Only the source store's directory is checked here, before it is listed;
    :func:`admit_store_run` checks the objects and the destination.
    """
    keys_dir = user_keys_dir()
    if keys_dir is None:
        return None
    admitted = _admit(job, credential, STAGE_TASK, keys_dir)
    check_claim(admitted.credential["claim"],
                stage_claim(job, source, model, run, to, cleanup, allow_gaps, verify_data),
                STAGE_TASK)
    root = parse_store_url(source).local_root
    if root is not None:
        check_local_store(admitted.party, Path(root), [], write=False, delete=False,
                          what="source")
    return admitted


def _check_store_rights(party: Party, run: StoreRun, destination: tuple[str, str],
                        cleanup: bool) -> None:
    root = parse_store_url(run.store_url).local_root
    if root is not None:
        files = [] if run.run_id is not None else [Path(root) / o.key for o in run.objects]
        check_local_store(party, Path(root), files, write=run.run_id is not None,
                          delete=cleanup and run.run_id is None, what="source")
    target = parse_store_url(destination[0]).local_root
    if target is not None:
        check_destination(party, Path(target), destination[1])


def admit_store_run(job: str, admitted: Admitted | None, run: StoreRun,
                    destination: tuple[str, str], cleanup: bool) -> None:
    """Refuse a store job whose submitter could not read its objects or publish where asked."""
    if admitted is None:
        return
    _check_store_rights(admitted.party, run, destination, cleanup)
    _keep(job, admitted)


def authorize_link(job: str, out_dir: str, model: str, cleanup: bool,
                   store: StoreJob | None) -> None:
    """Refuse to publish or delete unless the job's recorded credential allows it now.

    The credential is checked against the job's own records (the plan's
    directory and cleanup, or the store record's source, destination and
    cleanup), and the submitter's rights against the files as they are now.
    """
    keys_dir = user_keys_dir()
    if keys_dir is None:
        return
    credential = _recorded(job)
    if credential is None:
        raise NotPermittedError(f"job {job} has no accepted user credential: nothing was "
                                "published or deleted")
    if store is None:
        party, claim = verify(keys_dir, credential, PLAN_TASK, max_age=None)
        _check_plan_claim(claim, job, out_dir, model, cleanup, bool(claim.get("allow_gaps")))
        check_run_directory(party, Path(out_dir), model, cleanup)
        return
    from chkq.tasks.from_store import destination_of

    party, claim = verify(keys_dir, credential, STAGE_TASK, max_age=None)
    run = store.run
    asked = stage_claim(job, run.source, run.model, run.run_id, claim.get("to"),
                        store.cleanup, bool(claim.get("allow_gaps")), store.verify_data)
    check_claim(claim, asked, STAGE_TASK)
    if destination_of(run, claim.get("to")) != store.destination:
        raise NotPermittedError(f"store job {job} publishes to {store.output_url}, which its "
                                "credential does not name: refused")
    _check_store_rights(party, run, store.destination, store.cleanup)
