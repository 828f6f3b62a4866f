"""The design page's module map names exactly the modules the tree holds.

``docs/design.md`` has one table, "Where each behaviour lives", whose first
column names modules (``chkq/log/gc.py``) and packages (``chkq/log/``). The
map drifts silently when a module is added, moved or removed; this test
compares it with the tree so that whoever moves a module updates its row.
"""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

MAPPED_ROOTS = ("chkq", "tasks", "workers", "config")
MAP_HEADER = re.compile(r"^\|\s*module\s*\|\s*what it does\s*\|\s*$")


def repository() -> Path:
    """The checkout's root: the nearest folder above this file with a ``pyproject.toml``."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise AssertionError(f"no pyproject.toml above {__file__}")


def mapped_paths(design: str) -> list[str]:
    """Every backticked path in the first column of the module map's rows."""
    lines = design.splitlines()
    starts = [i for i, line in enumerate(lines) if MAP_HEADER.match(line)]
    assert len(starts) == 1, f"docs/design.md has {len(starts)} '| module | what it does |' tables"
    paths: list[str] = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        paths.extend(re.findall(r"`([^`]+)`", first))
    return paths


def tree_modules(root: Path) -> set[str]:
    """Every module of the mapped folders, as ``folder/…/name.py``; package ``__init__`` aside.

    ``chkq/tasks``, ``chkq/workers`` and ``chkq/config`` are links to the
    top-level folders, which are walked under their own names.
    """
    modules: set[str] = set()
    for top in MAPPED_ROOTS:
        for path in (root / top).rglob("*.py"):
            relative = path.relative_to(root)
            if relative.name == "__init__.py" or "__pycache__" in relative.parts:
                continue
            if relative.parts[0] == "chkq" and relative.parts[1] in MAPPED_ROOTS:
                continue
            modules.add(relative.as_posix())
    return modules


def test_the_module_map_lists_every_module_and_only_modules_that_exist() -> None:
    root = repository()
    listed = mapped_paths((root / "docs" / "design.md").read_text(encoding="utf-8"))
    missing_paths = sorted(p for p in listed if not (root / p).exists())
    not_listed = sorted(tree_modules(root) - set(listed))
    assert not missing_paths and not not_listed, (
        "docs/design.md's module map and the tree differ:\n"
        + "".join(f"  listed, but no such file or folder: {p}\n" for p in missing_paths)
        + "".join(f"  in the tree, not listed: {p}\n" for p in not_listed)
        + "update the table 'Where each behaviour lives' in docs/design.md"
    )


def test_the_check_reads_the_first_column_of_the_map_only() -> None:
    design = ("intro\n\n| module | what it does |\n|---|---|\n"
              "| `chkq/a.py`, `chkq/b.py` | two modules, beside `not/this.py` |\n"
              "| `chkq/pkg/` | a package |\n\nafter the table, `nor/this.py`\n")
    assert mapped_paths(design) == ["chkq/a.py", "chkq/b.py", "chkq/pkg/"]


@pytest.mark.cluster
def test_the_compose_walkthrough_makes_the_secrets_before_it_starts_the_workers(
        tmp_path: Path) -> None:
    """Run the walkthrough's commands up to its first ``docker compose up``, as a reader would:
    they leave in ``./secrets`` the key, certificate and trusted store ``compose.yaml`` mounts,
    a matching pair, the key readable by its owner only."""
    text = (repository() / "docs" / "cluster.md").read_text()
    section = text.split("\n## Docker Compose\n", 1)[1].split("\n## ", 1)[0]
    commands = [line[4:] for line in section.splitlines() if line.startswith("    ")]
    first_up = next(i for i, c in enumerate(commands) if c.startswith("docker compose up"))
    script = "\n".join(c for c in commands[:first_up]
                       if not c.startswith(("chown ", "export ")))
    done = subprocess.run(["sh", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    compose = (repository() / "compose.yaml").read_text()
    mounted = re.search(r"\$\{CHKQ_SECRETS:-\./(\w+)\}:(\S+):ro", compose)
    assert mounted, "compose.yaml mounts no secrets directory"
    secrets, inside = tmp_path / mounted.group(1), mounted.group(2)
    named = dict(re.findall(r"(CHKQ_SECURITY_\w+): (\S+)", compose))
    assert set(named) == {"CHKQ_SECURITY_KEY", "CHKQ_SECURITY_CERTIFICATE",
                          "CHKQ_SECURITY_CERT_STORE"}, named
    paths = {k: secrets / Path(v).relative_to(inside) for k, v in named.items()}
    key = serialization.load_pem_private_key(paths["CHKQ_SECURITY_KEY"].read_bytes(), None)
    certificate = x509.load_pem_x509_certificate(paths["CHKQ_SECURITY_CERTIFICATE"].read_bytes())
    assert certificate.public_key().public_numbers() == key.public_key().public_numbers()
    trusted = list(paths["CHKQ_SECURITY_CERT_STORE"].iterdir())
    assert [t.read_bytes() for t in trusted] == [paths["CHKQ_SECURITY_CERTIFICATE"].read_bytes()]
    assert stat.S_IMODE(paths["CHKQ_SECURITY_KEY"].stat().st_mode) & 0o077 == 0
