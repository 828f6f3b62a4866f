"""``--verify-data`` on a store job spread over two nodes: every row read back before publishing.

Two real workers against a private redis-server; the run in moto's S3 server
over HTTP, or in a local directory store. The output is completed at a staging
key of the job's own, its rows read back by verify units on both nodes, and
only then copied to the output's key. A source whose bytes change under its pin
after its rows were copied (what the metadata proof cannot see) fails the job,
naming the dataset, the row and the source object, with nothing at either key.
The flag is covered by the submitter's signed credential: a message that adds
or drops it is refused.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest
from test_from_store import LIMITS, TIMEOUT, fetched, reference_output, upload_run

from chkq.demo import RunShape, make_run
from chkq.stores import CheckpointStore, open_store
from chkq.tasks.state import records
from chkq.workers.client import ConsolidationJob, submit_store_consolidation
from support.helpers import assert_same_hdf5, wait_for
from support.plugins.cluster import WorkerProcess
from support.plugins.faults import Cluster
from support.plugins.object_stores import BUCKET

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "chkq.workers.cli"]
SHAPE = RunShape(checkpoints=3, writers=2, trials=1_000, spec_columns=1_000, chunk_rows=89)


def _two_nodes(make_cluster: Callable[..., Cluster], tmp_path: Path,
               env: dict[str, str] | None = None) -> tuple[Cluster, list[WorkerProcess]]:
    """Two workers, each with its own scratch, every run spread over both."""
    cluster = make_cluster()
    for name in ("reference", "stores"):
        (tmp_path / name).mkdir(mode=0o700)
    workers = []
    for node in ("node0", "node1"):
        scratch = tmp_path / node
        scratch.mkdir(mode=0o700)
        workers += cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
            **LIMITS, "CHKQ_SCRATCH_DIR": str(scratch / "work"),
            "CHKQ_SPREAD_BYTES": "0", "CHKQ_UPLOAD_PART_BYTES": str(5 << 20),
            "CHKQ_TASK_FILES": "2",
            "CHKQ_ALLOWED_ROOTS": f"{scratch}:{tmp_path / 'reference'}:{tmp_path / 'stores'}",
            **(env or {})})
    return cluster, workers


def _status(cluster: Cluster, job: str, code: int = 0) -> str:
    """What ``chkq status JOB`` prints (exit status 1 for a failed job)."""
    done = subprocess.run([*CLI, "status", job], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CHKQ_BROKER_URL": cluster.redis.url,
                               "CHKQ_RESULT_BACKEND": cluster.redis.url})
    assert done.returncode == code, done.stdout + done.stderr
    return done.stdout + done.stderr


def _nothing_left(store: CheckpointStore, keys: list[str]) -> None:
    """No output, no staged object, no unfinished upload: the store holds the sources only."""
    assert store.list() == sorted(keys)
    wait_for(lambda: store.stray_uploads() == [], 30, "the job's uploads to be aborted")


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_a_spread_job_reads_every_row_back_before_it_publishes(
        kind: str, make_cluster: Callable[..., Cluster], s3_endpoint: str,
        tmp_path: Path) -> None:
    del s3_endpoint
    cluster, workers = _two_nodes(make_cluster, tmp_path)
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", SHAPE)
    url = (f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/" if kind == "s3"
           else (tmp_path / "stores" / uuid.uuid4().hex[:12]).as_uri() + "/")
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url, verify_data=True)
    summary = job.wait_for_summary(timeout=TIMEOUT)

    assert summary.output == url + "sim.h5"
    assert store.list() == sorted([*keys, "sim.h5"]), "a staged object was left"
    assert store.stray_uploads() == []
    assert_same_hdf5(fetched(store, "sim.h5", tmp_path),
                     reference_output(files, run_dir, {"reference": tmp_path / "reference"},
                                      "sim"))
    done = records().finished_result(job.id)
    assert done is not None and done["spread"] is True, done
    assert done["verified_rows"] == done["rows"] > 0, done
    assert "every row read back from the store" in done["proof"], done["proof"]
    shown = _status(cluster, job.id)
    assert "every row read back before it is published (--verify-data)" in shown, shown
    rows = done["rows"]
    assert f"verified {rows:,}/{rows:,}" in shown, shown
    units = re.search(r"^  verify +(\d+) tasks: (\d+) done$", shown, re.MULTILINE)
    assert units is not None and int(units[1]) == int(units[2]) >= 2, shown
    logs = "".join(w.log_path.read_text(errors="replace") for w in workers)
    assert len(re.findall(rf"chkq\.verify_object\[{job.id}-verify-\d+\] succeeded", logs)) >= 1


def _first_chunk(path: Path, name: str, chunk: int) -> tuple[int, int]:
    """The byte offset in ``path`` of chunk ``chunk`` of dataset ``name``, and its first row."""
    with h5py.File(path, "r") as f:
        info = f[name].id.get_chunk_info(chunk)
        assert info.filter_mask == 0
        return int(info.byte_offset), int(info.chunk_offset[0])


def _rewrite_keeping_pin(path: Path, offset: int) -> None:
    """Flip a byte of ``path`` in place and put its modification time back: its inode, size
    and mtime, which a local store pins, are those of the version pinned."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)


