"""Paths read from job records, checked again where they are used, whoever wrote them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.access import check_allowed
from chkq.consolidation.discovery import Checkpoint, checkpoint_pattern
from chkq.errors import BadMessageError

if TYPE_CHECKING:
    from chkq.consolidation.plan import Plan


def check_recorded_path(path: Any, out_dir: str, model: str, what: str) -> Path:
    """``path``, read from a job record, if it names a checkpoint file of ``model`` in ``out_dir``.

    By discovery's rules: ``OUT_DIR/MODEL_chkNNNNN.h5`` or
    ``OUT_DIR/MODEL_chkNNNNN/NAME.h5`` (``NAME`` not starting with a dot),
    spelled exactly (absolute, no ``..``, ``.`` or doubled ``/``).
    ``out_dir`` is a directory with its links resolved, checked against the
    allowed roots by the caller (once, not per file: a path spelled so lies
    lexically inside it, and discovery refuses checkpoints that are links and
    no open follows one).

    Raises
    ------
    BadMessageError
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
                               what: str, allowed_roots: Any) -> list[Checkpoint]:
    """``checkpoints`` read from a job record, if each is one of ``model``'s in ``out_dir``.

    Every file passes :func:`check_recorded_path`; a checkpoint is its file
    (``MODEL_chkNNNNN.h5``) or the directory holding its files, and its
    number is the one in its name. ``out_dir`` must resolve inside
    ``allowed_roots`` (PermissionError if not).
    """
    check_allowed(out_dir, allowed_roots)
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
                                  f"{str(checkpoint.path)!r} with files "
                                  f"{[str(f) for f in files]}, which is not a checkpoint of "
                                  f"model {model!r} in {out_dir!r}: refused")
    return checkpoints


def check_plan_paths(plan: Plan, job: str, what: str, allowed_roots: Any) -> Plan:
    """``plan`` if every path it names is one of its run's checkpoints (BadMessageError if not)."""
    if plan.job_id != job:
        raise BadMessageError(f"{what} is the plan of job {plan.job_id!r}: refused")
    if not isinstance(plan.out_dir, str) or os.path.realpath(plan.out_dir) != plan.out_dir:
        raise BadMessageError(
            f"{what} names a run directory {plan.out_dir!r} that is not resolved: refused")
    check_allowed(plan.out_dir, allowed_roots)
    try:
        named = {str(check_recorded_path(f[0], plan.out_dir, plan.model, what))
                 for f in plan.files}
    except (TypeError, IndexError):
        raise BadMessageError(f"{what} lists files malformed: refused") from None
    if plan.reference_file not in named:
        raise BadMessageError(f"{what} names a template {plan.reference_file!r} that is not one "
                              "of its files: refused")
    for entry in plan.checkpoints:
        folder = entry[1] if isinstance(entry, list) and len(entry) == 3 else None
        if not isinstance(folder, str) or os.path.normpath(folder) != folder or \
                not (Path(folder).parent == Path(plan.out_dir)
                     and checkpoint_pattern(plan.model).fullmatch(Path(folder).name)):
            raise BadMessageError(f"{what} names checkpoint {entry!r}, which is not one of model "
                                  f"{plan.model!r} in {plan.out_dir!r}: refused")
    return plan
