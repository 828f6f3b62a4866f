"""Consolidation of runs kept only in an object store: real workers, real stores.

The workers here see no run directory: each has its own scratch directory,
and ``CHKQ_ALLOWED_ROOTS`` names only that, the directory of the local
stores, and the directory where the reference outputs (the same runs
consolidated from a directory) are made.
Stores are a local directory (``file://``), moto's S3 server over HTTP and
fake-gcs-server.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chkq.config.celery_app import get_app
from chkq.demo import RunShape, make_run
from chkq.log import CheckpointLog
from chkq.stores import CheckpointStore, open_store
from chkq.workers.client import submit_consolidation, submit_store_consolidation
from support import corpus
from support.corpus_expect import compare_full
from support.helpers import assert_same_hdf5
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import Cluster
from support.plugins.object_stores import BUCKET

TIMEOUT = 180
#: The default time limits, not a fault cluster's short ones: real files take their time.
LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "240", "CHKQ_TIME_LIMIT": "300",
          "CHKQ_VISIBILITY_TIMEOUT": "420"}


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The workers' scratch directory, the reference runs' directory, the file store's."""
    root = tmp_path_factory.mktemp("from-store")
    found = {name: root / name for name in ("scratch", "reference", "stores")}
    for path in found.values():
        path.mkdir(mode=0o700)
    return found


@pytest.fixture(scope="module")
def store_worker(redis_server: object, s3_endpoint: str, gcs_endpoint: str,
                 places: dict[str, Path]) -> Iterator[WorkerProcess]:
    """Two worker processes that can reach the stores but no submitter's run directory.

    They are the only workers of a cluster of the module's own: a worker of the session,
    started before the stores' servers were, could otherwise take a job's first step.
    """
    cluster = Cluster(places["scratch"]).start()
    try:
        (process,) = cluster.add_workers(1, "control,copy,verify,commit", concurrency=2, env={
            **LIMITS, "CHKQ_SCRATCH_DIR": str(places["scratch"] / "work"),
            "CHKQ_ALLOWED_ROOTS":
                f"{places['scratch']}:{places['reference']}:{places['stores']}"})
        yield process
    finally:
        cluster.release()
        cluster.close()


def store_url(kind: str, places: dict[str, Path]) -> str:
    """A fresh, empty place in a store of ``kind``, as a URL ending in ``/``."""
    name = uuid.uuid4().hex[:12]
    if kind == "file":
        return (places["stores"] / name).as_uri() + "/"
    return f"{'s3' if kind == 's3' else 'gs'}://{BUCKET}/{name}/"


def upload_run(files: list[Path], run_dir: Path, store: CheckpointStore) -> list[str]:
    """Put each file of a run at its name relative to the run directory; return the keys."""
    keys = []
    for path in files:
        key = str(path.relative_to(run_dir))
        store.put(key, path.read_bytes())
        keys.append(key)
    return keys


def reference_output(files: list[Path], run_dir: Path, places: dict[str, Path],
                     model: str) -> Path:
    """The same run consolidated from a directory, as chkq always did."""
    directory = places["reference"] / uuid.uuid4().hex[:12]
    directory.mkdir()
    for path in files:
        target = directory / path.relative_to(run_dir)
        target.parent.mkdir(exist_ok=True)
        shutil.copy2(path, target)
    output = submit_consolidation(model, directory).wait_for_output(timeout=TIMEOUT)
    assert isinstance(output, Path)
    return output


def fetched(store: CheckpointStore, key: str, into: Path) -> Path:
    path = into / Path(key).name
    path.write_bytes(store.get(key))
    return path


@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
@pytest.mark.parametrize("writers", [0, 3])
def test_plain_objects_consolidate_to_the_same_output_as_a_directory(
        kind: str, writers: int, store_worker: WorkerProcess, places: dict[str, Path],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=3, writers=writers, trials=400))
    url = store_url(kind, places)
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url)
    summary = job.wait_for_summary(timeout=TIMEOUT)

    assert summary.output == url + "sim.h5"
    assert store.list() == sorted([*keys, "sim.h5"])
    output = fetched(store, "sim.h5", tmp_path)
    assert summary.bytes == output.stat().st_size
    assert_same_hdf5(output, reference_output(files, run_dir, places, "sim"))
    assert list((places["scratch"] / "work").iterdir()) == [], "workspace left behind"


