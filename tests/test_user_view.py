"""What a user sees around a job: a second submission of a run, a dry run, progress, notices."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import psutil
import pytest

from chkq.config.routing import CONTROL_QUEUE, VERIFY_QUEUE
from chkq.demo import RunShape, make_run
from chkq.errors import RunBusyError
from chkq.tasks.state import job_status
from chkq.workers.cancel import cancel_job
from chkq.workers.cli.common import ProgressLine
from chkq.workers.client import submit_consolidation
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.cluster import WorkerProcess, consumers_paused
from support.plugins.users import LocalUser

pytestmark = pytest.mark.cluster

TIMEOUT = 180


def chkq(*args: str, broker: bool = False, cwd: Path | None = None,
         **popen: object) -> subprocess.Popen[str]:
    """Start ``chkq ARGS`` as a user would (embedded unless ``broker``)."""
    env = dict(os.environ)
    if not broker:
        env.pop("CHKQ_BROKER_URL", None)
        env.pop("CHKQ_RESULT_BACKEND", None)
    return subprocess.Popen([sys.executable, "-m", "chkq.workers.cli", *args], env=env,
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)  # type: ignore[call-overload]


def run(*args: str, broker: bool = False) -> tuple[int, str, str]:
    process = chkq(*args, broker=broker)
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out, err


def test_a_second_consolidation_of_a_queued_run_is_refused_naming_the_job(
        worker: WorkerProcess, tmp_path: Path) -> None:
    """On a cluster, a run submitted twice: the second is refused at once, naming the first."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=20))
    with consumers_paused(worker, CONTROL_QUEUE):
        first = submit_consolidation("run", tmp_path)
        with pytest.raises(RunBusyError, match=f"already being consolidated by job {first.id} "
                           rf"\(queued\).*chkq cancel {first.id}"):
            submit_consolidation("run", tmp_path)
        status, _, err = run("consolidate", "run", "--out-dir", str(tmp_path), "--no-wait",
                             broker=True)
        assert status == 1 and f"job {first.id}" in err, err
        make_run(tmp_path / "other", "run", RunShape(checkpoints=1, trials=5))
        other = submit_consolidation("run", tmp_path / "other")  # another run: not held
        cancel_job(first.id)
    again = submit_consolidation("run", tmp_path)
    assert again.wait_for_output(timeout=TIMEOUT) == tmp_path / "run.h5"
    assert other.wait_for_output(timeout=TIMEOUT) == tmp_path / "other" / "run.h5"


def test_a_second_embedded_consolidation_of_a_run_is_refused_naming_the_first(
        tmp_path: Path) -> None:
    """Two ``chkq consolidate`` of one run with no broker: the second refused, the first goes on."""
    make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=200))
    first = chkq("consolidate", "run", "--out-dir", str(tmp_path), "--workers", "1")
    command = psutil.Process(first.pid)
    deadline = time.monotonic() + 60
    while len(command.children()) < 2 and time.monotonic() < deadline:  # broker, worker
        time.sleep(0.02)
    first.send_signal(signal.SIGSTOP)  # it holds the run while it is stopped
    assert first.poll() is None, "the first command ended before its cluster was seen"
    try:
        status, out, err = run("consolidate", "run", "--out-dir", str(tmp_path))
    finally:
        first.send_signal(signal.SIGCONT)
    assert status == 1 and out == "", err
    assert err.startswith(f"error: model 'run' in '{tmp_path}' is already being consolidated")
    assert f"process {first.pid}" in err, err
    out, err = first.communicate(timeout=TIMEOUT)
    assert first.returncode == 0, err
    assert_consolidated(tmp_path / "run.h5", sorted(tmp_path.glob("run_chk*/*.h5")))


