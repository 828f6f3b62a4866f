"""chkq installs one import package: a program with its own config, tasks and workers keeps them."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from support.plugins.cluster import WorkerProcess

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


#: The folders whose modules are chkq's own (``chkq/`` also holds links to tasks/, workers/
#: and config/, which are not followed: they are read once, at their own place).
SOURCE_FOLDERS = ("chkq", "tasks", "workers", "config", "bench", "tests")

#: Top-level names that, imported bare, load chkq's own modules a second time under another
#: name in a checkout (and are a simulation's own modules once chkq is installed).
BARE_NAMES = frozenset({"tasks", "workers", "config"})


def bare_imports(source: str, filename: str) -> list[str]:
    """``line: statement`` for each import of a bare ``tasks``, ``workers`` or ``config``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in BARE_NAMES for name in names):
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def python_files(root: Path) -> list[Path]:
    """Every ``.py`` file below ``root``'s source folders, links to folders not followed."""
    files = []
    for folder in SOURCE_FOLDERS:
        for directory, _, names in os.walk(root / folder):
            files.extend(Path(directory) / n for n in names if n.endswith(".py"))
    return sorted(files)


def test_the_finder_sees_every_form_of_a_bare_import() -> None:
    source = textwrap.dedent("""
        import tasks
        import os, workers.cli as cli
        from config.settings import Settings
        from tasks import protocol
        from chkq.tasks import protocol
        import chkq.config
        from . import config
        text = "import config"
    """)
    assert [line.split(":")[0] for line in bare_imports(source, "example.py")] == \
        ["2", "3", "4", "5"]


def test_no_module_imports_bare_tasks_workers_or_config() -> None:
    root = Path(__file__).resolve().parents[1]
    files = python_files(root)
    assert len(files) > 100, "the walk must see the whole tree"
    assert root / "tasks" / "commit.py" in files and root / "tests" / "conftest.py" in files
    offenders = {str(path.relative_to(root)): found for path in files
                 if (found := bare_imports(path.read_text(), str(path)))}
    assert offenders == {}, "import these through chkq. (chkq.tasks, chkq.workers, chkq.config)"


def test_tests_import_chkq_as_users_do() -> None:
    """pytest leaves the checkout off sys.path: the bare names a checkout has do not import."""
    root = Path(__file__).resolve().parents[1]
    assert str(root) not in [os.path.abspath(p or os.curdir) for p in sys.path]
    for name in sorted(BARE_NAMES):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    canvas = importlib.import_module("chkq.tasks.canvas")
    assert Path(canvas.__file__).resolve() == root / "tasks" / "canvas.py"


@pytest.mark.cluster
def test_import_chkq_beside_a_checkout_named_chkq_says_what_it_found(tmp_path: Path) -> None:
    """Python in the directory holding a checkout cloned as ``chkq/``: a clear ImportError.

    The current directory comes first on ``sys.path``; the checkout's top folder is
    found before the installed package, and must not pass for it.
    """
    import chkq

    checkout = Path(chkq.__file__).resolve().parent.parent
    (tmp_path / "chkq").symlink_to(checkout, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import chkq; chkq.consolidate_checkpoints"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"ImportError: 'import chkq' found the chkq checkout '{tmp_path / 'chkq'}' (Python "
        "looks in the current directory first), not the chkq package: run Python from another "
        "directory; installed (pip install -e CHECKOUT), chkq imports from any other"), \
        done.stderr
    elsewhere = subprocess.run([sys.executable, "-c", "import chkq; chkq.consolidate_checkpoints"],
                               cwd=tmp_path / "chkq", env=env, capture_output=True, text=True,
                               timeout=60)
    assert elsewhere.returncode == 0, elsewhere.stderr
