"""Names as entries of their own, restore, read-only commands, malformed
records, gc against concurrent commits, and output files that never follow links."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chkq.log import CheckpointLog
from chkq.log.delta import compress_full
from chkq.log.transfer import restore_run
from chkq.stores import CheckpointStore, LocalDirectoryStore, MemoryStore, open_store
from chkq.stores.faults import FaultyStore
from chkq.workers.cli import main as chkq_main
from support.plugins.object_stores import BUCKET

TIMEOUT = 120


def blob(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chkq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line in a fresh process, with no broker configured."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=environment,
                          capture_output=True, text=True, timeout=TIMEOUT)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# names ----------------------------------------------------------------------


@pytest.mark.cluster
def test_log_commit_of_identical_bytes_under_two_names_restores_both(tmp_path: Path) -> None:
    """``chkq log commit`` (in process, no cluster): both names come back, byte-identical,
    and each commit's annotations are kept in its own entry."""
    run = tmp_path / "run"
    (run / "sim_chk00001").mkdir(parents=True)
    data = blob(100_000, 1)
    for name in ("sim_chk00001/thread_0000.h5", "sim_chk00001/thread_0001.h5"):
        (run / name).write_bytes(data)
    url = (tmp_path / "store").as_uri()
    ids = []
    for label, name in (("a", "sim_chk00001/thread_0000.h5"),
                        ("b", "sim_chk00001/thread_0001.h5")):
        done = chkq("log", "commit", url, "r1", str(run / name), "--name", name,
                    "--step", "1", "--label", label)
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", "nothing but the result on success (no embedded cluster)"
        ids.append(done.stdout.strip())
    assert ids == [sha(data)] * 2

    log = CheckpointLog(open_store(url), "r1")
    entries = {e.name: e for e in log.entries()}
    assert {n: (e.id, e.label, e.model) for n, e in entries.items()} == {
        "sim_chk00001/thread_0000.h5": (sha(data), "a", "sim"),
        "sim_chk00001/thread_0001.h5": (sha(data), "b", "sim"),
    }
    back = tmp_path / "back"
    restored = chkq("log", "restore", url, "r1", str(back), "sim")
    assert restored.returncode == 0, restored.stderr
    assert snapshot(back) == snapshot(run)
    assert restored.stdout.split() == [str(back / n) for n in sorted(entries)]
    assert f"restored 2 file(s), {2 * len(data)} bytes" in restored.stderr


def test_recommit_and_redelivery(tmp_path: Path) -> None:
    """Same name, same bytes, same annotations (a redelivered task): no new entry.
    Same bytes, new name: a new entry, record untouched."""
    store = MemoryStore()
    log = CheckpointLog(store, "r")
    data = blob(10_000, 2)
    log.commit(data, name="x.bin", step=1)
    before = set(store.list())
    log.commit(data, name="x.bin", step=1)
    assert set(store.list()) == before
    log.commit(data, name="copy/x.bin", step=1, label="again")
    added = set(store.list()) - before
    assert len(added) == 1 and next(iter(added)).startswith("runs/r/names/")
    assert sorted(log.files()) == ["copy/x.bin", "x.bin"]
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        log.commit(data, name="../escape")


def test_format_1_logs_still_restore(tmp_path: Path) -> None:
    """Records written before name entries (format 1, ``meta.name``) are read as entries."""
    store = LocalDirectoryStore(tmp_path / "store")
    log = CheckpointLog(store, "old")
    files = {"m_chk00001.h5": blob(5000, 3), "m_chk00002.h5": blob(5000, 4)}
    parent = None
    for name, data in files.items():
        parent = log.commit(data, parent)
        key = log.keys.record(parent)
        record = json.loads(store.get(key))
        del record["format"]
        record["meta"] = {"name": name, "model": "m"}
        store.put(key, json.dumps(record).encode())
    view = CheckpointLog(store, "old")
    assert {n: e.legacy for n, e in view.files("m").items()} == dict.fromkeys(files, True)
    result = restore_run(view, tmp_path / "back", "m")
    assert snapshot(tmp_path / "back") == files
    assert result.bytes_written == 10_000
    assert view.verify(read_data=True).ok


