"""``chkq watch`` against a slow fake simulation, with a restart of the watcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.consolidation.checkpoint_files import COMPLETE_ATTR
from chkq.consolidation.completeness import is_complete
from chkq.log import CheckpointLog
from chkq.stores import open_store
from chkq.workers.client import submit_consolidation
from support import fake_simulation
from support.helpers import assert_consolidated
from support.plugins.cluster import WorkerProcess

TIMEOUT = 120


def start_watch(out_dir: Path, store: str, pid: int, log_path: Path) -> subprocess.Popen[str]:
    with open(log_path, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "chkq.workers.cli", "watch", str(out_dir), "sim",
             "--store", store, "--run", "r1", "--pid", str(pid), "--interval", "0.2",
             "--consolidate", "--wait"],
            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )


def enqueued(log_path: Path) -> list[str]:
    return [line.split()[1] for line in log_path.read_text().splitlines()
            if line.startswith("enqueued ")]


def test_a_file_marked_complete_is_not_complete_while_its_writer_holds_it(
        tmp_path: Path) -> None:
    path = tmp_path / "sim_chk00001.h5"
    with h5py.File(path, "w") as f:
        f["rows"] = np.arange(10)
        f.attrs[COMPLETE_ATTR] = 10
        f.flush()
        assert not is_complete(path)
    assert is_complete(path)


def test_a_file_seen_complete_is_opened_again_only_once_it_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chkq.consolidation import completeness

    path = tmp_path / "sim_chk00001.h5"
    with h5py.File(path, "w") as f:
        f["rows"] = np.arange(10)
        f.attrs[COMPLETE_ATTR] = 10
    opened: list[Path] = []
    real = completeness.is_complete
    monkeypatch.setattr(completeness, "is_complete",
                        lambda p: opened.append(p) or real(p))
    assert completeness.seen_complete(path) and completeness.seen_complete(path)
    assert opened == [path], "a file seen complete, unchanged since, was opened again"
    with h5py.File(path, "r+") as f:
        del f.attrs[COMPLETE_ATTR]
    assert not completeness.seen_complete(path), "a file that changed is looked at again"
    assert opened == [path, path]


def test_watch_commits_each_complete_checkpoint_once_in_order_and_restore_reproduces(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    store = f"file://{tmp_path / 'store'}"
    sim = fake_simulation.start(out_dir, "sim", 4, 2, 0.8)
    log_path = tmp_path / "watch.log"
    watcher = start_watch(out_dir, store, sim.pid, log_path)
    deadline = time.monotonic() + TIMEOUT
    while len(enqueued(log_path)) < 3:
        assert time.monotonic() < deadline, log_path.read_text()
        assert watcher.poll() is None, log_path.read_text()
        time.sleep(0.05)
    os.killpg(watcher.pid, signal.SIGKILL)
    watcher.wait()
    watcher = start_watch(out_dir, store, sim.pid, log_path)
    assert sim.wait(TIMEOUT) == 0
    assert watcher.wait(TIMEOUT) == 0, log_path.read_text()

    files = sorted(out_dir.glob("sim_chk*/thread_*.h5"))
    assert len(files) == 8
    log = CheckpointLog(open_store(store), "r1")
    entries = log.entries()
    assert sorted(e.name for e in entries) == sorted(
        str(f.relative_to(out_dir)) for f in files), "each file committed exactly once"
    by_name = {e.name: e for e in entries}
    records = {r.id: r for r in log.manifest()}
    for f in files:
        entry = by_name[str(f.relative_to(out_dir))]
        assert entry.model == "sim"
        assert log.load(entry.id) == f.read_bytes(), f"{f} committed incomplete or changed"
    for writer in ("thread_0000.h5", "thread_0001.h5"):
        chain = [by_name[f"sim_chk{n:05d}/{writer}"] for n in range(1, 5)]
        assert [e.step for e in chain] == [1, 2, 3, 4]
        assert [records[e.id].parent for e in chain] == [None] + [e.id for e in chain[:-1]]
    output = out_dir / "sim.h5"
    assert_consolidated(output, files)
    assert f"{output}" in log_path.read_text()

    back = tmp_path / "elsewhere"
    restore = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "log", "restore", store,
                              "r1", str(back), "sim"], capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert restore.returncode == 0, restore.stderr
    restored = sorted(back.glob("sim_chk*/thread_*.h5"))
    assert [p.relative_to(back) for p in restored] == [p.relative_to(out_dir) for p in files]
    again = submit_consolidation("sim", back).wait_for_output(timeout=TIMEOUT)
    with h5py.File(output, "r") as a, h5py.File(again, "r") as b:
        names: list[str] = []
        a.visit(names.append)
        for name in names:
            if isinstance(a[name], h5py.Dataset):
                assert np.asarray(a[name][()]).tobytes() == np.asarray(b[name][()]).tobytes()


def test_watch_restores_byte_identical_files_under_every_name(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    """Thread files with the same bytes (in one checkpoint directory and across
    checkpoints) are committed by ``chkq watch`` and restored under every name."""
    import shutil

    from chkq.demo import RunShape, make_run

    out_dir = tmp_path / "run"
    make_run(out_dir, "sim", RunShape(checkpoints=2, writers=2, trials=20))
    first = out_dir / "sim_chk00001" / "thread_0000.h5"
    for twin in ("sim_chk00002/thread_0000.h5", "sim_chk00002/thread_0001.h5"):
        shutil.copyfile(first, out_dir / twin)
    files = sorted(out_dir.glob("sim_chk*/thread_*.h5"))
    assert len({f.read_bytes() for f in files}) == 2
    store = f"file://{tmp_path / 'store'}"
    watch = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "watch", str(out_dir), "sim",
         "--store", store, "--run", "r1", "--idle", "1", "--interval", "0.2"],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert watch.returncode == 0, watch.stderr
    assert len(enqueued_lines(watch.stdout)) == 4

    back = tmp_path / "elsewhere"
    restore = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "log", "restore", store,
                              "r1", str(back), "sim"], capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert restore.returncode == 0, restore.stderr
    restored = sorted(back.glob("sim_chk*/thread_*.h5"))
    assert [p.relative_to(back) for p in restored] == [p.relative_to(out_dir) for p in files]
    for f in files:
        assert (back / f.relative_to(out_dir)).read_bytes() == f.read_bytes()
    assert "restored 4 file(s)" in restore.stderr
    listed = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "log", "list", store,
                             "r1"], capture_output=True, text=True, timeout=TIMEOUT)
    assert listed.returncode == 0 and listed.stderr == ""
    assert sum(line.count(" name=") for line in listed.stdout.splitlines()) == 4


def enqueued_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("enqueued ")]


def test_watch_consolidates_from_the_store_for_workers_that_see_no_run_directory(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    """``--from-store``: the consolidation reads the run from the log, and its output is
    published and recorded there; the run directory is left as it was."""
    from chkq.stores import open_store
    from support.helpers import assert_same_hdf5

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    store = f"file://{tmp_path / 'store'}"
    sim = fake_simulation.start(out_dir, "sim", 3, 2, 0.3)
    watch = subprocess.Popen(
        [sys.executable, "-m", "chkq.workers.cli", "watch", str(out_dir), "sim",
         "--store", store, "--run", "r1", "--pid", str(sim.pid), "--interval", "0.2",
         "--consolidate", "--from-store", "--wait"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert sim.wait(TIMEOUT) == 0
    stdout, stderr = watch.communicate(timeout=TIMEOUT)
    assert watch.returncode == 0, stderr
    url = f"{store}/runs/r1/outputs/sim.h5"
    assert stdout.splitlines()[-1] == url
    assert not (out_dir / "sim.h5").exists()
    entry = CheckpointLog(open_store(store), "r1").output("sim")
    assert entry is not None and len(entry.checkpoints) == 6
    published = tmp_path / "published.h5"
    published.write_bytes(open_store(store).get("runs/r1/outputs/sim.h5"))
    reference = submit_consolidation("sim", out_dir).wait_for_output(timeout=TIMEOUT)
    assert isinstance(reference, Path)
    assert_same_hdf5(published, reference)


def versions_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("version ")]


def watch_env(on: str) -> dict[str, str]:
    """The environment of a watch on the test's cluster, or on an embedded one (no broker)."""
    if on == "cluster":
        return dict(os.environ)
    return {k: v for k, v in os.environ.items()
            if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}


