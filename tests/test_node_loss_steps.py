"""A worker node killed outright in each step of a job, on both brokers: the job still ends right.

Two nodes of two pool processes each; the run is small (three files of
60,000 rows) and ``CHKQ_TASK_BYTES`` small, so that the copy and the
verification have several units and the merge several pieces. When a node
is seen running the step (its log has the step's start line and not its
end), the node's whole process group is frozen, the step checked to be
still under way, and the group SIGKILLed: main process and pool, as when a
machine dies. RabbitMQ hands the node's message on as soon as its
connection drops (the killed writer may not be gone yet); Redis after the
visibility timeout. Each test checks what a user would: the job's output
holds every checkpoint's rows, as a merge in one piece makes them, and
nothing is left beside it.

The merge is also killed in process at every kind of instant of a piece
(before each write, truncation, fsync, rename and removal it makes), and
the next delivery must finish it right.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np
import pytest
from test_merge_pieces import TASK_BYTES, assert_same_output, make_pieces_run, one_piece_output
from test_rabbitmq import AmqpCluster

from chkq.consolidation.copy_rows import copy_unit
from chkq.consolidation.merge import merge_items, merge_piece, next_piece
from chkq.consolidation.output_check import check_plan_output
from chkq.consolidation.plan import Plan
from chkq.consolidation.prepare import prepare
from chkq.consolidation.temporaries import JobFiles
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import submit_consolidation
from support.helpers import wait_for
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import FAULT_LIMITS, Cluster, leftovers
from support.plugins.rabbitmq import Vhost, amqp_vhost

__all__ = ["amqp_vhost"]

pytestmark = [pytest.mark.fault, pytest.mark.cluster,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

#: Small units: several copy and verify units, a merge of several pieces.
SMALL_UNITS = {**FAULT_LIMITS, "CHKQ_TASK_BYTES": str(TASK_BYTES)}
JOB_SECONDS = 150
#: The steps a node is killed in. The link step is left out: it ends in well under a second
#: on this run, so a node is caught in it only by chance (a run timed out waiting for one).
STEPS = ["plan", "copy", "merge", "verify"]


#: Limits for a node whose pool process gdb follows (a stop at each of its writes).
TRACED_UNITS = {**SMALL_UNITS, "CHKQ_SOFT_TIME_LIMIT": "40", "CHKQ_TIME_LIMIT": "45",
                "CHKQ_VISIBILITY_TIMEOUT": "50"}


class Nodes(Protocol):
    def start(self, name: str, env: dict[str, str] = ...) -> WorkerProcess: ...


class RedisNodes:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def start(self, name: str, env: dict[str, str] = SMALL_UNITS) -> WorkerProcess:
        worker, = self.cluster.add_workers(1, "control,copy,verify", 2, env,
                                           name=f"{name}-{uuid.uuid4().hex[:6]}@localhost")
        return worker


class AmqpNodes:
    def __init__(self, cluster: AmqpCluster) -> None:
        self.cluster = cluster

    def start(self, name: str, env: dict[str, str] = SMALL_UNITS) -> WorkerProcess:
        return self.cluster.add_worker("control,copy,verify", 2, env)


@pytest.fixture(params=["redis", "rabbitmq"])
def nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Nodes]:
    """Worker nodes on a Redis cluster of the test's own, or on a RabbitMQ vhost of its own."""
    if request.param == "redis":
        make_cluster: Callable[..., Cluster] = request.getfixturevalue("make_cluster")
        yield RedisNodes(make_cluster())
        return
    vhost: Vhost = request.getfixturevalue("amqp_vhost")
    redis_server: PrivateRedis = request.getfixturevalue("redis_server")
    log_dir = tmp_path / "amqp-logs"
    log_dir.mkdir()
    cluster = AmqpCluster(vhost, redis_server.url, log_dir)
    try:
        yield AmqpNodes(cluster)
    finally:
        for worker in cluster.workers:
            worker.kill()
        cluster.workers = []
        cluster.close()


def step_lines(worker: WorkerProcess, step: str, job: str) -> tuple[int, int]:
    """How many deliveries of ``job``'s ``step`` the worker started, and how many it ended."""
    lines = [line for line in worker.log().splitlines() if f"task=chkq.{step} job={job} " in line]
    return (sum(" start task=" in line for line in lines),
            sum(" end task=" in line or " skip task=" in line or " fail task=" in line
                for line in lines))


def job_lines(workers: list[WorkerProcess], job: str) -> str:
    """What each worker logged of ``job``: which step ran where, and what failed (HDF5's text)."""
    return "\n".join(f"{worker.name}: {line}" for worker in workers
                     for line in worker.log().splitlines() if f"job={job}" in line)


