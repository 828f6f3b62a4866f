"""Commits under faults: lost responses, S3 409, a committer killed mid-commit, load.

Real parts only: moto's HTTP server behind a fault-injecting TCP proxy, real
worker processes, a committer process really SIGKILLed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from celery.result import AsyncResult

from chkq.config.routing import COMMIT_QUEUE
from chkq.log import CheckpointLog, checkpoint_id
from chkq.stores import open_store
from chkq.workers.commit_client import record_of, submit_commit, submit_commit_chain
from tests.plugins.cluster import WorkerProcess, consumers_paused
from tests.plugins.object_stores import BUCKET, FaultProxy
from tests.test_log_tasks import checkpoint_series, payload_keys

TIMEOUT = 180


def s3_env(proxy: FaultProxy) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def assert_exact(url: str, run: str, files: list[Path]) -> None:
    """One record per file, every payload referenced, every checkpoint loads verified."""
    log = CheckpointLog(open_store(url), run)
    manifest = log.manifest()
    assert sorted(r.id for r in manifest) == sorted(checkpoint_id(f.read_bytes()) for f in files)
    assert payload_keys(url, run) == {r.payload for r in manifest}, "orphan payloads"
    for f in files:
        assert log.load(checkpoint_id(f.read_bytes())) == f.read_bytes()


@pytest.mark.parametrize("which", ["payloads", "records"])
def test_lost_response_to_a_conditional_put(tmp_path: Path, worker: WorkerProcess,
                                            start_worker: object, s3_proxy: FaultProxy,
                                            which: str) -> None:
    """The store wrote the object but the answer was lost: botocore retries, gets 412
    against its own write, and the commit recognises it — no duplicate, nothing lost."""
    files = checkpoint_series(tmp_path / "run", 3, size=128 * 1024)
    prefix = f"t-lost-{which}-{os.getpid()}"
    url = f"s3://{BUCKET}/{prefix}"
    with consumers_paused(worker, COMMIT_QUEUE):
        start_worker("commit", concurrency=1, env=s3_env(s3_proxy))  # type: ignore[operator]
        record_of(submit_commit(url, "r1", files[0], name="a").get(timeout=TIMEOUT))
        s3_proxy.lose_next_response(f"PUT /{BUCKET}/{prefix}/runs/r1/{which}/".encode())
        parent = checkpoint_id(files[0].read_bytes())
        record = record_of(submit_commit(url, "r1", files[1], parent=parent, name="b")
                           .get(timeout=TIMEOUT))
        assert s3_proxy.lost == 1
        record_of(submit_commit(url, "r1", files[2], parent=record.id, name="c")
                  .get(timeout=TIMEOUT))
    assert_exact(url, "r1", files)


def test_s3_409_conditional_conflict_is_retried(tmp_path: Path, worker: WorkerProcess,
                                                start_worker: object,
                                                s3_proxy: FaultProxy) -> None:
    files = checkpoint_series(tmp_path / "run", 2, size=64 * 1024)
    prefix = f"t-409-{os.getpid()}"
    url = f"s3://{BUCKET}/{prefix}"
    body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ConditionalRequestConflict"
            b"</Code><Message>A conflicting conditional operation is in progress</Message>"
            b"</Error>")
    with consumers_paused(worker, COMMIT_QUEUE):
        start_worker("commit", concurrency=1, env=s3_env(s3_proxy))  # type: ignore[operator]
        s3_proxy.answer_next(
            f"PUT /{BUCKET}/{prefix}/runs/r1/records/".encode(),
            b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        first = record_of(submit_commit(url, "r1", files[0]).get(timeout=TIMEOUT))
        assert s3_proxy.answered == 1
        record_of(submit_commit(url, "r1", files[1], parent=first.id).get(timeout=TIMEOUT))
    assert_exact(url, "r1", files)


KILLED_COMMITTER = """
import os, signal, sys
from chkq.log import CheckpointLog
from chkq.stores import open_store
store = open_store(sys.argv[1])
real = store.put_if_absent
def put_then_die(key, data):
    done = real(key, data)
    if "/payloads/" in key:
        os.kill(os.getpid(), signal.SIGKILL)
    return done
store.put_if_absent = put_then_die
log = CheckpointLog(store, "r1")
log.commit(open(sys.argv[2], "rb").read(), sys.argv[3] if len(sys.argv) > 3 else None)
"""


def test_gc_removes_what_a_killed_committer_left_and_nothing_else(tmp_path: Path) -> None:
    """A committer SIGKILLed between payload and record leaves one orphan; gc takes it."""
    url = f"file://{tmp_path / 'store'}"
    files = checkpoint_series(tmp_path / "run", 3, size=256 * 1024)
    log = CheckpointLog(open_store(url), "r1")
    first = log.commit(files[0].read_bytes())
    second = log.commit(files[1].read_bytes(), first)
    live = payload_keys(url, "r1")
    died = subprocess.run([sys.executable, "-c", KILLED_COMMITTER, url, str(files[2]), second],
                          timeout=TIMEOUT)
    assert died.returncode == -9
    orphans = payload_keys(url, "r1") - live
    assert len(orphans) == 1
    assert checkpoint_id(files[2].read_bytes()) not in CheckpointLog(open_store(url), "r1")
    gc = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "log", "gc", url, "r1",
                         "--older-than", "0"], capture_output=True, text=True, timeout=TIMEOUT)
    assert gc.returncode == 0, gc.stderr
    assert set(gc.stdout.split()) == orphans
    assert payload_keys(url, "r1") == live
    fresh = CheckpointLog(open_store(url), "r1")
    assert fresh.load(second) == files[1].read_bytes()
    fresh.commit(files[2].read_bytes(), second)
    assert_exact(url, "r1", files)


@pytest.mark.slow
def test_2000_commits_from_8_clients_on_8_worker_processes(
    tmp_path: Path, worker: WorkerProcess, start_worker: object
) -> None:
    """8 clients each enqueue a chain of 250 small checkpoints into one log at once."""
    start_worker("commit", concurrency=6)  # type: ignore[operator]
    url = f"file://{tmp_path / 'store'}"
    chains = [checkpoint_series(tmp_path / f"client{c}", 250, size=4096, seed=c)
              for c in range(8)]
    results: list[AsyncResult] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        """Clients 0-3 send single commits, clients 4-7 one Celery chain each."""
        paths = chains[index]
        if index < 4:
            sent = [submit_commit(url, "load", p, step=i,
                                  parent=checkpoint_id(paths[i - 1].read_bytes()) if i else None)
                    for i, p in enumerate(paths)]
        else:
            sent = [submit_commit_chain(url, "load", list(paths), first_step=0)]
        with lock:
            results.extend(sent)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(chains))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        result.get(timeout=TIMEOUT)
    every = [p for chain in chains for p in chain]
    assert_exact(url, "load", every)
    log = CheckpointLog(open_store(url), "load")
    assert sorted(h.id for h in log.heads()) == sorted(
        checkpoint_id(chain[-1].read_bytes()) for chain in chains)
