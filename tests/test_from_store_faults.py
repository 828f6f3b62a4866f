"""Store jobs with the parties real: a worker of another user, killed processes, rival writers.

Each test has a cluster of its own (a private redis-server and workers with
short time limits), so that no other worker of the session can take its
tasks, and a run that exists only in the store (and in a directory its
workers cannot read).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from celery.result import AsyncResult

from chkq.demo import RunShape, make_run
from chkq.errors import WaitTimeoutError
from chkq.jobs import keys
from chkq.jobs.records import task_id
from chkq.stores import CheckpointStore, open_store
from chkq.workers.client import submit_consolidation, submit_store_consolidation
from chkq.workers.waiting import FIRST_WORKER_CHECK_SECONDS
from support.helpers import assert_same_hdf5, wait_for
from support.plugins.faults import SLOW_RUN, Cluster
from support.plugins.object_stores import BUCKET, FaultProxy
from support.plugins.users import LocalUser

TIMEOUT = 180

#: A run whose copy units take seconds: gzip rows re-encoded across file boundaries.
SLOW_STORE_RUN = dataclasses.replace(SLOW_RUN, trials=30011)


def s3_place() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/"


def upload(files: list[Path], run_dir: Path, store: CheckpointStore) -> dict[str, bytes]:
    """Put a run's files at their names in ``store``; return every object's bytes."""
    objects = {}
    for path in files:
        key = str(path.relative_to(run_dir))
        objects[key] = path.read_bytes()
        store.put(key, objects[key])
    return objects


def put_in_s3(run_dir: Path, shape: RunShape
              ) -> tuple[Path, list[Path], str, CheckpointStore, dict[str, bytes]]:
    """A run written to ``run_dir``, then put in a fresh place in S3, the only place its
    job reads: (run_dir, its files, the place's URL, the store there, every object's bytes).
    """
    files = make_run(run_dir, "sim", shape)
    url = s3_place()
    store = open_store(url)
    return run_dir, files, url, store, upload(files, run_dir, store)


def published_as_from_a_directory(cluster: Cluster, store: CheckpointStore, files: list[Path],
                                  run_dir: Path, objects: dict[str, bytes],
                                  tmp_path: Path) -> None:
    """``sim.h5`` in the store equals the run consolidated from a directory, every source
    is intact, and no upload was left unfinished."""
    output = tmp_path / "sim.h5"
    output.write_bytes(store.get("sim.h5"))
    assert_same_hdf5(output, reference(cluster, files, run_dir, tmp_path))
    assert {k: store.get(k) for k in objects} == objects
    no_strays(store)


def reference(cluster: Cluster, files: list[Path], run_dir: Path, tmp_path: Path) -> Path:
    """The run consolidated from a directory by a worker that can read it."""
    cluster.add_workers(1, "control,copy,verify", concurrency=2)
    directory = tmp_path / "reference"
    shutil.copytree(run_dir, directory)
    output = submit_consolidation("sim", directory).wait_for_output(timeout=TIMEOUT)
    assert isinstance(output, Path)
    return output


def running_step(cluster: Cluster, job: str) -> bool:
    """Whether a worker of ``cluster`` runs a task of ``job`` (past its staging) now."""
    names = [w.name for w in cluster.workers if w.process.poll() is None]
    active = cluster.app.control.inspect(destination=names, timeout=1.0).active() or {}
    return any(str(r.get("id", "")).startswith(job) and "-stage" not in str(r.get("id"))
               for requests in active.values() for r in requests)


def copy_mid_way(cluster: Cluster, job: str) -> tuple[int, int] | None:
    """A copy of ``job`` with rows left to do (its unit), and the pid of the process running it.

    A copy reports progress as it goes and once more just before it ends: only a report
    short of its total says it is mid-way.
    """
    names = [w.name for w in cluster.workers if w.process.poll() is None]
    active = cluster.app.control.inspect(destination=names, timeout=1.0).active() or {}
    for requests in active.values():
        for request in requests:
            task = str(request.get("id", ""))
            if not task.startswith(f"{job}-copy-"):
                continue
            result = AsyncResult(task, app=cluster.app)
            info = result.info if result.state == "PROGRESS" else None
            if isinstance(info, dict) and int(info.get("done", 0)) < int(info.get("total", 0)):
                return int(task.rsplit("-", 1)[1]), int(request["worker_pid"])
    return None


def store_env(scratch: Path) -> dict[str, str]:
    return {"CHKQ_SCRATCH_DIR": str(scratch), "CHKQ_ALLOWED_ROOTS": str(scratch)}


def no_strays(store: CheckpointStore) -> None:
    assert store.stray_uploads() == [], "an upload was left unfinished"


def test_a_worker_of_another_user_consolidates_a_run_it_cannot_read(
        make_cluster: Callable[..., Cluster], local_users: tuple[LocalUser, LocalUser],
        s3_endpoint: str, tmp_path: Path) -> None:
    scientist, service = local_users
    run_dir = scientist.mkdir(f"run-{uuid.uuid4().hex[:8]}")
    files = make_run(run_dir, "sim", RunShape(checkpoints=3, writers=2, trials=300))
    scientist.chown_tree(run_dir)
    scratch = service.mkdir(f"scratch-{uuid.uuid4().hex[:8]}")
    probe = service.python(f"import os; os.listdir({str(run_dir)!r})")
    assert probe.returncode != 0 and b"PermissionError" in probe.stderr
    url = s3_place()
    store = open_store(url)
    objects = upload(files, run_dir, store)

    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2,
                                    env={**store_env(scratch / "work"), "HOME": str(service.home)},
                                    user=service.uid, group=service.gid, extra_groups=[])
    summary = submit_store_consolidation("sim", url).wait_for_summary(timeout=TIMEOUT)
    assert summary.output == url + "sim.h5"
    assert f"task=chkq.link job={summary.job}" in worker.log()
    worker.stop()
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)
    assert list((scratch / "work").iterdir()) == []


def test_a_copy_process_killed_mid_task_runs_again_on_the_jobs_worker(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", SLOW_STORE_RUN)
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2,
                                    env=store_env(tmp_path / "scratch"))
    job = submit_store_consolidation("sim", url)
    unit, pid = wait_for(lambda: copy_mid_way(cluster, job.id), timeout=60, interval=0.01,
                         what="a copy running mid-way")
    os.kill(pid, signal.SIGKILL)
    assert job.wait_for_summary(timeout=TIMEOUT).output == url + "sim.h5"
    assert cluster.deliveries(job, "copy", unit) >= 2
    worker.stop()
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)


def test_a_worker_killed_and_started_again_under_its_name_finishes_its_store_job(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", SLOW_STORE_RUN)
    cluster = make_cluster()
    env = store_env(tmp_path / "scratch")
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env=env)
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: running_step(cluster, job.id), timeout=60, interval=0.01,
             what="a step of the job running")
    worker.kill()
    notices: list[str] = []
    with pytest.raises(WaitTimeoutError):
        job.wait_for_summary(timeout=FIRST_WORKER_CHECK_SECONDS + 6, on_notice=notices.append)
    assert any(f"the worker {worker.name}, which holds job {job.id}" in n and "is gone" in n
               for n in notices), notices
    (again,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env=env,
                                   name=worker.name)
    summary = job.wait_for_summary(timeout=TIMEOUT)
    assert f"job={job.id}" in again.log()
    again.stop()
    assert summary.output == url + "sim.h5"
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)
    assert list((tmp_path / "scratch").iterdir()) == []


def test_a_destination_created_by_someone_else_during_the_job_is_left_alone(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", SLOW_STORE_RUN)
    cluster = make_cluster()
    cluster.add_workers(1, "control,copy,verify", concurrency=2,
                        env=store_env(tmp_path / "scratch"))
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: cluster.client().exists(keys.job_record(job.id, "store")), timeout=60,
             what="the job staged")
    store.put("sim.h5", b"theirs")
    with pytest.raises(FileExistsError, match="sim.h5"):
        job.wait_for_output(timeout=TIMEOUT)
    assert store.get("sim.h5") == b"theirs"
    assert {k: store.get(k) for k in objects} == objects
    assert wait_for(lambda: list((tmp_path / "scratch").iterdir()) == [], timeout=30,
                    what="workspace removed")
    no_strays(store)


def test_a_source_replaced_before_it_is_fetched_fails_the_job_naming_it(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    run_dir, files, url, store, objects = put_in_s3(
        tmp_path / "run", RunShape(checkpoints=3, trials=200))
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control", concurrency=1,
                                    env=store_env(tmp_path / "scratch"))
    # Only the control queue is served, and the fetches go to the worker's own queue,
    # which it serves too: stop that one until the source is replaced.
    node_queue = f"chkq.node.{worker.name}"
    from support.plugins.cluster import consumers_paused

    with consumers_paused(worker, node_queue):
        job = submit_store_consolidation("sim", url)
        wait_for(lambda: cluster.client().exists(keys.job_record(job.id, "store")), timeout=60,
                 what="the job staged")
        time.sleep(0.5)
        original = files[1].read_bytes()
        replaced = original[:-1] + bytes([original[-1] ^ 0xFF])
        store.put("sim_chk00002.h5", replaced)
    with pytest.raises(Exception, match=r"sim_chk00002\.h5") as failed:
        job.wait_for_output(timeout=TIMEOUT)
    assert url in str(failed.value) or "sim_chk00002.h5" in str(failed.value)
    assert not store.exists("sim.h5")
    assert store.get("sim_chk00002.h5") == replaced
    no_strays(store)


#: A run whose output is several 5 MiB parts: spectra of 1,024 float64 columns.
PARTS_RUN = RunShape(checkpoints=2, trials=2000, spec_columns=1024)


def publisher_killed(make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path,
                     when: Callable[[CheckpointStore, str], bool]) -> tuple[Cluster, object]:
    """Start a store job whose worker reaches S3 through a fault proxy; once ``when`` holds
    (checked on the store directly), cut the proxy and SIGKILL the process running the link.
    """
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", PARTS_RUN)
    proxy = FaultProxy(s3_endpoint)
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        **store_env(tmp_path / "scratch"), "AWS_ENDPOINT_URL": proxy.url,
        "CHKQ_UPLOAD_PART_BYTES": str(5 << 20), "CHKQ_STORE_RETRY_SECONDS": "60"})
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: when(store, "sim.h5"), timeout=120, interval=0.005,
             what="the publish reached the point of the kill")
    proxy.go_down(4)
    _, pid = wait_for(lambda: cluster.running(job.id), timeout=10, what="the link running")
    os.kill(pid, signal.SIGKILL)
    summary = job.wait_for_summary(timeout=TIMEOUT)
    assert cluster.deliveries(job, "link") >= 2
    worker.stop()
    assert summary.output == url + "sim.h5"
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)
    proxy.close()
    return cluster, job


def test_a_publisher_killed_mid_upload_leaves_nothing_and_the_job_publishes_once(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    def uploading(store: CheckpointStore, key: str) -> bool:
        return any(u.key == key for u in store.stray_uploads(key))

    publisher_killed(make_cluster, s3_endpoint, tmp_path, uploading)


def test_a_publisher_killed_after_completing_is_recognised_by_its_redelivery(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    def published(store: CheckpointStore, key: str) -> bool:
        return store.exists(key)

    publisher_killed(make_cluster, s3_endpoint, tmp_path, published)


def test_a_lost_answer_to_the_completion_of_the_upload_is_recognised(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    """S3 completes the upload but its answer never reaches the worker: the retry meets
    the object, which holds the worker's own bytes, and the job ends with it."""
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", PARTS_RUN)
    proxy = FaultProxy(s3_endpoint)
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    proxy.lose_next_response(f"POST /{BUCKET}/{prefix}sim.h5?uploadId=".encode())
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        **store_env(tmp_path / "scratch"), "AWS_ENDPOINT_URL": proxy.url,
        "CHKQ_UPLOAD_PART_BYTES": str(5 << 20)})
    summary = submit_store_consolidation("sim", url).wait_for_summary(timeout=TIMEOUT)
    worker.stop()
    assert proxy.lost == 1
    assert summary.output == url + "sim.h5"
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)
    proxy.close()


def test_a_fetch_killed_mid_download_runs_again_and_the_job_ends_correctly(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    run_dir, files, url, store, objects = put_in_s3(tmp_path / "run", PARTS_RUN)
    proxy = FaultProxy(s3_endpoint)
    cluster = make_cluster()
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        **store_env(tmp_path / "scratch"), "AWS_ENDPOINT_URL": proxy.url,
        "CHKQ_STORE_RETRY_SECONDS": "60"})
    job = submit_store_consolidation("sim", url)
    wait_for(lambda: cluster.client().exists(keys.job_record(job.id, "store")), timeout=60,
             interval=0.005, what="the job staged")
    proxy.go_down(4)
    _, pid = wait_for(lambda: cluster.running(task_id(job.id, "fetch", 0)), timeout=20,
                      what="the fetch running")
    os.kill(pid, signal.SIGKILL)
    assert job.wait_for_summary(timeout=TIMEOUT).output == url + "sim.h5"
    assert cluster.deliveries(job, "fetch", 0) >= 2
    worker.stop()
    published_as_from_a_directory(cluster, store, files, run_dir, objects, tmp_path)
    proxy.close()
