"""A store job's scratch directory: where it is by default, which roots allow it, how full.

Real workers of a cluster of each test's own; the small scratch is a real
64 MiB tmpfs (the tests run as root), and the sparse object a real 4 GiB
sparse file in a ``file://`` store.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chkq.config.settings import Settings
from chkq.demo import RunShape, make_run
from chkq.workers.client import submit_store_consolidation
from support.helpers import snapshot
from support.plugins.faults import Cluster
from support.plugins.users import LocalUser

TIMEOUT = 120


def _store_of(tmp_path: Path, checkpoints: int = 3) -> Path:
    """A ``file://`` store directory holding a small run of model ``sim``."""
    run = tmp_path / "run"
    make_run(run, "sim", RunShape(checkpoints=checkpoints, trials=300))
    store = tmp_path / "stores" / uuid.uuid4().hex[:8]
    store.mkdir(parents=True)
    for path in sorted(run.iterdir()):
        (store / path.name).write_bytes(path.read_bytes())
    return store


def test_a_scratch_directory_outside_the_allowed_roots_is_the_workers_own(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    store = _store_of(tmp_path)
    cluster = make_cluster()
    cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        "CHKQ_SCRATCH_DIR": str(tmp_path / "scratch"),
        "CHKQ_ALLOWED_ROOTS": str(tmp_path / "stores")})
    summary = submit_store_consolidation("sim", store.as_uri() + "/").wait_for_summary(
        timeout=TIMEOUT)
    assert summary.output == store.as_uri() + "/sim.h5"
    assert (store / "sim.h5").stat().st_size == summary.bytes


def test_the_default_scratch_directory_is_in_the_users_home(
        local_users: tuple[LocalUser, LocalUser], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a name in the shared /tmp that another user can take first: the victim's default
    scratch lies in its home, where the attacker can create nothing."""
    victim, attacker = local_users
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    found = victim.python("from chkq.config.settings import Settings; "
                          "print(Settings().scratch_root)")
    assert found.returncode == 0, found.stderr
    scratch = Path(found.stdout.decode().strip())
    assert scratch.is_relative_to(victim.home), scratch
    planted = attacker.python(f"import os; os.makedirs({str(scratch)!r})")
    assert planted.returncode != 0 and b"PermissionError" in planted.stderr
    made = victim.python("from chkq.config.settings import Settings; "
                         "from chkq.fsutil import private_directory; "
                         "print(private_directory(Settings().scratch_root))")
    assert made.returncode == 0, made.stderr
    assert oct(scratch.stat().st_mode & 0o777) == "0o700"
    assert scratch.stat().st_uid == victim.uid
    assert dataclasses.replace(Settings(), scratch_dir="/x/y").scratch_root == Path("/x/y")


@pytest.fixture
def small_scratch(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, mounted for the test."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_sparse_object_larger_than_the_scratch_is_refused_naming_it(
        make_cluster: Callable[..., Cluster], tmp_path: Path, small_scratch: Path) -> None:
    store = _store_of(tmp_path, checkpoints=2)
    sparse = store / "sim_chk00003.h5"
    with open(sparse, "wb") as fh:
        fh.truncate(4 << 30)
    assert os.stat(sparse).st_blocks == 0
    before = snapshot(store)
    cluster = make_cluster()
    cluster.add_workers(1, "control,copy,verify", concurrency=2, env={
        "CHKQ_SCRATCH_DIR": str(small_scratch / "scratch"),
        "CHKQ_ALLOWED_ROOTS": str(tmp_path / "stores")})
    job = submit_store_consolidation("sim", store.as_uri() + "/", cleanup=True)
    with pytest.raises(OSError) as failed:
        job.wait_for_output(timeout=TIMEOUT)
    message = str(failed.value)
    assert "sim_chk00003.h5" in message and "4,294,967,296 bytes" in message, message
    assert "scratch directory" in message and "No space left on device" not in message, message
    assert snapshot(store) == before
    assert not (store / "sim.h5").exists()
    assert os.statvfs(small_scratch).f_bfree == os.statvfs(small_scratch).f_blocks
