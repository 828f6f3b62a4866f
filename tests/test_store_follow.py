"""``chkq consolidate MODEL --from URL --follow`` beside a simulation that uploads its checkpoints.

A real writer process writes checkpoints as slug does (file created, rows written,
``trials_completed`` set at close) and puts each finished file into the store; a real
reader process finds the latest version through its pointer in a loop and checks every
version it sees against the writer's files. The final output, at the key a one-shot
``--from`` job writes, must equal a one-shot ``--from`` consolidation of the same objects,
object for object, and the interim versions must be gone after it. Then the faults: a
damaged checkpoint object, an object replaced after a version was made from it, the
follower started again after its worker's workspace was lost, and a second follower.
The workers are real processes against a real redis-server; S3 is moto's server over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import pytest

from chkq.consolidation.driver import consolidate_here
from chkq.demo import RunShape, write_checkpoint_file
from chkq.staging.follow_upload import publish_version_file
from chkq.staging.follow_versions import fetch_version, latest_pointer, versions_prefix
from chkq.stores import CheckpointStore, open_store
from chkq.stores.publish import publish_file
from chkq.workers.client import submit_store_consolidation
from support import fake_simulation, store_follow_reader
from support.helpers import assert_same_hdf5, wait_for
from support.plugins.faults import Cluster
from support.plugins.object_stores import BUCKET

pytestmark = pytest.mark.integration

TIMEOUT = 180
LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "240", "CHKQ_TIME_LIMIT": "300",
          "CHKQ_VISIBILITY_TIMEOUT": "420"}


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The workers' scratch directory and the file stores' directory."""
    root = tmp_path_factory.mktemp("store-follow")
    found = {name: root / name for name in ("scratch", "stores")}
    for path in found.values():
        path.mkdir(mode=0o700)
    return found


@pytest.fixture(scope="module")
def cluster(redis_server: object, s3_endpoint: str, places: dict[str, Path]
            ) -> Iterator[Cluster]:
    """A cluster of the module's own: one worker (two processes) that reaches the stores.

    Its scratch directory and the file stores are all it may touch: it sees none of
    the writer's files.
    """
    made = Cluster(places["scratch"]).start()
    try:
        made.add_workers(1, "control,copy,verify,commit", concurrency=2, env={
            **LIMITS, "CHKQ_SCRATCH_DIR": str(places["scratch"] / "work"),
            "CHKQ_UPLOAD_PART_BYTES": str(5 << 20),
            "CHKQ_ALLOWED_ROOTS": f"{places['scratch']}:{places['stores']}"})
        yield made
    finally:
        made.release()
        made.close()


def store_url(kind: str, places: dict[str, Path]) -> str:
    """A fresh, empty place in a store of ``kind`` (a ``file://`` store's directory made)."""
    name = uuid.uuid4().hex[:12]
    if kind == "file":
        (places["stores"] / name).mkdir()
        return (places["stores"] / name).as_uri() + "/"
    return f"s3://{BUCKET}/{name}/"


def cluster_env(cluster: Cluster) -> dict[str, str]:
    """The environment of a ``chkq`` command that uses the module's cluster."""
    return {**os.environ, "CHKQ_BROKER_URL": cluster.redis.url,
            "CHKQ_RESULT_BACKEND": cluster.redis.url}


def start_follow(cluster: Cluster, url: str, log: Path, *options: str) -> subprocess.Popen[str]:
    env = cluster_env(cluster)
    with open(log, "a") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--from", url,
             "--follow", *options], stdout=sink, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=env)


def versions_in(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("version ")]


def one_shot_from(run_dir: Path, files: list[Path], places: dict[str, Path],
                  tmp_path: Path) -> Path:
    """The same checkpoints put under another prefix and consolidated by a one-shot ``--from``."""
    url = store_url("file", places)
    store = open_store(url)
    for path in files:
        store.put(str(path.relative_to(run_dir)), path.read_bytes())
    output = submit_store_consolidation("sim", url).wait_for_output(timeout=TIMEOUT)
    return fetched(store, str(output).removeprefix(url), tmp_path / "one-shot.h5")


def fetched(store: CheckpointStore, key: str, into: Path) -> Path:
    into.write_bytes(store.get(key))
    return into


def files_of(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("sim_chk*.h5")) + sorted(run_dir.glob("sim_chk*/*.h5"))