def assert_all_committed(store: str, out_dir: Path, files: list[Path]) -> None:
    """The log's run r1 holds every file under its name, byte for byte."""
    log = CheckpointLog(open_store(store), "r1")
    by_name = {e.name: e for e in log.entries()}
    assert sorted(by_name) == sorted(str(f.relative_to(out_dir)) for f in files)
    for f in files:
        assert log.load(by_name[str(f.relative_to(out_dir))].id) == f.read_bytes(), f


@pytest.mark.cluster
@pytest.mark.parametrize("on, writers", [("embedded", 0), ("cluster", 2)],
                         ids=["embedded-files", "cluster-directories"])
def test_watch_consolidate_keeps_the_output_current_and_ends_with_the_one_shot(
        tmp_path: Path, request: pytest.FixtureRequest, on: str, writers: int) -> None:
    """``chkq watch --consolidate`` beside a running simulation: a reader sees whole versions
    of sim.h5 while the run goes on, the last equals a one-shot consolidation, and every
    checkpoint file is in the log."""
    import json

    from support import follow_reader
    from support.helpers import assert_same_hdf5, one_shot

    if on == "cluster":
        request.getfixturevalue("worker")
    run, stop, seen = tmp_path / "run", tmp_path / "stop", tmp_path / "seen.json"
    run.mkdir()
    done = tmp_path / "done"
    store = f"file://{tmp_path / 'store'}"
    sim = fake_simulation.start(run, "sim", 6, writers, 0.6, "--trials", "150",
                                "--done", str(done))
    reader = follow_reader.start(run, "sim", stop, seen)
    log_path = tmp_path / "watch.log"
    with open(log_path, "w") as sink:
        watch = subprocess.Popen(
            [sys.executable, "-m", "chkq.workers.cli", "watch", str(run), "sim",
             "--store", store, "--run", "r1", "--consolidate", "--done-file", str(done),
             "--interval", "0.2", "--workers", "1"],
            stdout=sink, stderr=subprocess.STDOUT, text=True, env=watch_env(on))
    try:
        assert sim.wait(TIMEOUT) == 0
        assert watch.wait(TIMEOUT) == 0, log_path.read_text()
    finally:
        stop.touch()
        reader.wait(30)
    found = json.loads(seen.read_text())
    said = log_path.read_text()
    assert found["errors"] == [], found
    assert len(found["seen"]) >= 2 and found["seen"] == sorted(found["seen"]), (found, said)
    assert found["seen"][-1] == 6, found
    assert len(versions_in(said)) >= 2, said
    output = run / "sim.h5"
    assert said.splitlines()[-1] == str(output), said
    assert_same_hdf5(output, one_shot(run, tmp_path / "again"))
    files = sorted(p for p in run.glob("sim_chk*") if p.suffix == ".h5") \
        + sorted(run.glob("sim_chk*/thread_*.h5"))
    assert len(files) == (6 * writers or 6)
    assert_all_committed(store, run, files)
    assert not list(run.glob(".chkq-*")), "temporaries left behind"


