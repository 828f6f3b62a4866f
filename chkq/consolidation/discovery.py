"""Finding a run's checkpoints in its output directory.

Checkpoint ``NNNNN`` (exactly five digits) of model ``MODEL`` is a file
``MODEL_chkNNNNN.h5`` or a directory ``MODEL_chkNNNNN/`` of ``.h5`` files,
one per writer. The file wins over a directory with the same number;
checkpoints come in ascending number, files in a directory in name order;
anything else is ignored. A checkpoint entry that is a symbolic link is
refused: it could point out of the run directory, and cleanup deletes
checkpoints.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chkq.errors import (
    BadCheckpointError,
    BadNameError,
    CheckpointGapError,
    NoCheckpointsError,
    RunNotADirectoryError,
    RunNotFoundError,
    RunNotReadableError,
)
from chkq.rundir import RunDir

_BAD_MODEL = re.compile(r"[/\\\x00]")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: its number, where it is, and its files in order."""

    number: int
    path: Path
    files: tuple[Path, ...]

    @property
    def is_directory(self) -> bool:
        """Whether the checkpoint is a directory of files, as discovery found it."""
        return len(self.files) != 1 or str(self.files[0]) != str(self.path)


def check_model_name(model: str) -> str:
    """Return ``model`` if it can name files in one directory, else raise ValueError.

    A model name reaches chkq from users and from task messages: one with a
    path separator, ``..`` or a NUL could make a task touch files outside
    the run's directory.
    """
    if not isinstance(model, str) or not model or model in {".", ".."}:
        raise BadNameError(f"invalid model name {model!r}: it must be a non-empty file name")
    if _BAD_MODEL.search(model) or ".." in model or model.startswith("."):
        raise BadNameError(
            f"invalid model name {model!r}: it must not contain '/', '\\', '..', NUL "
            "or start with '.'"
        )
    return model