@pytest.mark.parametrize("kind, writers", [("s3", 0), ("file", 3)],
                         ids=["s3-files", "file-directories"])
def test_a_reader_sees_only_whole_versions_and_the_final_is_the_one_shot(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path, kind: str,
        writers: int) -> None:
    run_dir, stop, seen = tmp_path / "run", tmp_path / "stop", tmp_path / "seen.json"
    run_dir.mkdir()
    url = store_url(kind, places)
    store = open_store(url)
    done = tmp_path / "done"
    sim = fake_simulation.start(run_dir, "sim", 5, writers, 0.6, "--trials", "150",
                                "--done", str(done), "--upload", url)
    reader = store_follow_reader.start(url, "sim.h5", run_dir, "sim", stop, seen)
    log = tmp_path / "follow.log"
    follower = start_follow(cluster, url, log, "--done-file", str(done),
                            "--keep-versions", "1")
    try:
        assert sim.wait(TIMEOUT) == 0
        assert follower.wait(TIMEOUT) == 0, log.read_text()
    finally:
        stop.touch()
        reader.wait(60)
    found = json.loads(seen.read_text())
    assert found["errors"] == [], found
    assert len(found["seen"]) >= 2 and found["seen"] == sorted(found["seen"]), found
    assert found["seen"][-1] == 5, found
    assert len(versions_in(log)) >= 2, log.read_text()
    assert log.read_text().splitlines()[-1] == f"{url}sim.h5", log.read_text()
    final = fetched(store, "sim.h5", tmp_path / "final.h5")
    assert_same_hdf5(final, one_shot_from(run_dir, files_of(run_dir), places, tmp_path))
    pointer = latest_pointer(store, "sim.h5")
    assert pointer is not None and pointer.final and pointer.key("sim.h5") == "sim.h5"
    assert pointer.through == 5 and pointer.number == len(versions_in(log))
    assert store.list(versions_prefix("sim.h5")) == [f"sim.h5.versions/{pointer.number:06d}.json"]
    assert workspaces(places, url) == []
    status = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "status", "--limit", "100"],
        capture_output=True, text=True, timeout=TIMEOUT, env=cluster_env(cluster))
    assert status.returncode == 0, status.stderr
    [block] = [b for b in status.stdout.split("follows:\n", 1)[1].split("  follow ")[1:]
               if f" of sim in {url}: finished" in b.splitlines()[0]]
    assert (f"{pointer.number} versions published, the latest through checkpoint 5" in block
            and f"{url}sim.h5\n" in block), block


def workspaces(places: dict[str, Path], url: str) -> list[Path]:
    """The follow workspaces in the worker's scratch directory of the store run at ``url``."""
    found = []
    for space in (places["scratch"] / "work").glob("follow-*"):
        if not space.is_dir():
            continue
        store, key = json.loads((space / "state.json").read_text())["destination"]
        if f"{store.rstrip('/')}/{key}" == f"{url}sim.h5":
            found.append(space)
    return found


def write(run_dir: Path, number: int, first: int, trials: int, seed: int = 0) -> Path:
    shape = RunShape(trials=trials, spec_columns=8, chunk_rows=64, seed=seed)
    path = run_dir / f"sim_chk{number:05d}.h5"
    write_checkpoint_file(path, shape, first, trials, number)
    return path


def upload(store: CheckpointStore, path: Path) -> None:
    store.put(path.name, path.read_bytes())


def rows_of(path: Path) -> int:
    with h5py.File(path, "r") as f:
        return int(f["galaxy/trial"].shape[0])


def followed(cluster: Cluster, places: dict[str, Path], tmp_path: Path, trials: int,
             *options: str) -> tuple[CheckpointStore, str, Path, Path, subprocess.Popen[str]]:
    """An S3 run of one checkpoint, followed until its first version is out."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = store_url("s3", places)
    store = open_store(url)
    upload(store, write(run_dir, 1, 0, trials))
    log = tmp_path / "follow.log"
    follower = start_follow(cluster, url, log, "--keep-versions", "0", *options)
    wait_for(lambda: len(versions_in(log)) == 1, TIMEOUT, "the first version")
    return store, url, run_dir, log, follower


def latest_rows(store: CheckpointStore, into: Path) -> tuple[int, int]:
    """The newest version's number and rows, read as a reader reads it."""
    pointer = latest_pointer(store, "sim.h5")
    assert pointer is not None
    fetch_version(store, "sim.h5", pointer, into)
    try:
        return pointer.number, rows_of(into)
    finally:
        into.unlink()