def test_existing_destination_is_refused_before_anything_is_sent(
        store_worker: WorkerProcess, places: dict[str, Path], tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", "sim", RunShape(checkpoints=2, trials=100))
    url = store_url("file", places)
    store = open_store(url)
    upload_run(files, tmp_path / "run", store)
    store.put("sim.h5", b"someone else's")
    with pytest.raises(FileExistsError, match="sim.h5 exists"):
        submit_store_consolidation("sim", url)
    assert store.get("sim.h5") == b"someone else's"


def test_cleanup_deletes_the_sources_once_published(
        store_worker: WorkerProcess, places: dict[str, Path], tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", "sim", RunShape(checkpoints=2, writers=2, trials=100))
    url = store_url("s3", places)
    store = open_store(url)
    upload_run(files, tmp_path / "run", store)
    store.put("notes.txt", b"kept")
    output = submit_store_consolidation("sim", url, to=url + "out/sim.h5",
                                        cleanup=True).wait_for_output(timeout=TIMEOUT)
    assert output == url + "out/sim.h5"
    assert store.list() == ["notes.txt", "out/sim.h5"]


def test_a_local_store_outside_the_allowed_roots_is_refused_untouched(
        store_worker: WorkerProcess, places: dict[str, Path], tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", "sim", RunShape(checkpoints=2, trials=100))
    url = (tmp_path / "elsewhere").as_uri() + "/"
    store = open_store(url)
    keys = upload_run(files, tmp_path / "run", store)
    with pytest.raises(PermissionError, match="outside the directories this worker may touch"):
        submit_store_consolidation("sim", url).wait_for_output(timeout=TIMEOUT)
    assert store.list() == keys


def commit_run(files: list[Path], run_dir: Path, url: str, run: str) -> list[str]:
    """Commit a run's files to a checkpoint log under their names; return the ids."""
    log = CheckpointLog(open_store(url), run)
    ids, parents = [], {}
    for path in files:
        name = str(path.relative_to(run_dir))
        writer = path.name
        parents[writer] = log.commit(path.read_bytes(), parents.get(writer), name=name,
                                     model="sim")
        ids.append(parents[writer])
    return ids


@pytest.mark.parametrize("kind", ["file", "gcs"])
def test_a_log_run_is_consolidated_recorded_and_found_the_second_time(
        kind: str, store_worker: WorkerProcess, places: dict[str, Path],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=3, writers=2, trials=300,
                                               compression="gzip"))
    url = store_url(kind, places)
    ids = commit_run(files, run_dir, url, "r1")

    summary = submit_store_consolidation("sim", url, run="r1").wait_for_summary(
        timeout=TIMEOUT)

    store = open_store(url)
    key = "runs/r1/outputs/sim.h5"
    assert summary.output == url + key
    entry = CheckpointLog(store, "r1").output("sim")
    assert entry is not None and entry.key == key and list(entry.checkpoints) == ids
    data = store.get(key)
    assert entry.size == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    output = tmp_path / "sim.h5"
    output.write_bytes(data)
    assert_same_hdf5(output, reference_output(files, run_dir, places, "sim"))

    verify = chkq_command("log", "verify", url, "r1", "--read-data")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    back = tmp_path / "back"
    restore = chkq_command("log", "restore", url, "r1", str(back), "sim", "--outputs")
    assert restore.returncode == 0, restore.stderr
    assert (back / "sim.h5").read_bytes() == data

    with pytest.raises(FileExistsError, match="already consolidated"):
        submit_store_consolidation("sim", url, run="r1")
    assert store.get(key) == data


def chkq_command(*args: str) -> subprocess.CompletedProcess[str]:
    """A ``chkq`` command on the module's cluster."""
    conf = get_app().conf
    env = {**os.environ, "CHKQ_BROKER_URL": conf.broker_url,
           "CHKQ_RESULT_BACKEND": conf.result_backend}
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_the_command_line_consolidates_from_a_store_and_prints_the_url(
        store_worker: WorkerProcess, places: dict[str, Path], tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", "sim", RunShape(checkpoints=2, writers=2, trials=100))
    url = store_url("s3", places)
    upload_run(files, tmp_path / "run", open_store(url))
    done = chkq_command("consolidate", "sim", "--from", url, "--to", url + "final/sim.h5")
    assert done.returncode == 0, done.stderr
    assert done.stdout == url + "final/sim.h5\n"
    missing = chkq_command("consolidate", "nosuch", "--from", url)
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: ") and url in missing.stderr
    assert "nosuch" in missing.stderr
    usage = chkq_command("consolidate", "sim", "--to", url + "x.h5")
    assert usage.returncode == 2 and "--to needs --from" in usage.stderr


#: Files other software wrote (see tests/test_corpus.py), a few of each kind of outcome.
REAL_FILES = ["slug-QHIFUVstats.h5", "pytables-attr-u16.h5", "netcdfc-cf_timeseries.nc",
              "anndata-adata-v0.7.8.h5ad", "hdf5ex-REF_REG.h5", "syn-gzip-padding.h5",
              "pytables-Tables_lzo2_shuffle.h5", "pytables-elink.h5"]


def outcome(run: Callable[[], object]) -> tuple[object, BaseException | None]:
    try:
        return run(), None
    except (ValueError, TypeError, NotImplementedError, OSError) as exc:
        return None, exc


@pytest.mark.parametrize("case", REAL_FILES)
def test_real_files_consolidate_from_a_store_as_from_a_directory(
        case: str, store_worker: WorkerProcess, places: dict[str, Path],
        tmp_path: Path) -> None:
    """An output equal, object by object, to what its sources say (as the directory job's
    is; checked by the corpus tests' independent comparison), or the same refusal, naming
    the object's URL where the directory job names its path."""
    if case.startswith("slug-"):
        source, companions = Path(__file__).parent / "data" / "QHIFUVstats.h5", []
    else:
        source, companions = corpus.resolve(case, tmp_path / "source")
    run_dir = tmp_path / "run"
    files = corpus.make_run(source, run_dir, "run", n_checkpoints=2, directory=True,
                            companions=companions)
    url = store_url("s3", places)
    store = open_store(url)
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        store.put(str(path.relative_to(run_dir)), path.read_bytes())
    directory = places["reference"] / uuid.uuid4().hex[:12]
    shutil.copytree(run_dir, directory)

    expected, refused = outcome(lambda: submit_consolidation("run", directory)
                                .wait_for_output(timeout=TIMEOUT))
    got, store_refused = outcome(lambda: submit_store_consolidation("run", url)
                                 .wait_for_output(timeout=TIMEOUT))

    if refused is not None:
        assert type(store_refused) is type(refused), (store_refused, refused)
        shown = str(refused).replace(str(directory) + "/", url)
        assert str(store_refused) == shown
        assert not store.exists("run.h5")
        return
    assert store_refused is None, store_refused
    assert got == url + "run.h5"
    output = tmp_path / "run.h5"
    output.write_bytes(store.get("run.h5"))
    assert isinstance(expected, Path)
    assert compare_full(output, files).differences == []
    assert compare_full(expected, files).differences == []
