"""The ``chkq`` command and the Python API as a user runs them, embedded cluster included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from tests.helpers import assert_consolidated, snapshot

TIMEOUT = 180


def run(*args: str, broker: bool = False, cwd: Path | None = None,
        stderr: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if not broker:
        env.pop("CHKQ_BROKER_URL", None)
        env.pop("CHKQ_RESULT_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=env, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=TIMEOUT)


def test_quick_start_on_the_embedded_cluster(tmp_path: Path) -> None:
    """``chkq demo`` then ``chkq consolidate`` with no broker: a private one is started."""
    made = run("demo", str(tmp_path), "--checkpoints", "3", "--writers", "2")
    assert made.returncode == 0, made.stderr
    done = run("consolidate", "demo", "--out-dir", str(tmp_path), "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "demo.h5")
    assert done.stderr == "", "a successful run prints nothing but the output path"
    files = sorted(tmp_path.glob("demo_chk*/*.h5"))
    assert_consolidated(tmp_path / "demo.h5", files)


def test_default_out_dir_is_the_current_directory(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    done = run("consolidate", "run", "--workers", "1", "--cleanup", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


@pytest.mark.parametrize("case", ["missing", "exists", "bad-model", "not-a-dir"])
def test_failures_print_one_error_line_and_exit_1(tmp_path: Path, case: str) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=1, trials=5))
    model, out_dir = "run", str(tmp_path)
    if case == "missing":
        model = "other"
    elif case == "exists":
        (tmp_path / "run.h5").write_bytes(b"")
    elif case == "bad-model":
        model = "../run"
    else:
        out_dir = str(tmp_path / "run_chk00001.h5")
    before = snapshot(tmp_path)
    done = run("consolidate", model, "--out-dir", out_dir, "--workers", "1")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert done.stdout == ""
    assert snapshot(tmp_path) == before


def test_usage_errors_exit_2_and_version() -> None:
    assert run("consolidate").returncode == 2
    assert run("no-such-command").returncode == 2
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("chkq ")


def test_progress_is_shown_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal, stderr carries a self-rewriting line of rows copied/verified."""
    make_run(tmp_path, "run", RunShape(checkpoints=4, writers=2, trials=2000, spec_columns=256,
                                       compression="gzip", shuffle=True))
    primary, secondary = os.openpty()
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
        env["CHKQ_BLOCK_BYTES"] = str(256 * 1024)
        done = subprocess.run(
            [sys.executable, "-m", "chkq.workers.cli", "consolidate", "run", "--out-dir",
             str(tmp_path), "--workers", "1"],
            env=env, stdout=subprocess.PIPE, stderr=secondary, text=True, timeout=TIMEOUT)
        os.close(secondary)
        secondary = -1
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
        if secondary != -1:
            os.close(secondary)
    assert done.returncode == 0
    text = shown.decode(errors="replace")
    assert "rows" in text and "\r" in text, text
    assert done.stdout.strip() == str(tmp_path / "run.h5")


def test_python_api_on_the_embedded_cluster(tmp_path: Path) -> None:
    """``chkq.consolidate_checkpoints`` blocks, returns the path, raises the SPEC's errors."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=10))
    script = f"""
import chkq
from pathlib import Path
out = chkq.consolidate_checkpoints("run", {str(tmp_path)!r}, workers=1)
assert out == Path({str(tmp_path / "run.h5")!r}), out
try:
    chkq.consolidate_checkpoints("run", {str(tmp_path)!r}, workers=1)
except FileExistsError as exc:
    print("FileExistsError", exc)
try:
    chkq.consolidate_checkpoints("nothing", {str(tmp_path)!r}, workers=1)
except FileNotFoundError as exc:
    print("FileNotFoundError", exc)
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "FileExistsError" in done.stdout and "FileNotFoundError" in done.stdout


@pytest.mark.slow
def test_embedded_cluster_without_redis_server_uses_fakeredis(tmp_path: Path) -> None:
    """No redis-server on PATH: the embedded broker is fakeredis's TCP server (slower)."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=20))
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    env["PATH"] = str(tmp_path / "empty-path")
    done = subprocess.run(
        [sys.executable, "-m", "chkq.workers.cli", "consolidate", "run", "--out-dir", str(tmp_path),
         "--workers", "1"], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "run.h5")
    assert done.stderr == ""
    assert_consolidated(tmp_path / "run.h5", sorted(tmp_path.glob("run_chk*/*.h5")))
