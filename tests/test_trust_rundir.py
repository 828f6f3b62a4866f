"""A run directory's owner swaps parts of it for symbolic links into another user's run.

Two real local users: the attacker owns the run directory; the victim has a private (0700)
run of their own, of the same model and skeleton, with rows of its own and an attribute
no output of the attacker's may ever hold. The worker runs as root (a service account that
can read both runs). At every stage of a job — after discovery, during the copy, before
verification, before the whole-output check, before the link and cleanup — the attacker
replaces a checkpoint directory, a checkpoint file or the directory above the run by a
symbolic link into the victim's run. Each swap is made by the attacker's own process, at a
point made deterministic by pausing a queue's consumers (or, inside one task, by the task's
own progress callback). The job must fail with an error naming what was swapped, or end
with the attacker's own rows only; the victim's files are never changed or deleted; no
output holds any of the victim's bytes.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.routing import CONTROL_QUEUE, COPY_QUEUE, VERIFY_QUEUE
from chkq.consolidation.checkpoint_files import open_checkpoint_id
from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.merge import merge_parts, remove_parts
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.prepare import prepare
from chkq.consolidation.run_scan import find_run, run_files, scan_files
from chkq.demo import RunShape, make_run
from chkq.errors import CheckpointChangedError
from chkq.jobs.proof import verify_unit_count
from chkq.rundir import RunDir
from chkq.tasks.consolidate import consolidation_signature
from chkq.tasks.state import records
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.cluster import WorkerProcess, consumers_paused
from support.plugins.users import LocalUser

MODEL = "run"
SECRET = "victim-private-attribute"
SHAPE = RunShape(checkpoints=3, writers=2, trials=40, empty_writer=False)
VICTIM_SHAPE = RunShape(checkpoints=3, writers=2, trials=40, empty_writer=False, seed=4242)
TIMEOUT = 90

#: What the attacker swaps: a checkpoint directory, a checkpoint file, the directory above.
KINDS = ("directory", "file", "parent")


@dataclass
class Scene:
    """The attacker's run, the victim's private run, and what must stay true of both."""

    attacker: LocalUser
    victim: LocalUser
    top: Path
    run: Path
    victim_top: Path
    expected: list[Path]
    victim_before: dict[str, str]

    def swapped(self, kind: str, checkpoint: int) -> tuple[Path, Path]:
        """The attacker's entry that ``kind`` replaces, and the victim's entry it points to."""
        folder = f"{MODEL}_chk{checkpoint:05d}"
        if kind == "parent":
            return self.top, self.victim_top
        if kind == "directory":
            return self.run / folder, self.victim_top / "r" / folder
        return (self.run / folder / "thread_0000.h5",
                self.victim_top / "r" / folder / "thread_0000.h5")

    def swap(self, kind: str, checkpoint: int) -> Path:
        """Make the swap as the attacker; return the attacker's entry that is now a link."""
        mine, theirs = self.swapped(kind, checkpoint)
        done = self.attacker.python(
            f"import os; os.rename({str(mine)!r}, {str(mine)!r} + '.orig'); "
            f"os.symlink({str(theirs)!r}, {str(mine)!r})")
        assert done.returncode == 0, done.stderr.decode()
        assert mine.is_symlink()
        return mine

    def outputs(self) -> list[Path]:
        """Every output or job file chkq could have written anywhere in either user's tree."""
        found = []
        for base in (self.top.parent, self.victim_top):
            for path in base.rglob("*"):
                if path.name == f"{MODEL}.h5" or path.name.startswith(".chkq-"):
                    found.append(path)
        return sorted(found)