def test_a_source_changed_under_its_pin_after_the_copy_fails_the_job_with_nothing_published(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """The parts are copied from the sources; then one source's bytes change while its pin
    (inode, size, mtime) holds. The metadata proof cannot see it; the data check reads the
    source as it is now, finds a row the output does not hold, and the job fails."""
    cluster, _ = _two_nodes(make_cluster, tmp_path)
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", SHAPE)
    root = tmp_path / "stores" / uuid.uuid4().hex[:12]
    url = root.as_uri() + "/"
    store = open_store(url)
    keys = upload_run(files, run_dir, store)
    victim = sorted(k for k in keys if "chk00002" in k)[0]
    offset, row = _first_chunk(run_dir / victim, "spectra/spec", 3)

    job = submit_store_consolidation("sim", url, verify_data=True)

    def all_parts_sent() -> bool:
        assembly = records().assembly(job.id)
        return assembly is not None and len(records().parts(job.id)) == len(assembly["parts"])

    wait_for(all_parts_sent, TIMEOUT, "every part to be sent", interval=0.002)
    _rewrite_keeping_pin(root / victim, offset + 3)

    with pytest.raises(Exception) as failed:
        job.wait_for_output(timeout=TIMEOUT)
    message = str(failed.value)
    assert re.search(rf"row \d+ of dataset 'spectra/spec' in the output differs from row "
                     rf"{row} of checkpoint file '{re.escape(url + victim)}'", message), message
    assert "nothing was published" in message, message
    _nothing_left(store, keys)
    shown = _status(cluster, job.id, code=1)
    assert "FAILURE" in shown and "OutputMismatchError" in shown, shown
    assert f"of checkpoint file '{url + victim}'" in shown, shown


def test_the_destination_taken_while_the_rows_are_read_back_is_left_as_found(
        make_cluster: Callable[..., Cluster], s3_endpoint: str, tmp_path: Path) -> None:
    """Someone else creates the output's key once the job staged its output: the job fails
    naming it, their object is untouched, the staged object and every upload are gone."""
    del s3_endpoint
    _two_nodes(make_cluster, tmp_path)
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", SHAPE)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/"
    store = open_store(url)
    keys = upload_run(files, run_dir, store)

    job = submit_store_consolidation("sim", url, verify_data=True)
    wait_for(lambda: records().staged(job.id) is not None, TIMEOUT, "the output to be staged",
             interval=0.005)
    theirs = b"someone else's " + uuid.uuid4().bytes
    assert store.put_if_absent("sim.h5", theirs)

    with pytest.raises(Exception) as failed:
        job.wait_for_output(timeout=TIMEOUT)
    assert "never overwritten" in str(failed.value), failed.value
    assert store.get("sim.h5") == theirs
    _nothing_left(store, [*keys, "sim.h5"])


def _keyed_worker(make_cluster: Callable[..., Cluster], tmp_path: Path) -> bytes:
    """One worker that runs jobs only for users proving who they are; this user's key."""
    keys_dir = tmp_path / "users"
    keys_dir.mkdir(mode=0o700)
    key = secrets.token_hex(32).encode()
    path = keys_dir / "root.key"
    path.write_bytes(key)
    path.chmod(0o600)
    cluster = make_cluster()
    (tmp_path / "stores").mkdir(mode=0o700)
    scratch = tmp_path / "node"
    scratch.mkdir(mode=0o700)
    cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        **LIMITS, "CHKQ_SCRATCH_DIR": str(scratch / "work"),
        "CHKQ_USER_KEYS_DIR": str(keys_dir),
        "CHKQ_ALLOWED_ROOTS": f"{scratch}:{tmp_path / 'stores'}"})
    return key