def check_out_dir(out_dir: str | Path) -> Path:
    """Return ``out_dir`` as an absolute path if it is an existing directory."""
    path = Path(out_dir).expanduser()
    if not path.exists():
        raise RunNotFoundError(f"output directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise RunNotADirectoryError(f"output directory {str(path)!r} is not a directory")
    return path.absolute()


def _refuse_link(entry: os.DirEntry[str], folder: Path) -> None:
    if entry.is_symlink():
        raise BadCheckpointError(
            f"checkpoint {str(folder / entry.name)!r} is a symbolic link: chkq does not follow "
            "links in a run directory (copy the checkpoint in instead)")


def checkpoint_pattern(model: str) -> re.Pattern[str]:
    """The name of checkpoint entries of ``model``: ``MODEL_chkNNNNN`` + optional ``.h5``."""
    return re.compile(re.escape(model) + r"_chk(\d{5})(\.h5)?")


def find_checkpoints(out_dir: str | Path, model: str,
                     run: RunDir | None = None) -> list[Checkpoint]:
    """List ``model``'s checkpoints in ``out_dir``, in the order they are consolidated.

    Returns an empty list when there are none; the caller decides whether that
    is an error. A checkpoint directory with no ``.h5`` file in it is kept (with
    no files) so that validation can name it. ``run``: ``out_dir`` already
    opened (the job's planning reads the run through one descriptor).
    """
    directory = check_out_dir(out_dir)
    check_model_name(model)
    pattern = checkpoint_pattern(model)
    # os.scandir: the entries' types come with the listing (no stat per entry, which
    # dominated listing a run of thousands of files). Directories are
    # listed through descriptors opened without following a link at any level.
    if run is not None:
        return _listed(run, directory, pattern)
    try:
        opened = RunDir.open(directory)
    except PermissionError as exc:
        raise unreadable("run directory", directory, exc) from None
    with opened:
        return _listed(opened, directory, pattern)


#: Any model's checkpoint entry, the model's name first.
_ANY_CHECKPOINT = re.compile(r"(.+)_chk\d{5}(?:\.h5)?")
#: Most model names a refusal lists.
MODELS_SHOWN = 20


def models_in(out_dir: str | Path, run: RunDir | None = None) -> list[str]:
    """The models whose checkpoints ``out_dir`` holds, sorted (``[]`` if it cannot be listed).

    For a refusal that names the models a mistyped name could have meant, as
    ``chkq log restore`` lists a run's models.
    """
    try:
        names = os.listdir(run.fd) if run is not None else os.listdir(out_dir)
    except OSError:
        return []
    found = {m.group(1) for m in map(_ANY_CHECKPOINT.fullmatch, names) if m}
    return sorted(found)


def no_checkpoints(out_dir: str | Path, model: str, run: RunDir | None = None
                   ) -> NoCheckpointsError:
    """The error for a run directory that holds no checkpoint of ``model``, with its models."""
    models = models_in(out_dir, run)
    shown = ", ".join(repr(m) for m in models[:MODELS_SHOWN])
    if len(models) > MODELS_SHOWN:
        shown += f" and {len(models) - MODELS_SHOWN} more"
    return NoCheckpointsError(
        f"no checkpoints of model {model!r} in {str(out_dir)!r} "
        f"(expected {model}_chkNNNNN.h5 or {model}_chkNNNNN/"
        + (f"; its models: {shown})" if models else "; it holds no model's checkpoints)"))


def unreadable(what: str, path: Path, exc: OSError) -> RunNotReadableError:
    """The error for a directory of a run that this process may not open or list.

    Names the whole path (the system's message names only its last component)
    and who is asking, so that the user knows what to change.
    """
    uid = os.geteuid()
    try:
        who = f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        who = f"uid {uid}"
    return RunNotReadableError(
        f"cannot read {what} {str(path)!r}: permission denied to {who}, which must be able "
        "to list and enter it: check its mode and owner (chmod u+rx, or g+rx for a group "
        "of that user)")


def _listed(run: RunDir, directory: Path, pattern: re.Pattern[str]) -> list[Checkpoint]:
    files: dict[int, Path] = {}
    dirs: dict[int, Path] = {}
    try:
        entries = os.scandir(run.fd)
    except PermissionError as exc:
        raise unreadable("run directory", directory, exc) from None
    with entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None:
                continue
            number = int(match.group(1))
            _refuse_link(entry, directory)
            if match.group(2):
                if entry.is_file(follow_symlinks=False):
                    files[number] = directory / entry.name
            elif entry.is_dir(follow_symlinks=False):
                dirs[number] = directory / entry.name
    found = []
    for number in sorted(files.keys() | dirs.keys()):
        if number in files:
            found.append(Checkpoint(number, files[number], (files[number],)))
        else:
            folder = dirs[number]
            try:
                folder_fd = run.open_dir(folder)
            except PermissionError as exc:
                raise unreadable("checkpoint directory", folder, exc) from None
            try:
                try:
                    listing = os.scandir(folder_fd)
                except PermissionError as exc:
                    raise unreadable("checkpoint directory", folder, exc) from None
                with listing:
                    candidates = [p for p in listing
                                  if p.name.endswith(".h5") and not p.name.startswith(".")]
            finally:
                os.close(folder_fd)
            for member in candidates:
                _refuse_link(member, folder)
            members = sorted(folder / p.name for p in candidates
                             if p.is_file(follow_symlinks=False))
            found.append(Checkpoint(number, folder, tuple(members)))
    return found


def missing_numbers(checkpoints: Sequence[Checkpoint]) -> list[int]:
    """Checkpoint numbers absent between the first and the last of ``checkpoints``.

    Names alone cannot show a checkpoint missing before the first or after
    the last one found.
    """
    present = {c.number for c in checkpoints}
    if not present:
        return []
    return [n for n in range(min(present), max(present) + 1) if n not in present]


def _ranges(numbers: list[int]) -> str:
    """``00002, 00005-00007`` for [2, 5, 6, 7]."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a:05d}" if a == b else f"{a:05d}-{b:05d}" for a, b in spans)


def check_numbering(checkpoints: Sequence[Checkpoint], model: str, *,
                    allow_gaps: bool = False) -> str | None:
    """Refuse a run whose checkpoint numbers have a gap; with ``allow_gaps``, describe it.

    A checkpoint missing in the middle (deleted, never written, moved away)
    would leave its rows out of the output without a word, and ``cleanup``
    would then delete the others: the gap is refused unless the caller
    accepts it.

    Returns
    -------
    str or None
        With ``allow_gaps``, a warning naming the missing numbers (None: no gap).

    Raises
    ------
    CheckpointGapError
        Naming the missing numbers, if there is a gap and ``allow_gaps`` is false.
    """
    missing = missing_numbers(checkpoints)
    if not missing:
        return None
    where = str(checkpoints[0].path.parent)
    first, last = checkpoints[0].number, checkpoints[-1].number
    what = (f"checkpoint{'s' if len(missing) > 1 else ''} {_ranges(missing)} of model "
            f"{model!r} {'are' if len(missing) > 1 else 'is'} missing in {where!r} (found "
            f"{len(checkpoints)} between {first:05d} and {last:05d})")
    them, their = ("them", "their") if len(missing) > 1 else ("it", "its")
    if allow_gaps:
        return f"{what}: consolidated without {them}"
    raise CheckpointGapError(
        f"{what}: {their} rows would be missing from the output; put {them} back, or accept "
        "the gap with --allow-gaps (Python: allow_gaps=True)")
