"""Signed task messages: broker write access alone runs nothing.

A throwaway CA signs the deployment's certificate; a real ``chkq worker``
runs with CHKQ_SECURITY_KEY / CERTIFICATE / CERT_STORE set, on a Redis
database of its own. Raw messages published with kombu — unsigned, signed by
an unknown key, signed by a key that claims the trusted certificate's id,
signed and then altered, signed around a non-JSON payload — and an unsigned
remote-control ping must all be refused; the worker must go on answering
(signed) pings; and the ``chkq`` command line, with the same settings, must
commit a checkpoint and consolidate a run end to end through it, with JSON
results in the backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.security.serialization import SecureSerializer
from kombu import Connection, Producer

from chkq.config.celery_app import get_app, make_app
from chkq.config.routing import COMMIT_QUEUE, QUEUES
from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.log import CheckpointLog
from chkq.stores import open_store
from chkq.workers.broker import PrivateRedis
from support.helpers import assert_consolidated
from support.plugins.cluster import WorkerProcess
from support.plugins.signing import (
    CLI_TIMEOUT,
    Secrets,
    SignedWorker,
    signed_ping,
)

#: Redis database of these tests (the session's tests use 0).
DB = 12


# ------------------------------------------------------------ certificates
















# ------------------------------------------------------------ processes


def _chkq(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the ``chkq`` command line (a fresh process) with ``env`` on top of ours."""
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT)






@pytest.fixture
def signing_url(redis_server: PrivateRedis) -> Iterator[str]:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    redis.Redis.from_url(url).flushdb()
    yield url
    redis.Redis.from_url(url).flushdb()


# ------------------------------------------------------------ raw messages


def _headers(task: str, task_id: str) -> dict[str, Any]:
    return {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None,
            "group": None, "retries": 0, "eta": None, "expires": None, "argsrepr": "",
            "kwargsrepr": "", "origin": "attacker@test"}


def _commit_body(store_url: str, run: str, path: Path) -> list[Any]:
    return [[store_url, run, str(path)], {},
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]


def _repack(signed: str, **change: bytes | str) -> str:
    """A signed message with some of its packed fields replaced, signature kept."""
    packer = SecureSerializer()
    fields = packer._unpack(signed)
    fields.update(change)
    return str(packer._pack(fields["body"], fields["content_type"],
                            fields["content_encoding"], signer=fields["signer"],
                            signature=fields["signature"]))


def _hostile_commits(url: str, secrets: Secrets, store_url: str, source: Path
                     ) -> list[str]:
    """Publish commits no worker may run, one run name each; return the run names."""
    trusted = secrets.trusted.serializer()
    messages: dict[str, tuple[bytes | str, str]] = {}
    messages["unsigned"] = (json.dumps(_commit_body(store_url, "unsigned", source)),
                            "application/json")
    messages["unsigned-as-data"] = (
        json.dumps(_commit_body(store_url, "unsigned-as-data", source)), "application/data")
    messages["rogue"] = (
        secrets.rogue.serializer().serialize(_commit_body(store_url, "rogue", source)),
        "application/data")
    messages["impostor"] = (
        secrets.impostor.serializer().serialize(_commit_body(store_url, "impostor", source)),
        "application/data")
    # The trusted signature of one body, put on another.
    original = trusted.serialize(_commit_body(store_url, "original", source))
    messages["tampered"] = (
        _repack(original, body=json.dumps(_commit_body(store_url, "tampered", source))
                .encode()), "application/data")
    # A trusted signature around a payload declared as pickle (outside the signature).
    pickled = trusted.serialize(_commit_body(store_url, "pickled", source))
    messages["pickled"] = (_repack(pickled, content_type="application/x-python-serialize",
                                   content_encoding="binary"), "application/data")
    messages["garbage"] = ("not base64 at all \x00\x01", "application/data")
    queue = get_app().amqp.queues[COMMIT_QUEUE]
    with Connection(url) as connection:
        producer = Producer(connection.channel())
        for n, (run, (body, content_type)) in enumerate(messages.items()):
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue], serializer=None, content_type=content_type,
                             content_encoding="utf-8",
                             headers=_headers("chkq.commit", f"hostile-{n}-{run}"),
                             retry=True)
    return [*messages, "original"]


def _drained(url: str, timeout: float = 30) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(int(client.llen(q)) for q in QUEUES) == 0 and not client.zcard("unacked_index"):
            return
        time.sleep(0.2)
    raise AssertionError("the hostile messages were not consumed")


# ------------------------------------------------------------ tests


