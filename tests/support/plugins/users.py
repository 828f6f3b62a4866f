"""Two real local users, a victim and an attacker, for tests of what one user can do to another.

Claims about trust between users are shown with the users real: the test process is root
(as a worker running under a service account is more privileged than the users it serves),
and the fixtures here create two ordinary accounts with ``useradd`` and run commands as each.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

VICTIM = "chkqvictim"
ATTACKER = "chkqattacker"


@dataclass(frozen=True)
class LocalUser:
    """An ordinary local account and a private directory of its own (mode 0700)."""

    name: str
    uid: int
    gid: int
    home: Path

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 120.0, cwd: Path | None = None,
            input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` as this user (no supplementary groups), capturing its output."""
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
                       "USER": self.name, "LANG": "C.UTF-8", **(env or {})}
        return subprocess.run(list(argv), env=environment, cwd=cwd or self.home, user=self.uid,
                              group=self.gid, extra_groups=[], capture_output=True,
                              timeout=timeout, input=input, check=False)

    def python(self, code: str, env: Mapping[str, str] | None = None,
               timeout: float = 120.0) -> subprocess.CompletedProcess[bytes]:
        """Run Python ``code`` as this user with the test interpreter (chkq importable)."""
        return self.run([sys.executable, "-c", code], env=env, timeout=timeout)

    def mkdir(self, name: str, mode: int = 0o700) -> Path:
        """A new directory ``name`` in this user's home, owned by the user."""
        path = self.home / name
        path.mkdir(mode=mode)
        os.chown(path, self.uid, self.gid)
        path.chmod(mode)
        return path

    def chown_tree(self, path: Path) -> None:
        """Give ``path`` and everything below it to this user (files the test wrote as root)."""
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                os.lchown(os.path.join(root, name), self.uid, self.gid)
        os.lchown(path, self.uid, self.gid)


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True,
                       capture_output=True)


def _grant_traverse(paths: list[Path]) -> dict[Path, int]:
    """Let other users traverse (not list) every ancestor of ``paths``; returns modes to restore.

    The test interpreter may live under a private home (pyenv in ``/root``): the users must
    be able to run it and import chkq, as they would an installation of their own.
    """
    changed: dict[Path, int] = {}
    for path in paths:
        for ancestor in [path, *path.parents]:
            if not ancestor.is_dir() or ancestor in changed:
                continue
            mode = ancestor.stat().st_mode & 0o7777
            if not mode & 0o001:
                changed[ancestor] = mode
                ancestor.chmod(mode | 0o001)
    return changed


def _interpreter_reachable(user: LocalUser) -> None:
    probe = user.python("import chkq")
    if probe.returncode != 0:
        pytest.fail(f"user {user.name} cannot run {sys.executable} with chkq importable "
                    f"(the checkout must be readable by other users): "
                    f"{probe.stderr.decode(errors='replace')[-500:]}")


@pytest.fixture(scope="session")
def local_users() -> Iterator[tuple[LocalUser, LocalUser]]:
    """(victim, attacker): two real accounts, each with a fresh private home for this session."""
    if os.geteuid() != 0:
        pytest.fail("tests of trust between local users need root (useradd, setuid)")
    base = Path(tempfile.mkdtemp(prefix="chkq-users-"))
    base.chmod(0o711)
    users = []
    for name in (VICTIM, ATTACKER):
        _ensure_user(name)
        entry = pwd.getpwnam(name)
        home = base / name
        home.mkdir(mode=0o700)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        users.append(LocalUser(name, entry.pw_uid, entry.pw_gid, home))
    victim, attacker = users
    import chkq

    restore = _grant_traverse([Path(os.path.realpath(sys.executable)).parent,
                               Path(sys.prefix), Path(chkq.__file__).resolve().parent])
    try:
        _interpreter_reachable(victim)
        yield victim, attacker
    finally:
        for path, mode in restore.items():
            path.chmod(mode)
        shutil.rmtree(base, ignore_errors=True)
