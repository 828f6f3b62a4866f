"""What a new user meets first: the errors of common mistakes, gaps in a run, the demo,
a full or read-only disk, and the command line's output."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest

import chkq
from chkq.config.celery_app import get_app
from chkq.demo import RunShape, make_run
from chkq.errors import (
    BadCheckpointError,
    BadNameError,
    CheckpointGapError,
    NoCheckpointsError,
    OutputExistsError,
    OutputNotWritableError,
    OutputWriteError,
    RunNotADirectoryError,
    RunNotFoundError,
)
from chkq.jobs.status import JobStatus
from chkq.tasks.canvas import consolidation_signature
from chkq.tasks.state import records
from chkq.workers.client import ConsolidationJob, ConsolidationWarning, submit_consolidation
from support.helpers import assert_consolidated, snapshot
from support.plugins.cluster import WorkerProcess
from support.plugins.users import LocalUser

TIMEOUT = 180

#: Each common mistake: (the built-in a caller catches, chkq's class for it).
MISTAKES: dict[str, tuple[type[BaseException], type[BaseException]]] = {
    "output-exists": (FileExistsError, OutputExistsError),
    "no-directory": (FileNotFoundError, RunNotFoundError),
    "not-a-directory": (NotADirectoryError, RunNotADirectoryError),
    "no-checkpoints": (FileNotFoundError, NoCheckpointsError),
    "bad-name": (ValueError, BadNameError),
    "gap": (ValueError, CheckpointGapError),
    "not-hdf5": (ValueError, BadCheckpointError),
}


def no_broker() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args],
                          env=env if env is not None else no_broker(), capture_output=True,
                          text=True, timeout=TIMEOUT)


def mistake(tmp_path: Path, case: str) -> tuple[str, Path]:
    """A run directory holding ``case``'s mistake; the (model, directory) to consolidate."""
    run = tmp_path / case
    make_run(run, "run", RunShape(checkpoints=3, trials=20))
    if case == "output-exists":
        (run / "run.h5").write_bytes(b"precious")
    elif case == "no-directory":
        return "run", run / "nowhere"
    elif case == "not-a-directory":
        return "run", run / "run_chk00001.h5"
    elif case == "no-checkpoints":
        return "other", run
    elif case == "bad-name":
        return "../run", run
    elif case == "gap":
        (run / "run_chk00002.h5").unlink()
    elif case == "not-hdf5":
        (run / "run_chk00004.h5").write_bytes(b"not HDF5 at all\n" * 20)
    return "run", run


# ------------------------------------------------------------------ errors


def test_each_common_mistake_is_a_chkq_error_and_its_builtin_on_a_cluster(
        worker: WorkerProcess, tmp_path: Path) -> None:
    """Through the Python API against real workers: ``except chkq.ChkqError`` catches each
    mistake, ``except FileExistsError`` (etc.) still does. A file that is not HDF5 is
    refused by the worker's planning step: its class survives Celery's JSON results."""
    for case, (builtin, own) in MISTAKES.items():
        model, where = mistake(tmp_path, case)
        before = snapshot(tmp_path)
        with pytest.raises(chkq.ChkqError) as caught:
            submit_consolidation(model, where).wait_for_output(timeout=TIMEOUT)
        assert type(caught.value) is own, (case, caught.value)
        assert isinstance(caught.value, builtin), case
        with pytest.raises(builtin):
            submit_consolidation(model, where).wait_for_output(timeout=TIMEOUT)
        assert snapshot(tmp_path) == before, case


