"""The ``chkq`` command and the Python API as a user runs them, embedded cluster included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from support.helpers import assert_consolidated, snapshot

#: Every test here starts processes (the command line, an embedded cluster).
pytestmark = pytest.mark.cluster

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
    """``chkq.consolidate_checkpoints`` blocks, returns the path, raises the documented errors."""
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


def test_version_and_help_import_no_heavy_library() -> None:
    """``--version`` and ``--help`` import neither Celery, h5py, numpy nor boto3 (fast start)."""
    heavy = ("celery", "kombu", "h5py", "numpy", "boto3", "google", "redis")
    for args in (["--version"], ["--help"], ["consolidate", "--help"], ["status", "--help"],
                 ["cancel", "--help"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "chkq.workers.cli",
                               *args], capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        imported = {line.split("|")[-1].strip().split(".")[0]
                    for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert not imported & set(heavy), (args, sorted(imported & set(heavy)))
    listed = run("--help").stdout
    for command in ("consolidate", "worker", "log", "watch", "flower", "status", "cancel"):
        assert re.search(rf"^\s+{command}\s", listed, re.MULTILINE), listed


@pytest.mark.parametrize("args", [
    ["consolidate", "run", "--workers", "0"],
    ["consolidate", "run", "--workers", "-3"],
    ["consolidate", "run", "--timeout", "0"],
    ["worker", "-c", "0"],
    ["watch", ".", "run", "--store", "memory://x", "--run", "r", "--workers", "0"],
    ["watch", ".", "run", "--store", "memory://x", "--run", "r", "--cleanup"],
])
def test_nonsense_options_are_usage_errors(args: list[str]) -> None:
    """No worker count below 1, no ``watch --cleanup`` without ``--consolidate``: exit 2."""
    done = run(*args)
    assert done.returncode == 2, (args, done.stderr)
    assert "error:" in done.stderr.splitlines()[-1]
    assert done.stdout == ""


def test_a_missing_directory_is_file_not_found(tmp_path: Path) -> None:
    """In Python, a missing output directory raises FileNotFoundError naming it."""
    missing = tmp_path / "nowhere"
    script = f"""
import chkq
try:
    chkq.consolidate_checkpoints("run", {str(missing)!r}, workers=1)
except FileNotFoundError as exc:
    assert {str(missing)!r} in str(exc), exc
    print("FileNotFoundError")
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FileNotFoundError"


def test_cleanup_warnings_and_summary_reach_the_user(tmp_path: Path) -> None:
    """A checkpoint directory kept by --cleanup is a ``warning:`` line; -v adds the summary."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, writers=2, trials=50))
    (tmp_path / "run_chk00001" / "notes.txt").write_text("keep me")
    done = run("consolidate", "run", "--out-dir", str(tmp_path), "--workers", "1", "--cleanup",
               "-v")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'run.h5'}\n"
    phases = ("queued", "planning", "copying", "merging", "verifying", "linking")
    lines = [line for line in done.stderr.splitlines() if not line.startswith(phases)]
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: checkpoint directory ") and "run_chk00001" in lines[0]
    assert "notes.txt" in lines[0]
    assert re.fullmatch(r"wrote \S+run\.h5: 7 datasets of up to [\d,]+ rows from 4 files, "
                        r"[\d.,]+ MB in [\d.]+ s \(job [0-9a-f]{32}\)", lines[1]), lines[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "run_chk00001"]
