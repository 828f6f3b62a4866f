"""RabbitMQ as chkq's broker, with job state in Redis: every job and command on real parts.

Each test gets a vhost of its own on the machine's RabbitMQ
(:mod:`support.plugins.rabbitmq`) and the session's private redis-server as
result backend; workers are real ``chkq worker`` processes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from chkq.config.celery_app import close_app, get_settings, make_app, use_app
from chkq.config.routing import COPY_QUEUE, QUEUES
from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.log import CheckpointLog
from chkq.stores import open_store
from chkq.workers.broker import PrivateRedis, free_port
from chkq.workers.client import ConsolidationJob, JobCancelledError, submit_consolidation
from chkq.workers.commit_client import submit_commit
from support import fake_simulation
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.cluster import WorkerProcess, consumers_paused
from support.plugins.rabbitmq import Vhost, amqp_vhost
from support.plugins.signing import Secrets

__all__ = ["amqp_vhost"]

CLI = [sys.executable, "-m", "chkq.workers.cli"]
JOB_SECONDS = 90


class AmqpCluster:
    """Workers on a RabbitMQ vhost with the result backend in Redis; the client app on both."""

    def __init__(self, vhost: Vhost, backend: str, log_dir: Path) -> None:
        self.vhost, self.backend, self.log_dir = vhost, backend, log_dir
        self.workers: list[WorkerProcess] = []
        self.app = make_app(replace(get_settings(), broker_url=vhost.url,
                                    result_backend=backend))
        self.previous = use_app(self.app)

    def sign_with(self, secrets: Secrets) -> None:
        """The client app signs its messages (and accepts only signed ones) from now on."""
        signed = make_app(replace(get_settings(), broker_url=self.vhost.url,
                                  result_backend=self.backend,
                                  security_key=str(secrets.key_file),
                                  security_certificate=str(secrets.cert_file),
                                  security_cert_store=str(secrets.store)))
        use_app(signed)
        close_app(self.app)
        self.app = signed

    @property
    def env(self) -> dict[str, str]:
        """The environment of a chkq command on this cluster."""
        return {**os.environ, "CHKQ_BROKER_URL": self.vhost.url,
                "CHKQ_RESULT_BACKEND": self.backend}

    def add_worker(self, queues: str = "control,copy,verify,commit", concurrency: int = 2,
                   env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(self.vhost.url, queues, concurrency, self.log_dir,
                               {"CHKQ_RESULT_BACKEND": self.backend, **(env or {})})
        self.workers.append(worker)
        return worker

    def chkq(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(CLI + list(args), env=self.env, capture_output=True, text=True,
                              timeout=120)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        use_app(self.previous)
        close_app(self.app)


@pytest.fixture
def amqp_cluster(amqp_vhost: Vhost, redis_server: PrivateRedis, tmp_path: Path
                 ) -> Iterator[AmqpCluster]:
    cluster = AmqpCluster(amqp_vhost, redis_server.url, tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


# ----------------------------------------------------------------- settings


def test_amqp_broker_needs_a_redis_result_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Job state lives in Redis: an amqp broker without a Redis backend is refused clearly."""
    monkeypatch.setenv("CHKQ_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/x")
    monkeypatch.delenv("CHKQ_RESULT_BACKEND", raising=False)
    with pytest.raises(ValueError, match=r"CHKQ_RESULT_BACKEND must be a Redis URL.*amqp"):
        Settings.from_env()
    monkeypatch.setenv("CHKQ_RESULT_BACKEND", "rpc://")
    with pytest.raises(ValueError, match=r"CHKQ_RESULT_BACKEND must be a Redis URL.*rpc"):
        Settings.from_env()
    monkeypatch.setenv("CHKQ_RESULT_BACKEND", "redis://127.0.0.1:1/0")
    assert Settings.from_env().broker_is_amqp