def test_a_dry_run_prints_what_the_job_would_write_and_touches_nothing(tmp_path: Path) -> None:
    """``--dry-run``: checkpoints, files, bytes, each dataset's rows: what the job then writes."""
    make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=50))
    before = snapshot(tmp_path)
    status, out, err = run("consolidate", "run", "--out-dir", str(tmp_path), "--dry-run")
    assert status == 0 and err == "", err
    assert snapshot(tmp_path) == before, "a dry run wrote or deleted something"
    files = sorted(tmp_path.glob("run_chk*/*.h5"))
    size = sum(f.stat().st_size for f in files) / 1e6
    lines = out.splitlines()
    assert lines[0] == (f"would consolidate 3 checkpoints (00001-00003) of {tmp_path}: "
                        f"6 files, {size:,.1f} MB")
    assert lines[1] == f"into {tmp_path / 'run.h5'}"
    assert lines[-1] == "dry run: nothing was submitted, written or deleted"
    said = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in lines[2:-1]}
    status, out, err = run("consolidate", "run", "--out-dir", str(tmp_path), "--workers", "1")
    assert status == 0, err
    with h5py.File(tmp_path / "run.h5", "r") as output:
        written: dict[str, int] = {}
        output.visititems(lambda name, obj: written.__setitem__(f"/{name}", len(obj))
                          if isinstance(obj, h5py.Dataset) and obj.maxshape[:1] == (None,)
                          else None)
    assert said == written


def test_a_dry_run_says_what_the_job_would_refuse(tmp_path: Path) -> None:
    """A truncated checkpoint file: the dry run names it, as the job would, and changes nothing."""
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=20))
    victim = sorted(tmp_path.glob("run_chk00002*"))[0]
    victim = victim if victim.is_file() else sorted(victim.glob("*.h5"))[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    before = snapshot(tmp_path)
    status, out, err = run("consolidate", "run", "--out-dir", str(tmp_path), "--dry-run")
    assert status == 1 and out == "" and str(victim) in err, err
    assert snapshot(tmp_path) == before


def test_verbose_progress_reaches_a_log_as_plain_lines_at_a_sane_rate(tmp_path: Path) -> None:
    """``-v`` with stderr a file (a batch job): progress lines as the job goes, then the summary."""
    # Gzip rows re-encoded across file boundaries: a copy step of seconds, which the client's
    # polls see on any machine.
    make_run(tmp_path, "run", RunShape(checkpoints=4, writers=2, trials=3000, spec_columns=256,
                                       compression="gzip", shuffle=True))
    log = tmp_path / "job.log"
    started = time.monotonic()
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "chkq.workers.cli", "consolidate", "run",
                               "--out-dir", str(tmp_path), "--workers", "2", "-v"],
                              env={k: v for k, v in os.environ.items()
                                   if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")},
                              stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=TIMEOUT)
    took = time.monotonic() - started
    assert done.returncode == 0
    text = log.read_text()
    assert "\r" not in text and "\x1b" not in text, "a log gets no terminal controls"
    lines = text.splitlines()
    assert lines[-1].startswith(f"wrote {tmp_path / 'run.h5'}: ")
    progress = lines[:-1]
    phases = [line.split(":")[0].rstrip(".") for line in progress]
    assert len(set(phases)) >= 2, text
    assert any(line.split(":")[0] in ("copying", "merging", "verifying") and " rows" in line
               for line in progress), text
    assert len(progress) <= len(set(phases)) * (1 + took / 10), text