@pytest.mark.parametrize(("claimed", "asked"), [(False, True), (True, False), (True, True)])
def test_the_flag_is_covered_by_the_signed_credential(
        make_cluster: Callable[..., Cluster], tmp_path: Path, claimed: bool,
        asked: bool) -> None:
    """A credential signed for one value of ``--verify-data`` and a message asking the other
    (the flag added or dropped on the way) is refused; the message as signed runs (on one
    node: the flag accepted there, where every row is verified anyway)."""
    if os.geteuid() != 0:
        pytest.fail("the user key must be root's: the worker runs as root")
    from chkq.identity import issue
    from chkq.tasks.from_store import stage_signature
    from chkq.tasks.parties import stage_claim

    key = _keyed_worker(make_cluster, tmp_path)
    run_dir = tmp_path / "run"
    files = make_run(run_dir, "sim", RunShape(checkpoints=2, trials=50))
    url = (tmp_path / "stores" / uuid.uuid4().hex[:12]).as_uri() + "/"
    store = open_store(url)
    keys = upload_run(files, run_dir, store)
    job = uuid.uuid4().hex
    party = issue("root", key, "chkq.stage",
                  stage_claim(job, url, "sim", None, None, False, False, verify_data=claimed))
    records().record_submitted(job, "sim", url)
    stage_signature(url, "sim", job, party=party, verify_data=asked).apply_async()
    handle = ConsolidationJob.sent(job)

    if claimed == asked:
        assert handle.wait_for_output(timeout=TIMEOUT) == url + "sim.h5"
        stored = records().store_job_record(job)
        assert stored is not None and stored["verify_data"] is True and not stored["spread"]
        return
    with pytest.raises(Exception) as refused:
        handle.wait_for_output(timeout=TIMEOUT)
    assert type(refused.value).__name__ == "NotPermittedError", refused.value
    assert "differs in verify_data" in str(refused.value), refused.value
    assert store.list() == sorted(keys)


def test_the_flag_needs_a_run_kept_in_a_store(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "consolidate", "sim", "--out-dir", str(tmp_path),
                           "--verify-data"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--verify-data needs --from" in done.stderr, done.stderr
    helped = subprocess.run([*CLI, "consolidate", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert "--verify-data" in helped.stdout and "on one node" in " ".join(helped.stdout.split())


def test_gc_deletes_staged_outputs_left_behind_and_nothing_else(tmp_path: Path) -> None:
    """A staged output a job left (cancelled between two steps, say) is deleted by
    ``chkq gc`` once old enough; other objects, even with a similar name, are kept."""
    root = tmp_path / "store"
    root.mkdir()
    store = open_store(root.as_uri() + "/")
    left = f"run/sim.h5.chkq-staged-{uuid.uuid4().hex}"
    kept = ["run/sim.h5", "run/sim_chk00001.h5", "run/sim.h5.chkq-staged-notajob",
            f"run/sim.h5.chkq-staged-{uuid.uuid4().hex}.h5"]
    for key in [left, *kept]:
        store.put(key, b"bytes")
    young = subprocess.run([*CLI, "gc", store.url], capture_output=True, text=True, timeout=60)
    assert young.returncode == 0 and store.exists(left), young.stderr
    done = subprocess.run([*CLI, "gc", store.url, "--older-than", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [left]
    assert "deleted 1 staged output(s)" in done.stderr, done.stderr
    assert store.list() == sorted(kept)
