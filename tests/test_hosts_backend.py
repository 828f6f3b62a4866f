"""The result backend unreachable from one worker host while it verifies, then back.

Hosts are network namespaces on a bridge of the test's own
(:mod:`support.plugins.hosts`). The broker host (the root namespace) runs
RabbitMQ (a vhost of the test's own) and the Redis result backend; the
backend also answers at an address of its own on the bridge (a relay), the
only one the verifying host is given, so that host's path to the backend
can be cut while its path to the broker stays up: a ``blackhole`` route to
that address in the host's namespace (new connections fail, packets of
open ones go nowhere, no peer is told).

One host plans, copies and merges; the other only verifies, and its verify
task is held in ``open`` on the job's temporary output (the test holds a
write lease on it) until the cut is in place. The cut is shown to bite (the
host's connection to the backend holds unsent data, its broker connection
works), then lifted. The job must end with one correct output (a task that
met the cut is handed back, never failed), the checkpoints untouched and no
temporaries left, and the cut-off worker must not spin: each task it hands
back is held longer each time (1, 2, 4... up to 30 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from support.helpers import assert_consolidated, snapshot, wait_for, write_lease
from support.plugins.hosts import Host, Hosts, HostWorker, hosts, ip
from support.plugins.rabbitmq import Vhost, amqp_vhost

__all__ = ["amqp_vhost", "hosts"]

pytestmark = [pytest.mark.slow, pytest.mark.fault]

CLI = [sys.executable, "-m", "chkq.workers.cli"]
LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "200", "CHKQ_TIME_LIMIT": "240",
          "CHKQ_VISIBILITY_TIMEOUT": "300", "CHKQ_BLOCK_BYTES": str(64 * 1024)}
#: Short time limits: a cut that outlasts them ends the held task by its hard limit.
SHORT_LIMITS = {**LIMITS, "CHKQ_SOFT_TIME_LIMIT": "20", "CHKQ_TIME_LIMIT": "30",
                "CHKQ_VISIBILITY_TIMEOUT": "60"}
#: The job must end within this long after the backend is back.
END_BOUND = 300


def most_handbacks(seconds: float) -> int:
    """How often one task can be handed back in ``seconds``, held 1, 2, 4... 30 s each time."""
    count, held, delay = 1, 0.0, 1.0
    while held + delay <= seconds:
        count, held, delay = count + 1, held + delay, min(30.0, 2 * delay)
    return count


class BackendAlias:
    """The result backend at an address of its own on the bridge: a ``socat`` relay."""

    def __init__(self, hosts: Hosts) -> None:
        self.address = f"{hosts.subnet}.254"
        self.port = hosts.redis_port
        ip("addr", "add", f"{self.address}/32", "dev", hosts.bridge)
        self.relay = subprocess.Popen(
            ["socat", f"TCP-LISTEN:{self.port},bind={self.address},fork,reuseaddr",
             f"TCP:127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    def cut(self, host: Host) -> None:
        """``host`` can no longer reach this address (and only this one)."""
        ip("route", "add", "blackhole", f"{self.address}/32", netns=host.name)

    def restore(self, host: Host) -> None:
        ip("route", "del", "blackhole", f"{self.address}/32", netns=host.name)

    def close(self) -> None:
        if self.relay.poll() is None:
            self.relay.kill()
            self.relay.wait(10)


@pytest.fixture
def alias(hosts: Hosts) -> Iterator[BackendAlias]:
    made = BackendAlias(hosts)
    try:
        yield made
    finally:
        made.close()


def reaches(host: Host, address: str, port: int) -> bool:
    """Whether a TCP connection from ``host`` to ``address:port`` opens within 2 s."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])),"
             " timeout=2).close()\nexcept OSError:\n sys.exit(1)")
    done = subprocess.run(host.argv([sys.executable, "-c", probe, address, str(port)]),
                          capture_output=True, timeout=30)
    return done.returncode == 0


def unsent_to(host: Host, address: str) -> int:
    """Bytes sent but not acknowledged on ``host``'s TCP connections to ``address``."""
    out = subprocess.run(host.argv(["ss", "-tnH", "dst", address]), capture_output=True,
                         text=True, timeout=30).stdout
    return sum(int(line.split()[2]) for line in out.splitlines() if len(line.split()) > 2)


def temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".chkq-"))


def ready(worker: HostWorker) -> bool:
    assert worker.process.poll() is None, worker.log()[-3000:]
    return " ready." in worker.log()