@pytest.mark.cluster
def test_restore_filters_by_model_for_every_entry(tmp_path: Path) -> None:
    """Files committed with ``chkq log commit`` (no --model) belong to the model their
    name says; a model that matches nothing is an error and writes nothing."""
    url = (tmp_path / "store").as_uri()
    for name, seed in (("alpha_chk00001.h5", 1), ("beta_chk00001.h5", 2), ("notes.txt", 3)):
        path = tmp_path / name
        path.write_bytes(blob(1000, seed))
        assert chkq("log", "commit", url, "r1", str(path)).returncode == 0
    back = tmp_path / "back"
    only = chkq("log", "restore", url, "r1", str(back), "beta")
    assert only.returncode == 0, only.stderr
    assert sorted(snapshot(back)) == ["beta_chk00001.h5"]
    nothing = chkq("log", "restore", url, "r1", str(tmp_path / "none"), "gamma")
    assert nothing.returncode == 1
    assert nothing.stderr.startswith("error: run 'r1' has no files of model 'gamma'")
    assert nothing.stderr.count("\n") == 1
    assert not (tmp_path / "none").exists()
    every = chkq("log", "restore", url, "r1", str(tmp_path / "all"))
    assert every.returncode == 0
    assert sorted(snapshot(tmp_path / "all")) == ["alpha_chk00001.h5", "beta_chk00001.h5",
                                                   "notes.txt"]


# read-only commands ---------------------------------------------------------


READ_COMMANDS = [["list"], ["heads"], ["lineage", "abcdef"], ["verify"],
                 ["pull", "abcdef", "-o", "OUT"], ["restore", "OUT"]]


