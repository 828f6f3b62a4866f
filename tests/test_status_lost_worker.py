"""``chkq status`` shows a task whose worker is gone, and when it runs again.

A real job is held in its copy step (the copy worker waits in ``open`` on a
checkpoint the test holds a write lease on), then the copy worker's whole
process group is SIGKILLed, as when its node dies. While it lived, ``chkq
status`` said on which worker the copy ran; now it must say the worker is
gone and when the broker hands the copy to another worker: by the
visibility timeout on Redis, at once on RabbitMQ. A worker started then
finishes the job with a correct output and no temporaries left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chkq.demo import RunShape, make_run
from chkq.workers.broker import PrivateRedis
from support.helpers import assert_consolidated, snapshot, wait_for, write_lease
from support.plugins.rabbitmq import Vhost, amqp_vhost

#: Every test here kills a process or cuts a server off.
pytestmark = pytest.mark.fault

__all__ = ["amqp_vhost"]

CLI = [sys.executable, "-m", "chkq.workers.cli"]

#: Short limits, so that Redis hands a dead worker's message back within a minute.
VISIBILITY_TIMEOUT = 40
LIMITS = {"CHKQ_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT), "CHKQ_TIME_LIMIT": "35",
          "CHKQ_SOFT_TIME_LIMIT": "30", "CHKQ_BLOCK_BYTES": str(64 * 1024)}
#: Redis's sweep runs every visibility timeout / 10 seconds (at most 60).
TAKEOVER_BOUND = VISIBILITY_TIMEOUT + VISIBILITY_TIMEOUT // 10


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    """A redis-server of this module's own: the result backend (and the Redis broker)."""
    with PrivateRedis() as server:
        yield server.url


class Worker:
    """A ``chkq worker`` process (its own process group) serving some queues."""

    def __init__(self, env: dict[str, str], log: Path, queues: str, name: str) -> None:
        self.name = f"{name}{os.getpid()}-{time.monotonic_ns() % 10**6}@localhost"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                CLI + ["worker", "-c", "1", "-Q", queues, "-n", self.name],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, 90, f"worker {self.name} to be ready")

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text(errors="replace")[-2000:]
        return b" ready." in self.log.read_bytes()

    def kill(self) -> None:
        """SIGKILL the main process and its pool together, as when the node dies."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def chkq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=120)


def copy_unit(env: dict[str, str], job: str, task: str | None = None) -> dict[str, Any]:
    """The job's running copy task (or copy ``task``) as ``chkq status --json`` gives it."""
    done = chkq(env, "status", job, "--json")
    assert done.returncode == 0, done.stderr
    units = json.loads(done.stdout)["steps"]["copy"]
    found = [u for u in units if u["task_id"] == task or task is None and u["worker"]]
    assert len(found) == 1, units
    return dict(found[0])


@pytest.fixture(params=["redis", "rabbitmq"])
def cluster_env(request: pytest.FixtureRequest, backend: str) -> dict[str, str]:
    """The environment of chkq commands and workers on either broker."""
    broker = backend
    if request.param == "rabbitmq":
        vhost: Vhost = request.getfixturevalue("amqp_vhost")
        broker = vhost.url
    return {**os.environ, **LIMITS, "CHKQ_BROKER_URL": broker, "CHKQ_RESULT_BACKEND": backend}