@pytest.mark.fault
def test_the_waiting_client_says_when_the_worker_running_its_task_is_gone(
        tmp_path: Path) -> None:
    """A copy worker killed outright: ``chkq consolidate`` says so on stderr within seconds."""
    import threading

    from test_status_lost_worker import CLI, LIMITS, Worker

    from chkq.workers.broker import PrivateRedis
    from support.helpers import wait_for, write_lease

    with PrivateRedis() as server:
        env = {**os.environ, **LIMITS, "CHKQ_BROKER_URL": server.url,
               "CHKQ_RESULT_BACKEND": server.url}
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        make_run(run_dir, "run", RunShape(checkpoints=2, writers=2, trials=2000))
        held = run_dir / "run_chk00001" / "thread_0000.h5"
        workers = [Worker(env, tmp_path / "control.log", "control,verify", "control")]
        client = subprocess.Popen(CLI + ["consolidate", "run", "--out-dir", str(run_dir)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(iter(client.stderr.readline, "")),
                                  daemon=True)
        reader.start()
        try:
            temporary = wait_for(lambda: next((p for p in run_dir.iterdir()
                                               if p.name.startswith(".chkq-")), None),
                                 90, "the job's temporary output")
            job = temporary.name.removeprefix(".chkq-").split(".")[0]
            with write_lease(held) as lease:
                copier = Worker(env, tmp_path / "copier.log", "copy", "copier")
                workers.append(copier)
                wait_for(lease.waited_on, 90, "the copy to wait on the held checkpoint")
                assert not any("gone" in line for line in said), said
                copier.kill()
            killed = time.monotonic()
            notice = wait_for(lambda: next((line for line in said if copier.name in line),
                                           None), 30, "the client to say the worker is gone")
            print(f"\n{notice.strip()}\n(said {time.monotonic() - killed:.1f} s after the kill)")
            assert notice.startswith(f"warning: the worker {copier.name} running task {job}-copy-")
            assert "is gone (not answering; copying): redelivered by " in notice, notice
            assert f"chkq cancel {job}" in notice
            cancelled = subprocess.run(CLI + ["cancel", job], env=env, capture_output=True,
                                       text=True, timeout=120)
            assert cancelled.returncode == 0, cancelled.stderr
            assert client.wait(60) == 1
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
            for worker in workers:
                worker.stop()


def test_every_command_says_what_it_does_and_every_argument_has_help() -> None:
    """``chkq COMMAND --help``: a description, help for each argument, defaults where they apply."""
    import argparse

    from chkq.workers.cli import build_parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    if not child.description:
                        missing.append(f"{name} {child_name}: no description")
                    walk(child, f"{name} {child_name}")
            elif action.help is None:
                missing.append(f"{name} {action.dest}: no help")

    walk(build_parser(None), "chkq")
    assert missing == []
    status, out, _ = run("watch", "--help")
    assert status == 0 and "(default: 1)" in " ".join(out.split()), out


def _run_with_labels(directory: Path) -> list[Path]:
    """A run of 2 checkpoints of 50 trials whose files also hold a variable-length dataset."""
    files = make_run(directory, "run", RunShape(checkpoints=2, trials=50))
    for n, path in enumerate(files):
        with h5py.File(path, "r+") as f:
            label = f["galaxy"].create_dataset("label", (50,), maxshape=(None,), chunks=(16,),
                                               dtype=h5py.string_dtype())
            label[:] = [f"trial {50 * n + i}" * (i % 4) for i in range(50)]
    return files


def _datasets(output: Path) -> dict[str, int]:
    """Each extensible dataset of ``output`` and its rows, read as a user would."""
    found: dict[str, int] = {}
    with h5py.File(output, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(f"/{name}", len(obj))
                     if isinstance(obj, h5py.Dataset) and obj.maxshape[:1] == (None,) else None)
    return found


def test_progress_and_summary_count_rows_as_a_user_does(worker: WorkerProcess,
                                                         tmp_path: Path) -> None:
    """Variable-length rows count as copied; the summary says the datasets' rows, not their sum.

    A job that succeeded shows every row copied and verified, the variable-length
    dataset's included; its summary and ``chkq status`` give the longest dataset's
    rows (100 trials of 2 clusters: 200) and each dataset's, not 8 datasets' rows added up.
    """
    _run_with_labels(tmp_path)
    job = submit_consolidation("run", tmp_path)
    summary = job.wait_for_summary(timeout=TIMEOUT)
    written = _datasets(tmp_path / "run.h5")
    assert len(written) == 8 and written["/galaxy/label"] == 100
    assert summary.datasets == written and summary.records == 200
    assert summary.line().startswith(
        f"wrote {tmp_path / 'run.h5'}: 8 datasets of up to 200 rows from 2 files, ")
    status, out, err = run("status", job.id, broker=True)
    assert status == 0, err
    total = sum(written.values())
    assert f"rows copied {total:,}/{total:,}, verified {total:,}/{total:,}" in out, out
    assert "wrote 8 datasets of up to 200 rows from 2 files" in out, out
    assert "    /galaxy/label 100 rows" in out and "    /clusters/uid 200 rows" in out, out


def test_progress_counts_variable_length_rows_as_copied_once_merged(
        worker: WorkerProcess, tmp_path: Path) -> None:
    """Held before verification, a job reads every row copied, the variable-length ones too."""
    _run_with_labels(tmp_path)
    with consumers_paused(worker, VERIFY_QUEUE):
        job = submit_consolidation("run", tmp_path)
        wait_for(lambda: job_status(job.id).steps["merge"][0].state == "SUCCESS", TIMEOUT,
                 "the merge to finish")
        progress = job.progress
        total = sum(_datasets_of_plan(tmp_path).values())
        assert (progress.copied, progress.verified, progress.total, progress.records) == (
            total, 0, total, 200), progress
        shown = io.StringIO()
        ProgressLine(shown, log=True)(progress)
        assert shown.getvalue() == f"{progress.phase}: copied 100%, verified 0% of 200 rows\n"
    job.wait_for_output(timeout=TIMEOUT)


def _datasets_of_plan(directory: Path) -> dict[str, int]:
    """Each extensible dataset's rows summed over the run's checkpoint files."""
    rows: dict[str, int] = {}
    for path in sorted(directory.glob("run_chk*.h5")):
        for name, count in _datasets(path).items():
            rows[name] = rows.get(name, 0) + count
    return rows

@pytest.mark.parametrize("closed", ["run directory", "checkpoint directory"])
def test_an_unreadable_directory_is_named_in_full_with_what_to_do(
        local_users: tuple[LocalUser, LocalUser], closed: str) -> None:
    """A run or checkpoint directory its user may not list: its whole path and the fix."""
    victim, _ = local_users
    run_dir = victim.mkdir(f"unreadable-{closed.split()[0]}")
    make_run(run_dir, "QHIFUV", RunShape(checkpoints=3, writers=2, trials=10))
    victim.chown_tree(run_dir)
    before = snapshot(run_dir)
    shut = run_dir if closed == "run directory" else run_dir / "QHIFUV_chk00003"
    shut.chmod(0o300 if shut == run_dir else 0o000)
    try:
        for extra in (["--dry-run"], []):
            done = victim.run([sys.executable, "-m", "chkq.workers.cli", "consolidate", "QHIFUV",
                               "--out-dir", str(run_dir), *extra])
            err = done.stderr.decode()
            assert done.returncode == 1 and done.stdout == b"", err
            assert err == (f"error: cannot read {closed} '{shut}': permission denied to user "
                           f"{victim.name} (uid {victim.uid}), which must be able to list and "
                           "enter it: check its mode and owner (chmod u+rx, or g+rx for a "
                           "group of that user)\n"), err
    finally:
        shut.chmod(0o755)
    assert snapshot(run_dir) == before


def test_a_wrong_model_name_lists_the_models_the_directory_holds(tmp_path: Path) -> None:
    """``qhifuv`` for ``QHIFUV``: the refusal names the models there are (as log restore does)."""
    make_run(tmp_path, "QHIFUV", RunShape(checkpoints=2, trials=5))
    make_run(tmp_path, "demo", RunShape(checkpoints=1, writers=2, trials=5))
    (tmp_path / "notes_chk1.h5").write_text("not a checkpoint")
    for extra in (["--dry-run"], []):
        status, out, err = run("consolidate", "qhifuv", "--out-dir", str(tmp_path), *extra)
        assert status == 1 and out == "", err
        assert err == (f"error: no checkpoints of model 'qhifuv' in '{tmp_path}' (expected "
                       "qhifuv_chkNNNNN.h5 or qhifuv_chkNNNNN/; its models: 'QHIFUV', 'demo')\n")