def test_amqp_command_without_backend_names_the_setting(amqp_vhost: Vhost) -> None:
    env = {**os.environ, "CHKQ_BROKER_URL": amqp_vhost.url}
    env.pop("CHKQ_RESULT_BACKEND", None)
    done = subprocess.run(CLI + ["status"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "CHKQ_RESULT_BACKEND must be a Redis URL" in done.stderr


def test_amqp_app_config() -> None:
    """Quorum queues, confirms, heartbeats; the Redis transport's options only on Redis."""
    amqp = make_app(Settings(broker_url="amqp://h/v", result_backend="redis://h:1/0"))
    conf = amqp.conf
    assert conf.broker_transport_options == {"confirm_publish": True}
    assert conf.broker_heartbeat == Settings().broker_heartbeat <= 30
    assert conf.task_default_queue_type == "quorum"
    assert {q.name: q.queue_arguments for q in conf.task_queues} == {
        name: {"x-queue-type": "quorum"} for name in QUEUES}
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    redis_app = make_app(Settings(broker_url="redis://h:1/0"))
    assert redis_app.conf.broker_transport == "chkq.workers.runtime.broker_transport:Transport"
    assert all(q.queue_arguments is None for q in redis_app.conf.task_queues)


# --------------------------------------------------------------- real jobs


def test_consolidation_on_rabbitmq(amqp_cluster: AmqpCluster, tmp_path: Path) -> None:
    """A job with scan units, copies and verifies on two workers; quorum queues declared;
    ``chkq status`` reads it; the queues are empty afterwards."""
    amqp_cluster.add_worker()
    amqp_cluster.add_worker("copy,verify", 1)
    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=4, writers=2, trials=500))
    job = submit_consolidation("run", run)
    output = job.wait_for_output(timeout=JOB_SECONDS)
    assert_consolidated(output, files)
    queues = amqp_cluster.vhost.queues()
    for name in QUEUES:
        assert queues[name]["type"] == "quorum", queues
    wait_for(lambda: all(amqp_cluster.vhost.queues()[n]["messages"] == "0" for n in QUEUES),
             30, "the queues to drain")
    status = amqp_cluster.chkq("status", job.id)
    assert status.returncode == 0, status.stderr
    assert "SUCCESS" in status.stdout and str(output) in status.stdout
    listed = amqp_cluster.chkq("status")
    assert job.id in listed.stdout


def test_consolidate_command_and_scan_units_on_rabbitmq(amqp_cluster: AmqpCluster,
                                                        tmp_path: Path) -> None:
    """``chkq consolidate`` on the amqp cluster, with files enough for scan units."""
    amqp_cluster.add_worker()
    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=12, trials=50))
    done = subprocess.run(CLI + ["consolidate", "run", "--out-dir", str(run)],
                          env={**amqp_cluster.env, "CHKQ_TASK_FILES": "2"},
                          capture_output=True, text=True, timeout=JOB_SECONDS)
    assert done.returncode == 0, done.stderr
    assert_consolidated(run / "run.h5", files)


def test_commit_waiting_for_its_parent_retries_on_rabbitmq(amqp_cluster: AmqpCluster,
                                                           tmp_path: Path) -> None:
    """A commit whose parent is not in the log yet retries with a countdown (held by the
    worker on quorum queues) and succeeds once the parent is committed."""
    amqp_cluster.add_worker("commit", 2)
    files = make_run(tmp_path / "run", "run", RunShape(checkpoints=2, trials=100))
    store = f"file://{tmp_path / 'store'}"
    (tmp_path / "store").mkdir()
    parent = hashlib.sha256(files[0].read_bytes()).hexdigest()
    child = submit_commit(store, "r1", files[1], parent=parent)
    wait_for(lambda: child.state == "RETRY", JOB_SECONDS, "the child commit to retry")
    assert submit_commit(store, "r1", files[0]).get(timeout=JOB_SECONDS)["id"] == parent
    assert child.get(timeout=JOB_SECONDS)["parent"] == parent


def _queued_copies(cluster: AmqpCluster) -> int:
    """Messages ready in the copy queue, as RabbitMQ counts them now (a passive declare)."""
    from kombu import Connection

    with Connection(cluster.vhost.url) as conn:
        return int(conn.default_channel.queue_declare(COPY_QUEUE, passive=True).message_count)