def test_a_damaged_checkpoint_object_stops_the_follow_naming_it_and_the_last_version_stays(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path) -> None:
    store, url, run_dir, log, follower = followed(cluster, places, tmp_path, 300,
                                                  "--idle", "60")
    damaged = write(run_dir, 2, 300, 300)
    store.put(damaged.name, damaged.read_bytes()[: damaged.stat().st_size // 2])
    upload(store, write(run_dir, 3, 600, 300))
    assert follower.wait(TIMEOUT) == 1, log.read_text()
    said = log.read_text()
    assert f"{url}sim_chk00002.h5" in said and "damaged" in said, said
    assert latest_rows(store, tmp_path / "latest.h5") == (1, 300)
    assert not store.exists("sim.h5")
    assert workspaces(places, url) == []


def test_an_object_replaced_after_a_version_was_made_from_it_stops_the_follow(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path) -> None:
    store, url, run_dir, log, follower = followed(cluster, places, tmp_path, 100,
                                                  "--idle", "60")
    upload(store, write(run_dir, 2, 100, 90))
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    upload(store, write(run_dir, 2, 100, 95, seed=7))
    assert follower.wait(TIMEOUT) == 1, log.read_text()
    said = log.read_text()
    assert f"{url}sim_chk00002.h5" in said and "replaced" in said, said
    assert latest_rows(store, tmp_path / "latest.h5") == (2, 190)


def test_a_follow_started_again_without_its_workspace_resumes_from_the_store(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path) -> None:
    """The follower is killed and its worker's workspace lost: the next follow goes on."""
    store, url, run_dir, log, follower = followed(cluster, places, tmp_path, 150,
                                                  "--idle", "60")
    upload(store, write(run_dir, 2, 150, 130))
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    os.killpg(follower.pid, signal.SIGKILL)
    follower.wait()
    [space] = workspaces(places, url)
    shutil.rmtree(space)
    upload(store, write(run_dir, 3, 280, 70))
    done = tmp_path / "done"
    again = start_follow(cluster, url, log, "--done-file", str(done), "--keep-versions", "0")
    wait_for(lambda: len(versions_in(log)) == 3, TIMEOUT, "a version after the restart")
    assert versions_in(log)[-1].startswith("version 3: checkpoints 1..3"), log.read_text()
    upload(store, write(run_dir, 4, 350, 20))
    wait_for(lambda: len(versions_in(log)) == 4, TIMEOUT, "the fourth version")
    done.touch()
    assert again.wait(TIMEOUT) == 0, log.read_text()
    final = fetched(store, "sim.h5", tmp_path / "final.h5")
    assert rows_of(final) == 370
    assert_same_hdf5(final, one_shot_from(run_dir, files_of(run_dir), places, tmp_path))


def test_a_second_follower_of_a_store_run_is_refused_naming_the_first(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path) -> None:
    store, url, run_dir, log, first = followed(cluster, places, tmp_path, 50, "--idle", "60")
    second = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--from", url,
         "--follow", "--idle", "5"], capture_output=True, text=True, timeout=TIMEOUT,
        env=cluster_env(cluster))
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(30)
    assert second.returncode == 1, second.stderr
    assert str(first.pid) in second.stderr, second.stderr


