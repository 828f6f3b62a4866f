"""Faults across hosts: RabbitMQ broker, workers on two other hosts, real cuts and kills.

The hosts are network namespaces on a bridge of the test's own
(:mod:`support.plugins.hosts`): the broker host (RabbitMQ, in a vhost of the
test's own, and the Redis result backend) is the root namespace, where the
test process also waits for the job; two worker hosts run ``chkq worker``
each; a submitter host runs ``chkq consolidate``. Faults are real: a host's
main and pool processes SIGKILLed, its link cut. Each test ends with one
correct output or a clear error, the checkpoints untouched and no
temporaries, and prints how long the job took from the fault to its end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from celery.result import AsyncResult

from chkq.config.celery_app import close_app, get_app, get_settings, make_app, use_app
from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.jobs.keys import deliveries as deliveries_key
from chkq.workers.client import ConsolidationJob, submit_consolidation
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.hosts import Host, Hosts, HostWorker, hosts
from support.plugins.rabbitmq import Vhost, amqp_vhost

__all__ = ["amqp_vhost", "hosts"]

pytestmark = [pytest.mark.slow, pytest.mark.fault,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

#: A node's loss must cost a job at most this long (from the loss to the job's end).
NODE_LOSS_BOUND = 120.0

#: Copies of several seconds each whatever the machine: gzip data re-encoded through
#: HDF5's own zlib (fletcher32), cut into units of CHKQ_TASK_BYTES.
RUN = RunShape(checkpoints=2, trials=10007, spec_columns=384, compression="gzip",
               fletcher32=True, chunk_rows=100)
LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "200", "CHKQ_TIME_LIMIT": "240",
          "CHKQ_VISIBILITY_TIMEOUT": "300", "CHKQ_TASK_BYTES": str(16 * 2**20)}

#: On Redis a lost node's tasks wait for the visibility timeout and a restore sweep: the
#: default limits (soft 240 s, hard 300 s, visibility 420 s, back within 462 s) divided by
#: REDIS_SCALE, so that the test takes a minute, not eight (CHKQ_TEST_REDIS_SCALE=1 runs it
#: at the defaults: give pytest ``--timeout 900``).
REDIS_SCALE = int(os.environ.get("CHKQ_TEST_REDIS_SCALE") or 10)
REDIS_SETTINGS = Settings(soft_time_limit=Settings().soft_time_limit // REDIS_SCALE,
                          time_limit=Settings().time_limit // REDIS_SCALE,
                          visibility_timeout=Settings().visibility_timeout // REDIS_SCALE)
REDIS_VISIBILITY = REDIS_SETTINGS.visibility_timeout
REDIS_LIMITS = {**LIMITS, "CHKQ_SOFT_TIME_LIMIT": str(REDIS_SETTINGS.soft_time_limit),
                "CHKQ_TIME_LIMIT": str(REDIS_SETTINGS.time_limit),
                "CHKQ_VISIBILITY_TIMEOUT": str(REDIS_VISIBILITY)}
#: What the rest of the job takes once the lost copy runs again, at most.
REDIS_JOB_REST = 60.0


class Cluster:
    """The broker host's view: two worker hosts and a submitter host on RabbitMQ."""

    def __init__(self, hosts: Hosts, vhost: Vhost | None, log_dir: Path,
                 limits: dict[str, str] | None = None) -> None:
        self.hosts, self.vhost, self.log_dir = hosts, vhost, log_dir
        self.limits = limits or LIMITS
        broker = vhost.url if vhost is not None else hosts.local_redis_url
        self.app = make_app(replace(get_settings(), broker_url=broker,
                                    result_backend=hosts.local_redis_url))
        self.previous = use_app(self.app)
        self.worker_hosts = [hosts.add_host("w1"), hosts.add_host("w2")]
        self.submitter = hosts.add_host("sub")
        self.workers = [hosts.worker(h, self.env(), log_dir) for h in self.worker_hosts]
        for worker in self.workers:
            self.wait_ready(worker)

    def env(self) -> dict[str, str]:
        """The environment of chkq on a host other than the broker's."""
        broker = (self.vhost.url_for(self.hosts.address) if self.vhost is not None
                  else self.hosts.redis_url)
        return {**os.environ, "CHKQ_BROKER_URL": broker,
                "CHKQ_RESULT_BACKEND": self.hosts.redis_url, **self.limits}

    def wait_ready(self, worker: HostWorker, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not get_app().control.ping(destination=[worker.name], timeout=0.5):
            if worker.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {worker.name} not up: {worker.log()[-3000:]}")

    def copying_on(self, job: ConsolidationJob) -> tuple[HostWorker, str]:
        """A worker running one of ``job``'s copies that reported progress, and the copy's id."""
        found: list[tuple[HostWorker, str]] = []

        def look() -> bool:
            names = [w.name for w in self.workers]
            active = get_app().control.inspect(destination=names, timeout=1.0).active() or {}
            for worker in self.workers:
                for request in active.get(worker.name, []):
                    task = str(request.get("id"))
                    if (task.startswith(f"{job.id}-copy-")
                            and AsyncResult(task, app=get_app()).state == "PROGRESS"):
                        found.append((worker, task))
                        return True
            return False

        wait_for(look, 240, "a copy to run on a worker host", interval=0.2)
        return found[0]

    def deliveries(self, task: str) -> int:
        client = redis.Redis.from_url(self.hosts.local_redis_url)
        return int(client.get(deliveries_key(task)) or 0)

    def close(self) -> None:
        use_app(self.previous)
        close_app(self.app)


@pytest.fixture
def cluster(hosts: Hosts, amqp_vhost: Vhost, tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(hosts, amqp_vhost, tmp_path)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def redis_cluster(hosts: Hosts, tmp_path: Path) -> Iterator[Cluster]:
    """The same hosts with Redis as the broker, its visibility timeout at REDIS_VISIBILITY."""
    made = Cluster(hosts, None, tmp_path, REDIS_LIMITS)
    try:
        yield made
    finally:
        made.close()


def temporaries(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".chkq-*"))


def _run(tmp_path: Path) -> tuple[Path, list[Path], dict[str, str]]:
    run = tmp_path / "run"
    files = make_run(run, "run", RUN)
    return run, files, snapshot(run)


def _ended_correctly(job: ConsolidationJob, run: Path, files: list[Path], lost: float,
                     what: str, bound: float = NODE_LOSS_BOUND) -> float:
    output = job.wait_for_output(timeout=bound + 60)
    took = time.monotonic() - lost
    print(f"\n{what}: the job ended {took:.1f} s after the loss")
    assert_consolidated(output, files)
    assert temporaries(run) == []
    return took


def test_hosts_harness_addresses_and_isolation(hosts: Hosts) -> None:
    """Each host reaches the broker host's Redis and RabbitMQ at the bridge address; a cut
    host reaches nothing while the other still does; restored, it does again."""
    one, two = hosts.add_host("a"), hosts.add_host("b")

    def reaches(host: Host, port: int) -> bool:
        probe = (f"import socket; socket.create_connection(({hosts.address!r}, {port}), "
                 "timeout=2).close()")
        return subprocess.run(host.argv([sys.executable, "-c", probe]),
                              capture_output=True).returncode == 0

    assert reaches(one, hosts.redis_port) and reaches(two, 5672)
    one.cut()
    assert not reaches(one, hosts.redis_port)
    assert reaches(two, hosts.redis_port)
    one.restore()
    wait_for(lambda: reaches(one, hosts.redis_port), 10, "the link to come back")


def test_worker_host_killed_mid_copy(cluster: Cluster, tmp_path: Path) -> None:
    """Main process and pool of the host running a copy SIGKILLed: the kernel closes its
    connections, RabbitMQ hands its unacknowledged copy to the other host at once."""
    run, files, before = _run(tmp_path)
    job = submit_consolidation("run", run)
    victim, task = cluster.copying_on(job)
    victim.kill()
    lost = time.monotonic()
    took = _ended_correctly(job, run, files, lost, "worker host killed")
    assert took <= NODE_LOSS_BOUND
    assert cluster.deliveries(task) >= 2, "the copy did not run again elsewhere"
    assert {k: v for k, v in snapshot(run).items() if k != "run.h5"} == before


def test_worker_host_killed_mid_copy_on_redis(redis_cluster: Cluster, tmp_path: Path
                                              ) -> None:
    """The same loss with Redis as the broker and its default limits scaled down by
    REDIS_SCALE: nobody returns the dead host's message; it waits for the visibility
    timeout and the next restore sweep (the takeover bound), then runs elsewhere."""
    run, files, before = _run(tmp_path)
    job = submit_consolidation("run", run)
    victim, task = redis_cluster.copying_on(job)
    victim.kill()
    lost = time.monotonic()
    took = _ended_correctly(job, run, files, lost, "worker host killed (Redis broker)",
                            REDIS_SETTINGS.takeover_bound + REDIS_JOB_REST)
    print(f"Redis limits {REDIS_LIMITS['CHKQ_TIME_LIMIT']}/{REDIS_VISIBILITY} s (the defaults "
          f"/ {REDIS_SCALE}): takeover bound {REDIS_SETTINGS.takeover_bound} s; at the "
          f"defaults the bound is {Settings().takeover_bound} s")
    assert took > REDIS_VISIBILITY - 15, "the dead host's copy came back before its timeout"
    assert took <= REDIS_SETTINGS.takeover_bound + REDIS_JOB_REST
    assert redis_cluster.deliveries(task) >= 2
    assert {k: v for k, v in snapshot(run).items() if k != "run.h5"} == before


def test_worker_host_cut_off_mid_copy_then_back(cluster: Cluster, tmp_path: Path) -> None:
    """The link of the host running a copy cut: no connection is told. RabbitMQ misses its
    heartbeats, closes its connection and hands the copy to the other host; the job ends
    within the bound. The link comes back after the job ended: whatever the cut-off host
    still wrote or sends late changes neither the output nor the run directory."""
    run, files, before = _run(tmp_path)
    job = submit_consolidation("run", run)
    victim, task = cluster.copying_on(job)
    victim.host.cut()
    lost = time.monotonic()
    took = _ended_correctly(job, run, files, lost, "worker host cut off")
    assert took <= NODE_LOSS_BOUND
    assert cluster.deliveries(task) >= 2, "the copy did not run again elsewhere"
    published = snapshot(run)
    victim.host.restore()
    wait_for(lambda: victim.log().count("Connected to amqp") >= 2, 120,
             "the cut-off worker to reconnect")
    time.sleep(5)
    assert snapshot(run) == published, "a late write of the cut-off host changed the run"
    assert_consolidated(run / "run.h5", files)
    assert {k: v for k, v in published.items() if k != "run.h5"} == before


def test_broker_unreachable_from_every_worker_for_30_s(cluster: Cluster, tmp_path: Path
                                                       ) -> None:
    """Both worker hosts cut off from the broker host for 30 s mid-job, then back; the job
    is submitted with ``chkq consolidate`` on the submitter host, whose link stays up. It
    ends with a correct output or a clear error; checkpoints untouched, no temporaries."""
    run, files, before = _run(tmp_path)
    client = subprocess.Popen(
        cluster.submitter.argv([sys.executable, "-m", "chkq.workers.cli", "consolidate",
                                "run", "--out-dir", str(run), "--timeout", "400"]),
        env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def copying() -> bool:
        if client.poll() is not None:
            raise AssertionError(f"the client ended early: {client.communicate()}")
        return any(AsyncResult(f"{job}-copy-0", app=get_app()).state != "PENDING"
                   for job in _jobs())

    wait_for(copying, 240, "the job's first copy", interval=0.2)
    for host in cluster.worker_hosts:
        host.cut()
    cut = time.monotonic()
    time.sleep(30)
    for host in cluster.worker_hosts:
        host.restore()
    try:
        out, err = client.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
        logs = "\n".join(f"--- {w.name}\n{w.log()[-4000:]}" for w in cluster.workers)
        raise AssertionError(f"the job did not end 200 s after the broker came back: {err}"
                             f"\n{logs}") from None
    took = time.monotonic() - cut
    print(f"\nbroker unreachable 30 s: the client ended {took:.1f} s after the cut "
          f"(status {client.returncode})")
    after = snapshot(run)
    assert temporaries(run) == []
    if client.returncode == 0:
        assert_consolidated(run / "run.h5", files)
        after.pop("run.h5")
    else:
        assert "error:" in err and not (run / "run.h5").exists(), (out, err)
    assert after == before


def _jobs() -> list[str]:
    from chkq.tasks.state import records

    return records().recent_jobs(5)
