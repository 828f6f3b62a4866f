"""What a user of the embedded mode meets: any current directory works, commits need no cluster
and fail in bounded time saying so, Flower always asks for credentials and Ctrl-C ends it.

Every command runs as the user runs it: the installed ``chkq`` script, no broker configured.
"""

from __future__ import annotations

import base64
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from chkq.log import CheckpointLog
from chkq.stores import TransientStoreError, open_store
from chkq.stores import retry as store_retry
from chkq.workers.broker import PrivateRedis, free_port
from support.plugins.object_stores import BUCKET

CHKQ = str(Path(sys.executable).parent / "chkq")
TIMEOUT = 120.0
#: Broker and Flower settings a user may have in their shell, which these tests must not see.
UNSET = ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND", "CHKQ_FLOWER_BASIC_AUTH",
         "FLOWER_BASIC_AUTH", "FLOWER_UNAUTHENTICATED_API")


def plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(extra)
    return env


@pytest.fixture
def shadowing_dir(tmp_path: Path) -> Path:
    """A current directory holding a ``chkq`` folder (as the clone's parent does) that fails
    loudly if anything imports it, and a ``flowerconfig.py`` that would turn auth off."""
    here = tmp_path / "parent-of-clone"
    (here / "chkq").mkdir(parents=True)
    (here / "chkq" / "__init__.py").write_text(
        "raise ImportError('the chkq folder of the current directory was imported')\n")
    (here / "flowerconfig.py").write_text("basic_auth = []\naddress = '0.0.0.0'\n")
    return here