@pytest.mark.parametrize(("cut_seconds", "limits", "rescue"), [
    pytest.param(30, LIMITS, False, id="cut-30s"),
    pytest.param(45, SHORT_LIMITS, True, id="cut-past-the-time-limit"),
    pytest.param(45, SHORT_LIMITS, False, id="cut-past-the-time-limit-no-other-verifier"),
])
def test_result_backend_unreachable_from_the_verifying_host_then_back(
        hosts: Hosts, amqp_vhost: Vhost, alias: BackendAlias, tmp_path: Path,
        cut_seconds: int, limits: dict[str, str], rescue: bool) -> None:
    """A cut of 30 s: the held verify resumes when the backend is back. A cut of 45 s,
    past the worker's time limits: the held verify is ended by its soft limit and handed
    back, taken either by a second verifying worker (on the building host, which reaches
    the backend) or, with none, by the cut-off worker again once the backend is back."""
    here = {**os.environ, **limits, "CHKQ_BROKER_URL": amqp_vhost.url,
            "CHKQ_RESULT_BACKEND": hosts.local_redis_url}
    remote = {**os.environ, **limits, "CHKQ_BROKER_URL": amqp_vhost.url_for(hosts.address),
              "CHKQ_RESULT_BACKEND": hosts.redis_url}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = make_run(run_dir, "run", RunShape(checkpoints=3, writers=2, trials=2000))
    checkpoints = snapshot(run_dir)
    builder_host, verifier_host = hosts.add_host("build"), hosts.add_host("verify")
    builder = hosts.worker(builder_host, remote, tmp_path, "control,copy,commit")
    wait_for(lambda: ready(builder), 90, "the building worker")

    def status() -> dict[str, object]:
        done = subprocess.run(CLI + ["status", job, "--json"], env=here, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    client = subprocess.Popen(CLI + ["consolidate", "run", "--out-dir", str(run_dir)],
                              env=here, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        temporary = wait_for(lambda: next((p for p in run_dir.iterdir()
                                           if p.name.endswith(".h5.tmp")), None),
                             120, "the job's temporary output")
        job = temporary.name.removeprefix(".chkq-").split(".")[0]
        wait_for(lambda: status()["steps"]["merge"][0]["state"] == "SUCCESS",  # type: ignore[index]
                 180, "the merge to finish")
        with write_lease(temporary) as lease:
            verifier = hosts.worker(verifier_host, {**remote, "CHKQ_RESULT_BACKEND": alias.url},
                                    tmp_path, "verify")
            wait_for(lambda: ready(verifier), 90, "the verifying worker")
            wait_for(lease.waited_on, 120, "a verify task to open the held output")
            alias.cut(verifier_host)
            cut = time.monotonic()
            assert not reaches(verifier_host, alias.address, alias.port)
            assert reaches(verifier_host, hosts.address, 5672), "the broker must stay reachable"
            assert reaches(builder_host, alias.address, alias.port), "only one host is cut"
        wait_for(lambda: unsent_to(verifier_host, alias.address) > 0, cut_seconds,
                 "the verifying host to send to the cut-off backend")
        # The verifying worker still answers through the broker: not taken for gone.
        verifying = [u for u in status()["steps"]["verify"]  # type: ignore[attr-defined]
                     if u["worker"]]
        assert [(u["worker"], u["worker_gone"]) for u in verifying] == [(verifier.name, None)]
        if rescue:
            rescuer = hosts.worker(builder_host, remote, tmp_path, "verify")
            wait_for(lambda: ready(rescuer), 90, "the second verifying worker")
        time.sleep(max(0.0, cut_seconds - (time.monotonic() - cut)))
        alias.restore(verifier_host)
        restored = time.monotonic()
        out, err = client.communicate(timeout=END_BOUND)
        ended = time.monotonic()
        handbacks = re.findall(r"task \S+\[(\S+)\] interrupted by a broker or backend outage",
                               verifier.log())
        print(f"\nbackend cut from the verifying host for {restored - cut:.1f} s; job ended "
              f"{ended - cut:.1f} s after the cut, {ended - restored:.1f} s after the backend was "
              f"back (exit {client.returncode}); the cut-off worker handed back tasks "
              f"{len(handbacks)} times ({len(set(handbacks))} tasks)"
              + (f"; {err.strip().splitlines()[-1]}" if client.returncode else ""))
        assert client.returncode == 0, err
        assert_consolidated(run_dir / "run.h5", files)
        bound = most_handbacks(ended - cut)
        assert all(handbacks.count(t) <= bound for t in handbacks), (handbacks, bound)
        wait_for(lambda: not temporaries(run_dir), 60, "the temporaries to go")
        left = snapshot(run_dir)
        assert {k: v for k, v in left.items() if k != "run.h5"} == checkpoints, \
            "checkpoints changed"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
