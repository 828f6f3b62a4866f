"""A store tenant plants log objects: signed logs refuse them, unsigned logs report the conflict.

The attack: a well-formed payload, record and name entry for a name the victim committed
(``V_chk00003.h5``), with ``created`` far in the future so that "latest entry wins" would
pick it. Mounted on every store kind (local directory, memory, S3 through moto's server,
GCS through fake-gcs-server), and on a shared local directory by a second real user.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.log import CheckpointLog, NameEntry
from chkq.log.signing import LogTrust, generate_key_pair
from chkq.log.transfer import restore_run
from chkq.stores import CheckpointStore, LocalDirectoryStore
from chkq.watcher import Watcher
from chkq.workers.cli import main as chkq_main
from chkq.workers.cli.watch import committed_names
from support.plugins.users import LocalUser

FAR_FUTURE = 4102444800.0  # 2100-01-01
REAL = b"the victim's real checkpoint 3" * 1000
PLANTED = b"the attacker's checkpoint" * 1000


def plant(store: CheckpointStore, run: str, name: str, data: bytes,
          created: float = FAR_FUTURE) -> str:
    """Write payload, record and name entry for ``name`` as an unsigned tenant would."""
    log = CheckpointLog(store, run, trust=LogTrust())
    ident = log.commit(data)
    entry = NameEntry(name=name, id=ident, model="V", writer="attacker", created=created)
    assert store.put_if_absent(log.keys.entry(entry.digest()), entry.to_json())
    return ident


@pytest.fixture
def keys(tmp_path: Path) -> tuple[LogTrust, LogTrust]:
    """(the victim's trust: signs and trusts its own key; another writer's key)."""
    made = []
    for name in ("mine", "other"):
        (tmp_path / name).mkdir()
        made.append(generate_key_pair(tmp_path / name)[0])
    return LogTrust.from_files(made[0], None), LogTrust.from_files(made[1], None)


def test_without_signing_a_planted_later_entry_is_a_conflict_not_a_winner(
        store: CheckpointStore, tmp_path: Path) -> None:
    log = CheckpointLog(store, "run", trust=LogTrust())
    real = log.commit(REAL, name="V_chk00003.h5", model="V")
    log.commit(b"checkpoint 2" * 100, name="V_chk00002.h5", model="V")
    planted = plant(store, "run", "V_chk00003.h5", PLANTED)

    reader = CheckpointLog(store, "run", trust=LogTrust())
    result = restore_run(reader, tmp_path / "out")
    assert not (tmp_path / "out" / "V_chk00003.h5").exists()
    assert (tmp_path / "out" / "V_chk00002.h5").read_bytes() == b"checkpoint 2" * 100
    [(name, why)] = result.failed
    assert name == "V_chk00003.h5"
    assert real[:12] in why and planted[:12] in why and "conflicting" in why

    report = CheckpointLog(store, "run", trust=LogTrust()).verify()
    assert not report.ok
    conflicts = [why for _, why in report.problems if why.startswith("conflict")]
    assert len(conflicts) == 2 and all("'V_chk00003.h5'" in why for why in conflicts)


def test_with_signing_planted_objects_are_refused_and_the_real_file_restored(
        store: CheckpointStore, tmp_path: Path, keys: tuple[LogTrust, LogTrust]) -> None:
    mine, other = keys
    log = CheckpointLog(store, "run", trust=mine)
    real = log.commit(REAL, name="V_chk00003.h5", model="V")
    plant(store, "run", "V_chk00003.h5", PLANTED)
    # A writer with a key of its own, which the victim does not trust.
    foreign = CheckpointLog(store, "run", trust=other)
    foreign.commit(PLANTED + b"x", name="V_chk00003.h5", model="V")

    reader = CheckpointLog(store, "run", trust=mine)
    result = restore_run(reader, tmp_path / "out")
    assert not result.failed
    assert (tmp_path / "out" / "V_chk00003.h5").read_bytes() == REAL
    assert [r.id for r in reader.manifest()] == [real]
    refusals = sorted(reader.malformed.values())
    assert any("not signed" in why for why in refusals)
    assert any("which is not trusted" in why for why in refusals)

    report = CheckpointLog(store, "run", trust=mine).verify(read_data=True)
    assert not report.ok
    assert {why.split(":")[0] for _, why in report.problems} == {
        "record refused", "name entry refused"}
    assert report.records == 1 and report.names == 1


def test_a_signed_entry_cannot_be_replayed_into_another_run_or_edited(
        store: CheckpointStore, tmp_path: Path, keys: tuple[LogTrust, LogTrust]) -> None:
    mine, _ = keys
    log = CheckpointLog(store, "run", trust=mine)
    real = log.commit(REAL, name="V_chk00003.h5", model="V")
    other_run = CheckpointLog(store, "other", trust=mine)
    other_run.commit(PLANTED, name="V_chk00004.h5", model="V")
    # Copy the other run's signed record, payload and entry into "run" under the right keys.
    for key in store.list("runs/other/"):
        store.put(key.replace("runs/other/", "runs/run/", 1), store.get(key))
    # Edit the real entry's created time (its signature no longer matches).
    [entry_key] = [k for k in store.list("runs/run/names/")
                   if json.loads(store.get(k))["id"] == real]
    edited = json.loads(store.get(entry_key))
    edited["created"] = FAR_FUTURE
    store.put(entry_key, (json.dumps(edited) + "\n").encode())

    reader = CheckpointLog(store, "run", trust=mine)
    assert reader.files() == {}
    assert all("bad signature" in why for why in reader.malformed.values())
    assert len(reader.malformed) == 3  # the replayed record and entry, the edited entry


def test_trusted_keys_directory_and_key_file_checks(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    private, public, ident = generate_key_pair(keys)
    assert private.stat().st_mode & 0o777 == 0o600
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "writer.pub").write_bytes(public.read_bytes())
    reader = LogTrust.from_files(None, trusted)
    assert reader.enforcing and list(reader.trusted) == [ident] and reader.signer is None
    private.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        LogTrust.from_files(private, None)
    with pytest.raises(FileExistsError, match="not overwritten"):
        generate_key_pair(keys)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        LogTrust.from_files(None, tmp_path / "empty")


def write_complete(path: Path, value: int) -> None:
    with h5py.File(path, "w") as f:
        f["x"] = np.full(10, value)
        f.attrs["trials_completed"] = 1


def test_a_planted_name_does_not_make_the_watcher_skip_the_real_checkpoint(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    write_complete(out / "V_chk00001.h5", 1)
    store = LocalDirectoryStore(tmp_path / "store")
    plant(store, "r1", "V_chk00001.h5", PLANTED)
    log = CheckpointLog(store, "r1", trust=LogTrust())
    committed = committed_names(log, "V")
    assert "V_chk00001.h5" in committed  # the planted entry is what the log says
    sent: list[str] = []
    watcher = Watcher(out, "V", committed, lambda request: sent.append(request.name))
    watcher.poll()
    watcher.poll()
    assert sent == ["V_chk00001.h5"]
    assert watcher.done["V_chk00001.h5"] == _sha256(out / "V_chk00001.h5")
    watcher.poll()
    assert sent == ["V_chk00001.h5"]  # once


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_keygen_command_makes_a_usable_pair(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert chkq_main(["log", "keygen", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.split() == [str(tmp_path / "chkq-log.key"), str(tmp_path / "chkq-log.pub")]
    trust = LogTrust.from_files(tmp_path / "chkq-log.key", tmp_path / "chkq-log.pub")
    assert len(trust.trusted) == 1 and "CHKQ_LOG_SIGNING_KEY" in out.err
    assert chkq_main(["log", "keygen", str(tmp_path)]) == 1
    assert "not overwritten" in capsys.readouterr().err


# two real users on a shared local store --------------------------------------------------

ATTACK = r"""
import sys
from chkq.log import CheckpointLog, NameEntry
from chkq.log.signing import LogTrust
from chkq.stores import LocalDirectoryStore
store = LocalDirectoryStore(sys.argv[1])
log = CheckpointLog(store, "run1", trust=LogTrust())
ident = log.commit(b"the attacker's checkpoint" * 1000)
entry = NameEntry(name="V_chk00003.h5", id=ident, model="V", writer="attacker",
                  created=4102444800.0)