def chkq(cwd: Path, *args: str, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHKQ, *args], cwd=cwd, env=env or plain_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.mark.cluster
def test_every_command_works_from_a_directory_holding_a_chkq_folder(
    shadowing_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    made = chkq(shadowing_dir, "demo", str(run))
    assert made.returncode == 0, made.stderr
    consolidated = chkq(shadowing_dir, "consolidate", "demo", "--out-dir", str(run),
                        "--workers", "1")
    assert consolidated.returncode == 0, consolidated.stderr
    assert consolidated.stdout.strip() == str(run / "demo.h5")

    store = f"file://{tmp_path / 'store'}"
    first = sorted(run.glob("demo_chk*/thread_*.h5"))[0]
    committed = chkq(shadowing_dir, "log", "commit", store, "r1", str(first))
    assert committed.returncode == 0, committed.stderr

    watched = tmp_path / "watched"
    assert chkq(shadowing_dir, "demo", str(watched)).returncode == 0
    watch = chkq(shadowing_dir, "watch", str(watched), "demo", "--store", store, "--run", "r2",
                 "--idle", "0.5", "--interval", "0.1", "--consolidate", "--workers", "1")
    assert watch.returncode == 0, watch.stderr
    assert watch.stdout.splitlines()[-1] == str(watched / "demo.h5")
    assert len([line for line in watch.stdout.splitlines() if line.startswith("committed ")]) \
        == len(list(watched.glob("demo_chk*/thread_*.h5")))


def test_a_broker_less_s3_commit_runs_in_the_command_itself(
    s3_endpoint: str, tmp_path: Path
) -> None:
    path = tmp_path / "sim_chk00001.h5"
    path.write_bytes(os.urandom(4096))
    store = f"s3://{BUCKET}/inproc-{os.getpid()}"
    process = subprocess.Popen([CHKQ, "log", "commit", store, "r1", str(path)],
                               env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    out, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err
    entry = CheckpointLog(open_store(store), "r1").files()["sim_chk00001.h5"]
    assert entry.id == out.strip()
    assert entry.writer is not None and entry.writer.endswith(f":{process.pid}"), (
        f"committed by {entry.writer}, not by the command (pid {process.pid}) itself")


@pytest.mark.cluster
def test_a_commit_to_an_unreachable_store_fails_within_one_budget_and_says_it_retries(
    tmp_path: Path
) -> None:
    path = tmp_path / "sim_chk00001.h5"
    path.write_bytes(b"x" * 100)
    env = plain_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
                    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                    AWS_DEFAULT_REGION="us-east-1", CHKQ_STORE_RETRY_SECONDS="2",
                    CHKQ_STORE_CONNECT_TIMEOUT="1", CHKQ_STORE_READ_TIMEOUT="1")
    started = time.monotonic()
    result = chkq(tmp_path, "log", "commit", f"s3://{BUCKET}/runs", "r1", str(path), env=env)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert any(line.startswith("retrying: store s3://") for line in lines), result.stderr
    assert lines[-1].startswith("error: store s3://") and "retry budget" in lines[-1], lines
    # The task path retried up to 30 times, each with a budget of its own (minutes).
    assert elapsed < 60, f"took {elapsed:.0f} s with a 2 s budget"


class Unreachable:
    """A store that refuses every connection, on a clock the retries advance by sleeping."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = [1000.0]
        self.calls: list[float] = []
        monkeypatch.setattr(store_retry.time, "monotonic", lambda: self.clock[0])
        monkeypatch.setattr(store_retry.time, "sleep",
                            lambda s: self.clock.__setitem__(0, self.clock[0] + s))

    def __call__(self) -> None:
        self.calls.append(self.clock[0])
        raise ConnectionError("refused")


def test_store_operations_inside_one_budget_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two operations against a store that keeps failing: the second gets what the first left."""
    unreachable = Unreachable(monkeypatch)
    calls = unreachable.calls

    def operation() -> None:
        store_retry.retry_transient(unreachable, is_transient=lambda e: True, what="op",
                                   attempts=1000, budget=10.0, initial_delay=0.5)

    with store_retry.overall_budget(10.0):
        with pytest.raises(TransientStoreError):
            operation()
        with pytest.raises(TransientStoreError):
            operation()
    assert calls[-1] - calls[0] <= 10.0, "the second operation got a budget of its own"
    calls.clear()
    with pytest.raises(TransientStoreError):
        operation()
    assert calls[-1] - calls[0] > 5.0, "outside the block an operation has its own budget"


def test_a_shared_budget_starts_with_the_first_store_operation(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow work inside the block before any store operation (a loaded node) leaves it whole."""
    unreachable = Unreachable(monkeypatch)
    clock, calls = unreachable.clock, unreachable.calls

    with store_retry.overall_budget(2.0):
        clock[0] += 5.0
        with pytest.raises(TransientStoreError, match="retry budget 2 s"):
            store_retry.retry_transient(unreachable, is_transient=lambda e: True, what="op",
                                        attempts=1000, initial_delay=0.1)
    assert len(calls) > 1, "the store was tried once: the work before it took the budget"
    assert calls[-1] - calls[0] <= 2.0


@pytest.mark.cluster
def test_a_watch_whose_store_goes_away_says_so_and_commits_once_it_is_back(
    tmp_path: Path
) -> None:
    from moto.server import ThreadedMotoServer

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1"
                 ).create_bucket(Bucket=BUCKET)
    staged = tmp_path / "staged"
    assert chkq(tmp_path, "demo", str(staged), "--checkpoints", "2").returncode == 0
    run = tmp_path / "run"
    run.mkdir()
    done = tmp_path / "done"
    store = f"s3://{BUCKET}/watch-{os.getpid()}"
    watch = subprocess.Popen(
        [CHKQ, "watch", str(run), "demo", "--store", store, "--run", "r1", "--done-file",
         str(done), "--interval", "0.2"],
        env=plain_env(**aws, CHKQ_STORE_RETRY_SECONDS="1", CHKQ_STORE_CONNECT_TIMEOUT="1",
                      CHKQ_STORE_READ_TIMEOUT="2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watch.stdout is not None and watch.stderr is not None
    out, err = Lines(watch.stdout), Lines(watch.stderr)
    committed: list[str] = []
    try:
        (staged / "demo_chk00001").rename(run / "demo_chk00001")
        while len(committed) < 2:
            committed.append(out.next_with("committed ", watch).split()[1])
        server.stop()
        (staged / "demo_chk00002").rename(run / "demo_chk00002")
        err.next_with("not committed yet", watch)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        while len(committed) < 4:
            committed.append(out.next_with("committed ", watch).split()[1])
        done.touch()
        assert watch.wait(TIMEOUT) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        server.stop()
    files = sorted(run.glob("demo_chk*/thread_*.h5"))
    assert sorted(committed) == sorted(str(f.relative_to(run)) for f in files)


class Lines:
    """The lines a process writes on one of its pipes, read by a thread as they come."""

    def __init__(self, pipe: IO[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.queue.put(line)

    def next_with(self, text: str, process: subprocess.Popen[str],
                  timeout: float = TIMEOUT) -> str:
        """The next line containing ``text``; fails if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=0.5)
            except queue.Empty:
                assert process.poll() is None, f"exited {process.returncode}"
                assert time.monotonic() < deadline, f"no line with {text!r}"
                continue
            if text in line:
                return line


# ------------------------------------------------------------------ Flower


@pytest.fixture
def broker() -> Iterator[str]:
    with PrivateRedis() as server:
        yield server.url


def get(url: str, auth: str | None = None) -> int:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} \
        if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def start_flower(cwd: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    flower = subprocess.Popen([CHKQ, "flower", "--port", str(port)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert flower.poll() is None, flower.stderr.read() if flower.stderr else ""
        try:
            if get(f"http://127.0.0.1:{port}/healthcheck") == 200:
                return flower
        except OSError:
            pass
        assert time.monotonic() < deadline, "Flower did not answer /healthcheck"
        time.sleep(0.2)


UI_AND_API = ("/", "/workers", "/tasks", "/broker", "/worker/x", "/task/x", "/api/workers",
              "/api/tasks", "/api/task/info/x")


@pytest.mark.cluster
def test_flower_asks_every_page_and_the_api_for_credentials_and_ctrl_c_ends_it(
    shadowing_dir: Path, broker: str
) -> None:
    port = free_port()
    flower = start_flower(shadowing_dir, plain_env(CHKQ_BROKER_URL=broker), port)
    try:
        base = f"http://127.0.0.1:{port}"
        for page in UI_AND_API:
            assert get(base + page) == 401, f"{page} answered without credentials"
        assert get(base + "/healthcheck") == 200
        assert get(base + "/metrics") == 200
        # flowerconfig.py of the current directory asked for every interface: not read.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{non_loopback_address()}:{port}/healthcheck",
                                   timeout=5)
        flower.send_signal(signal.SIGINT)
        out, err = flower.communicate(timeout=30)
    finally:
        if flower.poll() is None:
            flower.kill()
            flower.wait()
    assert flower.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    assert "error: interrupted (SIGINT)" in err.splitlines(), err
    generated = [line for line in err.splitlines() if line.startswith("flower: user chkq")]
    assert len(generated) == 1, err
    password = generated[0].split("password ", 1)[1].split()[0]
    assert len(password) >= 16


@pytest.mark.cluster
def test_flower_takes_the_configured_credentials_and_the_generated_ones_open_the_ui(
    tmp_path: Path, broker: str
) -> None:
    port = free_port()
    flower = start_flower(tmp_path, plain_env(CHKQ_BROKER_URL=broker), port)
    try:
        assert flower.stderr is not None
        line = flower.stderr.readline()
        password = line.split("password ", 1)[1].split()[0]
        base = f"http://127.0.0.1:{port}"
        assert get(base + "/workers", f"chkq:{password}") == 200
        assert get(base + "/api/workers", f"chkq:{password}") == 200
        assert get(base + "/workers", "chkq:wrong") == 401
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.communicate(timeout=30)
    assert flower.returncode == 128 + signal.SIGTERM

    port = free_port()
    flower = start_flower(tmp_path, plain_env(CHKQ_BROKER_URL=broker,
                                              CHKQ_FLOWER_BASIC_AUTH="admin:long-secret"), port)
    try:
        base = f"http://127.0.0.1:{port}"
        assert get(base + "/workers") == 401
        assert get(base + "/workers", "admin:long-secret") == 200
        assert get(base + "/api/workers", "admin:nope") == 401
    finally:
        flower.send_signal(signal.SIGINT)
        _, err = flower.communicate(timeout=30)
    assert flower.returncode == 128 + signal.SIGINT
    assert "flower: user" not in err, "a password was generated although one was configured"


def non_loopback_address() -> str:
    """An address of this host beyond loopback (skip-free: the host has one, or 'localhost')."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.2"
