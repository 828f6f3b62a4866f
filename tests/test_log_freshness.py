"""A store tenant without the signing key rolls a signed name back, or brings a deleted one back.

The tenant can delete and re-put any object but sign none.  Two attacks: deleting a name's
newest signed entry (so the superseded one looks current), and planting again, after the
owner deleted a name, the signed entries saved before.  Mounted on a shared local directory
by a second real user through the command line, and on S3 through moto's server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chkq.log import CheckpointLog
from chkq.log.seen import SeenNames
from chkq.log.signing import LogTrust, generate_key_pair
from chkq.log.transfer import restore_run
from chkq.staging import delete_sources, find_store_run
from chkq.stores import CheckpointStore, open_store
from support.plugins.object_stores import make_store
from support.plugins.users import LocalUser

OLD = b"version one of checkpoint 3" * 1000
NEW = b"version two of checkpoint 3" * 1000
OTHER = b"checkpoint 2" * 1000

DELETE_NEWEST = r"""
import json, os, sys
names = os.path.join(sys.argv[1], "runs", "run1", "names")
for entry in os.listdir(names):
    if json.load(open(os.path.join(names, entry)))["id"] == sys.argv[2]:
        os.unlink(os.path.join(names, entry))
        print(entry)
"""


def test_another_user_deleting_the_newest_signed_entry_does_not_roll_the_name_back(
        local_users: tuple[LocalUser, LocalUser], shared: Path) -> None:
    victim, attacker = local_users
    store = f"file://{shared / 'store'}"
    keydir = victim.mkdir(f"keys-{shared.name}")
    made = victim.run([sys.executable, "-m", "chkq.workers.cli", "log", "keygen", str(keydir)])
    assert made.returncode == 0, made.stderr
    env = {"CHKQ_LOG_SIGNING_KEY": str(keydir / "chkq-log.key")}
    run_dir = victim.mkdir(f"run-{shared.name}")
    checkpoint = run_dir / "V_chk00003.h5"
    for data in (OLD, NEW):
        checkpoint.write_bytes(data)
        victim.chown_tree(run_dir)
        done = victim.chkq("log", "commit", store, "run1", str(checkpoint), env=env)
        assert done.returncode == 0, done.stderr
    new_id = done.stdout.decode().strip()
    checked = victim.chkq("log", "verify", store, "run1", env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    attack = attacker.run([sys.executable, "-c", DELETE_NEWEST, str(shared / "store"), new_id])
    assert attack.returncode == 0 and attack.stdout.strip(), attack.stderr

    out = victim.home / f"restored-{shared.name}"
    restored = victim.chkq("log", "restore", store, "run1", str(out), env=env)
    err = restored.stderr.decode()
    assert restored.returncode == 1, err
    assert not (out / "V_chk00003.h5").exists()
    assert "not restored: V_chk00003.h5" in err and "newer entries were removed" in err
    verify = victim.chkq("log", "verify", store, "run1", env=env)
    assert verify.returncode == 1
    assert "rolled back" in verify.stdout.decode() and "'V_chk00003.h5'" in verify.stdout.decode()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.integration)])
def tenant_store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    return make_store(str(request.param), request, tmp_path)


@pytest.fixture
def signing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LogTrust:
    """The owner's key, in the environment as a store job's worker has it."""
    (tmp_path / "keys").mkdir()
    private = generate_key_pair(tmp_path / "keys")[0]
    monkeypatch.setenv("CHKQ_LOG_SIGNING_KEY", str(private))
    return LogTrust.from_files(private, None)


def _names(store: CheckpointStore) -> dict[str, bytes]:
    return {key: store.get(key) for key in store.list("runs/run1/names/")}


def test_a_name_deleted_by_cleanup_stays_deleted_when_saved_entries_are_planted_again(
        tenant_store: CheckpointStore, signing: LogTrust, tmp_path: Path) -> None:
    log = CheckpointLog(tenant_store, "run1", trust=signing)
    log.commit(OLD, name="V_chk00003.h5", model="V")
    log.commit(OTHER, name="W_chk00002.h5", model="W")
    saved = _names(tenant_store)  # what the tenant copies while the name is live

    run = find_store_run(tenant_store.url, "V", run="run1")
    assert delete_sources(run) == []
    reader = CheckpointLog(tenant_store, "run1", trust=signing,
                           seen=SeenNames(tmp_path / "seen.json"))
    assert set(reader.files()) == {"W_chk00002.h5"}

    for key, raw in saved.items():  # the tenant plants every saved signed entry again
        tenant_store.put(key, raw)
    again = CheckpointLog(tenant_store, "run1", trust=signing,
                          seen=SeenNames(tmp_path / "seen.json"))
    result = restore_run(again, tmp_path / "out")
    assert not (tmp_path / "out" / "V_chk00003.h5").exists()
    assert (tmp_path / "out" / "W_chk00002.h5").read_bytes() == OTHER
    assert result.failed == []
    assert again.verify().ok

    # The tenant also removes the deletion: a reader that saw it refuses the name.
    for key in set(_names(tenant_store)) - set(saved):
        tenant_store.delete(key)
    back = CheckpointLog(tenant_store, "run1", trust=signing,
                         seen=SeenNames(tmp_path / "seen.json"))
    result = restore_run(back, tmp_path / "out2")
    assert not (tmp_path / "out2" / "V_chk00003.h5").exists()
    [(name, why)] = result.failed
    assert name == "V_chk00003.h5" and "was deleted" in why
    problems = [why for _, why in back.verify().problems]
    assert any("rolled back" in why and "'V_chk00003.h5'" in why for why in problems)


@pytest.mark.integration
def test_deleting_the_newest_signed_entry_from_s3_is_noticed(
        request: pytest.FixtureRequest, tmp_path: Path, signing: LogTrust) -> None:
    store = make_store("s3", request, tmp_path)
    seen = SeenNames(tmp_path / "seen.json")
    log = CheckpointLog(store, "run1", trust=signing, seen=seen)
    log.commit(OLD, name="V_chk00003.h5", model="V")
    new = log.commit(NEW, name="V_chk00003.h5", model="V")
    assert log.files()["V_chk00003.h5"].id == new  # the owner looked: this reader saw it

    tenant = open_store(store.url)  # another client of the bucket, without the key
    [newest] = [k for k in store.list("runs/run1/names/") if json.loads(store.get(k))["id"] == new]
    tenant.delete(newest)

    reader = CheckpointLog(store, "run1", trust=signing, seen=seen)
    result = restore_run(reader, tmp_path / "out")
    assert not (tmp_path / "out" / "V_chk00003.h5").exists()
    [(name, why)] = result.failed
    assert name == "V_chk00003.h5" and new[:12] in why
    assert not reader.verify().ok
    # A reader that never saw the newer entry has nothing to compare with (see the README).
    fresh = CheckpointLog(store, "run1", trust=signing)
    assert fresh.files()["V_chk00003.h5"].id != new
