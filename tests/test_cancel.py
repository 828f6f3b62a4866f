"""A client on a cluster says what becomes of its job; ``chkq cancel`` ends a job for good.

Against a Redis of this module's own, with no worker at first: the client
must say within seconds that no worker serves the queue its job waits in,
honour ``--timeout``, and on Ctrl-C say that the job stays queued and how to
cancel it. A cancelled job never runs, not even on a worker started later;
a job cancelled while it runs stops, and its temporaries go.
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
from dataclasses import replace
from pathlib import Path

import pytest

from chkq.config.celery_app import close_app, get_settings, make_app, use_app
from chkq.config.routing import QUEUES
from chkq.demo import RunShape, make_run
from chkq.workers.broker import PrivateRedis
from chkq.workers.runtime.launch import launch_worker, stop_worker
from support.helpers import snapshot, wait_for, write_lease

#: Every test here starts processes (workers, the command line).
pytestmark = pytest.mark.cluster

CLI = [sys.executable, "-m", "chkq.workers.cli"]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def broker() -> Iterator[dict[str, str]]:
    """The environment of commands against a Redis that no worker serves (yet)."""
    with PrivateRedis() as server:
        yield {**os.environ, "CHKQ_BROKER_URL": server.url, "CHKQ_RESULT_BACKEND": server.url}


def chkq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def start_worker(env: dict[str, str], log: Path, queues: str = ",".join(QUEUES),
                 name: str = "w") -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return launch_worker(f"{name}{os.getpid()}@localhost", log=out, env=env,
                             concurrency=2, queues=queues, peers=True)


def read_line(stream: object, deadline: float) -> str:
    line = stream.readline()  # type: ignore[attr-defined]
    assert time.monotonic() < deadline, "too late"
    return str(line)


def test_no_worker_is_announced_and_interrupt_says_how_to_cancel(
        broker: dict[str, str], tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=100))
    before = snapshot(tmp_path)

    # --timeout: told about the missing worker, then one error line; the job goes on.
    done = chkq(broker, "consolidate", "run", "--out-dir", str(tmp_path), "--timeout", "8")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: no worker serves queue chkq.control, where job ")
    timed_out = re.fullmatch(r"error: job ([0-9a-f]{32}) did not finish within 8 s; it goes on "
                             r"\(chkq status \1; chkq cancel \1 to cancel it\)", lines[1])
    assert timed_out, lines[1]

    # Ctrl-C: says the job stays queued, with its id and how to cancel it.
    # (Another run: a second job of the first one's run is refused while it is queued.)
    second = tmp_path.parent / f"{tmp_path.name}-second"
    make_run(second, "run", RunShape(checkpoints=2, writers=2, trials=100))
    client = subprocess.Popen(CLI + ["consolidate", "run", "--out-dir", str(second)],
                              env=broker, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    started = time.monotonic()
    warning = read_line(client.stderr, started + 15)
    told_after = time.monotonic() - started
    assert warning.startswith("warning: no worker serves queue chkq.control"), warning
    assert told_after < 10, f"told after {told_after:.1f} s"
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=30)
    assert client.returncode == 128 + signal.SIGINT
    assert out == ""
    said = re.fullmatch(r"error: interrupted; job ([0-9a-f]{32}) is still queued on the "
                        r"cluster: chkq status \1 follows it, chkq cancel \1 cancels it\n", err)
    assert said, err
    jobs = [timed_out.group(1), said.group(1)]

    status = chkq(broker, "status", jobs[1])
    assert status.returncode == 0 and f"job {jobs[1]}: PENDING (queued)" in status.stdout

    for job in jobs:
        cancelled = chkq(broker, "cancel", job[:10])
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.startswith(f"cancelled job {job}: 1 queued tasks removed"), \
            cancelled.stdout
        status = chkq(broker, "status", job)
        assert status.returncode == 1
        assert f"job {job}: CANCELLED (cancelled)" in status.stdout, status.stdout
        assert status.stderr.startswith(f"error: job {job} was cancelled ")
    again = chkq(broker, "cancel", jobs[0])
    assert again.returncode == 0 and "already cancelled" in again.stdout

    # A worker started now finds nothing of the cancelled jobs to run.
    worker = start_worker(broker, tmp_path.parent / f"{tmp_path.name}-worker.log")
    try:
        time.sleep(8)
        assert worker.poll() is None
    finally:
        stop_worker(worker)
    assert snapshot(tmp_path) == before, "a cancelled job ran"


def test_cancel_stops_a_running_job_and_removes_its_temporaries(
        broker: dict[str, str], tmp_path: Path) -> None:
    """The job is held running, whatever the machine's speed: its copy step waits in
    ``open`` on a checkpoint the test holds a lease on, taken once planning is over and
    before any worker serves the copy queue."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make_run(run_dir, "run", RunShape(checkpoints=4, writers=2, trials=3000, spec_columns=256,
                                      compression="gzip", shuffle=True, fletcher32=True))
    held = run_dir / "run_chk00001" / "thread_0000.h5"
    before = snapshot(run_dir)
    env = {**broker, "CHKQ_BLOCK_BYTES": str(64 * 1024)}
    worker = start_worker(env, tmp_path / "worker.log", "control,verify", "control")
    copier: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: b" ready." in (tmp_path / "worker.log").read_bytes(), 60,
                 "the control worker to be ready")
        client = subprocess.Popen(CLI + ["consolidate", "run", "--out-dir", str(run_dir)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".chkq-") for p in run_dir.iterdir()):
            assert time.monotonic() < deadline and client.poll() is None, client.poll()
            time.sleep(0.05)
        job = next(p.name for p in run_dir.iterdir() if p.name.startswith(".chkq-"))
        job = job.removeprefix(".chkq-").split(".")[0]
        while json.loads(chkq(env, "status", job, "--json").stdout)["phase"] != "copying":
            assert time.monotonic() < deadline and client.poll() is None, client.poll()
            time.sleep(0.1)
        with write_lease(held) as lease:
            copier = start_worker(env, tmp_path / "copier.log", "copy", "copy")
            while not lease.waited_on():
                assert time.monotonic() < deadline and copier.poll() is None, copier.poll()
                time.sleep(0.05)
            cancelled = chkq(env, "cancel", job)
        assert cancelled.returncode == 0, cancelled.stderr
        assert re.match(rf"cancelled job {job}: \d+ queued tasks removed, [1-9]\d* running "
                        r"tasks stopped, \d+ temporary files removed", cancelled.stdout), \
            cancelled.stdout
        out, err = client.communicate(timeout=60)
        assert client.returncode == 1
        lines = err.splitlines()
        assert lines[-1] == f"error: job {job} was cancelled (chkq cancel)", err
        # Until the copy worker started, the client was right to say none served its queue.
        assert all(line.startswith("warning: no worker serves queue chkq.copy, ")
                   for line in lines[:-1]), err
        assert out == ""
        wait_for(lambda: snapshot(run_dir) == before, 15, "the temporaries to go")
        status = chkq(env, "status", job)
        assert "CANCELLED" in status.stdout
        assert worker.poll() is None and copier.poll() is None, "workers survive a cancel"
    finally:
        stop_worker(worker)
        if copier is not None:
            stop_worker(copier)


def test_cancel_with_no_worker_is_quick(broker: dict[str, str], tmp_path: Path) -> None:
    """No worker at all: ``cancel`` removes the queued job and returns within a broadcast.

    It asks the workers once which tasks they run (1 s with none to answer),
    where it asked twice per look and looked twice.
    """
    from chkq.workers.cancel import cancel_job

    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=20))
    submitted = chkq(broker, "consolidate", "run", "--out-dir", str(tmp_path), "--no-wait")
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    url = broker["CHKQ_BROKER_URL"]
    app = make_app(replace(get_settings(), broker_url=url, result_backend=url))
    previous = use_app(app)
    try:
        started = time.monotonic()
        said = cancel_job(job)
        seconds = time.monotonic() - started
    finally:
        use_app(previous)
        close_app(app)
    assert said.startswith(f"cancelled job {job}: 1 queued tasks removed, 0 running tasks "
                           "stopped"), said
    assert seconds < 3.0, f"cancel took {seconds:.1f} s with no worker to ask"
    status = chkq(broker, "status", job)
    assert f"job {job}: CANCELLED (cancelled)" in status.stdout, status.stdout
