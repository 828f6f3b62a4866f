"""One store job spread over two nodes whose scratch is far smaller than the run.

Two workers, each with its own 40 MiB tmpfs as scratch, consolidate runs
several times that size kept in a local directory, in moto's S3 server and
in fake-gcs-server, uncompressed and gzip: the staging worker fetches only
the sources' metadata (and, for gzip, the few source chunks it encodes
again), both send parts of the output, and the output is assembled in the
store.
Each output is compared object for object with the same run consolidated
from a directory, and nothing is left behind: no workspace, no unfinished
upload, no staged object.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest
from test_encoded_parts import gzip_run
from test_from_store import LIMITS, TIMEOUT, fetched, reference_output, store_url, upload_run
from test_output_parts import _uneven_run

from chkq.demo import RunShape, make_run
from chkq.stores import open_store
from chkq.tasks.from_store import store_job
from chkq.tasks.state import records
from chkq.workers.client import submit_store_consolidation
from support.helpers import assert_same_hdf5
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import Cluster

pytestmark = pytest.mark.integration

SCRATCH_MIB = 40


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Each node's small scratch (a tmpfs), the reference runs' directory, the file store's."""
    root = tmp_path_factory.mktemp("spread")
    found = {name: root / name for name in ("node0", "node1", "reference", "stores")}
    for path in found.values():
        path.mkdir(mode=0o700)
    for node in ("node0", "node1"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SCRATCH_MIB}m,mode=0700",
                        "tmpfs", str(found[node])], check=True)
    try:
        yield found
    finally:
        for node in ("node0", "node1"):
            subprocess.run(["umount", "-l", str(found[node])], check=False)


@pytest.fixture(scope="module")
def nodes(redis_server: object, s3_endpoint: str, gcs_endpoint: str,
          places: dict[str, Path]) -> Iterator[tuple[Cluster, list[WorkerProcess]]]:
    """Two workers, each with its own small scratch, neither able to hold a whole run."""
    cluster = Cluster(places["reference"]).start()
    try:
        workers = [cluster.add_workers(1, "control,copy,verify,commit", concurrency=2, env={
            **LIMITS, "CHKQ_SCRATCH_DIR": str(places[node] / "work"),
            "CHKQ_SPREAD_BYTES": "0", "CHKQ_UPLOAD_PART_BYTES": str(5 << 20),
            "CHKQ_ALLOWED_ROOTS": f"{places[node]}:{places['reference']}:{places['stores']}",
        })[0] for node in ("node0", "node1")]
        yield cluster, workers
    finally:
        cluster.release()
        cluster.close()


def _parts_sent_by(workers: list[WorkerProcess], job: str) -> list[int]:
    """How many of the job's parts each worker's log says it sent."""
    return [len(re.findall(rf"chkq\.part\[{job}-part-\d+\] succeeded",
                           w.log_path.read_text(errors="replace"))) for w in workers]


