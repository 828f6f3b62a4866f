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

from chkq.log import CheckpointLog
from chkq.stores import open_store
from chkq.workers.client import submit_consolidation
from tests.helpers import assert_consolidated
from tests.plugins.cluster import WorkerProcess

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


def test_watch_commits_each_complete_checkpoint_once_in_order_and_restore_reproduces(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    store = f"file://{tmp_path / 'store'}"
    sim = subprocess.Popen([sys.executable, "-m", "tests.fake_simulation", str(out_dir), "sim",
                            "4", "2", "0.8"])
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
    records = log.manifest()
    assert sorted(r.meta["name"] for r in records) == sorted(
        str(f.relative_to(out_dir)) for f in files), "each file committed exactly once"
    by_name = {r.meta["name"]: r for r in records}
    for f in files:
        record = by_name[str(f.relative_to(out_dir))]
        assert log.load(record.id) == f.read_bytes(), f"{f} committed incomplete or changed"
    for writer in ("thread_0000.h5", "thread_0001.h5"):
        chain = [by_name[f"sim_chk{n:05d}/{writer}"] for n in range(1, 5)]
        assert [r.step for r in chain] == [1, 2, 3, 4]
        assert [r.parent for r in chain] == [None] + [r.id for r in chain[:-1]]
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