@pytest.mark.cluster
@pytest.mark.integration
def test_status_shows_a_copy_whose_worker_was_killed_and_when_it_runs_again(
        cluster_env: dict[str, str], tmp_path: Path) -> None:
    env = cluster_env
    amqp = env["CHKQ_BROKER_URL"].startswith("amqp")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = make_run(run_dir, "run", RunShape(checkpoints=3, writers=2, trials=2000))
    held = run_dir / "run_chk00001" / "thread_0000.h5"
    checkpoints = snapshot(run_dir)
    control = Worker(env, tmp_path / "control.log", "control,verify", "control")
    workers = [control]
    client: subprocess.Popen[str] | None = None
    try:
        client = subprocess.Popen(CLI + ["consolidate", "run", "--out-dir", str(run_dir)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        temporary = wait_for(lambda: next((p for p in run_dir.iterdir()
                                           if p.name.startswith(".chkq-")), None),
                             90, "the job's temporary output")
        job = temporary.name.removeprefix(".chkq-").split(".")[0]
        wait_for(lambda: json.loads(chkq(env, "status", job, "--json").stdout)["phase"]
                 == "copying", 90, "the job to reach its copy step")
        with write_lease(held) as lease:
            copier = Worker(env, tmp_path / "copier.log", "copy", "copier")
            workers.append(copier)
            wait_for(lease.waited_on, 90, "the copy to wait on the held checkpoint")
            started = time.monotonic()
            alive = chkq(env, "status", job)
            alive_seconds = time.monotonic() - started
            assert alive.returncode == 0, alive.stderr
            assert f"STARTED   on {copier.name}\n" in alive.stdout + "\n", alive.stdout
            assert "gone" not in alive.stdout, alive.stdout
            unit = copy_unit(env, job)
            assert unit["worker"] == copier.name and unit["worker_gone"] is None, unit
            task = unit["task_id"]
            dead = "amqp://guest:guest@127.0.0.1:1//" if amqp else "redis://127.0.0.1:1/0"
            blind = chkq({**env, "CHKQ_BROKER_URL": dead}, "status", job)
            assert blind.returncode == 0, blind.stderr
            assert blind.stderr.startswith("warning: could not ask the workers whether they "
                                           "still run these tasks: the broker is unreachable"), \
                blind.stderr
            assert f"STARTED   on {copier.name}\n" in blind.stdout, blind.stdout
            assert isinstance(unit["pid"], int) and unit["pid"] in copier_pool(copier), unit
            copier.kill()
            killed = time.time()
        started = time.monotonic()
        gone = chkq(env, "status", job)
        gone_seconds = time.monotonic() - started
        assert gone.returncode == 0, gone.stderr
        print(f"\n$ chkq status {job}\n{gone.stdout}\n(chkq status took {alive_seconds:.2f} s "
              f"with the worker alive, {gone_seconds:.2f} s with it gone)")
        assert re.search(r"copy     \d+ tasks: 1 on a gone worker(, \d+ pending)?\n",
                         gone.stdout), gone.stdout
        assert f"STARTED   on {copier.name} (worker gone: not answering; " in gone.stdout, \
            gone.stdout
        unit = copy_unit(env, job, task)
        assert unit["worker_gone"] == "not answering", unit
        if amqp:
            assert unit["redelivery"] == (
                "RabbitMQ redelivers it once the worker's connection is closed: at once if its "
                "process died, within ~40 s (two heartbeats) if its host went silent"), unit
            assert unit["redelivered_by"] is None
        else:
            assert re.fullmatch(r"redelivered by [-\d]+ [:\d]+, in ~\d+ s \(the broker's "
                                r"visibility timeout, 40 s, swept by a running worker\)",
                                unit["redelivery"]), unit
            assert killed - TAKEOVER_BOUND < unit["redelivered_by"] <= killed + TAKEOVER_BOUND
        listed = chkq(env, "status")
        assert f"{job}  RUNNING" in listed.stdout and "1 tasks on a gone worker" in listed.stdout, \
            listed.stdout
        workers.append(Worker(env, tmp_path / "rescuer.log", "copy", "rescuer"))
        out, err = client.communicate(timeout=TAKEOVER_BOUND + 120)
        assert client.returncode == 0, err
        output = run_dir / "run.h5"
        assert_consolidated(output, files)
        left = snapshot(run_dir)
        assert {k: v for k, v in left.items() if k != "run.h5"} == checkpoints, \
            "checkpoints changed or temporaries left"
        done = chkq(env, "status", job)
        assert "SUCCESS" in done.stdout and "gone" not in done.stdout, done.stdout
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        for worker in workers:
            worker.stop()


def copier_pool(worker: Worker) -> list[int]:
    """Pids of a worker's pool processes."""
    import psutil

    return [c.pid for c in psutil.Process(worker.process.pid).children()]


@pytest.mark.parametrize("name", ["\x1b[2Jcelery@node", "celery@node\nforged line", "node",
                                  "a" * 300 + "@node", 17])
def test_a_worker_name_that_is_no_node_name_is_neither_shown_nor_asked(name: object) -> None:
    """A task's state is untrusted input: its worker name is kept only if it is one."""
    from chkq.jobs.status import _unit

    unit = _unit("j-copy-0", {"status": "PROGRESS",
                              "result": {"done": 1, "total": 2, "hostname": name, "pid": 7}})
    assert (unit.state, unit.done, unit.worker, unit.pid) == ("PROGRESS", 1, None, None)


def test_a_progress_state_names_its_worker_and_process() -> None:
    from chkq.jobs.status import _unit

    unit = _unit("j-verify-1", {"status": "PROGRESS", "result": {
        "done": 5, "total": 9, "hostname": "chkq-3@node12.site", "pid": 4242}})
    assert (unit.worker, unit.pid, unit.worker_gone) == ("chkq-3@node12.site", 4242, None)
    done = _unit("j-verify-1", {"status": "SUCCESS", "result": {
        "rows": 9, "hostname": "chkq-3@node12.site", "pid": 4242}})
    assert done.worker is None, "only a running task is on a worker"