def test_store_follow_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    for extra, said in ((["--run", "r1"], "--run"), (["--cleanup"], "--cleanup")):
        done = subprocess.run(
            [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--from",
             tmp_path.as_uri() + "/", "--follow", "--idle", "3", *extra],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--out-dir",
         str(tmp_path), "--follow", "--idle", "3", "--keep-versions", "1"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--keep-versions needs --from" in done.stderr, done.stderr


def test_a_large_version_on_s3_is_mostly_copied_from_the_previous_one_and_ends_right(
        cluster: Cluster, places: dict[str, Path], tmp_path: Path) -> None:
    """Checkpoints of 24 MiB: the second version's parts that the first holds unchanged are
    copied by S3, and the final version still equals a one-shot consolidation."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = store_url("s3", places)
    store = open_store(url)
    shape = RunShape(trials=30000, spec_columns=64, chunk_rows=1024)
    first = run_dir / "sim_chk00001.h5"
    write_checkpoint_file(first, shape, 0, 30000, 1)
    upload(store, first)
    log, done = tmp_path / "follow.log", tmp_path / "done"
    follower = start_follow(cluster, url, log, "--done-file", str(done), "--keep-versions", "0")
    wait_for(lambda: len(versions_in(log)) == 1, TIMEOUT, "the first version")
    second = run_dir / "sim_chk00002.h5"
    write_checkpoint_file(second, shape, 30000, 30000, 2)
    upload(store, second)
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    done.touch()
    assert follower.wait(TIMEOUT) == 0, log.read_text()
    lines = versions_in(log)
    copied = int(lines[1].split(" (")[-1].split(" of ")[0].replace(",", ""))
    assert copied >= 10 << 20, lines
    final = fetched(store, "sim.h5", tmp_path / "final.h5")
    assert rows_of(final) == 60000
    assert_same_hdf5(final, one_shot_from(run_dir, files_of(run_dir), places, tmp_path))


def test_a_version_on_s3_copies_its_unchanged_parts_from_the_previous_version_object(
        s3_endpoint: str, tmp_path: Path) -> None:
    """The store copies what the new version shares with the previous one at the same offsets;
    a previous object that is not the previous version's bytes gets the version sent whole."""
    part = 5 << 20
    store = open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/")
    old = os.urandom(3 * part + 1000)
    new = bytearray(old[:3 * part])
    new[part + 17] ^= 0xFF                      # the second part changed (metadata, say)
    new += os.urandom(part + 5000)              # the new rows, and the tail
    old_path, new_path = tmp_path / "old.h5", tmp_path / "new.h5"
    old_path.write_bytes(old)
    new_path.write_bytes(bytes(new))
    publish_file(store, "sim.h5.versions/000001.h5", old_path, part_bytes=part)
    sent = publish_version_file(store, "sim.h5.versions/000002.h5", new_path, part_bytes=part,
                                previous=("sim.h5.versions/000001.h5", old_path))
    assert sent.copied == 2 * part              # parts 1 and 3; the rest was sent
    assert store.get("sim.h5.versions/000002.h5") == bytes(new)
    assert sent.published.sha256 == hashlib.sha256(new).hexdigest()
    store.put("sim.h5.versions/000001.h5", os.urandom(len(old)))   # not the previous version
    again = publish_version_file(store, "sim.h5.versions/000003.h5", new_path, part_bytes=part,
                                 previous=("sim.h5.versions/000001.h5", old_path))
    assert again.copied == 0
    assert store.get("sim.h5.versions/000003.h5") == bytes(new)
    assert store.stray_uploads("sim.h5.versions/") == []


@pytest.mark.fault
def test_a_worker_killed_between_versions_and_started_again_under_its_name_goes_on(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    """The follow's jobs go to its worker's own queue: killed outright, the worker leaves the
    next version waiting there; started again under its name (same scratch directory) it
    takes that job, extends the version its workspace kept, and the follow ends right."""
    cluster = make_cluster()
    env = {"CHKQ_SCRATCH_DIR": str(tmp_path / "scratch"),
           "CHKQ_ALLOWED_ROOTS": str(tmp_path / "scratch")}
    (worker,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env=env)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/"
    store = open_store(url)
    upload(store, write(run_dir, 1, 0, 200))
    log, done = tmp_path / "follow.log", tmp_path / "done"
    follower = start_follow(cluster, url, log, "--done-file", str(done), "--keep-versions", "0")
    wait_for(lambda: len(versions_in(log)) == 1, TIMEOUT, "the first version")
    worker.kill()
    upload(store, write(run_dir, 2, 200, 150))
    time.sleep(2)  # the follower has sent the next version's job to the dead worker's queue
    assert len(versions_in(log)) == 1 and follower.poll() is None, log.read_text()
    (again,) = cluster.add_workers(1, "control,copy,verify", concurrency=2, env=env,
                                   name=worker.name)
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the version after the restart")
    assert versions_in(log)[1].startswith("version 2: checkpoints 1..2, "), log.read_text()
    done.touch()
    assert follower.wait(TIMEOUT) == 0, log.read_text()
    assert "chkq.store_version" in again.log()
    again.stop()
    final = fetched(store, "sim.h5", tmp_path / "final.h5")
    assert rows_of(final) == 350
    reference = tmp_path / "reference"
    shutil.copytree(run_dir, reference)
    assert_same_hdf5(final, consolidate_here(reference, "sim"))
    assert [p for p in (tmp_path / "scratch").iterdir() if p.is_dir()] == []