def test_settings_need_all_three(secrets: Secrets) -> None:
    """Half-configured signing is refused, not silently off."""
    with pytest.raises(ValueError, match="CHKQ_SECURITY_CERT_STORE"):
        Settings(security_key=str(secrets.key_file),
                 security_certificate=str(secrets.cert_file)).check()
    assert not Settings().signing


def test_signing_refuses_a_key_of_another_certificate(secrets: Secrets, tmp_path: Path
                                                      ) -> None:
    """A worker whose key does not match its certificate does not start signing."""
    wrong = tmp_path / "wrong.key"
    wrong.write_text(secrets.rogue.key)
    settings = Settings(security_key=str(wrong), security_certificate=str(secrets.cert_file),
                        security_cert_store=str(secrets.store))
    with pytest.raises(ValueError, match="does not match"):
        make_app(settings)


def test_signed_worker_refuses_unsigned_and_forged_messages(
        secrets: Secrets, signing_url: str, tmp_path: Path) -> None:
    """Only a message signed by a trusted key runs; the worker survives the others."""
    run_dir = tmp_path / "runs"
    store_dir = tmp_path / "store"
    run_dir.mkdir()
    store_dir.mkdir()
    store_url = f"file://{store_dir}"
    source = run_dir / "sim_chk00001.h5"
    source.write_bytes(os.urandom(4096))
    env = {**secrets.env(), "CHKQ_ALLOWED_ROOTS": str(tmp_path)}
    worker = SignedWorker(signing_url, tmp_path, env)
    try:
        refused = _hostile_commits(signing_url, secrets, store_url, source)
        # An unsigned remote-control command gets no answer, and breaks nothing.
        plain = make_app(Settings(broker_url=signing_url, result_backend=signing_url))
        try:
            assert plain.control.ping(destination=[worker.name], timeout=2) == []
        finally:
            plain.close()
        _drained(signing_url)
        assert worker.process.poll() is None, worker.log()[-3000:]
        assert signed_ping(worker.name, worker.client_env), worker.log()[-3000:]

        # The chkq command line, signing with the deployment's key, goes through.
        done = _chkq(["log", "commit", store_url, "good", str(source)], worker.client_env)
        assert done.returncode == 0, done.stderr + worker.log()[-3000:]
        committed = done.stdout.strip()
        store = open_store(store_url)
        assert [r.id for r in CheckpointLog(store, "good").manifest()] == [committed]
        for run in refused:
            assert CheckpointLog(store, run).manifest() == [], run

        # A consolidation: chord callbacks are sent, signed, by the worker itself.
        files = make_run(run_dir, "run", RunShape(checkpoints=2, writers=2, trials=200))
        done = _chkq(["consolidate", "run", "--out-dir", str(run_dir)], worker.client_env)
        assert done.returncode == 0, done.stderr + worker.log()[-3000:]
        assert done.stdout.strip().splitlines()[-1] == str(run_dir / "run.h5")
        assert_consolidated(run_dir / "run.h5", files)

        # Results stay JSON in the backend.
        backend = redis.Redis.from_url(signing_url)
        metas = list(backend.scan_iter("celery-task-meta-*"))
        assert metas
        for key in metas:
            json.loads(backend.get(key) or b"null")

        log = worker.log()
        assert "Unknown certificate" in log
        assert "bad signature: not signed by the key of" in log
        assert "not JSON" in log
        assert worker.process.poll() is None
    finally:
        worker.stop()


def test_unsigned_cluster_refuses_signed_messages(
        secrets: Secrets, signing_url: str, tmp_path: Path) -> None:
    """Signing off (the embedded cluster's default): a signed message is not decoded."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    source = tmp_path / "sim_chk00001.h5"
    source.write_bytes(b"x" * 100)
    worker = _PlainWorker(signing_url, tmp_path)
    try:
        runs = _hostile_commits(signing_url, secrets, f"file://{store_dir}", source)
        _drained(signing_url)
        store = open_store(f"file://{store_dir}")
        # Only the plain JSON message is a chkq message to this worker.
        committed = [run for run in runs if CheckpointLog(store, run).manifest()]
        assert committed == ["unsigned"]
        assert worker.process.poll() is None
    finally:
        worker.stop()


class _PlainWorker(WorkerProcess):
    """A worker without signing on its own database, waited for with plain pings."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.client = make_app(Settings(broker_url=url, result_backend=url))
        super().__init__(url, "commit", 1, log_dir, {"CHKQ_ALLOWED_ROOTS": str(log_dir)})

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log()[-2000:]}")
            if self.client.control.ping(destination=[self.name], timeout=0.5):
                return
        raise RuntimeError(f"worker {self.name} did not answer ping within {timeout} s")

    def stop(self) -> None:
        super().stop()
        self.client.close()
