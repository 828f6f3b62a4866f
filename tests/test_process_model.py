"""No process outlives the command that started it, and nothing is left on disk.

Each test runs the real ``chkq`` command (embedded cluster: a private
redis-server and a real worker with its pool), waits until the job is
really running, ends the command one way or another (SIGINT, SIGTERM,
SIGHUP, SIGKILL, an error), and walks the process tree (psutil) recorded
before the end: every descendant must be gone within seconds, the private
temporary directory (``TMPDIR``) must be empty, and the run directory must
hold its checkpoints only.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from chkq.demo import RunShape, make_run
from support.helpers import snapshot, wait_for, write_lease

CLI = [sys.executable, "-m", "chkq.workers.cli"]

#: Seconds the whole tree gets to go after the command was ended.
GONE_WITHIN = 10.0


def embedded_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a command that runs the embedded cluster, temporaries in ``tmp``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    tmp.mkdir(exist_ok=True)
    env.update(TMPDIR=str(tmp), **extra)
    return env


def slow_run(directory: Path) -> None:
    """A run whose consolidation takes several seconds (gzip, small blocks)."""
    make_run(directory, "run", RunShape(checkpoints=4, writers=2, trials=3000,
                                        spec_columns=256, compression="gzip", shuffle=True))


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (zombies count as gone: they only wait to be reaped)."""
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def command_line(process: psutil.Process) -> str:
    """``process``'s command line ('' once it is gone)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def wait_gone(processes: list[psutil.Process], timeout: float = GONE_WITHIN) -> float:
    """Seconds until every one of ``processes`` is gone; fails after ``timeout``."""
    start = time.monotonic()
    while alive(processes):
        if time.monotonic() - start > timeout:
            left = [(p.pid, p.name()) for p in alive(processes)]
            raise AssertionError(f"still running {timeout} s later: {left}")
        time.sleep(0.02)
    return time.monotonic() - start


class Command:
    """A ``chkq`` command started in its own session (like a shell's foreground job)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.process = subprocess.Popen(CLI + args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.tree: dict[int, psutil.Process] = {}

    def watch_tree(self) -> list[psutil.Process]:
        """Remember every descendant seen so far; return the current ones."""
        now = descendants(self.process.pid)
        for child in now:
            self.tree.setdefault(child.pid, child)
        return now

    def wait_running(self, run_dir: Path, workers: int, broker: Broker,
                     timeout: float = 90.0) -> None:
        """Until redis-server, the worker and its pool exist and the job wrote temporaries;
        then hold the job there.

        The embedded broker is told to hold every write (``CLIENT PAUSE WRITE``):
        no task can be delivered (BRPOP writes), report or record its end, so the
        job cannot finish however fast the machine, while the command keeps
        waiting (its polls only read).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()
            now = self.watch_tree()
            names = " ".join(command_line(p) for p in alive(now))
            started = "redis-server" in names and len(now) >= 2 + workers
            if started and any(p.name.startswith(".chkq-") for p in run_dir.iterdir()):
                broker.pause_writes()
                assert not (run_dir / "run.h5").exists(), "the job finished before it was held"
                return
            time.sleep(0.01)
        raise AssertionError(f"the job did not start: {self.watch_tree()}")

    def end(self, sig: int) -> float:
        """Send ``sig`` to the command; return seconds until its whole tree is gone."""
        self.watch_tree()
        self.process.send_signal(sig)
        self.process.wait(60)
        return wait_gone(list(self.tree.values()))


class Broker:
    """A ``redis-server`` for the command's PATH that shows the test the embedded broker.

    It records each start (its arguments, in ``starts``), keeps the
    configuration chkq feeds on its standard input (socket and password, in
    ``config``), and with a ``gate`` starts the real server only once that
    file exists.
    """

    def __init__(self, directory: Path, gate: Path | None = None) -> None:
        real = shutil.which("redis-server")
        assert real is not None, "the tests need redis-server on PATH"
        self.bin_dir, self.gate = directory / "bin", gate
        self.starts, self.config = directory / "redis-starts", directory / "redis.conf"
        self.bin_dir.mkdir(parents=True)
        script = self.bin_dir / "redis-server"
        wait = f"while [ ! -e {gate} ]; do sleep 0.01; done\n" if gate is not None else ""
        script.write_text(f"""#!/bin/sh
case "$1" in --version|-v) exec {real} "$@";; esac
echo "$*" >> {self.starts}
cat > {self.config}
{wait}exec {real} "$@" < {self.config}
""")
        script.chmod(0o755)

    def path(self) -> str:
        """PATH for the command: this ``redis-server`` first."""
        return f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"

    def client(self) -> redis.Redis:
        """A client of the running embedded broker (its socket and password)."""
        settings: dict[str, str] = {}
        for line in self.config.read_text().splitlines():
            words = shlex.split(line)
            if len(words) == 2:
                settings[words[0]] = words[1]
        if settings.get("unixsocket"):
            return redis.Redis(unix_socket_path=settings["unixsocket"],
                               password=settings.get("requirepass"), socket_timeout=10)
        return redis.Redis(host="127.0.0.1", port=int(settings["port"]),
                           password=settings.get("requirepass"), socket_timeout=10)

    def pause_writes(self, seconds: int = 120) -> None:
        """``CLIENT PAUSE WRITE``: no task is delivered, reports or records its end."""
        client = self.client()
        try:
            client.execute_command("CLIENT", "PAUSE", seconds * 1000, "WRITE")
        finally:
            client.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "run"
    directory.mkdir()
    slow_run(directory)
    yield directory


def checkpoints_only(run_dir: Path, before: dict[str, str]) -> None:
    assert snapshot(run_dir) == before, "the run directory changed"


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_ends_the_command_and_everything_it_started(
        run_dir: Path, tmp_path: Path, sig: int) -> None:
    """SIGINT (Ctrl-C), SIGTERM, SIGHUP: exit 128+N, one error line, no child, no temporary."""
    before = snapshot(run_dir)
    tmp = tmp_path / "tmp"
    broker = Broker(tmp_path / "broker")
    command = Command(["consolidate", "run", "--out-dir", str(run_dir), "--workers", "2"],
                      embedded_env(tmp, CHKQ_BLOCK_BYTES=str(64 * 1024), PATH=broker.path()))
    command.wait_running(run_dir, workers=2, broker=broker)
    seconds = command.end(sig)
    out, err = command.process.communicate()
    assert command.process.returncode == 128 + sig, err
    assert out == ""
    assert err == f"error: interrupted ({signal.Signals(sig).name})\n"
    assert seconds < 5, f"the tree took {seconds:.2f} s to go"
    assert len(command.tree) >= 4, "redis-server, the worker and its two pool processes"
    assert list(tmp.iterdir()) == [], "temporary files or directories left behind"
    checkpoints_only(run_dir, before)


@pytest.mark.cluster
def test_sigkill_of_the_command_takes_its_children_with_it(run_dir: Path, tmp_path: Path
                                                           ) -> None:
    """SIGKILL: the children die with their parent, and the reaper removes the job's
    temporaries from the run directory."""
    before = snapshot(run_dir)
    tmp = tmp_path / "tmp"
    broker = Broker(tmp_path / "broker")
    command = Command(["consolidate", "run", "--out-dir", str(run_dir), "--workers", "2"],
                      embedded_env(tmp, CHKQ_BLOCK_BYTES=str(64 * 1024), PATH=broker.path()))
    command.wait_running(run_dir, workers=2, broker=broker)
    seconds = command.end(signal.SIGKILL)
    assert command.process.returncode == -signal.SIGKILL
    assert seconds < 5, f"the tree took {seconds:.2f} s to go"
    assert len(command.tree) >= 4
    assert list(tmp.iterdir()) == [], "no directory is left, even after SIGKILL"
    assert not (run_dir / "run.h5").exists()
    wait_for(lambda: snapshot(run_dir) == before, 15, "the reaper to remove the temporaries")


@pytest.mark.cluster
def test_an_error_while_waiting_stops_the_cluster_and_removes_the_temporaries(
        run_dir: Path, tmp_path: Path) -> None:
    """The job fails on the client's side (``--timeout``): exit 1, nothing left.

    The job cannot finish first, however fast the machine: the planning step
    blocks opening the template checkpoint, on which the test holds a lease
    from before any worker starts until the command has ended.
    """
    before = snapshot(run_dir)
    tmp = tmp_path / "tmp"
    gate = tmp_path / "gate"
    broker = Broker(tmp_path / "broker", gate)
    template = sorted(run_dir.glob("run_chk*/*.h5"))[-2]
    command = Command(["consolidate", "run", "--out-dir", str(run_dir), "--workers", "2",
                       "--timeout", "1"],
                      embedded_env(tmp, CHKQ_BLOCK_BYTES=str(64 * 1024), PATH=broker.path()))
    deadline = time.monotonic() + 60
    while not any("redis-server" in command_line(p) for p in alive(command.watch_tree())):
        assert command.process.poll() is None, command.process.communicate()
        assert time.monotonic() < deadline, "the embedded cluster did not start"
        time.sleep(0.02)
    with write_lease(template):
        gate.touch()
        while command.process.poll() is None:
            command.watch_tree()
            time.sleep(0.02)
        out, err = command.process.communicate()
        wait_gone(list(command.tree.values()))
    assert command.process.returncode == 1, err
    assert err.startswith("error: job ") and "did not finish within 1 s" in err, err
    assert len(err.splitlines()) == 1, err
    assert len(command.tree) >= 3, "redis-server, the worker and its pool"
    assert list(tmp.iterdir()) == []
    checkpoints_only(run_dir, before)


@pytest.mark.cluster
def test_sigterm_ends_watch_and_its_embedded_cluster(run_dir: Path, tmp_path: Path) -> None:
    """``chkq watch --consolidate`` stopped by SIGTERM while its embedded cluster consolidates
    the finished run: exit 128+15, one error line, no child, no temporary, checkpoints kept."""
    before = snapshot(run_dir)
    store = tmp_path / "store"
    store.mkdir()
    tmp = tmp_path / "tmp"
    broker = Broker(tmp_path / "broker")
    command = Command(["watch", str(run_dir), "run", "--store", f"file://{store}", "--run",
                       "r1", "--interval", "0.2", "--idle", "1", "--consolidate",
                       "--workers", "1"],
                      embedded_env(tmp, CHKQ_BLOCK_BYTES=str(64 * 1024), PATH=broker.path()))
    command.wait_running(run_dir, workers=1, broker=broker)
    seconds = command.end(signal.SIGTERM)
    _, err = command.process.communicate()
    assert command.process.returncode == 128 + signal.SIGTERM, err
    assert err.endswith("error: interrupted (SIGTERM)\n"), err
    assert seconds < 5, f"the tree took {seconds:.2f} s to go"
    assert len(command.tree) >= 3, "redis-server, the worker and its pool process"
    assert list(tmp.iterdir()) == [], "temporary files or directories left behind"
    checkpoints_only(run_dir, before)


@pytest.mark.cluster
def test_refusals_need_no_cluster(tmp_path: Path) -> None:
    """What can be refused without a cluster is refused before anything starts.

    The ``redis-server`` on the command's PATH records every start: a
    cluster started even for an instant would leave its mark.
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make_run(run_dir, "run", RunShape(checkpoints=2, trials=10))
    (run_dir / "bad_chk00001.h5").write_bytes(b"not HDF5 at all\n" * 4)
    (run_dir / "exists.h5").write_bytes(b"")
    make_run(run_dir, "exists", RunShape(checkpoints=1, trials=5))
    (run_dir / "gap_chk00001.h5").write_bytes((run_dir / "run_chk00001.h5").read_bytes())
    (run_dir / "gap_chk00003.h5").write_bytes((run_dir / "run_chk00002.h5").read_bytes())
    broker = Broker(tmp_path / "broker")
    starts = broker.starts
    env = embedded_env(tmp_path / "tmp", PATH=broker.path())
    cases = {
        "exists": ("exists", str(run_dir), "exists"),
        "no checkpoints": ("other", str(run_dir), "no checkpoints"),
        "bad name": ("../run", str(run_dir), "invalid model name"),
        "not HDF5": ("bad", str(run_dir), "bad_chk00001.h5"),
        "no directory": ("run", str(tmp_path / "missing"), "does not exist"),
        "gap": ("gap", str(run_dir), "checkpoint 00002 of model 'gap' is missing"),
    }
    for case, (model, out_dir, words) in cases.items():
        command = Command(["consolidate", model, "--out-dir", out_dir], env)
        _, err = command.process.communicate(timeout=60)
        assert command.process.returncode == 1, (case, err)
        assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err
        assert not starts.exists(), f"{case}: started redis-server {starts.read_text()}"
