"""chkq installs one import package: a program with its own config, tasks and workers keeps them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from chkq.demo import RunShape, make_run
from tests.plugins.cluster import WorkerProcess

PROGRAM = textwrap.dedent("""
    import sys
    import config, tasks, workers
    assert (config.OWNER, tasks.OWNER, workers.OWNER) == ("simulation",) * 3
    from chkq import consolidate_checkpoints, submit_consolidation, CheckpointLog, open_store
    from chkq.config.celery_app import app
    job = submit_consolidation("run", sys.argv[1])
    print(job.wait_for_output(timeout=120))
    import config, tasks, workers
    assert (config.OWNER, tasks.OWNER, workers.OWNER) == ("simulation",) * 3
    assert sys.modules["config"].__file__.startswith(sys.argv[2])
""")


def test_a_program_with_its_own_config_tasks_and_workers(tmp_path: Path,
                                                          worker: WorkerProcess) -> None:
    program = tmp_path / "sim"
    program.mkdir()
    for name in ("config", "tasks", "workers"):
        (program / f"{name}.py").write_text('OWNER = "simulation"\n')
    (program / "main.py").write_text(PROGRAM)
    run = tmp_path / "run"
    make_run(run, "run", RunShape(checkpoints=2, trials=20))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "main.py", str(run), str(program)], cwd=program,
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(run / "run.h5")
