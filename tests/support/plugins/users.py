"""Two real local users, a victim and an attacker, for tests of what one user can do to another.

Claims about trust between users are shown with the users real: the test process is root
(as a worker running under a service account is more privileged than the users it serves),
and the fixtures here create two ordinary accounts with ``useradd`` and run commands as each.

Each test process has accounts of its own (a pytest-xdist worker's names end with its id),
so that tests running side by side never see each other's processes under one uid. What
the machine shares (``/etc/passwd``, the modes of the interpreter's directories) is changed
under a file lock: :func:`machine_lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
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

from support.machine import SHARED_DIR, machine_lock

#: This test process's suffix: the pytest-xdist worker id (``gw0``), none when run alone.
SUFFIX = os.environ.get("PYTEST_XDIST_WORKER", "")
VICTIM = f"chkqvictim{SUFFIX}"
ATTACKER = f"chkqattacker{SUFFIX}"


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

    def chkq(self, *args: str, env: Mapping[str, str] | None = None
             ) -> subprocess.CompletedProcess[bytes]:
        """Run the ``chkq`` command line as this user, with a umask that keeps nothing private
        (what the command makes private, it makes so itself)."""
        return self.run(["sh", "-c", 'umask 000; exec "$@"', "sh", sys.executable, "-m",
                         "chkq.workers.cli", *args], env=env)

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
    with machine_lock("passwd.lock"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name],
                           check=True, capture_output=True)


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


@contextlib.contextmanager
def _traverse_granted(paths: list[Path]) -> Iterator[None]:
    """Other users may traverse ``paths``' ancestors while any test process of the machine needs it.

    Every test process holds ``grants.lock`` shared for as long as its users run; the
    original modes are kept in ``grants.json``. Whoever can take the lock exclusively on
    the way out (no one else holds it) puts them back.
    """
    state = SHARED_DIR / "grants.json"
    with machine_lock("grants.state"):
        saved = json.loads(state.read_text()) if state.exists() else {}
        for path, mode in _grant_traverse(paths).items():
            saved.setdefault(str(path), mode)
        state.write_text(json.dumps(saved))
        holder = os.open(SHARED_DIR / "grants.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
        fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        yield
    finally:
        with machine_lock("grants.state"):
            try:
                fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                saved = json.loads(state.read_text()) if state.exists() else {}
                for path, mode in saved.items():
                    with contextlib.suppress(OSError):
                        Path(path).chmod(mode)
                state.unlink(missing_ok=True)
            os.close(holder)


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
        pytest.fail("tests of trust between local users need root (they create two accounts "
                    "with useradd and run commands as each): run the suite as root, as CI does")
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

    try:
        with _traverse_granted([Path(os.path.realpath(sys.executable)).parent,
                                Path(sys.prefix), Path(chkq.__file__).resolve().parent]):
            _interpreter_reachable(victim)
            yield victim, attacker
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory both users can write to (a project's shared store space)."""
    path = Path(tempfile.mkdtemp(prefix="chkq-shared-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