@pytest.mark.cluster
def test_watch_consolidate_cleanup_deletes_the_checkpoints_once_the_final_version_is_out(
        tmp_path: Path, worker: WorkerProcess) -> None:
    from chkq.demo import RunShape, make_run
    from support.helpers import assert_same_hdf5, one_shot

    run = tmp_path / "run"
    make_run(run, "sim", RunShape(checkpoints=3, writers=2, trials=30))
    files = sorted(run.glob("sim_chk*/thread_*.h5"))
    kept = {f: f.read_bytes() for f in files}
    reference = one_shot(run, tmp_path / "again")
    store = f"file://{tmp_path / 'store'}"
    watch = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "watch", str(run), "sim", "--store", store,
         "--run", "r1", "--consolidate", "--cleanup", "--idle", "1", "--interval", "0.2"],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert watch.returncode == 0, watch.stderr
    assert watch.stdout.splitlines()[-1] == str(run / "sim.h5")
    assert sorted(p.name for p in run.iterdir()) == ["sim.h5"]
    assert_same_hdf5(run / "sim.h5", reference)
    log = CheckpointLog(open_store(store), "r1")
    by_name = {e.name: e for e in log.entries()}
    assert {name: log.load(e.id) for name, e in by_name.items()} == {
        str(f.relative_to(run)): data for f, data in kept.items()}
