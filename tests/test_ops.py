"""Operations, as an operator sees them: ``chkq worker``, ``chkq flower``, ``chkq status``.

Everything runs as separate processes against a Redis of this module's own:
a worker with a small ``CHKQ_BLOCK_BYTES`` (so copy and verify tasks report
progress), Flower started by ``chkq flower`` with basic auth from
``CHKQ_FLOWER_BASIC_AUTH``, and jobs submitted and inspected with the
``chkq`` command line. Flower's Prometheus ``/metrics`` and its API tell
which tasks ran and that they sent progress events; the worker's log file
has one start and one end line per task.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chkq.demo import RunShape, make_run
from chkq.workers.broker import PrivateRedis, free_port
from chkq.workers.runtime.launch import launch_worker
from support import helpers
from support.helpers import assert_consolidated, corrupt_chunk, snapshot

CLI = [sys.executable, "-m", "chkq.workers.cli"]
AUTH = ("ops", "s3cret-pass")
TIMEOUT = 60.0


@dataclass
class Cluster:
    """Redis, one worker and Flower, all subprocesses; ``env`` addresses them."""

    env: dict[str, str]
    worker_name: str
    worker_log: Path
    flower_url: str

    def chkq(self, *args: str, env: dict[str, str] | None = None,
             timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run ``chkq ARGS`` as an operator would, against this cluster."""
        return subprocess.run(CLI + list(args), env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=False)

    def get(self, path: str, *, auth: tuple[str, str] | None = None) -> tuple[int, str]:
        """HTTP GET on Flower: (status, body)."""
        request = urllib.request.Request(self.flower_url + path)
        if auth:
            token = b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of metric ``name`` whose labels include ``labels``."""
        status, text = self.get("/metrics")
        assert status == 200, text[:500]
        total = 0.0
        for line in text.splitlines():
            match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
            if not match:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(CLI + args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def wait_for(condition: Any, what: str, timeout: float = TIMEOUT) -> Any:
    return helpers.wait_for(condition, timeout, what, interval=0.25)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("ops-logs")
    with PrivateRedis() as server:
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLOWER_UNAUTHENTICATED_API", "CHKQ_FLOWER_BASIC_AUTH",
                            "FLOWER_BASIC_AUTH")}
        env.update(CHKQ_BROKER_URL=server.url, CHKQ_RESULT_BACKEND=server.url,
                   CHKQ_BLOCK_BYTES=str(64 * 1024), CHKQ_TASK_BYTES=str(1024 * 1024))
        name = f"ops-{os.getpid()}@localhost"
        worker_log = logs / "worker.log"
        with open(worker_log, "wb") as out:
            worker = launch_worker(name, log=out, env=env, concurrency=2, peers=True)
        port = free_port()
        flower = _start(["flower", "--port", str(port)],
                        {**env, "CHKQ_FLOWER_BASIC_AUTH": ":".join(AUTH)}, logs / "flower.log")
        ops = Cluster(env, name, worker_log, f"http://127.0.0.1:{port}")
        try:
            def online() -> bool:
                for process, log in ((worker, worker_log), (flower, logs / "flower.log")):
                    assert process.poll() is None, log.read_text()[-3000:]
                try:
                    return ops.metric("flower_worker_online", worker=name) == 1.0
                except (OSError, AssertionError):
                    return False

            wait_for(online, "Flower to see the worker online")
            yield ops
        finally:
            _stop(flower)
            _stop(worker)


def _job_state(cluster: Cluster, job: str) -> dict[str, Any]:
    done = cluster.chkq("status", job, "--json")
    return dict(json.loads(done.stdout))


def _run_job(cluster: Cluster, out_dir: Path, model: str = "run") -> tuple[str, dict[str, Any]]:
    """Submit with ``chkq consolidate --no-wait``, wait with ``chkq status``."""
    submitted = cluster.chkq("consolidate", model, "--out-dir", str(out_dir), "--no-wait")
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    state = wait_for(lambda: (s := _job_state(cluster, job))["state"] in ("SUCCESS", "FAILURE")
                     and s, f"job {job} to end")
    return job, state


@pytest.fixture(scope="module")
def finished_job(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[str, dict[str, Any], Path, list[Path]]:
    """A consolidation of several copy and verify tasks, run to the end."""
    out_dir = tmp_path_factory.mktemp("ops-run")
    files = make_run(out_dir, "run", RunShape(checkpoints=3, writers=2, trials=1500,
                                              spec_columns=64, empty_writer=False))
    job, state = _run_job(cluster, out_dir)
    return job, state, out_dir, files


@pytest.mark.cluster
def test_consolidation_is_seen_by_flower_with_progress(
    cluster: Cluster, finished_job: tuple[str, dict[str, Any], Path, list[Path]],
) -> None:
    job, state, out_dir, files = finished_job
    assert state["state"] == "SUCCESS", state
    assert state["output"] == str(out_dir / "run.h5")
    assert_consolidated(out_dir / "run.h5", files)
    copies, verifies = state["plan"]["copy_units"], state["plan"]["verify_units"]
    assert copies >= 2 and verifies >= 2, state["plan"]

    # /metrics needs no credentials; the events reach Flower a moment after the result.
    def progress_events(task: str) -> float:
        return cluster.metric("flower_events_total", task=task, type="task-progress",
                              worker=cluster.worker_name)

    wait_for(lambda: progress_events("chkq.copy") >= copies
             and progress_events("chkq.verify") >= verifies, "progress events in /metrics")
    for task, count in (("chkq.copy", copies), ("chkq.verify", verifies)):
        assert cluster.metric("flower_events_total", task=task, type="task-succeeded") >= count

    # The API needs the credentials, and lists every task of the job by its id.
    status, body = cluster.get("/api/tasks")
    assert status == 401, body[:300]
    status, body = cluster.get("/api/tasks", auth=("ops", "wrong"))
    assert status == 401
    status, body = cluster.get("/api/tasks?limit=1000", auth=AUTH)
    assert status == 200, body[:300]
    tasks = json.loads(body)
    for step, count in (("copy", copies), ("verify", verifies)):
        for unit in range(count):
            task = tasks[f"{job}-{step}-{unit}"]
            assert task["name"] == f"chkq.{step}" and task["state"] == "SUCCESS", task
    assert tasks[job]["name"] == "chkq.link" and tasks[job]["state"] == "SUCCESS"
    assert cluster.get("/healthcheck")[0] == 200


@pytest.mark.cluster
def test_every_task_logs_one_start_and_one_end_line(
    cluster: Cluster, finished_job: tuple[str, dict[str, Any], Path, list[Path]],
) -> None:
    job, state, _, _ = finished_job
    lines = [m.groups() for m in re.finditer(
        rf"^\[[^]]*\] (start|end|fail) task=(\S+) job={job} (.*)$",
        cluster.worker_log.read_text(), re.MULTILINE)]
    assert not [line for line in lines if line[0] == "fail"], lines
    plan = state["plan"]
    expected = {"chkq.plan": 1, "chkq.copy": plan["copy_units"], "chkq.merge": 1,
                "chkq.verify": plan["verify_units"], "chkq.link": 1}
    for task, count in expected.items():
        starts = [rest for kind, name, rest in lines if kind == "start" and name == task]
        ends = [rest for kind, name, rest in lines if kind == "end" and name == task]
        assert len(starts) == len(ends) == count, (task, starts, ends)
        assert all(re.search(r"\bseconds=\d+(\.\d+)?\b", end) for end in ends), ends
        assert all(re.search(r"\bmodel=run\b", line) for line in starts + ends)
        if task in ("chkq.copy", "chkq.verify"):
            assert all(re.search(r"\bbytes=[1-9]\d*\b", end) for end in ends), (task, ends)
        if task == "chkq.merge":  # bytes of part files moved: none when all is raw
            assert all(re.search(r"\bbytes=\d+\b", end) for end in ends), (task, ends)
    # The copy and verify lines say what: which unit, datasets or files, and rows.
    assert all(re.search(r"\bunit=\d+ .*\brows=\d+", rest) for kind, name, rest in lines
               if kind == "end" and name in ("chkq.copy", "chkq.verify"))


@pytest.mark.cluster
def test_plan_and_link_end_lines_carry_bytes(
    cluster: Cluster, finished_job: tuple[str, dict[str, Any], Path, list[Path]],
) -> None:
    job = finished_job[0]
    log = cluster.worker_log.read_text()
    for task in ("chkq.plan", "chkq.link"):
        end = re.search(rf"\] end task={task} job={job} (.*)$", log, re.MULTILINE)
        assert end and re.search(r"\bbytes=\d+", end.group(1)), (task, end)


@pytest.mark.cluster
def test_status_lists_recent_jobs(
    cluster: Cluster, finished_job: tuple[str, dict[str, Any], Path, list[Path]],
) -> None:
    job, _, out_dir, _ = finished_job
    listed = cluster.chkq("status")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith(job))
    assert "SUCCESS" in line and str(out_dir / "run.h5") in line
    shown = cluster.chkq("status", job)
    assert shown.returncode == 0, shown.stderr
    assert f"job {job}: SUCCESS" in shown.stdout
    assert re.search(r"copy\s+\d+ tasks: \d+ done", shown.stdout), shown.stdout


@pytest.mark.cluster
def test_status_names_the_failing_plan_and_its_error(cluster: Cluster, tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=50))
    (tmp_path / "run_chk00003.h5").write_bytes(b"this is not HDF5\n" * 10)
    before = snapshot(tmp_path)
    job, state = _run_job(cluster, tmp_path)
    assert state["state"] == "FAILURE" and state["failed_task"] == f"{job}-plan", state
    shown = cluster.chkq("status", job)
    assert shown.returncode == 1
    assert f"job {job}: FAILURE" in shown.stdout
    assert f"failed task: {job}-plan" in shown.stdout
    assert re.search(r"reason: BadCheckpointError: .*run_chk00003\.h5", shown.stdout), shown.stdout
    assert re.fullmatch(rf"error: job {job} failed in {job}-plan: BadCheckpointError: "
                        r".*run_chk00003\.h5.*\n", shown.stderr), shown.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.cluster
def test_status_names_the_failing_copy_task_and_its_error(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    # Files above the scan's digest size: the damage is found by the copy, not the plan.
    make_run(tmp_path, "run", RunShape(checkpoints=4, trials=600, fletcher32=True,
                                       chunk_rows=64, spec_columns=256))
    corrupt_chunk(tmp_path / "run_chk00004.h5", "spectra/spec")
    before = snapshot(tmp_path)
    job, state = _run_job(cluster, tmp_path)
    assert state["state"] == "FAILURE", state
    assert re.fullmatch(rf"{job}-copy-\d+", state["failed_task"]), state
    shown = cluster.chkq("status", job)
    assert shown.returncode == 1
    unit = state["failed_task"].removeprefix(f"{job}-")
    assert re.search(rf"^\s+{unit}\s+FAILURE\s+OSError: .*(checksum|fletcher|filter|read)",
                     shown.stdout, re.MULTILINE | re.IGNORECASE), shown.stdout
    assert re.search(r"copy\s+\d+ tasks: .*1 failed", shown.stdout), shown.stdout
    assert f"failed task: {state['failed_task']}" in shown.stdout
    assert shown.stderr.startswith(f"error: job {job} failed in {state['failed_task']}: ")
    assert snapshot(tmp_path) == before


@pytest.mark.cluster
def test_status_of_an_unknown_job_is_an_error(cluster: Cluster) -> None:
    shown = cluster.chkq("status", "0123456789abcdef0123456789abcdef")
    assert shown.returncode == 1
    assert shown.stderr.startswith("error: no job 0123456789abcdef0123456789abcdef")
    shown = cluster.chkq("status", "../../etc")
    assert shown.returncode == 1 and shown.stderr.startswith("error: invalid job id")


@pytest.mark.cluster
def test_flower_refuses_to_listen_beyond_loopback_without_auth(cluster: Cluster) -> None:
    port = str(free_port())
    for address in ("0.0.0.0", "::", "", "192.0.2.1", "example.org"):
        refused = cluster.chkq("flower", "--address", address, "--port", port, timeout=30)
        assert refused.returncode == 1, (address, refused.stdout, refused.stderr)
        lines = refused.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: refusing to listen on"), lines
        assert "CHKQ_FLOWER_BASIC_AUTH" in lines[0]
    bad = cluster.chkq("flower", "--address", "0.0.0.0", "--port", port,
                       env={"CHKQ_FLOWER_BASIC_AUTH": "nopassword"}, timeout=30)
    assert bad.returncode == 1 and bad.stderr.startswith("error: CHKQ_FLOWER_BASIC_AUTH")


@pytest.mark.cluster
def test_consolidate_on_a_cluster_prints_the_output_and_nothing_else(
        cluster: Cluster, tmp_path: Path) -> None:
    """Exit 0, the path on stdout, and not a byte on stderr (no AsyncResult.__del__ noise).

    The old client left result subscriptions that were collected at interpreter
    shutdown: 19 lines of ``ImportError: sys.meta_path is None`` (seen from 14 MB on).
    """
    files = make_run(tmp_path, "run", RunShape(checkpoints=4, writers=2, trials=1500,
                                               spec_columns=256))
    done = cluster.chkq("consolidate", "run", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'run.h5'}\n"
    assert done.stderr == ""
    assert_consolidated(tmp_path / "run.h5", files)


@pytest.mark.cluster
def test_status_takes_an_id_prefix_and_shows_what_the_job_wrote(
        cluster: Cluster, tmp_path: Path) -> None:
    """``chkq status`` with the first digits of an id; a finished job's rows, size, time, and
    the warning about a checkpoint directory kept by --cleanup."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=200))
    (tmp_path / "run_chk00002" / "README").write_text("not a checkpoint")
    submitted = cluster.chkq("consolidate", "run", "--out-dir", str(tmp_path), "--cleanup",
                             "--no-wait")
    job = submitted.stdout.strip()
    wait_for(lambda: _job_state(cluster, job)["state"] == "SUCCESS", f"job {job} to succeed")
    shown = cluster.chkq("status", job[:10])
    assert shown.returncode == 0, shown.stderr
    assert f"job {job}: SUCCESS" in shown.stdout
    assert re.search(r"wrote 7 datasets of up to [\d,]+ rows from 4 files, [\d.,]+ MB in "
                     r"[\d.]+ s", shown.stdout)
    assert re.search(r"warning: checkpoint directory .*run_chk00002.* was kept: it holds "
                     r"other files \(README\)", shown.stdout), shown.stdout
    state = json.loads(cluster.chkq("status", job[:8], "--json").stdout)
    assert state["job"] == job and state["rows_written"] > 0 and len(state["warnings"]) == 1
    refused = cluster.chkq("status", "abc")
    assert refused.returncode == 1 and refused.stderr.startswith("error: invalid job id")
    cancel = cluster.chkq("cancel", job[:12])
    assert cancel.returncode == 1
    assert cancel.stderr.startswith(f"error: job {job} already finished"), cancel.stderr