def _files_below(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.h5"))


@pytest.fixture
def scene(local_users: tuple[LocalUser, LocalUser], tmp_path: Path) -> Iterator[Scene]:
    victim, attacker = local_users
    name = f"t{uuid.uuid4().hex[:10]}"
    base = attacker.mkdir(name, 0o755)
    top = base / "runs"
    make_run(top / "r", MODEL, SHAPE)
    attacker.chown_tree(base)
    victim_top = victim.mkdir(name, 0o700)
    for path in make_run(victim_top / "r", MODEL, VICTIM_SHAPE):
        with h5py.File(path, "r+") as f:
            f.attrs["owner"] = SECRET
    victim.chown_tree(victim_top)
    expected = tmp_path / "expected"
    shutil.copytree(top / "r", expected)
    yield Scene(attacker, victim, top, top / "r", victim_top, _files_below(expected),
                snapshot(victim_top))
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(victim_top, ignore_errors=True)


def _holds_secret(path: Path) -> bool:
    with h5py.File(path, "r") as f:
        found = [SECRET in str(f.attrs.get("owner", ""))]
        f.visititems(lambda _n, obj: found.append(SECRET in str(obj.attrs.get("owner", ""))))
    return any(found)


def assert_victim_safe(scene: Scene) -> None:
    """The victim's run is as it was, and no output anywhere holds its rows or attributes."""
    assert snapshot(scene.victim_top) == scene.victim_before
    for path in scene.outputs():
        if path.name == f"{MODEL}.h5" and path.is_file() and not path.is_symlink():
            assert not _holds_secret(path), path
            assert_consolidated(path, scene.expected)


def assert_no_temporaries(scene: Scene, kind: str) -> None:
    """No job file is left in the run directory (nor, when the attacker moved the directory
    above the run away, anywhere but in the moved directory, which is theirs)."""
    left = [p for p in scene.outputs() if p.name.startswith(".chkq-")]
    if kind == "parent":
        moved = scene.top.with_name(scene.top.name + ".orig")
        assert all(moved in p.parents for p in left), left
    else:
        assert left == []


def assert_names(error: BaseException, scene: Scene, kind: str, checkpoint: int) -> None:
    """The error is a clear refusal naming the swapped entry (or the run directory)."""
    assert isinstance(error, ValueError), repr(error)
    mine, _ = scene.swapped(kind, checkpoint)
    named = scene.run if kind == "parent" else mine
    assert str(named) in str(error), str(error)
    assert "symbolic link" in str(error) or kind == "parent", str(error)


# ------------------------------------------------------------------ the descriptor itself


def test_hdf5_reads_the_opened_file_after_its_directory_is_swapped(scene: Scene) -> None:
    """HDF5 re-opening ``/proc/self/fd/N`` lands on the opened inode, whatever the name holds."""
    path = scene.run / f"{MODEL}_chk00002" / "thread_0000.h5"
    with RunDir.open(scene.run) as run:
        fd = run.open_file(path)
        try:
            planned = os.fstat(fd)
            scene.swap("directory", 2)
            fid = open_checkpoint_id(path, fd)
            try:
                assert os.fstat(fid.get_vfd_handle()).st_ino == planned.st_ino
                assert "owner" not in h5py.File(fid).attrs
            finally:
                fid.close()
        finally:
            os.close(fd)
    with RunDir.open(scene.run) as run, \
            pytest.raises(CheckpointChangedError, match="symbolic link") as caught:
        run.open_file(path)
    assert str(path) in str(caught.value)
    assert_victim_safe(scene)


def test_paths_that_leave_the_run_directory_are_refused(scene: Scene) -> None:
    """A path read from a record is re-checked where it is opened: it must name a file below
    the run directory, with no ``..``, ``.`` or empty component."""
    victim_file = scene.victim_top / "r" / f"{MODEL}_chk00001" / "thread_0000.h5"
    with RunDir.open(scene.run) as run:
        climbing = os.path.relpath(victim_file, scene.run)
        for bad in (victim_file, scene.run / climbing, climbing, f"{MODEL}_chk00001/../../x.h5",
                    f"{MODEL}_chk00001//thread_0000.h5", "./x.h5", ""):
            with pytest.raises(ValueError, match="run directory"):
                run.open_file(bad)
    assert_victim_safe(scene)


# ------------------------------------------------------------------ inside one process


@pytest.mark.parametrize("kind", KINDS)
def test_swap_between_discovery_and_scan(scene: Scene, kind: str) -> None:
    checkpoints = find_run(scene.run, MODEL)
    scene.swap(kind, 2)
    with pytest.raises(ValueError) as caught:
        scan_files(run_files(checkpoints), scene.run)
    if kind == "parent":
        assert "resolves to" in str(caught.value) and str(scene.run) in str(caught.value)
    else:
        assert_names(caught.value, scene, kind, 2)
    assert_victim_safe(scene)
    assert_no_temporaries(scene, kind)


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_swap_before_the_template_is_copied_into_the_skeleton(scene: Scene, kind: str) -> None:
    checkpoints = find_run(scene.run, MODEL)
    scanned = scan_files(run_files(checkpoints), scene.run)
    scene.swap(kind, 3)
    with pytest.raises(ValueError) as caught:
        prepare(scene.run, MODEL, uuid.uuid4().hex, run=(checkpoints, scanned))
    assert_names(caught.value, scene, kind, 3)
    assert_victim_safe(scene)
    assert_no_temporaries(scene, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_swap_during_a_copy(scene: Scene, kind: str) -> None:
    """The swap happens inside the copy task, after its first file's rows were copied."""
    plan = prepare(scene.run, MODEL, uuid.uuid4().hex, task_files=64)
    unit = next(i for i, u in enumerate(plan.copy_units) if len(u.pieces) and u.part is None)
    swapped: list[bool] = []

    def progress(_rows: int) -> None:
        if not swapped:
            swapped.append(True)
            scene.swap(kind, 2)

    try:
        if kind == "parent":
            # The task holds the run directory's descriptor: it goes on reading the
            # attacker's own files, and the next step refuses the directory now named.
            copy_unit(plan, unit, progress)
            assert swapped
            with pytest.raises(CheckpointChangedError, match="resolves to"):
                merge_parts(plan)
        else:
            with pytest.raises(ValueError) as caught:
                copy_unit(plan, unit, progress)
            assert swapped
            assert_names(caught.value, scene, kind, 2)
    finally:
        moved = scene.top.with_name(scene.top.name + ".orig")
        for directory in (scene.run, moved / "r"):
            for temp in directory.glob(".chkq-*"):
                temp.unlink()
    assert_victim_safe(scene)


def test_run_directory_replaced_after_planning(scene: Scene) -> None:
    """The planned directory itself, replaced by a link or by another directory, is refused."""
    plan = prepare(scene.run, MODEL, uuid.uuid4().hex)
    moved = scene.run.with_name("r.orig")
    done = scene.attacker.python(
        f"import os; os.rename({str(scene.run)!r}, {str(moved)!r}); "
        f"os.symlink({str(scene.victim_top / 'r')!r}, {str(scene.run)!r})")
    assert done.returncode == 0, done.stderr.decode()
    with pytest.raises(CheckpointChangedError, match="resolves to"):
        copy_unit(plan, 0)
    os.unlink(scene.run)
    os.rename(moved, scene.run)
    done = scene.attacker.python(
        f"import os; os.rename({str(scene.run)!r}, {str(moved)!r}); "
        f"os.mkdir({str(scene.run)!r})")
    assert done.returncode == 0, done.stderr.decode()
    with pytest.raises(CheckpointChangedError, match="no longer the directory the job"):
        copy_unit(plan, 0)
    for temp in moved.glob(".chkq-*"):
        temp.unlink()
    assert_victim_safe(scene)


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_swap_before_the_whole_output_check(scene: Scene, kind: str) -> None:
    plan = prepare(scene.run, MODEL, uuid.uuid4().hex)
    try:
        for unit in range(len(plan.copy_units)):
            copy_unit(plan, unit)
        merge_parts(plan)
        remove_parts(plan)
        scene.swap(kind, 3)
        with pytest.raises(ValueError) as caught:
            check_plan_output(plan)
        assert_names(caught.value, scene, kind, 3)
    finally:
        for temp in scene.run.glob(".chkq-*"):
            temp.unlink()
    assert_victim_safe(scene)


# ------------------------------------------------------------------ real workers


def _submit(scene: Scene) -> str:
    job = uuid.uuid4().hex
    consolidation_signature(str(scene.run), MODEL, job, True).apply_async()
    return job


def _outcome(job: str) -> BaseException | dict[str, object]:
    try:
        return dict(AsyncResult(job, app=get_app()).get(timeout=TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return exc


def _all_verified(job: str) -> bool:
    plan = records().recorded_plan(job)
    return plan is not None and len(records().verified(job)) == verify_unit_count(plan)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", ["copy", "verify", "whole-output"])
def test_swap_while_a_job_runs(scene: Scene, worker: WorkerProcess, stage: str,
                               kind: str) -> None:
    """Swapped after planning (before the copies) or after the merge (before verification):
    the job fails, naming what was swapped, and leaves nothing behind."""
    queue, checkpoint = {"copy": (COPY_QUEUE, 2), "verify": (VERIFY_QUEUE, 1),
                         "whole-output": (VERIFY_QUEUE, 3)}[stage]
    with consumers_paused(worker, queue):
        job = _submit(scene)
        if stage == "copy":
            wait_for(lambda: records().recorded_plan(job), TIMEOUT, "the plan")
        else:
            wait_for(lambda: records().merged(job), TIMEOUT, "the merge")
        scene.swap(kind, checkpoint)
    result = _outcome(job)
    if stage == "verify" and kind != "parent" and isinstance(result, dict):
        # Small files are verified against the digest their scan took, without being
        # opened again; then the output holds the attacker's rows and cleanup keeps the link.
        assert_kept(result, scene, kind, checkpoint)
    else:
        assert isinstance(result, BaseException), result
        assert_names(result, scene, kind, checkpoint)
        wait_for(lambda: records().failure(job), TIMEOUT, "the recorded failure")
    assert_victim_safe(scene)
    assert_no_temporaries(scene, kind)


def assert_kept(result: dict[str, object], scene: Scene, kind: str, checkpoint: int) -> None:
    """The job succeeded with the attacker's rows; cleanup kept the swapped entry, saying so."""
    output = Path(str(result["output"]))
    assert output == scene.run / f"{MODEL}.h5"
    assert not _holds_secret(output)
    assert_consolidated(output, scene.expected)
    mine, _ = scene.swapped(kind, checkpoint)
    assert mine.is_symlink()
    warnings = result["warnings"]
    assert isinstance(warnings, list)
    assert any(str(mine) in str(w) for w in warnings), warnings


@pytest.mark.parametrize("kind", KINDS)
def test_swap_before_the_link_and_cleanup(scene: Scene, worker: WorkerProcess,
                                          kind: str) -> None:
    """Everything verified, then the swap: the output holds the attacker's rows only, and
    cleanup deletes nothing of the victim's (the swapped entry is kept, with a warning)."""
    verify_paused = consumers_paused(worker, VERIFY_QUEUE)
    verify_paused.__enter__()
    try:
        job = _submit(scene)
        wait_for(lambda: records().merged(job), TIMEOUT, "the merge")
        with consumers_paused(worker, CONTROL_QUEUE):
            verify_paused.__exit__(None, None, None)
            verify_paused = None
            wait_for(lambda: _all_verified(job), TIMEOUT, "every verification")
            scene.swap(kind, 2)
    finally:
        if verify_paused is not None:
            verify_paused.__exit__(None, None, None)
    result = _outcome(job)
    if kind == "parent":
        assert isinstance(result, BaseException), result
        assert_names(result, scene, kind, 2)
    else:
        assert isinstance(result, dict), result
        assert_kept(result, scene, kind, 2)
    assert_victim_safe(scene)
    assert_no_temporaries(scene, kind)