@pytest.mark.cluster
def test_each_common_mistake_is_a_chkq_error_on_the_embedded_cluster(tmp_path: Path) -> None:
    """``chkq.consolidate_checkpoints`` with no broker, as the Python example of docs/using.md."""
    cases = {case: [str(x) for x in mistake(tmp_path, case)] for case in MISTAKES}
    script = textwrap.dedent(f"""
        import json, chkq
        found = {{}}
        for case, (model, where) in {cases!r}.items():
            try:
                chkq.consolidate_checkpoints(model, where, workers=1)
            except chkq.ChkqError as exc:
                found[case] = [type(exc).__name__, [c.__name__ for c in type(exc).__mro__]]
        print(json.dumps(found))
    """)
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=no_broker(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for case, (builtin, own) in MISTAKES.items():
        assert found[case][0] == own.__name__, (case, found[case])
        assert builtin.__name__ in found[case][1], (case, found[case])
    assert snapshot(tmp_path) == before


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_each_common_mistake_on_the_command_line(tmp_path: Path, case: str) -> None:
    """One ``error:`` line naming the thing at fault, exit 1, nothing touched."""
    model, where = mistake(tmp_path, case)
    before = snapshot(tmp_path)
    done = cli("consolidate", model, "--out-dir", str(where), "--workers", "1")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    named = {"gap": "00002", "not-hdf5": "run_chk00004.h5", "bad-name": "../run",
             "no-checkpoints": "'other'", "output-exists": "run.h5",
             "no-directory": "nowhere", "not-a-directory": "run_chk00001.h5"}[case]
    assert named in lines[0], lines[0]
    assert snapshot(tmp_path) == before


def test_errors_raised_by_a_worker_arrive_as_chkq_errors(worker: WorkerProcess,
                                                         tmp_path: Path) -> None:
    """A job message sent without the client's checks (another client, a script): the
    worker's planning step refuses the gap and the existing output, and the client gets
    the very class back from the result backend; ``chkq status`` names it."""
    gap = tmp_path / "gap"
    make_run(gap, "run", RunShape(checkpoints=3, trials=20))
    (gap / "run_chk00002.h5").unlink()
    exists = tmp_path / "exists"
    make_run(exists, "run", RunShape(checkpoints=2, trials=20))
    (exists / "run.h5").write_bytes(b"precious")
    before = snapshot(tmp_path)
    for where, own, builtin in [(gap, CheckpointGapError, ValueError),
                                (exists, OutputExistsError, FileExistsError)]:
        job = uuid.uuid4().hex
        records().record_submitted(job, "run", str(where))
        consolidation_signature(str(where), "run", job, False).apply_async()
        with pytest.raises(own) as caught:
            ConsolidationJob(job, app=get_app()).wait_for_output(timeout=TIMEOUT)
        assert isinstance(caught.value, chkq.ChkqError) and isinstance(caught.value, builtin)
        shown = cli("status", job, env=dict(os.environ))
        assert shown.returncode == 1
        assert f"{own.__name__}: " in shown.stdout, shown.stdout
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ gaps


def gap_run(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Checkpoints 1, 3 and 6 of a run whose 2, 4 and 5 are gone; the files left."""
    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=6, writers=2, trials=30,
                                          empty_writer=False))
    for number in (2, 4, 5):
        shutil.rmtree(run / f"run_chk{number:05d}")
    return run, [f for f in files if f.exists()]


@pytest.mark.cluster
def test_a_gap_is_refused_naming_the_missing_numbers_and_cleanup_deletes_nothing(
        tmp_path: Path) -> None:
    run, _ = gap_run(tmp_path)
    before = snapshot(run)
    done = cli("consolidate", "run", "--out-dir", str(run), "--cleanup", "--workers", "1")
    assert done.returncode == 1
    assert "checkpoints 00002, 00004-00005 of model 'run' are missing" in done.stderr
    assert "--allow-gaps" in done.stderr, done.stderr
    assert snapshot(run) == before


@pytest.mark.cluster
def test_allow_gaps_consolidates_the_rest_with_a_warning(tmp_path: Path) -> None:
    run, files = gap_run(tmp_path)
    done = cli("consolidate", "run", "--out-dir", str(run), "--allow-gaps", "--workers", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run / "run.h5")
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and "00002, 00004-00005" in warned[0], done.stderr
    assert_consolidated(run / "run.h5", files)


def test_allow_gaps_from_python_on_a_cluster_warns_and_cleans_up(
        worker: WorkerProcess, tmp_path: Path) -> None:
    run, files = gap_run(tmp_path)
    keep = tmp_path / "copies"
    shutil.copytree(run, keep)
    with pytest.raises(CheckpointGapError, match="00004-00005"):
        chkq.consolidate_checkpoints("run", run, cleanup=True)
    assert snapshot(run) == snapshot(keep)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        output = chkq.consolidate_checkpoints("run", run, cleanup=True, allow_gaps=True)
    assert [w.category for w in seen] == [ConsolidationWarning], [str(w.message) for w in seen]
    assert "00002, 00004-00005" in str(seen[0].message)
    assert sorted(p.name for p in run.iterdir()) == ["run.h5"]
    assert_consolidated(output, [keep / f.relative_to(run) for f in files])


def test_a_gap_in_a_run_scanned_in_parallel(worker: WorkerProcess, tmp_path: Path) -> None:
    """More than SCAN_FILES files: the plan step runs again after its scan units, and an
    accepted gap stays accepted there; without --allow-gaps the worker refuses it too."""
    from chkq.consolidation.run_scan import SCAN_FILES

    run = tmp_path / "run"
    files = make_run(run, "run", RunShape(checkpoints=SCAN_FILES + 20, trials=1))
    (run / "run_chk00002.h5").unlink()
    files = [f for f in files if f.exists()]
    job = uuid.uuid4().hex
    records().record_submitted(job, "run", str(run))
    consolidation_signature(str(run), "run", job, False).apply_async()
    with pytest.raises(CheckpointGapError, match="checkpoint 00002 of model 'run' is missing"):
        ConsolidationJob(job, app=get_app()).wait_for_output(timeout=TIMEOUT)
    handle = submit_consolidation("run", run, allow_gaps=True)
    assert handle.client_warnings and "00002" in handle.client_warnings[0]
    output = handle.wait_for_output(timeout=TIMEOUT)
    assert_consolidated(output, files)


# ------------------------------------------------------------------ demo


@pytest.mark.cluster
def test_demo_refuses_to_overwrite_and_its_threads_have_rows(tmp_path: Path) -> None:
    made = cli("demo", str(tmp_path))
    assert made.returncode == 0, made.stderr
    before = snapshot(tmp_path)
    again = cli("demo", str(tmp_path))
    assert again.returncode == 1
    assert again.stderr.startswith("error: ") and "demo_chk00001" in again.stderr, again.stderr
    assert snapshot(tmp_path) == before
    rows = {}
    for path in sorted(tmp_path.glob("demo_chk*/thread_*.h5")):
        with h5py.File(path, "r") as f:
            rows[str(path.relative_to(tmp_path))] = f["galaxy/trial"].shape[0]
    empty = [name for name, count in rows.items() if count == 0]
    assert empty == ["demo_chk00001/thread_0001.h5"], rows
    assert all(rows[f"demo_chk{n:05d}/thread_0001.h5"] > 0 for n in (2, 3, 4)), rows
    other = cli("demo", str(tmp_path), "--model", "other")
    assert other.returncode == 0, other.stderr


# ------------------------------------------------------------------ full and read-only disks


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs (the tests run as root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


#: Incompressible rows under gzip: HDF5 itself runs out of space while it writes chunks.
FULL_RUN = RunShape(checkpoints=2, trials=6500, spec_columns=128, compression="gzip",
                    nans=False)


def test_disk_full_names_the_file_and_the_filesystem(worker: WorkerProcess,
                                                     small_disk: Path) -> None:
    make_run(small_disk, "run", FULL_RUN)
    assert shutil.disk_usage(small_disk).used > 12 * 2**20, "the checkpoints fill half the disk"
    before = snapshot(small_disk)
    with pytest.raises(OutputWriteError) as caught:
        submit_consolidation("run", small_disk).wait_for_output(timeout=TIMEOUT)
    message = str(caught.value)
    assert isinstance(caught.value, OSError) and caught.value.errno == 28, message
    assert f"cannot write '{small_disk}/.chkq-" in message, message
    assert "No space left on device" in message and "filesystem tmpfs mounted at" in message
    assert f"'{small_disk}'" in message and "free of 24.0 MiB" in message, message
    assert snapshot(small_disk) == before


@pytest.mark.cluster
def test_disk_full_on_the_command_line(small_disk: Path) -> None:
    make_run(small_disk, "run", FULL_RUN)
    before = snapshot(small_disk)
    done = cli("consolidate", "run", "--out-dir", str(small_disk), "--workers", "1")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: [Errno 28] cannot write '{small_disk}/"), lines[0]
    assert "filesystem tmpfs" in lines[0] and "free of 24.0 MiB" in lines[0], lines[0]
    assert snapshot(small_disk) == before


TRIPWIRE = """
import sys
import chkq.workers.embedded as embedded
def tripped(*args, **kwargs):
    raise AssertionError("an embedded cluster was started")
embedded.EmbeddedCluster.__init__ = tripped
from chkq.workers.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_read_only_output_directory_is_refused_before_any_cluster_starts(
        small_disk: Path, worker: WorkerProcess) -> None:
    make_run(small_disk, "run", RunShape(checkpoints=2, trials=20))
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    done = subprocess.run([sys.executable, "-c", TRIPWIRE, "consolidate", "run", "--out-dir",
                           str(small_disk)], env=no_broker(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: output directory '{small_disk}' is on a read-only "
                               f"file system (filesystem tmpfs mounted at '{small_disk}', "
                               "read-only: "), lines[0]
    assert lines[0].endswith("free of 24.0 MiB): the output cannot be written there"), lines[0]
    with pytest.raises(OutputNotWritableError, match="read-only file system"):
        submit_consolidation("run", small_disk)


# ------------------------------------------------------------------ command-line output


def test_status_columns_stay_aligned_for_every_state() -> None:
    from chkq.jobs.status import when as _when
    from chkq.workers.cli.status import format_recent

    statuses = [JobStatus(f"{n:032x}", state, phase, model="run", out_dir="/r", submitted=0.0)
                for n, (state, phase) in enumerate([
                    ("SUCCESS", "done"), ("CANCELLED", "cancelled"), ("FAILURE", "failed"),
                    ("RUNNING", "verifying"), ("PENDING", "queued")])]
    lines = format_recent(statuses).splitlines()
    shown = _when(0.0)
    starts = {line.index(shown) if shown in line else line.index("SUBMITTED") for line in lines}
    assert len(starts) == 1, "\n".join(lines)
    states = {line.split()[1] for line in lines[1:]}
    assert states == {"SUCCESS", "CANCELLED", "FAILURE", "RUNNING", "PENDING"}


def test_the_progress_line_is_erased_with_what_the_terminal_echoed() -> None:
    """Closing the progress line (before ``error: interrupted``) erases to the end of the
    line, so a ``^C`` echoed after it does not remain beside the error."""
    from chkq.workers.cli.common import ProgressLine
    from chkq.workers.client import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    line = ProgressLine(term)
    line(Progress("copying", 10, 0, 100))
    line.close()
    assert term.getvalue().endswith("\r\x1b[K"), repr(term.getvalue())


# ------------------------------------------------------------------ worker start


def test_a_worker_that_cannot_read_the_signing_key_says_why(
        local_users: tuple[LocalUser, ...]) -> None:
    """A key readable by root only (a ``./secrets`` the workers' user does not own), or no key
    at all (compose made an empty ``./secrets``): ``chkq worker`` exits 1 at once, naming the
    file, the worker's uid, the file's owner, and what to do."""
    worker_user = local_users[0]
    secrets = worker_user.home / f"secrets-{uuid.uuid4().hex[:8]}"
    (secrets / "trusted").mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=chkq", "-keyout", str(secrets / "chkq.key"),
                    "-out", str(secrets / "chkq.pem")], check=True, capture_output=True)
    shutil.copy(secrets / "chkq.pem", secrets / "trusted" / "chkq.pem")
    os.chmod(secrets / "chkq.key", 0o600)
    secrets.chmod(0o755)
    env = {"CHKQ_BROKER_URL": "redis://127.0.0.1:9/0",
           "CHKQ_SECURITY_KEY": str(secrets / "chkq.key"),
           "CHKQ_SECURITY_CERTIFICATE": str(secrets / "chkq.pem"),
           "CHKQ_SECURITY_CERT_STORE": str(secrets / "trusted")}
    done = worker_user.run([sys.executable, "-m", "chkq.workers.cli", "worker"], env=env,
                           timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err == (f"error: cannot read the private key (CHKQ_SECURITY_KEY) "
                   f"'{secrets / 'chkq.key'}' as uid {worker_user.uid} (Permission denied): it "
                   f"is owned by uid 0 (gid 0) with mode -rw-------: make it readable by uid "
                   f"{worker_user.uid}, e.g. chown it to the workers' user (CHKQ_UID in "
                   "compose.yaml)\n"), err
    missing = worker_user.run([sys.executable, "-m", "chkq.workers.cli", "worker"],
                              env={**env, "CHKQ_SECURITY_KEY": str(secrets / "none.key")},
                              timeout=60)
    assert missing.returncode == 1
    assert "it does not exist: the secrets directory (CHKQ_SECRETS" in missing.stderr.decode()
