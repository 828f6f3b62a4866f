"""A merge cut into pieces by the task byte bound, on real workers, with and without faults.

The run has a gzip dataset whose file boundaries fall inside chunks (its
rows go through part files of encoded chunks), variable-length strings and
object references (their rows are copied file by file). With
``CHKQ_TASK_BYTES`` small, the merge takes several pieces, each a delivery
of ``chkq.merge`` under the same id. Each test checks what a user would:
the output holds every checkpoint's rows, its stored chunks are byte for
byte those of a merge done in one piece, and nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.config.celery_app import get_app
from chkq.config.routing import CONTROL_QUEUE
from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.merge import merge_items
from chkq.errors import JobCancelledError
from chkq.jobs.keys import deliveries as deliveries_key
from chkq.tasks.consolidate import task_id
from chkq.tasks.state import records
from chkq.workers.cancel import cancel_job
from chkq.workers.client import submit_consolidation
from support.h5runs import chunk_infos, make_run
from support.helpers import snapshot, wait_for
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import Cluster, leftovers

pytestmark = [pytest.mark.fault,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

#: The byte bound of copy units and merge pieces: a few part files a piece.
TASK_BYTES = 256 * 1024
PIECES = {"CHKQ_TASK_BYTES": str(TASK_BYTES)}
ROWS = 60001
JOB_SECONDS = 120


def build(f: h5py.File, n: int) -> None:
    """A checkpoint: gzip rows in small chunks, strings and references, ``ROWS + n`` rows."""
    rows = ROWS + 7 * n
    data = np.random.default_rng(n).integers(0, 50, size=(rows, 4)).astype("f4")
    f.create_dataset("x", data=data, maxshape=(None, 4), chunks=(16, 4), compression="gzip")
    f.create_dataset("names", data=[f"file{n}-row{i}" for i in range(40 + n)],
                     maxshape=(None,), chunks=(8,), dtype=h5py.string_dtype())
    f["grid"] = np.arange(5)
    f.create_dataset("refs", data=[f["grid"].ref, f["x"].ref] * 3, maxshape=(None,),
                     chunks=(4,), dtype=h5py.ref_dtype)


def make_pieces_run(run: Path, libver: str = "earliest") -> list[Path]:
    return make_run(run, build, checkpoints=3, libver=(libver, "latest"))


def one_piece_output(run: Path, tmp_path: Path) -> Path:
    """The same run consolidated here, with the same copy units, merged in one piece."""
    here = tmp_path / "one-piece"
    shutil.copytree(run, here)
    return consolidate_here(here, "run", task_bytes=TASK_BYTES)


def assert_same_output(output: Path, reference: Path, files: list[Path]) -> None:
    """``output`` holds every file's rows, in the chunks ``reference`` has, as it does.

    The stored bytes of a chunk are not compared: which deflate encoder a
    copy unit uses for a chunk cut by a file boundary is the copy's, not
    the merge's, and decoding gives the same rows either way.
    """
    with h5py.File(output) as out, h5py.File(reference) as ref:
        x, rx = out["x"], ref["x"]
        assert x.shape == rx.shape == (sum(ROWS + 7 * n for n in (1, 2, 3)), 4)
        chunks, expected = chunk_infos(x.id), chunk_infos(rx.id)
        assert ([(c.chunk_offset, c.filter_mask) for c in chunks]
                == [(c.chunk_offset, c.filter_mask) for c in expected])
        assert (x.compression, x.chunks) == (rx.compression, rx.chunks) == ("gzip", (16, 4))
        parts = []
        for path in files:
            with h5py.File(path) as f:
                parts.append(f["x"][()])
        assert np.array_equal(x[()], np.concatenate(parts))
        assert np.array_equal(x[()], rx[()])
        assert list(out["names"][()]) == list(ref["names"][()])
        assert list(out["names"][()])[-1] == b"file3-row42"
        assert [out[r].name for r in out["refs"][()]] == ["/grid", "/x"] * 9


def merge_deliveries(cluster: Cluster, job: str) -> dict[int, int]:
    """How often each piece of the merge (by its replacement nesting) was delivered."""
    counts = {}
    for nesting in range(200):
        raw = cluster.client().get(deliveries_key(task_id(job, "merge"), 0, nesting))
        if raw is None and nesting:
            break
        counts[nesting] = int(raw or 0)
    return counts


def items_merged(job: str) -> int:
    """The merge's items recorded as in the output."""
    return len(records().merge_items_done(job))


@pytest.mark.slow
def test_a_merge_in_pieces_gives_the_one_piece_output(make_cluster: Callable[..., Cluster],
                                                      tmp_path: Path) -> None:
    cluster = make_cluster()
    cluster.add_workers(1, "control,copy,verify", 2, PIECES)
    run = tmp_path / "run"
    files = make_pieces_run(run)
    reference = one_piece_output(run, tmp_path)
    job = submit_consolidation("run", run)
    output = job.wait_for_output(timeout=JOB_SECONDS)
    assert_same_output(output, reference, files)
    pieces = merge_deliveries(cluster, job.id)
    assert len(pieces) >= 3, pieces
    assert set(pieces.values()) == {1}, f"a piece was delivered twice: {pieces}"
    assert leftovers(run) == []