@pytest.mark.cluster
def test_status_into_a_closed_pipe_says_nothing(
        cluster: Cluster, finished_job: tuple[str, dict[str, Any], Path, list[Path]]) -> None:
    """``chkq status --json | true`` (a reader that is gone): no ``Broken pipe`` message."""
    job = finished_job[0]
    for args in (f"status {job} --json", "status --json", "status"):
        command = " ".join(CLI) + f" {args} | true"
        done = subprocess.run(["bash", "-c", command], env=cluster.env, capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert done.stderr == "", (args, done.stderr)


@pytest.mark.cluster
def test_workers_log_user_errors_as_one_warning_line(cluster: Cluster, tmp_path: Path) -> None:
    """A refused run (not HDF5) is a WARNING in the worker's log, without a traceback."""
    make_run(tmp_path, "run", RunShape(checkpoints=1, trials=20))
    (tmp_path / "run_chk00002.h5").write_bytes(b"not HDF5\n" * 20)
    job, state = _run_job(cluster, tmp_path)
    assert state["state"] == "FAILURE"

    def lines_of_job() -> list[str]:
        return [line for line in cluster.worker_log.read_text().splitlines() if job in line]

    wait_for(lambda: any("chkq.fail" in line or "task=chkq.job" in line
                         for line in lines_of_job()), "the job's failure in the log")
    log = cluster.worker_log.read_text()
    mine = lines_of_job()
    assert mine and not [line for line in mine if "ERROR" in line or "unexpected" in line], mine
    assert any("WARNING" in line and "run_chk00002.h5" in line for line in mine), mine
    assert "Traceback" not in log[log.index(job):], "a refused run logs no traceback"