@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
def test_a_run_larger_than_any_node_is_assembled_in_the_store(
        kind: str, nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=3, writers=3, trials=2_500,
                                              spec_columns=1_000, chunk_rows=97))
    run_bytes = sum(f.stat().st_size for f in files)
    assert run_bytes > 2.5 * SCRATCH_MIB * 2**20
    url = store_url(kind, places)
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url)
    summary = job.wait_for_summary(timeout=TIMEOUT)

    assert summary.output == url + "sim.h5"
    assert store.list() == sorted([*keys, "sim.h5"])
    output = fetched(store, "sim.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files, run_dir, places, "sim"))
    assert store.stray_uploads() == []
    done = records().finished_result(job.id)
    assert done is not None and done["spread"] is True, done
    # The rows of a checkpoint's thread file lie in long runs of its chunks: the store copies
    # those; GCS has no ranged copy, so there every byte passes through a node, once.
    copied = done["copied_bytes"] / done["bytes"]
    through = done["through_workers"] / done["bytes"]
    assert copied > 0.4 and through == pytest.approx(1.0 if kind == "gcs" else 1 - copied), done
    for node in ("node0", "node1"):
        work = places[node] / "work"
        assert not work.exists() or list(work.iterdir()) == [], f"workspace left on {node}"


def test_h5py_automatic_chunks_and_uneven_checkpoints_are_built_by_both_nodes(
        nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = _uneven_run(run_dir, scale=5)
    url = store_url("s3", places)
    store = open_store(url)
    upload_run(files, run_dir, store)

    job = submit_store_consolidation("run", url)
    job.wait_for_summary(timeout=TIMEOUT)

    output = fetched(store, "run.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files, run_dir, places, "run"))
    _, workers = nodes
    assert all(_parts_sent_by(workers, job.id)), "a node sent no part"
    assert store.stray_uploads() == []


def test_the_destination_taken_midway_fails_clearly_and_leaves_no_upload(
        nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    """The destination taken while the parts are sent: a clear failure, nothing left."""
    del nodes
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=2, trials=2_000, spec_columns=1_000))
    url = store_url("s3", places)
    store = open_store(url)
    upload_run(files, run_dir, store)
    job = submit_store_consolidation("sim", url)
    for _ in range(400):
        if store.stray_uploads():
            break
        time.sleep(0.05)
    store.put_if_absent("sim.h5", b"someone else's " + uuid.uuid4().bytes)
    with pytest.raises(Exception) as failed:
        job.wait_for_output(timeout=TIMEOUT)
    assert "never overwritten" in str(failed.value), failed.value
    assert store.get("sim.h5").startswith(b"someone else's ")
    assert store.stray_uploads() == []


#: Rows of each writer of a gzip run of about 125 MB (:func:`test_encoded_parts.gzip_run`).
GZIP_ROWS = [[64 * 48, 64 * 53, 0], [64 * 65, 64 * 38, 0], [64 * 57, 64 * 44 + 17]]


@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
def test_a_gzip_run_larger_than_any_node_is_assembled_in_the_store(
        kind: str, nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    files = gzip_run(run_dir, GZIP_ROWS)
    assert sum(f.stat().st_size for f in files) > 2.5 * SCRATCH_MIB * 2**20
    url = store_url(kind, places)
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url)
    summary = job.wait_for_summary(timeout=TIMEOUT)

    assert summary.output == url + "sim.h5"
    assert store.list() == sorted([*keys, "sim.h5"])
    output = fetched(store, "sim.h5", tmp_path)
    assert_same_hdf5(output, reference_output(files, run_dir, places, "sim"))
    assert store.stray_uploads() == []
    done = records().finished_result(job.id)
    assert done is not None and done["spread"] is True, done
    assert "chunks placed as planned" in done["proof"], done
    _, workers = nodes
    assert all(_parts_sent_by(workers, job.id)), "a node sent no part"
    for node in ("node0", "node1"):
        work = places[node] / "work"
        assert not work.exists() or list(work.iterdir()) == [], f"workspace left on {node}"


def test_a_damaged_gzip_chunk_the_staging_node_encodes_fails_the_job_naming_it(
        nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    """A source chunk encoded again that does not decode: a clear failure, nothing left."""
    del nodes
    run_dir = tmp_path / "run"
    files = gzip_run(run_dir, GZIP_ROWS)
    # Its first row is off the 1,024-row grid of /galaxy/trial: its chunks are encoded again.
    victim = run_dir / "sim_chk00002" / "thread_0000.h5"
    with h5py.File(victim, "r") as f:
        info = f["galaxy/trial"].id.get_chunk_info(0)
    with open(victim, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xff" * 16)
    url = store_url("s3", places)
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url)
    with pytest.raises(Exception) as failed:
        job.wait_for_output(timeout=TIMEOUT)

    said = str(failed.value)
    found = store_job(job.id)
    assert found is not None and found.spread, "the job was not spread over the nodes"
    assert "dataset /galaxy/trial of" in said, said
    assert "sim_chk00002/thread_0000.h5 cannot be read" in said, said
    assert "nothing was published" in said, said
    assert store.list() == sorted(keys)
    assert store.stray_uploads() == []
    for node in ("node0", "node1"):
        work = places[node] / "work"
        assert not work.exists() or list(work.iterdir()) == [], f"workspace left on {node}"


def test_a_gzip_run_one_node_can_hold_is_consolidated_on_one_node(
        nodes: tuple[Cluster, list[WorkerProcess]], places: dict[str, Path],
        tmp_path: Path) -> None:
    """Whether a filtered run's chunks can be copied as stored is known only once planned: a
    run that fits in the staging node's scratch is not spread, whatever CHKQ_SPREAD_BYTES."""
    del nodes
    run_dir = tmp_path / "run"
    files = gzip_run(run_dir, [[3000, 2000], [2500]], width=8)
    url = store_url("s3", places)
    store = open_store(url)
    upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url)
    job.wait_for_summary(timeout=TIMEOUT)

    found = store_job(job.id)
    done = records().finished_result(job.id)
    assert done is not None and not done.get("spread"), done
    assert found is None or not found.spread
    assert_same_hdf5(fetched(store, "sim.h5", tmp_path),
                     reference_output(files, run_dir, places, "sim"))