def test_cancel_purges_only_the_jobs_messages_on_rabbitmq(amqp_cluster: AmqpCluster,
                                                          tmp_path: Path) -> None:
    """Two jobs wait in the copy queue (its only worker paused); ``chkq cancel`` of one
    removes its queued copies from RabbitMQ and leaves the other's, which then completes."""
    worker = amqp_cluster.add_worker()
    runs = {n: tmp_path / n for n in ("victim", "other")}
    files = {n: make_run(d, "run", RunShape(checkpoints=3, trials=300)) for n, d in runs.items()}
    before = snapshot(runs["victim"])
    with consumers_paused(worker, COPY_QUEUE):
        jobs: dict[str, ConsolidationJob] = {}
        for name, directory in runs.items():
            jobs[name] = submit_consolidation("run", directory)
        wait_for(lambda: _queued_copies(amqp_cluster) >= 2, JOB_SECONDS, "copies to queue")
        wait_for(lambda: _queued_copies(amqp_cluster) == _stable(amqp_cluster), 30, "plans")
        queued = _queued_copies(amqp_cluster)
        done = amqp_cluster.chkq("cancel", jobs["victim"].id)
        assert done.returncode == 0, done.stderr
        purged = int(done.stdout.split(": ", 1)[1].split(" queued")[0])
        assert purged >= 1, done.stdout
        assert _queued_copies(amqp_cluster) == queued - purged
    with pytest.raises(JobCancelledError):
        jobs["victim"].wait_for_output(timeout=JOB_SECONDS)
    output = jobs["other"].wait_for_output(timeout=JOB_SECONDS)
    assert_consolidated(output, files["other"])
    assert snapshot(runs["victim"]) == before
    time.sleep(2)
    assert not (runs["victim"] / "run.h5").exists()


def _stable(cluster: AmqpCluster, seconds: float = 1.5) -> int:
    """The copy queue's length once it stays the same for ``seconds``."""
    last = _queued_copies(cluster)
    time.sleep(seconds)
    return last if _queued_copies(cluster) == last else -1


def test_purge_loses_nothing_when_the_canceller_dies(amqp_cluster: AmqpCluster) -> None:
    """The purge holds others' messages unacknowledged only while it runs: a canceller
    SIGKILLed mid-sweep loses none (RabbitMQ returns what its connection held), and a
    purge then removes exactly the job's messages."""
    from kombu import Connection

    from chkq.config.routing import task_queues
    from chkq.workers.cancel import purge_queued

    queue = next(q for q in task_queues(quorum=True) if q.name == COPY_QUEUE)
    ids = [f"otherjob-copy-{n}" for n in range(5)] + ["victimjob-copy-0", "victimjob-copy-1"]
    with Connection(amqp_cluster.vhost.url) as conn:
        producer = conn.Producer()
        for task in ids:
            producer.publish({"id": task}, exchange=queue.exchange,
                             routing_key=queue.routing_key, declare=[queue],
                             headers={"id": task})
    holder = (
        "import os, sys\n"
        "from kombu import Connection, Queue\n"
        "conn = Connection(sys.argv[1]); ch = conn.default_channel\n"
        "held = [ch.basic_get(sys.argv[2], no_ack=False) for _ in range(4)]\n"
        "assert all(held)\n"
        "print('held', flush=True)\n"
        "os.kill(os.getpid(), 9)\n")
    died = subprocess.run([sys.executable, "-c", holder, amqp_cluster.vhost.url, COPY_QUEUE],
                          capture_output=True, text=True, timeout=60)
    assert died.stdout.strip() == "held" and died.returncode == -9, died
    wait_for(lambda: _queued_copies(amqp_cluster) == 7, 30, "held messages to come back")
    assert purge_queued("victimjob") == 2
    assert _queued_copies(amqp_cluster) == 5
    left = []
    with Connection(amqp_cluster.vhost.url) as conn:
        bound = queue.bind(conn.default_channel)
        while (message := bound.get(no_ack=True)) is not None:
            left.append(message.headers["id"])
    assert sorted(left) == sorted(ids[:5])