assert store.put_if_absent(log.keys.entry(entry.digest()), entry.to_json())
print(ident)
"""


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_another_user_with_write_access_to_a_shared_store_cannot_choose_what_restore_writes(
        local_users: tuple[LocalUser, LocalUser], tmp_path: Path, shared: Path,
        signed: bool) -> None:
    victim, attacker = local_users
    store = f"file://{shared / 'store'}"
    env: dict[str, str] = {}
    if signed:
        keydir = victim.mkdir(f"keys-{shared.name}")
        made = victim.run([sys.executable, "-m", "chkq.workers.cli", "log", "keygen",
                           str(keydir)])
        assert made.returncode == 0, made.stderr
        env = {"CHKQ_LOG_SIGNING_KEY": str(keydir / "chkq-log.key")}
    run_dir = victim.mkdir(f"run-{shared.name}")
    files = {"V_chk00002.h5": b"two" * 500, "V_chk00003.h5": REAL}
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
        (run_dir / name).chmod(0o600)
    victim.chown_tree(run_dir)
    for name in files:
        done = victim.chkq("log", "commit", store, "run1", str(run_dir / name), env=env)
        assert done.returncode == 0, done.stderr

    attack = attacker.run(["sh", "-c", 'umask 000; exec "$@"', "sh", sys.executable, "-c",
                           ATTACK, str(shared / "store")])
    assert attack.returncode == 0, attack.stderr
    planted = attack.stdout.decode().strip()

    out = victim.home / f"restored-{shared.name}"
    restored = victim.run([sys.executable, "-m", "chkq.workers.cli", "log", "restore", store,
                           "run1", str(out)], env=env)
    verify = victim.run([sys.executable, "-m", "chkq.workers.cli", "log", "verify", store,
                         "run1"], env=env)
    assert verify.returncode == 1
    err = restored.stderr.decode()
    if signed:
        assert restored.returncode == 0, err
        assert (out / "V_chk00003.h5").read_bytes() == REAL
        assert (out / "V_chk00002.h5").read_bytes() == files["V_chk00002.h5"]
        assert "name entry refused: not signed" in err
        assert "record refused: not signed" in verify.stdout.decode()
    else:
        assert restored.returncode == 1
        assert not (out / "V_chk00003.h5").exists()
        assert (out / "V_chk00002.h5").read_bytes() == files["V_chk00002.h5"]
        assert "not restored: V_chk00003.h5: conflicting entries" in err
        assert planted[:12] in err
        assert "conflict: name 'V_chk00003.h5'" in verify.stdout.decode()


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_objects_planted_at_the_keys_a_commit_will_use_do_not_lose_it(
        store: CheckpointStore, keys: tuple[LogTrust, LogTrust], signed: bool) -> None:
    """A tenant who knows the bytes to come pre-plants garbage at their payload key, a
    record that names nothing valid at their record key, and junk at the entry's key."""
    trust = keys[0] if signed else LogTrust()
    log = CheckpointLog(store, "run", trust=trust)
    first = log.commit(b"first checkpoint" * 1000, name="V_chk00001.h5", model="V")
    coming = b"second checkpoint" * 1000
    ident = hashlib.sha256(coming).hexdigest()
    store.put(log.keys.payload(ident, "full", None), b"garbage")
    for kind, base in (("delta", first), ("full", None)):
        store.put(log.keys.payload(ident, kind, base), b"garbage")
    planted = NameEntry(name="V_chk00002.h5", id=ident, model="V", writer="x")
    store.put(log.keys.record(ident), b'{"format": 2, "id": "' + ident.encode() + b'"}')
    store.put(log.keys.entry(planted.digest()), b"junk")
    junk = log.keys.numbered_entry("V_chk00002.h5", 1)
    store.put(junk, b"junk")  # where the name's first numbered entry would go

    assert CheckpointLog(store, "run", trust=trust).commit(
        coming, first, name="V_chk00002.h5", model="V") == ident
    reader = CheckpointLog(store, "run", trust=trust)
    assert reader.load(ident) == coming
    assert reader.files()["V_chk00002.h5"].id == ident
    assert reader.files()["V_chk00002.h5"].seq == 2  # the junk is skipped, never replaced
    report = CheckpointLog(store, "run", trust=trust).verify(read_data=True)
    assert sorted(key for key, _ in report.problems) == sorted(
        [junk, log.keys.entry(planted.digest())])
    assert all("not JSON" in why for _, why in report.problems) and report.decoded == 2


def test_a_reader_without_a_signing_key_refuses_to_commit_what_it_would_refuse(
        store: CheckpointStore, tmp_path: Path) -> None:
    _, public, _ = generate_key_pair(tmp_path)
    reader = CheckpointLog(store, "run", trust=LogTrust.from_files(None, public))
    with pytest.raises(ValueError, match="no signing key"):
        reader.commit(b"bytes", name="x.h5")
    assert store.list("") == []
