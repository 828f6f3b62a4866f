"""``chkq consolidate --follow`` beside a running simulation, with a reader looking on.

A real writer process writes checkpoints as slug does (file created, rows written,
``trials_completed`` set at close); a real reader process opens ``MODEL.h5`` in a loop
and checks every version it sees. The final output must equal a one-shot consolidation
of the same checkpoints, object for object. Then the faults: a checkpoint rewritten under
a published version (a restarted simulation), a damaged checkpoint, the follower killed
and started again, and a second follower.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from chkq.demo import RunShape, write_checkpoint_file
from support import fake_simulation, follow_reader
from support.helpers import assert_same_hdf5, one_shot, wait_for
from support.plugins.cluster import WorkerProcess

pytestmark = pytest.mark.cluster

TIMEOUT = 180


def start_follow(out_dir: Path, log: Path, *options: str) -> subprocess.Popen[str]:
    with open(log, "a") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--out-dir",
             str(out_dir), "--follow", *options],
            stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def versions_in(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("version ")]


@pytest.mark.parametrize("writers, options", [
    (0, ()),
    (3, ("--compression", "gzip", "--chunk-rows", "50")),
], ids=["files-uncompressed", "directories-gzip"])
def test_a_reader_sees_only_whole_verified_versions_and_the_last_is_the_one_shot(
        tmp_path: Path, worker: WorkerProcess, writers: int, options: tuple[str, ...]) -> None:
    run, stop, seen = tmp_path / "run", tmp_path / "stop", tmp_path / "seen.json"
    run.mkdir()
    done = run / "done"
    sim = fake_simulation.start(run, "sim", 6, writers, 0.6, "--trials", "180",
                                "--done", str(done), *options)
    reader = follow_reader.start(run, "sim", stop, seen)
    log = tmp_path / "follow.log"
    follower = start_follow(run, log, "--done-file", str(done))
    try:
        assert sim.wait(TIMEOUT) == 0
        assert follower.wait(TIMEOUT) == 0, log.read_text()
    finally:
        stop.touch()
        reader.wait(30)
    found = json.loads(seen.read_text())
    assert found["errors"] == [], found
    assert len(found["seen"]) >= 2 and found["seen"] == sorted(found["seen"]), found
    assert found["seen"][-1] == 6
    assert len(versions_in(log)) >= 2, log.read_text()
    output = run / "sim.h5"
    assert str(output) in log.read_text().splitlines()[-1]
    assert_same_hdf5(output, one_shot(run, tmp_path / "again"))
    assert not list(run.glob(".chkq-*")), "temporaries left behind"


def write(run: Path, number: int, first: int, trials: int, seed: int = 0) -> None:
    shape = RunShape(trials=trials, spec_columns=8, chunk_rows=64, seed=seed)
    write_checkpoint_file(run / f"sim_chk{number:05d}.h5", shape, first, trials, number)


def following(tmp_path: Path, trials: int, *options: str
              ) -> tuple[Path, Path, subprocess.Popen[str]]:
    """A run of one checkpoint of ``trials`` trials, followed until its first version is out.

    Returns the run directory, the follower's log and the follower.
    """
    run = tmp_path / "run"
    run.mkdir()
    write(run, 1, 0, trials)
    log = tmp_path / "follow.log"
    follower = start_follow(run, log, *options)
    wait_for(lambda: len(versions_in(log)) == 1, TIMEOUT, "the first version")
    return run, log, follower


def rows_of(path: Path) -> int:
    with h5py.File(path, "r") as f:
        return int(f["galaxy/trial"].shape[0])


def test_a_rewritten_checkpoint_stops_the_follow_and_the_last_good_version_stays(
        tmp_path: Path, worker: WorkerProcess) -> None:
    """The simulation restarted from checkpoint 1 and wrote checkpoint 2 again: refused."""
    run, log, follower = following(tmp_path, 100, "--idle", "60")
    output = run / "sim.h5"
    write(run, 2, 100, 90)
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    kept = tmp_path / "version2.h5"
    shutil.copyfile(output, kept)
    write(run, 2, 100, 95, seed=7)
    write(run, 3, 195, 80, seed=7)
    assert follower.wait(TIMEOUT) == 1, log.read_text()
    said = log.read_text()
    assert "sim_chk00002.h5" in said and "restarted" in said, said
    assert_same_hdf5(output, kept)
    assert rows_of(output) == 190
    assert not list(run.glob(".chkq-*"))


def test_a_damaged_checkpoint_stops_the_follow_naming_it(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run, log, follower = following(tmp_path, 300, "--idle", "60")
    output = run / "sim.h5"
    kept = tmp_path / "version1.h5"
    shutil.copyfile(output, kept)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(elsewhere, 2, 300, 300)
    with open(elsewhere / "sim_chk00002.h5", "r+b") as damaged:
        damaged.truncate(damaged.seek(0, os.SEEK_END) // 2)
    os.rename(elsewhere / "sim_chk00002.h5", run / "sim_chk00002.h5")
    write(run, 3, 600, 300)
    assert follower.wait(TIMEOUT) == 1, log.read_text()
    assert "sim_chk00002.h5" in log.read_text(), log.read_text()
    assert_same_hdf5(output, kept)
    assert not list(run.glob(".chkq-*"))


def test_a_follower_killed_and_started_again_resumes_and_ends_right(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run, log, follower = following(tmp_path, 150, "--idle", "60")
    write(run, 2, 150, 130)
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    os.killpg(follower.pid, signal.SIGKILL)
    follower.wait()
    write(run, 3, 280, 70)
    done = run / "done"
    again = start_follow(run, log, "--done-file", str(done))
    wait_for(lambda: len(versions_in(log)) == 3, TIMEOUT, "a version after the restart")
    write(run, 4, 350, 20)
    done.touch()
    assert again.wait(TIMEOUT) == 0, log.read_text()
    assert rows_of(run / "sim.h5") == 370
    assert_same_hdf5(run / "sim.h5", one_shot(run, tmp_path / "again"))


def test_a_second_follower_of_the_run_is_refused_naming_the_first(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write(run, 1, 0, 50)
    first = start_follow(run, tmp_path / "first.log", "--idle", "60")
    wait_for(lambda: (run / "sim.h5").exists(), TIMEOUT, "the first version")
    second = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim", "--out-dir",
         str(run), "--follow", "--idle", "5"], capture_output=True, text=True, timeout=TIMEOUT)
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(30)
    assert second.returncode == 1
    assert str(first.pid) in second.stderr, second.stderr


def test_follow_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim",
                           "--out-dir", str(tmp_path), "--follow"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--done-file" in done.stderr
    done = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "consolidate", "sim",
                           "--out-dir", str(tmp_path), "--idle", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "needs --follow" in done.stderr


def status_lines(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "status", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def follows_of(run: Path) -> list[str]:
    """The blocks ``chkq status`` prints for the follows of ``run``, newest first."""
    text = status_lines("--limit", "100")
    assert "follows:" in text, text
    blocks = text.split("follows:\n", 1)[1].split("  follow ")[1:]
    return [block for block in blocks if f" in {run}: " in block.splitlines()[0]]


def test_chkq_status_shows_a_follow_its_versions_latest_checkpoint_and_lag(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run, log, follower = following(tmp_path, 100, "--idle", "60")
    write(run, 2, 100, 90)
    wait_for(lambda: len(versions_in(log)) == 2, TIMEOUT, "the second version")
    [running] = follows_of(run)
    assert "running, or killed (no end recorded)" in running, running
    assert "2 versions published, the latest through checkpoint 2" in running, running
    assert "lag: none: the newest complete checkpoint, 2" in running, running
    os.killpg(follower.pid, signal.SIGKILL)
    follower.wait()
    write(run, 3, 190, 80)
    write(run, 4, 270, 70)
    [killed] = follows_of(run)
    assert "lag: 2 checkpoints complete but in no version yet (3..4)" in killed, killed
    done = run / "done"
    done.touch()
    again = start_follow(run, log, "--done-file", str(done))
    assert again.wait(TIMEOUT) == 0, log.read_text()
    finished, before = follows_of(run)
    assert "finished" in finished.splitlines()[0], finished
    assert "1 version published, the latest through checkpoint 4" in finished, finished
    assert "lag: none: the newest complete checkpoint, 4" in finished, finished
    assert "2 versions published, the latest through checkpoint 2" in before, before
    job = finished.split("(job ", 1)[1].split(")", 1)[0]
    assert "version 1 of follow" in status_lines(job)
    assert rows_of(run / "sim.h5") == 340