def test_signed_cluster_on_rabbitmq(amqp_cluster: AmqpCluster, secrets: Secrets,
                                    tmp_path: Path) -> None:
    """Signing works the same on RabbitMQ: a signed job completes; an unsigned submission
    is refused by the signed worker (it never runs, the worker lives on)."""
    amqp_cluster.sign_with(secrets)
    worker = amqp_cluster.add_worker(env=secrets.env())
    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=2, trials=200))
    signed = {**amqp_cluster.env, **secrets.env()}
    plain = subprocess.run(CLI + ["consolidate", "run", "--out-dir", str(run),
                                  "--timeout", "15"],
                           env=amqp_cluster.env, capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and not (run / "run.h5").exists(), plain.stdout
    assert worker.process.poll() is None
    done = subprocess.run(CLI + ["consolidate", "run", "--out-dir", str(run)], env=signed,
                          capture_output=True, text=True, timeout=JOB_SECONDS)
    assert done.returncode == 0, done.stderr
    assert_consolidated(run / "run.h5", files)


def test_watch_on_rabbitmq(amqp_cluster: AmqpCluster, tmp_path: Path) -> None:
    """``chkq watch --consolidate`` beside a running simulation, through RabbitMQ: every
    checkpoint committed once, the run consolidated at the end."""
    amqp_cluster.add_worker()
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    store = f"file://{tmp_path / 'store'}"
    sim = fake_simulation.start(out_dir, "sim", 3, 2, 0.5)
    watch_log = tmp_path / "watch.log"
    with open(watch_log, "wb") as out:
        watcher = subprocess.Popen(
            CLI + ["watch", str(out_dir), "sim", "--store", store, "--run", "r1", "--pid",
                   str(sim.pid), "--interval", "0.2", "--consolidate", "--wait"],
            env=amqp_cluster.env, stdout=out, stderr=subprocess.STDOUT)
    assert sim.wait(60) == 0
    try:
        assert watcher.wait(JOB_SECONDS) == 0, watch_log.read_text()
    except subprocess.TimeoutExpired:
        watcher.kill()
        raise AssertionError(f"chkq watch did not end: {watch_log.read_text()[-3000:]}"
                             ) from None
    files = sorted(out_dir.glob("sim_chk*/thread_*.h5"))
    log = CheckpointLog(open_store(store), "r1")
    assert sorted(e.name for e in log.entries()) == sorted(
        str(f.relative_to(out_dir)) for f in files)
    assert_consolidated(out_dir / "sim.h5", files)


def test_flower_on_rabbitmq(amqp_cluster: AmqpCluster, tmp_path: Path) -> None:
    """``chkq flower`` on the RabbitMQ cluster sees the worker and a job's tasks."""
    worker = amqp_cluster.add_worker()
    port = free_port()
    auth = ("ops", "secret-pass")
    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        flower = subprocess.Popen(
            CLI + ["flower", "--port", str(port)],
            env={**amqp_cluster.env, "CHKQ_FLOWER_BASIC_AUTH": ":".join(auth)},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    token = b64encode(":".join(auth).encode()).decode()

    def get(path: str) -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        request.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    try:
        def sees(text: str, path: str) -> bool:
            assert flower.poll() is None, log.read_text()[-3000:]
            try:
                return text in get(path)
            except OSError:
                return False

        wait_for(lambda: sees(worker.name, "/api/workers"), 60, "Flower to see the worker")
        run = tmp_path / "run"
        make_run(run, "run", RunShape(checkpoints=2, trials=100))
        job = submit_consolidation("run", run)
        job.wait_for_output(timeout=JOB_SECONDS)
        wait_for(lambda: sees(f"{job.id}-plan", "/api/tasks"), 60, "Flower to list the job")
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        try:
            flower.wait(20)
        except subprocess.TimeoutExpired:  # Flower may linger on its broker connection
            os.killpg(flower.pid, signal.SIGKILL)
            flower.wait(10)


def test_a_store_job_on_rabbitmq_uses_the_workers_own_quorum_queue(
        amqp_cluster: AmqpCluster, tmp_path: Path) -> None:
    """A run kept in a local store, consolidated on RabbitMQ: each worker's own queue is a
    quorum queue like chkq's others, the job's steps go through it, and it drains."""
    from chkq.stores import open_store
    from chkq.workers.client import submit_store_consolidation

    first = amqp_cluster.add_worker(env={"CHKQ_SCRATCH_DIR": str(tmp_path / "scratch-1")})
    amqp_cluster.add_worker(env={"CHKQ_SCRATCH_DIR": str(tmp_path / "scratch-2")})
    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=3, writers=2, trials=300))
    url = (tmp_path / "store").as_uri() + "/"
    store = open_store(url)
    for path in files:
        store.put(str(path.relative_to(run)), path.read_bytes())
    assert submit_store_consolidation("run", url).wait_for_output(timeout=JOB_SECONDS) \
        == url + "run.h5"
    published = tmp_path / "run.h5"
    published.write_bytes(store.get("run.h5"))
    assert_consolidated(published, files)
    queues = amqp_cluster.vhost.queues()
    own = f"chkq.node.{first.name}"
    assert queues[own]["type"] == "quorum", queues
    node_queues = [n for n in queues if n.startswith("chkq.node.")]
    assert len(node_queues) == 2
    wait_for(lambda: all(amqp_cluster.vhost.queues()[n]["messages"] == "0"
                         for n in node_queues), 30, "the workers' queues to drain")