@pytest.mark.cluster
@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_read_commands_on_a_missing_store_write_nothing_and_fail(
        tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    done = chkq("log", args[0], missing.as_uri(), "run1", *args[1:])
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert "does not exist" in done.stderr and str(missing) in done.stderr
    assert not (tmp_path / "no").exists(), "a read created the store's directory"
    assert not (tmp_path / "out").exists()


@pytest.mark.cluster
@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_read_commands_on_an_unknown_run_fail(tmp_path: Path, command: list[str]) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    CheckpointLog(store, "real").commit(b"data", name="a.bin")
    before = sorted(p for p in (tmp_path / "store").rglob("*"))
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    done = chkq("log", args[0], store.url, "typo", *args[1:])
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"error: run 'typo' not found in store {store.url}\n"
    assert sorted(p for p in (tmp_path / "store").rglob("*")) == before


@pytest.mark.cluster
@pytest.mark.integration
def test_read_commands_on_cloud_stores_fail_clearly(request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("s3_endpoint")
    request.getfixturevalue("gcs_endpoint")
    for scheme in ("s3", "gs"):
        missing = chkq("log", "list", f"{scheme}://no-such-bucket-chkq/p", "run1")
        assert missing.returncode == 1
        assert missing.stderr.startswith(f"error: store {scheme}://no-such-bucket-chkq/p "
                                         "does not exist"), missing.stderr
        unknown = chkq("log", "list", f"{scheme}://{BUCKET}/empty-prefix", "run1")
        assert unknown.returncode == 1
        assert unknown.stderr == (f"error: run 'run1' not found in store "
                                  f"{scheme}://{BUCKET}/empty-prefix\n")


# malformed records ------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("store", ["file", "s3"], indirect=True)
def test_a_malformed_record_is_reported_and_the_rest_lists_and_restores(
        store: CheckpointStore, tmp_path: Path) -> None:
    log = CheckpointLog(store, "r1")
    files = {f"m_chk{i:05d}.h5": blob(3000, 10 + i) for i in range(1, 4)}
    ids = {name: log.commit(data, name=name) for name, data in files.items()}
    bad = log.keys.record(ids["m_chk00002.h5"])
    record = json.loads(store.get(bad))
    record["depth"] = "zero"
    store.put(bad, json.dumps(record).encode())

    listed = chkq("log", "list", store.url, "r1")
    assert listed.returncode == 0, listed.stderr
    assert sorted(line.split()[0] for line in listed.stdout.splitlines()) == sorted(
        [ids["m_chk00001.h5"], ids["m_chk00003.h5"]])
    assert listed.stderr.startswith(f"warning: {bad}: ") and "depth" in listed.stderr

    back = tmp_path / "back"
    restored = chkq("log", "restore", store.url, "r1", str(back))
    assert restored.returncode == 1
    assert snapshot(back) == {n: d for n, d in files.items() if n != "m_chk00002.h5"}
    assert "error: 1 file(s) not restored (first: m_chk00002.h5" in restored.stderr
    assert bad in restored.stderr

    verified = CheckpointLog(store, "r1").verify()
    assert [key for key, _ in verified.problems] == [bad]


# gc against concurrent commits ---------------------------------------------------


def test_gc_never_deletes_a_payload_a_concurrent_commit_records() -> None:
    """A commit of the same bytes finds the old orphan and records it
    before each of gc's store calls on that payload or its record in turn (its first
    look, reading, putting aside, deleting, looking again, ...); the payload survives."""
    data = blob(20_000, 5)
    checkpoint = sha(data)
    for at in range(1, 9):
        name = f"gc-{at}-{os.getpid()}-{id(object())}"
        setup = CheckpointLog(MemoryStore(name), "run")
        orphan = setup.keys.payload(checkpoint, "full", None)
        setup.store.put(orphan, compress_full(data))
        store = FaultyStore(MemoryStore(name))
        watched = (orphan.rsplit("/", 1)[1], f"{checkpoint}.json")
        other_writer = CheckpointLog(MemoryStore(name), "run")
        commit = store.before(
            {"get", "get_at_most", "put", "delete", "modified"},
            lambda operation, key, other=other_writer: other.commit(data),
            lambda key, watched=watched: key.endswith(watched), nth=at)
        CheckpointLog(store, "run").gc(older_than=0)
        if not commit.fired:
            assert at == 8, "every interleaving up to gc's last call ran"
            continue
        view = CheckpointLog(MemoryStore(name), "run")
        assert checkpoint in view
        assert view.load(checkpoint) == data, f"payload lost with the commit before call {at}"
        assert view.verify(read_data=True).ok
        assert view.store.list("runs/run/trash/") == []


def test_gc_settles_the_trash_of_a_gc_that_died() -> None:
    store = MemoryStore()
    log = CheckpointLog(store, "run")
    data = blob(5000, 6)
    checkpoint = log.commit(data)
    payload = log.record(checkpoint).payload
    trash = log.keys.trash(payload)
    store.put(trash, store.get(payload))
    store.delete(payload)  # the dead gc's delete, after the commit recorded it
    assert log.gc(older_than=3600) == []
    assert store.list("runs/run/trash/") == []
    assert CheckpointLog(store, "run").load(checkpoint) == data


# output files never follow planted links ---------------------------------------------


def test_restore_never_writes_through_planted_links(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log = CheckpointLog(store, "r1")
    log.commit(b"checkpoint one", name="state.bin")
    log.commit(b"checkpoint two", name="sub/inner.bin")
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for guess in (f".state.bin.{os.getpid()}.tmp", ".state.bin.tmp"):
        (out / guess).symlink_to(victim)
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)

    result = restore_run(CheckpointLog(store, "r1"), out)
    assert victim.read_bytes() == b"precious"
    assert list(elsewhere.iterdir()) == []
    assert (out / "state.bin").read_bytes() == b"checkpoint one"
    assert not (out / "state.bin").is_symlink()
    assert [name for name, _ in result.failed] == ["sub/inner.bin"]
    assert "symbolic link" in result.failed[0][1]

    os.unlink(out / "state.bin")
    (out / "state.bin").symlink_to(victim)
    again = restore_run(CheckpointLog(store, "r1"), out)
    assert victim.read_bytes() == b"precious"
    assert "state.bin" in [name for name, _ in again.failed]


def test_pull_never_writes_through_a_planted_temporary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    checkpoint = CheckpointLog(store, "r1").commit(b"pulled bytes")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "pulled.bin"
    (tmp_path / f".pulled.bin.{os.getpid()}.tmp").symlink_to(victim)
    assert chkq_main(["log", "pull", store.url, "r1", checkpoint, "-o", str(target)]) == 0
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == b"pulled bytes"
    assert capsys.readouterr().out == f"{target}\n"
    target.unlink()
    target.symlink_to(victim)
    assert chkq_main(["log", "pull", store.url, "r1", checkpoint, "-o", str(target)]) == 1
    assert "is a symbolic link; not overwritten" in capsys.readouterr().err
    assert victim.read_bytes() == b"precious" and target.is_symlink()
    assert chkq_main(["log", "pull", store.url, "r1", checkpoint, "-o", str(target),
                      "--force"]) == 0
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"pulled bytes"