def merge_lines(worker: WorkerProcess, job: str) -> tuple[int, int]:
    """Pieces of ``job``'s merge the worker started, and those it ended (done or replaced)."""
    lines = [line for line in worker.log().splitlines() if f"task=chkq.merge job={job} " in line]
    started = sum(" start task=" in line for line in lines)
    return started, sum(" skip task=" in line or " end task=" in line for line in lines)


def opened(pid: int, path: Path) -> int:
    """How many of process ``pid``'s descriptors are open on ``path``."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
        except FileNotFoundError:
            continue
    return count


def stopped_inside_a_later_piece(worker: WorkerProcess, job: str) -> bool:
    """Freeze the pool process (SIGSTOP) if it has the output open in a piece after the first
    (through the piece's own descriptor, which HDF5 writes through); else False."""
    started, ended = merge_lines(worker, job)
    if started < 2 or ended == started:
        return False
    plan = records().recorded_plan(job)
    assert plan is not None
    (child,) = worker.child_pids()
    os.kill(child, signal.SIGSTOP)
    if merge_lines(worker, job)[1] < started and opened(child, plan.job.temp) >= 1:
        return True
    os.kill(child, signal.SIGCONT)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_pool_process_killed_inside_a_piece(make_cluster: Callable[..., Cluster],
                                           tmp_path: Path, libver: str) -> None:
    """SIGKILL of the pool process inside a later piece: that piece is done again.

    Files written under the latest format bounds have a superblock that
    HDF5 marks while the file is open for writing: the killed piece leaves
    the mark, which the piece run again must get past.
    """
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", 1, PIECES)
    run = tmp_path / "run"
    files = make_pieces_run(run, libver)
    reference = one_piece_output(run, tmp_path)
    job = submit_consolidation("run", run)
    wait_for(lambda: stopped_inside_a_later_piece(worker, job.id), JOB_SECONDS,
             "a later piece of the merge to run", interval=0.005)
    (child,) = worker.child_pids()
    os.kill(child, signal.SIGKILL)
    output = job.wait_for_output(timeout=JOB_SECONDS)
    assert_same_output(output, reference, files)
    pieces = merge_deliveries(cluster, job.id)
    assert max(pieces.values()) == 2, f"no piece was delivered again: {pieces}"
    assert leftovers(run) == []


@pytest.mark.slow
def test_worker_killed_between_pieces(make_cluster: Callable[..., Cluster],
                                      tmp_path: Path) -> None:
    """The only worker SIGKILLed while the next piece waits in the queue; a new one ends it."""
    cluster = make_cluster()
    (first,) = cluster.add_workers(1, "control,copy,verify", 1, PIECES)
    run = tmp_path / "run"
    files = make_pieces_run(run)
    reference = one_piece_output(run, tmp_path)
    job = submit_consolidation("run", run)
    wait_for(lambda: items_merged(job.id), JOB_SECONDS, "the first piece of the merge",
             interval=0.01)
    get_app().control.cancel_consumer(CONTROL_QUEUE, destination=[first.name], reply=True)
    wait_for(lambda: cluster.running(task_id(job.id, "merge")) is None, JOB_SECONDS,
             "the running piece to end")
    total = len(merge_items(records().recorded_plan(job.id)))  # type: ignore[arg-type]
    done = items_merged(job.id)
    assert 0 < done < total, (done, total)
    first.kill()
    cluster.add_workers(1, "control,copy,verify", 1, PIECES)
    output = job.wait_for_output(timeout=JOB_SECONDS + 15)
    assert_same_output(output, reference, files)
    assert leftovers(run) == []


@pytest.mark.slow
def test_a_job_cancelled_between_pieces_merges_no_more(make_cluster: Callable[..., Cluster],
                                                       tmp_path: Path) -> None:
    """``chkq cancel`` during a merge in pieces: no piece starts after it, nothing is left."""
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", 1, PIECES)
    run = tmp_path / "run"
    make_pieces_run(run)
    before = snapshot(run)
    job = submit_consolidation("run", run)
    wait_for(lambda: items_merged(job.id), JOB_SECONDS, "the first piece of the merge",
             interval=0.01)
    get_app().control.cancel_consumer(CONTROL_QUEUE, destination=[worker.name], reply=True)
    wait_for(lambda: cluster.running(task_id(job.id, "merge")) is None, JOB_SECONDS,
             "the running piece to end")
    cancel_job(job.id)
    get_app().control.add_consumer(CONTROL_QUEUE, destination=[worker.name], reply=True)
    started = merge_lines(worker, job.id)[0]
    with pytest.raises(JobCancelledError):
        job.wait_for_output(timeout=JOB_SECONDS)
    time.sleep(2)
    assert merge_lines(worker, job.id)[0] == started, "a piece started after the cancellation"
    assert snapshot(run) == before
    assert leftovers(run) == []