def killed_inside(workers: list[WorkerProcess], step: str, job: str) -> WorkerProcess | None:
    """SIGKILL the node (main process and pool) running ``job``'s ``step`` now, if one is."""
    for worker in workers:
        started, ended = step_lines(worker, step, job)
        if started <= ended or worker.process.poll() is not None:
            continue
        os.killpg(worker.process.pid, signal.SIGSTOP)
        started, ended = step_lines(worker, step, job)
        if started > ended:
            worker.kill()
            return worker
        os.killpg(worker.process.pid, signal.SIGCONT)
    return None


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("step", STEPS)
def test_a_node_killed_in_a_step_is_survived(nodes: Nodes, tmp_path: Path, step: str) -> None:
    first, second = nodes.start("w1"), nodes.start("w2")
    run = tmp_path / "run"
    files = make_pieces_run(run, "latest" if step == "merge" else "earliest")
    reference = one_piece_output(run, tmp_path)
    job = submit_consolidation("run", run)
    victim = wait_for(lambda: killed_inside([first, second], step, job.id), JOB_SECONDS,
                      f"a node to run the {step} step", interval=0.003)
    survivor = second if victim is first else first
    try:
        output = job.wait_for_output(timeout=JOB_SECONDS)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{job_lines([first, second], job.id)}") from exc
    assert_same_output(output, reference, files)
    assert step_lines(survivor, step, job.id)[0] >= 1, f"the {step} step was not run again"
    assert leftovers(run) == []


# ------------------------------------------------- the merge killed at every kind of instant


#: The calls through which a piece changes the output or its journal: the piece is
#: killed just before one of them.
CHANGING_CALLS = ("pwrite", "ftruncate", "fsync", "rename", "unlink")


def planned(run: Path) -> Plan:
    """A job of ``run`` planned and copied here, ready to merge."""
    plan = prepare(run, "run", uuid.uuid4().hex, task_bytes=TASK_BYTES)
    for unit in range(len(plan.copy_units)):
        copy_unit(plan, unit, lambda done: None)
    return plan


