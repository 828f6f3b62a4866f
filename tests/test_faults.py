"""Consolidation under real faults: killed processes, a restarted Redis, bad files, a full disk.

Every scenario runs real worker processes against a real redis-server and
injects a real fault (SIGKILL of a pool process or of a whole worker,
SIGKILL and restart of redis-server, files truncated, rewritten or replaced
under a running job, a full tmpfs, a task whose process is killed each time
it starts). Each then checks what a user would check: a correct output
(``assert_consolidated``) or a clear error with no ``MODEL.h5``, no
temporaries and the checkpoints untouched (``snapshot``), within a stated
time: never a hang.

Scenarios that kill processes or Redis get a cluster of their own (a
private redis-server and workers with short time limits and visibility
timeout); the others run on the session's worker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import pytest
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.routing import COPY_QUEUE, VERIFY_QUEUE
from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.errors import CheckpointChangedError, RunBusyError
from chkq.tasks.base import JobInterruptedError, PoisonMessageError
from chkq.tasks.canvas import consolidation_signature
from chkq.tasks.consolidate import task_id
from chkq.tasks.state import records
from chkq.workers.client import ConsolidationJob, JobLostError, submit_consolidation
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import (
    SLOW,
    SLOW_RUN,
    Cluster,
    checkpoints_only,
    leftovers,
)

# A result handle collected after its Redis was killed cannot unsubscribe: that
# is the fault injected here, not an error of the code under test.
pytestmark = [pytest.mark.fault,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

LIMITS = Settings(soft_time_limit=8, time_limit=10, visibility_timeout=12)

SLOW_DATASET = "spectra/spec"

# Time a job on SLOW_RUN takes with no fault, generously (2 busy cores).
JOB_SECONDS = 40


# ---------------------------------------------------------------- helpers


def slow_unit(job: ConsolidationJob, run: Path) -> int:
    """The copy unit of ``job`` that copies SLOW_DATASET (read from the job's plan)."""
    wait_for(lambda: state_of(job, "plan") == "SUCCESS", JOB_SECONDS, "the plan")
    plan = records().recorded_plan(job.id)
    return next(n for n, unit in enumerate(plan.copy_units)
                if any(plan.datasets[d].name == SLOW_DATASET for d, _, _ in unit.pieces))


def copying(job: ConsolidationJob, unit: int) -> Callable[[], bool]:
    """True while copy unit ``unit`` runs and has reported progress."""
    return lambda: state_of(job, "copy", unit) == "PROGRESS"


def state_of(job: ConsolidationJob, step: str, unit: int | None = None) -> str:
    return str(AsyncResult(task_id(job.id, step, unit), app=get_app()).state)






@contextmanager
def queue_paused(worker: WorkerProcess, queue: str) -> Iterator[None]:
    """``worker`` takes no task from ``queue`` for a while (Celery remote control)."""
    get_app().control.cancel_consumer(queue, destination=[worker.name], reply=True)
    try:
        yield
    finally:
        get_app().control.add_consumer(queue, destination=[worker.name], reply=True)


def flip_byte(path: Path, dataset: str, keep_mtime: bool) -> None:
    """Flip one byte inside the first stored chunk of ``dataset`` (uncompressed data).

    With ``keep_mtime`` the file's modification time is put back, as a
    faulty disk or a careless tool would leave it: size, time and inode are
    then all unchanged.
    """
    st = os.stat(path)
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 17)
        byte = fh.read(1)
        fh.seek(info.byte_offset + 17)
        fh.write(bytes([byte[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_app_sweeps_for_a_dead_workers_messages_steadily() -> None:
    """kombu 5.7 by default hands messages past the visibility timeout back only every
    100 s (10 s ticks, scanning on every 10th); the app scans on every tick."""
    options = get_app().conf.broker_transport_options or {}
    assert options.get("unacked_restore_throttle") == 1
    assert options.get("visibility_timeout") == Settings.from_env().visibility_timeout






def test_fault_limits_are_valid_settings() -> None:
    """The limits the fault clusters run with pass chkq's own checks (else workers refuse)."""
    LIMITS.check()
    assert LIMITS.takeover_bound <= LIMITS.visibility_timeout + 2
    assert Settings().takeover_bound <= Settings().visibility_timeout + 60


# ------------------------------------------------- 1. killed worker processes


@pytest.mark.slow
def test_pool_process_killed_while_copying(make_cluster: Callable[..., Cluster],
                                           tmp_path: Path) -> None:
    """SIGKILL of the pool process running a copy: it is delivered again at once.

    reject-on-worker-lost puts the message back as soon as the worker sees
    its pool process die, so the job ends correctly well before the
    visibility timeout would have mattered.
    """
    cluster = make_cluster()
    (copier,) = cluster.add_workers(1, "copy", 1, SLOW)
    cluster.add_workers(1, "control,verify", 2, SLOW)
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    job = submit_consolidation("run", run)
    unit = slow_unit(job, run)
    wait_for(copying(job, unit), JOB_SECONDS, "the long copy to run")
    (child,) = copier.child_pids()
    os.kill(child, signal.SIGKILL)
    killed = time.monotonic()
    output = job.wait_for_output(timeout=JOB_SECONDS)
    assert time.monotonic() - killed < LIMITS.visibility_timeout
    assert_consolidated(output, files)
    assert cluster.deliveries(job, "copy", unit) == 2, "the copy was not delivered again"
    assert leftovers(run) == []


@pytest.mark.slow
def test_whole_worker_killed_while_copying(make_cluster: Callable[..., Cluster],
                                           tmp_path: Path) -> None:
    """SIGKILL of a whole worker (main and pool) mid-copy, another worker alive.

    Nobody is left to reject the dead worker's message: it waits in Redis
    for the visibility timeout, then the surviving worker's next restore
    sweep hands it back. The job ends correctly within that bound plus the
    job's own time.
    """
    cluster = make_cluster()
    cluster.add_workers(2, "control,copy,verify", 1, SLOW)
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    job = submit_consolidation("run", run)
    unit = slow_unit(job, run)
    found: list[tuple[WorkerProcess, int]] = []

    def copy_running() -> bool:
        if copying(job, unit)():
            where = cluster.running(task_id(job.id, "copy", unit))
            found.extend([where] if where else [])
        return bool(found)

    wait_for(copy_running, JOB_SECONDS, "the long copy to run")
    victim, _ = found[0]
    victim.kill()
    killed = time.monotonic()
    output = job.wait_for_output(timeout=LIMITS.takeover_bound + JOB_SECONDS)
    elapsed = time.monotonic() - killed
    assert_consolidated(output, files)
    assert cluster.deliveries(job, "copy", unit) == 2, "the copy was not delivered again"
    assert elapsed > LIMITS.visibility_timeout - 3, "the dead worker's task came back early"
    assert leftovers(run) == []


# ------------------------------------------------------ 2. Redis restarted


def _resubmit_after_restart(run: Path) -> Path:
    """Submit the job again once Redis is back: the workers must have reconnected.

    celery/kombu 5.7 used to leave a worker that held an unacknowledged task
    alive but consuming nothing after the restart (``'NoneType' object has no
    attribute 'hostname'``); workers/runtime/broker_transport.py fixes that.
    """
    return submit_consolidation("run", run).wait_for_output(timeout=JOB_SECONDS)


def _kill_redis_mid_copy(cluster: Cluster, job: ConsolidationJob, run: Path) -> None:
    wait_for(copying(job, slow_unit(job, run)), JOB_SECONDS, "the long copy to run")
    cluster.redis.stop(kill=True)
    time.sleep(1.0)
    cluster.redis.start()


@pytest.mark.slow
def test_redis_killed_and_restarted_with_persistence(make_cluster: Callable[..., Cluster],
                                                     tmp_path: Path) -> None:
    """redis-server SIGKILLed mid-copy and restarted from its append-only file.

    The waiting client rides out the outage. Workers reconnect; Celery
    terminates the steps that were running when the connection broke
    (``worker_cancel_long_running_tasks_on_connection_loss``) and, the
    backend being down, records them as revoked: the job then fails with a
    clear JobInterruptedError and leaves the run as it was. (Were those steps
    handed back instead, the job would complete: either way, never a wrong
    or partial output.) The cluster is usable again at once.
    """
    cluster = make_cluster(persistent=True)
    cluster.add_workers(1, "control,copy,verify", 2, SLOW)
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    before = snapshot(run)
    job = submit_consolidation("run", run)
    _kill_redis_mid_copy(cluster, job, run)
    try:
        output = job.wait_for_output(timeout=LIMITS.takeover_bound + JOB_SECONDS)
    except JobInterruptedError as exc:
        assert "interrupted" in str(exc) and "submit the job again" in str(exc)
        checkpoints_only(before, run)
        output = _resubmit_after_restart(run)
    assert_consolidated(output, files)
    assert leftovers(run) == []


@pytest.mark.slow
def test_redis_killed_and_restarted_empty(make_cluster: Callable[..., Cluster],
                                          tmp_path: Path) -> None:
    """redis-server SIGKILLed mid-copy and restarted without persistence.

    The job's messages and state are gone: the waiting client is told so
    (JobLostError) and removes the job's temporaries; the run is as it was
    and a new submission succeeds.
    """
    cluster = make_cluster(persistent=False)
    cluster.add_workers(1, "control,copy,verify", 2, SLOW)
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    before = snapshot(run)
    job = submit_consolidation("run", run)
    _kill_redis_mid_copy(cluster, job, run)
    with pytest.raises(JobLostError, match="no longer knows job"):
        job.wait_for_output(timeout=JOB_SECONDS)
    time.sleep(2.0)  # whatever the workers were still doing has stopped by now
    checkpoints_only(before, run)
    output = _resubmit_after_restart(run)
    assert_consolidated(output, files)
    assert leftovers(run) == []


# ------------------------------------------- 3. the same job twice, resubmission


def _outcomes(jobs: list[ConsolidationJob]) -> tuple[list[Path], list[BaseException]]:
    outputs: list[Path] = []
    errors: list[BaseException] = []
    for job in jobs:
        try:
            outputs.append(job.wait_for_output(timeout=JOB_SECONDS))
        except Exception as exc:  # noqa: BLE001 - sorted out by the caller
            errors.append(exc)
    return outputs, errors


def test_same_consolidation_submitted_twice_at_once(worker: WorkerProcess,
                                                    tmp_path: Path) -> None:
    """Two jobs race for one output: one links it, the other gets FileExistsError.

    A second submission while the first is queued is refused at once, naming it; two
    clients that both pass that check at the same instant (the second job sent as its
    client sends it) still end with one output, the other job refused at the link."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=300))
    before = snapshot(tmp_path)
    first = submit_consolidation("run", tmp_path)
    racing = uuid.uuid4().hex
    records().record_submitted(racing, "run", str(tmp_path))
    consolidation_signature(str(tmp_path), "run", racing, False).apply_async()
    busy = f"already being consolidated by job ({first.id}|{racing})"
    with pytest.raises(RunBusyError, match=busy):
        submit_consolidation("run", tmp_path)
    outputs, errors = _outcomes([first, ConsolidationJob(racing, app=first.app)])
    assert len(outputs) == 1, errors
    assert len(errors) == 1 and isinstance(errors[0], FileExistsError), errors
    assert "run.h5" in str(errors[0])
    assert_consolidated(outputs[0], files)
    after = snapshot(tmp_path)
    after.pop("run.h5")
    assert after == before, "temporaries left, or checkpoints touched"


def test_resubmitted_after_a_failure_and_after_success(worker: WorkerProcess,
                                                       tmp_path: Path) -> None:
    """A job fails midway (a checksum error in the last file); fixed and resubmitted, it
    succeeds with nothing left from the first attempt; submitted once more, it is refused."""
    shape = RunShape(checkpoints=3, trials=600, fletcher32=True, chunk_rows=64)
    files = make_run(tmp_path, "run", shape)
    good = files[-1].read_bytes()
    flip_byte(files[-1], "spectra/spec", keep_mtime=False)
    before = snapshot(tmp_path)
    with pytest.raises(Exception, match=r"(?i)checksum|fletcher|filter|read"):
        submit_consolidation("run", tmp_path).wait_for_output(timeout=JOB_SECONDS)
    checkpoints_only(before, tmp_path)
    files[-1].write_bytes(good)
    output = submit_consolidation("run", tmp_path).wait_for_output(timeout=JOB_SECONDS)
    assert_consolidated(output, files)
    assert leftovers(tmp_path) == []
    linked = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="run.h5"):
        submit_consolidation("run", tmp_path).wait_for_output(timeout=JOB_SECONDS)
    assert snapshot(tmp_path) == linked


# ---------------------------------------------- 4. checkpoints damaged or changed


def test_truncated_checkpoint_is_named(worker: WorkerProcess, tmp_path: Path) -> None:
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, trials=400))
    os.truncate(files[1], files[1].stat().st_size // 2)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"run_chk00002\.h5"):
        submit_consolidation("run", tmp_path).wait_for_output(timeout=JOB_SECONDS)
    checkpoints_only(before, tmp_path)


def _replace_same_content(path: Path) -> None:
    """Replace ``path`` by a new file (new inode) with the very same bytes."""
    fresh = path.with_name(path.name + ".new")
    shutil.copyfile(path, fresh)
    os.replace(fresh, path)


CHANGES: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: os.truncate(p, p.stat().st_size - 4096),
    "replaced": _replace_same_content,
    "rewritten": lambda p: flip_byte(p, "galaxy/actual_mass", keep_mtime=False),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_checkpoint_changed_after_planning(worker: WorkerProcess, tmp_path: Path,
                                           change: str) -> None:
    """A file truncated, replaced or rewritten between planning and copying: the job
    fails naming it (size, mtime or inode differ from the plan's), no output."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=3, trials=400))
    with queue_paused(worker, COPY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: state_of(job, "plan") == "SUCCESS", JOB_SECONDS, "the plan")
        CHANGES[change](files[1])
        before = snapshot(tmp_path)
        before = {k: v for k, v in before.items() if not k.startswith(".chkq-")}
    with pytest.raises(CheckpointChangedError, match=r"run_chk00002\.h5.*changed"):
        job.wait_for_output(timeout=JOB_SECONDS)
    checkpoints_only(before, tmp_path)


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-changed", "mtime-kept"])
def test_byte_flipped_in_a_checkpoint_after_copy(worker: WorkerProcess, tmp_path: Path,
                                                 keep_mtime: bool) -> None:
    """A byte of uncompressed data flipped in a checkpoint after its rows were copied,
    before verification. Whether or not the file's mtime is put back, its ctime tells:
    verification refuses the changed file, naming it."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, trials=400, nans=False))
    with queue_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: state_of(job, "merge") == "SUCCESS", JOB_SECONDS, "copy and merge")
        flip_byte(files[1], "galaxy/actual_mass", keep_mtime=keep_mtime)
        before = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(".chkq-")}
    with pytest.raises(CheckpointChangedError, match=r"run_chk00002\.h5.*changed"):
        job.wait_for_output(timeout=JOB_SECONDS)
    checkpoints_only(before, tmp_path)


def test_byte_flipped_before_planning_is_copied_faithfully(worker: WorkerProcess,
                                                           tmp_path: Path) -> None:
    """What cannot be detected: uncompressed data without checksums damaged *before*
    the job. chkq copies and verifies the rows as they are on disk (only fletcher32, or
    a change after planning, can reveal such damage)."""
    files = make_run(tmp_path, "run", RunShape(checkpoints=2, trials=400, nans=False))
    with h5py.File(files[1], "r") as f:
        original = f["galaxy/actual_mass"][()]
    flip_byte(files[1], "galaxy/actual_mass", keep_mtime=True)
    output = submit_consolidation("run", tmp_path).wait_for_output(timeout=JOB_SECONDS)
    assert_consolidated(output, files)
    with h5py.File(output, "r") as out:
        tail = out["galaxy/actual_mass"][400:]
    assert tail.tobytes() != original.tobytes()


# ----------------------------------------------------------------- 5. disk full


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB tmpfs (root may mount one here); skipped where mounting is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_disk_full_while_writing_the_output(worker: WorkerProcess, small_disk: Path) -> None:
    """The checkpoints fit on the disk, the output does not: ENOSPC fails the job
    cleanly, its temporaries are removed and the space is given back."""
    files = make_run(small_disk, "run", RunShape(checkpoints=2, trials=7000, spec_columns=64))
    used = shutil.disk_usage(small_disk).used
    assert used > 10 * 2**20, "the checkpoints should fill more than half the disk"
    before = snapshot(small_disk)
    with pytest.raises(OSError, match=r"(?i)no space left|errno 28|errno = 28"):
        submit_consolidation("run", small_disk).wait_for_output(timeout=JOB_SECONDS)
    checkpoints_only(before, small_disk)
    assert shutil.disk_usage(small_disk).used <= used + 2**20
    assert len(files) == 2


# ------------------------------------------------------------ 6. poison message


@pytest.mark.slow
def test_task_that_kills_its_worker_every_time(make_cluster: Callable[..., Cluster],
                                               tmp_path: Path) -> None:
    """Every time a copy task starts, its pool process is SIGKILLed. After
    CHKQ_MAX_REDELIVERIES deliveries the next one fails the job with
    PoisonMessageError instead of looping; another job runs meanwhile and succeeds."""
    max_deliveries = 3
    cluster = make_cluster()
    env = {**SLOW, "CHKQ_MAX_REDELIVERIES": str(max_deliveries)}
    cluster.add_workers(1, "copy", 2, env)
    cluster.add_workers(1, "control,verify", 2, env)
    poisoned_run, other_run = tmp_path / "poisoned", tmp_path / "other"
    make_run(poisoned_run, "run", SLOW_RUN)
    other_files = make_run(other_run, "run", RunShape(checkpoints=2, trials=200))
    before = snapshot(poisoned_run)
    poisoned = submit_consolidation("run", poisoned_run)
    other = submit_consolidation("run", other_run)
    unit = slow_unit(poisoned, poisoned_run)
    victim = task_id(poisoned.id, "copy", unit)
    stop = threading.Event()
    kills: list[int] = []

    def killer() -> None:
        """SIGKILL the pool process of every delivery of the victim task (as it starts)."""
        while not stop.is_set():
            count = cluster.deliveries(poisoned, "copy", unit)
            if len(kills) < count <= max_deliveries:
                where = cluster.running(victim)
                if where is not None:
                    os.kill(where[1], signal.SIGKILL)
                    kills.append(where[1])
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with pytest.raises(PoisonMessageError, match=rf"delivered {max_deliveries + 1} times"):
            poisoned.wait_for_output(timeout=JOB_SECONDS + 10 * max_deliveries)
        output = other.wait_for_output(timeout=JOB_SECONDS)
    finally:
        stop.set()
        thread.join(5)
    assert len(kills) == max_deliveries
    assert cluster.deliveries(poisoned, "copy", unit) == max_deliveries + 1
    checkpoints_only(before, poisoned_run)
    assert_consolidated(output, other_files)
    assert leftovers(other_run) == []


# ---------------------------------------------------------------------- 7. load


@pytest.mark.slow
def test_fifty_concurrent_consolidations_on_eight_processes(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """2 workers x 4 processes, 50 small jobs submitted at once: all complete and verify."""
    cluster = make_cluster()
    cluster.add_workers(2, "control,copy,verify", 4)
    runs = []
    for n in range(50):
        shape = RunShape(checkpoints=2, writers=2 if n % 2 else 0, trials=30 + n, seed=n)
        runs.append((tmp_path / f"run{n:02d}", make_run(tmp_path / f"run{n:02d}", "run", shape)))
    started = time.monotonic()
    jobs = [submit_consolidation("run", directory) for directory, _ in runs]
    outputs = [job.wait_for_output(timeout=240 - (time.monotonic() - started)) for job in jobs]
    for (directory, files), output in zip(runs, outputs, strict=True):
        assert output == directory / "run.h5"
        assert_consolidated(output, files)
        assert leftovers(directory) == []