def merge_in_child(plan: Plan, piece: list[int], kill_at: int | None) -> int:
    """Run ``piece`` in a child process, SIGKILLed before its ``kill_at``-th changing call.

    Returns how many changing calls the piece made (when not killed), or -9.
    """
    context = multiprocessing.get_context("fork")
    counted = context.Value("i", 0)

    def child() -> None:
        def hooked(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                with counted.get_lock():
                    counted.value += 1
                    now = counted.value
                if kill_at is not None and now >= kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            return call

        for name in CHANGING_CALLS:
            setattr(os, name, hooked(name, getattr(os, name)))
        merge_piece(plan, merge_items(plan), piece)

    process = context.Process(target=child)
    process.start()
    process.join(120)
    assert process.exitcode is not None, "the merge piece did not end"
    if process.exitcode == -signal.SIGKILL:
        return -9
    assert process.exitcode == 0, f"the merge piece failed ({process.exitcode})"
    return int(counted.value)


def assert_same_rows(output: Path, reference: Path) -> None:
    """``output`` holds the rows ``reference`` (a merge in one piece) holds, dataset by dataset."""
    with h5py.File(output) as out, h5py.File(reference) as ref:
        assert np.array_equal(out["x"][()], ref["x"][()])
        assert list(out["names"][()]) == list(ref["names"][()])
        assert [out[r].name for r in out["refs"][()]] == [ref[r].name for r in ref["refs"][()]]


def finish_merge(plan: Plan, done: set[int], limit: int) -> None:
    items = merge_items(plan)
    while len(done) < len(items):
        piece = next_piece(items, done, limit)
        merge_piece(plan, items, piece)
        done |= set(piece)


def put_back(path: Path, content: bytes) -> None:
    """Give the file at ``path`` the bytes ``content`` again, in place (its inode kept)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, content, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_a_merge_piece_killed_at_any_instant_is_redone(tmp_path: Path, libver: str) -> None:
    """The second piece of a merge is killed before each kind of change it makes, spread over
    all of them (its writes, the journal's creation, the commit's writes and fsyncs, the
    journal's removal); the same piece run again, then the rest, gives the one-piece output.

    Each trial starts from the output as the first piece left it, put back in place (the
    merge checks the output is the file the planner made), with no journal.
    """
    limit = TASK_BYTES
    run = tmp_path / "run"
    make_pieces_run(run, libver)
    reference = one_piece_output(run, tmp_path)
    plan = planned(run)
    items = merge_items(plan)
    first = next_piece(items, set(), limit)
    merge_piece(plan, items, first)
    second = next_piece(items, set(first), limit)
    assert second, "the merge has one piece only: make the run larger"
    after_first = plan.job.temp.read_bytes()
    journal = plan.job.journal_path()
    calls = None
    trial = 0
    points: list[int] = [0]
    while trial < len(points):
        put_back(plan.job.temp, after_first)
        if calls is None:
            calls = merge_in_child(plan, second, None)
            assert calls > 8, calls
            points = [0, *sorted({*range(1, 8), *range(8, calls - 14, max(1, calls // 4)),
                                  *range(max(8, calls - 14), calls + 1)})]
            print(f"\nthe piece makes {calls} changing calls; killed before {points[1:]}")
            put_back(plan.job.temp, after_first)
        else:
            assert merge_in_child(plan, second, points[trial]) == -9
        finish_merge(plan, set(first), limit)
        check_plan_output(plan)
        assert_same_rows(plan.job.temp, reference)
        assert not journal.exists()
        trial += 1


# ------------------------------------- the node killed while a piece overwrites the output


def frozen_piece_writer(workers: list[WorkerProcess], job: str, temp: Path
                        ) -> tuple[WorkerProcess, int] | None:
    """A node whose pool process is inside a later piece of ``job``'s merge with the output
    open: the node frozen (SIGSTOP of its group), the node and that process; else None."""
    starts = [step_lines(worker, "merge", job) for worker in workers]
    if sum(started for started, _ in starts) < 2:
        return None
    for worker, (started, ended) in zip(workers, starts, strict=True):
        if started <= ended or worker.process.poll() is not None:
            continue
        os.killpg(worker.process.pid, signal.SIGSTOP)
        if step_lines(worker, "merge", job)[0] > step_lines(worker, "merge", job)[1]:
            for child in worker.child_pids():
                if output_descriptors(child, temp):
                    return worker, child
        os.killpg(worker.process.pid, signal.SIGCONT)
    return None


def output_descriptors(pid: int, path: Path) -> list[int]:
    """Process ``pid``'s descriptors open on ``path``."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                found.append(int(fd))
        except FileNotFoundError:
            continue
    return found


def kill_node_before_superblock(worker: WorkerProcess, child: int, temp: Path) -> None:
    """SIGKILL the frozen node as ``child`` is about to rewrite the output's superblock.

    A piece writes past the output's end until HDF5 closes the file; then
    it rewrites metadata the output has (index nodes, object headers) in
    place, and last the superblock (offset 0), which holds the file's end
    of allocation. The node is killed outright at the entry of the first
    write at offset 0 that follows a write below the output's size
    elsewhere (``pwrite64`` of the output's descriptors, caught by gdb on
    the pool process): the metadata is new, its end of allocation old.
    """
    fds = output_descriptors(child, temp)
    size = os.stat(temp).st_size
    same_fd = " || ".join(f"$rdi == {fd}" for fd in fds)
    trace = temp.parent.parent / f"gdb-{child}.log"
    script = trace.with_suffix(".gdb")
    script.write_text(
        "set pagination off\n"
        "handle all nostop noprint pass\n"
        "handle SIGSTOP nostop noprint nopass\n"
        "set $changed = 0\n"
        "catch syscall pwrite64\n"
        f"condition 1 ({same_fd}) && (($r10 > 0 && $r10 < {size} && ($changed = 1) && 0)"
        " || ($r10 == 0 && $changed))\n"
        f"commands 1\nshell kill -9 -{worker.process.pid}\nend\n"
        "continue\n")
    with open(trace, "wb") as sink:
        gdb = subprocess.Popen(["gdb", "-nx", "-batch", "-p", str(child), "-x", str(script)],
                               stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                               env={**os.environ, "SHELL": "/bin/sh"}, start_new_session=True)
    try:
        wait_for(lambda: "Catchpoint 1 (syscall" in trace.read_text(errors="replace"), 60,
                 "gdb to attach to the pool process")
        os.killpg(worker.process.pid, signal.SIGCONT)
        gdb.wait(60)
    finally:
        if gdb.poll() is None:
            gdb.kill()
    if worker.process.poll() is None:
        pytest.fail(f"the node was not killed: {trace.read_text(errors='replace')[-1500:]}")
    assert worker.process.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.integration
def test_a_node_killed_as_a_merge_piece_rewrites_the_output_is_survived(
        nodes: Nodes, tmp_path: Path) -> None:
    first, second = nodes.start("w1", TRACED_UNITS), nodes.start("w2", TRACED_UNITS)
    run = tmp_path / "run"
    files = make_pieces_run(run, "latest")
    reference = one_piece_output(run, tmp_path)
    job = submit_consolidation("run", run)
    temp = JobFiles(run, "run", job.id).temp
    victim, child = wait_for(lambda: frozen_piece_writer([first, second], job.id, temp),
                             JOB_SECONDS, "a later piece of the merge", interval=0.005)
    kill_node_before_superblock(victim, child, temp)
    survivor = second if victim is first else first
    try:
        output = job.wait_for_output(timeout=JOB_SECONDS)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{job_lines([first, second], job.id)}") from exc
    assert_same_output(output, reference, files)
    assert step_lines(survivor, "merge", job.id)[0] >= 1
    assert leftovers(run) == []
