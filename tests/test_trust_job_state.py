"""Job state in Redis proves who wrote it: a party with the Redis password but no signing key.

The unit tests drive the one verifying reader of :mod:`chkq.jobs.sealed`
against fakeredis. The attack tests run a real redis-server with a password,
real signed ``chkq worker`` processes with ``CHKQ_ALLOWED_ROOTS`` set, the
victim's ``chkq consolidate --cleanup`` as the victim user, and the attacker
as the attacker user: it has the Redis password but not the signing key,
watches ``chkq:jobs`` and pre-writes the job's records before any worker
plans the job. The failure-path tests plant a directory and a link named like
a job's temporaries and touch a checkpoint mid-job.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from chkq.config.celery_app import get_app
from chkq.config.routing import COPY_QUEUE
from chkq.config.settings import Settings
from chkq.consolidation.discovery import Checkpoint
from chkq.consolidation.plan import Plan
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.demo import RunShape, make_run
from chkq.errors import CheckpointChangedError, ForgedRecordError
from chkq.jobs import records as job_records
from chkq.jobs.paths import check_recorded_checkpoints, check_recorded_path
from chkq.jobs.records import JobRecords
from chkq.lru import LRU
from chkq.tasks import state
from chkq.tasks.consolidate import consolidation_signature
from chkq.workers.broker import free_port
from chkq.workers.client import ConsolidationJob
from support.helpers import snapshot
from support.plugins.cluster import WorkerProcess, consumers_paused
from support.plugins.signing import SignedWorker
from support.plugins.users import LocalUser

TIMEOUT = 120
RUN, MODEL = "run", "run"


# ------------------------------------------------------------ keys


def _self_signed(directory: Path, name: str) -> dict[str, str]:
    """A signing key, its certificate and a store trusting it; the CHKQ_SECURITY_* variables."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    store = directory / "trusted"
    store.mkdir(parents=True)
    key_file, cert_file = directory / "chkq.key", directory / "chkq.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (store / "chkq.pem").write_bytes(cert_file.read_bytes())
    return {"CHKQ_SECURITY_KEY": str(key_file), "CHKQ_SECURITY_CERTIFICATE": str(cert_file),
            "CHKQ_SECURITY_CERT_STORE": str(store)}


# ------------------------------------------------------------ the verifier (fakeredis)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    server = fakeredis.FakeRedis()
    monkeypatch.setattr(state, "records", lambda: JobRecords(
        server, state.record_secret(), None, state.get_settings().allowed_roots))
    monkeypatch.setattr(job_records, "_PLANS", LRU(job_records.PLAN_CACHE))
    return server


def _use(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> Settings:
    settings = dataclasses.replace(Settings(), **changes)
    monkeypatch.setattr(state, "get_settings", lambda: settings)
    state._RECORD_KEYS.clear()
    return settings


@pytest.fixture
def signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = _self_signed(tmp_path / "keys", "chkq")
    _use(monkeypatch, security_key=env["CHKQ_SECURITY_KEY"],
         security_certificate=env["CHKQ_SECURITY_CERTIFICATE"],
         security_cert_store=env["CHKQ_SECURITY_CERT_STORE"])
    return env


JOB_A, JOB_B = "a" * 32, "b" * 32


def test_sealed_records_read_back(fake: fakeredis.FakeRedis, signed: dict[str, str]) -> None:
    state.records().record_copied(JOB_A, 0, {"d": [[0, 5, "x"]]})
    state.records().record_finished(JOB_A, {"output": "/r/run.h5", "rows": 5})
    state.records().record_submitted(JOB_A, MODEL, "/r")
    assert state.records().copied(JOB_A) == {0: {"d": [[0, 5, "x"]]}}
    assert state.records().finished_result(JOB_A) == {"output": "/r/run.h5", "rows": 5}
    assert state.records().job_info(JOB_A)["out_dir"] == "/r"  # type: ignore[index]
    assert state.records().authenticated


@pytest.mark.parametrize("forged", [
    json.dumps({"output": "/r/run.h5", "rows": 1}).encode(),             # the format of old
    b"chkq1 " + b"0" * 64 + b" " + json.dumps({"output": "/r/run.h5"}).encode(),
    b"chkq1 - " + json.dumps({"output": "/r/run.h5"}).encode(),          # unsealed
])
def test_a_done_marker_written_without_the_key_is_refused(
        fake: fakeredis.FakeRedis, signed: dict[str, str], forged: bytes) -> None:
    fake.set(f"chkq:job:{JOB_A}:done", forged)
    with pytest.raises(ForgedRecordError, match=f"chkq:job:{JOB_A}:done"):
        state.records().finished_result(JOB_A)


def test_a_record_sealed_with_another_key_is_refused(
        fake: fakeredis.FakeRedis, signed: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    other = _self_signed(tmp_path / "other", "other")
    ours = state.get_settings()
    _use(monkeypatch, security_key=other["CHKQ_SECURITY_KEY"],
         security_certificate=other["CHKQ_SECURITY_CERTIFICATE"],
         security_cert_store=other["CHKQ_SECURITY_CERT_STORE"])
    state.records().record_finished(JOB_A, {"output": "/r/run.h5"})
    monkeypatch.setattr(state, "get_settings", lambda: ours)
    state._RECORD_KEYS.clear()
    with pytest.raises(ForgedRecordError, match="signing key"):
        state.records().finished_result(JOB_A)


def test_records_cannot_move_to_another_job_kind_or_unit(
        fake: fakeredis.FakeRedis, signed: dict[str, str]) -> None:
    """The seal binds the Redis key (job id and record kind) and the unit."""
    state.records().record_finished(JOB_A, {"output": "/r/run.h5"})
    state.records().record_copied(JOB_A, 0, {"d": []})
    state.records().record_verified(JOB_A, 1, [1, 2, 3, 4, 5, 6])
    fake.set(f"chkq:job:{JOB_B}:done", fake.get(f"chkq:job:{JOB_A}:done"))
    with pytest.raises(ForgedRecordError, match=f"chkq:job:{JOB_B}:done"):
        state.records().finished_result(JOB_B)
    fake.set(f"chkq:job:{JOB_A}:failed", fake.get(f"chkq:job:{JOB_A}:done"))
    with pytest.raises(ForgedRecordError, match="failed"):
        state.records().failure(JOB_A)
    fake.hset(f"chkq:job:{JOB_A}:copied", "1", fake.hget(f"chkq:job:{JOB_A}:copied", "0"))
    with pytest.raises(ForgedRecordError, match=r"copied\[1\]"):
        state.records().copied(JOB_A)
    fake.hset(f"chkq:job:{JOB_B}:verified", "1", fake.hget(f"chkq:job:{JOB_A}:verified", "1"))
    with pytest.raises(ForgedRecordError, match=r"verified\[1\]"):
        state.records().verified(JOB_B)


def test_a_forged_failure_record_is_replaced_by_the_real_failure(
        fake: fakeredis.FakeRedis, signed: dict[str, str]) -> None:
    fake.set(f"chkq:job:{JOB_A}:failed", b'{"type": "X", "step": "y", "message": "z"}')
    state.records().record_failed(JOB_A, f"{JOB_A}-copy-0", CheckpointChangedError("touched"))
    assert state.records().failure(JOB_A)["type"] == "CheckpointChangedError"  # type: ignore[index]


def test_without_signing_anyone_with_redis_access_writes_job_state(
        fake: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Said plainly in the threat model: unsigned, the seal is empty and is not checked."""
    _use(monkeypatch)
    fake.set(f"chkq:job:{JOB_A}:done", b'chkq1 - {"output": "/r/run.h5"}')
    assert state.records().finished_result(JOB_A) == {"output": "/r/run.h5"}
    assert not state.records().authenticated


@pytest.mark.parametrize("path", [
    "{run}/../../private/V_chk00004.h5",
    "{run}/../run_chk00001.h5",
    "/etc/passwd",
    "{run}/notes.h5",
    "{run}/other_chk00001.h5",
    "{run}/run_chk00001/.hidden.h5",
    "{run}/run_chk00001/deeper/x.h5",
    "{run}//run_chk00001.h5",
    "{run}/./run_chk00001.h5",
    "{run}/run_chk00001.h5/",
    "run_chk00001.h5",
])
def test_paths_from_records_must_be_checkpoints_of_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    _use(monkeypatch, allowed_roots=(str(tmp_path),))
    run = str(tmp_path / RUN)
    with pytest.raises(ValueError, match="not a checkpoint file of model 'run'"):
        check_recorded_path(path.format(run=run), run, MODEL, "the run record")


def test_checkpoint_paths_from_records_that_pass(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, allowed_roots=(str(tmp_path),))
    run = str(tmp_path / RUN)
    for good in (f"{run}/run_chk00001.h5", f"{run}/run_chk00002/w0.h5"):
        assert str(check_recorded_path(good, run, MODEL, "r")) == good
    _use(monkeypatch, allowed_roots=(str(tmp_path / "elsewhere"),))
    checkpoint = Checkpoint(1, Path(run) / "run_chk00001.h5", (Path(run) / "run_chk00001.h5",))
    with pytest.raises(PermissionError, match="CHKQ_ALLOWED_ROOTS"):
        check_recorded_checkpoints([checkpoint], run, MODEL, "r",
                                   state.get_settings().allowed_roots)


@pytest.mark.parametrize("entry", [
    [1, "{run}/run_chk00002.h5", ["{run}/run_chk00002.h5"]],        # number not its name's
    [1, "{run}/run_chk00001", ["{run}/run_chk00002/w.h5"]],          # file of another one
    [1, "{run}/run_chk00001.h5", ["{run}/run_chk00001/w.h5"]],       # file in a file
    [1, "{run}/run_chk00001", []],                                   # no files
])
def test_checkpoints_from_records_must_be_the_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: list[Any]) -> None:
    _use(monkeypatch, allowed_roots=(str(tmp_path),))
    run = str(tmp_path / RUN)
    number, where, files = entry
    checkpoint = Checkpoint(number, Path(where.format(run=run)),
                            tuple(Path(f.format(run=run)) for f in files))
    with pytest.raises(ValueError, match="not a checkpoint of model 'run'"):
        check_recorded_checkpoints([checkpoint], run, MODEL, "the run record",
                                   state.get_settings().allowed_roots)


def _plan(job: str, run: str, files: list[str], checkpoints: list[Any]) -> Plan:
    return Plan(job, MODEL, run, True, 1 << 20, checkpoints,
                [[f, 1, 1, 1, 1, 1] for f in files], files[0], [], [], [])


def test_a_plan_written_without_the_key_is_refused(
        fake: fakeredis.FakeRedis, signed: dict[str, str], tmp_path: Path) -> None:
    run = str(tmp_path)
    good = f"{run}/run_chk00001.h5"
    forged = _plan(JOB_A, run, [good], [[1, good, False]])
    fake.set(f"chkq:job:{JOB_A}:plan", b"chkq1 - " + forged.to_json().encode())
    with pytest.raises(ForgedRecordError, match=f"chkq:job:{JOB_A}:plan"):
        state.records().load_plan(JOB_A, run, MODEL)


@pytest.mark.parametrize("bad", ["files", "checkpoints", "job", "out_dir"])
def test_a_sealed_plan_naming_other_files_is_refused(
        fake: fakeredis.FakeRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        bad: str) -> None:
    """Without signing anyone may write a plan: its paths are still checked when read."""
    _use(monkeypatch, allowed_roots=(str(tmp_path),))
    run = str(tmp_path / RUN)
    os.makedirs(run)
    good, escape = f"{run}/run_chk00001.h5", f"{run}/../victim_chk00001.h5"
    plan = _plan(JOB_A, run, [escape] if bad == "files" else [good],
                 [[1, "/etc", False] if bad == "checkpoints" else [1, good, False]])
    if bad == "job":
        plan.job_id = JOB_B
    if bad == "out_dir":
        plan.out_dir = f"{run}/../{RUN}"
    fake.set(f"chkq:job:{JOB_A}:plan", b"chkq1 - " + plan.to_json().encode())
    with pytest.raises(ValueError, match="refused"):
        state.records().recorded_plan(JOB_A)


def test_discard_leaves_planted_directories_and_links(tmp_path: Path) -> None:
    job = JobFiles(tmp_path, MODEL, JOB_A)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    job.temp.write_bytes(b"x" * 1000)
    blocker = tmp_path / f"{job.prefix}.blocker"
    blocker.mkdir()
    (blocker / "inside").write_text("planted")
    link = tmp_path / f"{job.prefix}.part00000.h5"
    link.symlink_to(victim)
    assert discard_job_files(job) == [job.temp]
    assert not job.temp.exists()
    assert (blocker / "inside").read_text() == "planted"
    assert link.is_symlink() and victim.read_text() == "keep me"


# ------------------------------------------------------------ a Redis with a password


class PasswordRedis:
    """A redis-server of this module's own, on a free port, with ``requirepass``."""

    def __init__(self, directory: Path) -> None:
        self.password = uuid.uuid4().hex
        self.port = free_port()
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--requirepass", self.password, "--save", "", "--appendonly", "no",
             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    server = PasswordRedis(tmp_path_factory.mktemp("password-redis"))
    yield server
    server.stop()


@pytest.mark.cluster
def test_the_server_refuses_clients_without_the_password(password_redis: PasswordRedis) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=password_redis.port).set("x", "y")


# ------------------------------------------------------------ the attack, for real

#: The attacker: Redis password, no signing key. It watches ``chkq:jobs``, reads the job's
#: submission (readable, though sealed), and pre-writes forged records under the job's keys.
ATTACKER = r'''
import json, os, sys, time
import redis

client = redis.Redis.from_url(os.environ["ATTACK_REDIS"])
seen = set(j.decode() for j in client.lrange("chkq:jobs", 0, -1))
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    fresh = [j.decode() for j in client.lrange("chkq:jobs", 0, -1) if j.decode() not in seen]
    if fresh:
        break
    time.sleep(0.02)
else:
    sys.exit("no job appeared")
job = fresh[0]
info = json.loads(client.get(f"chkq:job:{job}:info").split(b" ", 2)[2])
run, model = info["out_dir"], info["model"]
private = os.environ["ATTACK_PRIVATE"]
# The record format is public: the attacker writes it with the seal of an unsigned deployment.
code = b"chkq1 - "
files = [[1, f"{run}/{model}_chk00001.h5", [f"{run}/{model}_chk00001.h5"]],
         [4, f"{run}/../../private/{os.path.basename(private)}",
          [f"{run}/../../private/{os.path.basename(private)}"]],
         [9, f"{run}/notes.h5", [f"{run}/notes.h5"]]]
mode = os.environ["ATTACK_MODE"]
if mode == "omit":
    first = f"{run}/{model}_chk00001"
    client.set(f"chkq:job:{job}:run", code + json.dumps(
        {"out_dir": run, "model": model,
         "checkpoints": [[1, first, [f"{first}/thread_0000.h5"]]]}).encode())
if mode == "records":
    client.set(f"chkq:job:{job}:run", code + json.dumps(
        {"out_dir": run, "model": model, "checkpoints": files}).encode())
if mode == "scans":
    def one(n):
        return [f"{run}/{model}_chk{n:05d}.h5", 0, [1], [1, 1, 1, 1, 1], [None], ""]
    for unit, numbers in enumerate((range(1, 257), range(257, 261))):
        client.hset(f"chkq:job:{job}:scanned", str(unit), code + json.dumps(
            {"skeletons": [{"trials": "extensible float64"}],
             "files": [one(n) for n in numbers]}).encode())
if mode == "done":
    genuine = os.environ.get("ATTACK_GENUINE_DONE")
    value = client.get(genuine) if genuine else None
    client.set(f"chkq:job:{job}:done", value or code + json.dumps(
        {"output": f"{run}/{model}.h5", "rows": 1, "files": 1,
         "warnings": ["checkpoints deleted"]}).encode())
    client.set(f"celery-task-meta-{job}", json.dumps(
        {"status": "SUCCESS", "result": {"output": f"{run}/{model}.h5", "rows": 1},
         "traceback": None, "children": [], "date_done": "2026-01-01T00:00:00",
         "task_id": job}))
print(job, flush=True)
'''


@dataclasses.dataclass
class Deployment:
    """Signed workers and clients on the password Redis, a victim's run and private file."""

    redis: PasswordRedis
    env: dict[str, str]
    victim: LocalUser
    attacker: LocalUser
    run: Path
    private: Path
    marker: bytes
    logs: Path
    started: list[WorkerProcess] = dataclasses.field(default_factory=list)

    def start_workers(self) -> WorkerProcess:
        """A worker serving every queue (signed unless the deployment's ``env`` is empty)."""
        worker = SignedWorker(self.redis.url, self.logs,
                              {**self.env, "CHKQ_ALLOWED_ROOTS": str(self.run.parent)})
        self.started.append(worker)
        return worker

    def client_env(self) -> dict[str, str]:
        return {**self.env, "CHKQ_BROKER_URL": self.redis.url,
                "CHKQ_RESULT_BACKEND": self.redis.url}

    def consolidate(self, run: Path, *extra: str) -> subprocess.Popen[bytes]:
        """The victim's ``chkq consolidate``, started (it waits for the job's end)."""
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                       "HOME": str(self.victim.home), "LANG": "C.UTF-8", **self.client_env()}
        return subprocess.Popen(
            [sys.executable, "-m", "chkq.workers.cli", "consolidate", MODEL, "--out-dir",
             str(run), "--timeout", "100", *extra], env=environment, cwd=self.victim.home,
            user=self.victim.uid, group=self.victim.gid, extra_groups=[],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def attack(self, mode: str, genuine_done: str = "") -> subprocess.Popen[bytes]:
        """The attacker, started: the Redis URL with its password, no key, its own account."""
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                       "HOME": str(self.attacker.home), "ATTACK_REDIS": self.redis.url,
                       "ATTACK_PRIVATE": str(self.private), "ATTACK_MODE": mode,
                       "ATTACK_GENUINE_DONE": genuine_done}
        return subprocess.Popen([sys.executable, "-c", ATTACKER], env=environment,
                                cwd=self.attacker.home, user=self.attacker.uid,
                                group=self.attacker.gid, extra_groups=[],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def deployment(password_redis: PasswordRedis, local_users: tuple[LocalUser, LocalUser],
               tmp_path: Path) -> Iterator[Deployment]:
    victim, attacker = local_users
    name = uuid.uuid4().hex[:8]
    home = victim.mkdir(f"d-{name}")
    keys = home / "keys"
    keys.mkdir()
    env = _self_signed(keys, "chkq")
    runs, private_dir = home / "runs", home / "private"
    runs.mkdir()
    private_dir.mkdir()
    run = runs / RUN
    make_run(run, MODEL, RunShape(checkpoints=3, writers=2, trials=40))
    (run / "notes.h5").write_bytes(b"unrelated file of the victim")
    (run / "README").write_text("unrelated")
    marker = hashlib.sha256(name.encode()).hexdigest().encode()
    private = private_dir / "V_chk00004.h5"
    make_run(private_dir, "V", RunShape(checkpoints=4, trials=10))
    with open(private, "ab") as fh:
        fh.write(marker)
    private.chmod(0o600)
    victim.chown_tree(home)
    home.chmod(0o711)
    runs.chmod(0o755)
    run.chmod(0o755)
    password_redis.client().flushdb()
    deployment = Deployment(password_redis, env, victim, attacker, run, private, marker,
                            tmp_path)
    yield deployment
    for worker in deployment.started:
        worker.stop()


def _finish(process: subprocess.Popen[bytes], timeout: float = TIMEOUT) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out.decode(errors="replace") + err.decode(errors="replace")


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and needle in p.read_bytes()]


def test_a_job_with_signed_records_succeeds(deployment: Deployment) -> None:
    """The baseline: password Redis, signing, roots, no attacker — the job ends correctly."""
    deployment.start_workers()
    code, output = _finish(deployment.consolidate(deployment.run))
    assert code == 0, output
    assert (deployment.run / "run.h5").exists()


def test_a_forged_run_list_is_refused(deployment: Deployment) -> None:
    """The issue's attack: a run list with a ``..`` entry to the victim's 0600 file outside
    the roots and an unrelated file of the run; the job runs with ``--cleanup``."""
    before, private_before = snapshot(deployment.run), deployment.private.read_bytes()
    attacker = deployment.attack("records")
    client = deployment.consolidate(deployment.run, "--cleanup")
    job_line = _finish(attacker, 100)
    assert job_line[0] == 0, job_line[1]
    job = job_line[1].split()[0]
    deployment.start_workers()
    code, output = _finish(client)
    assert code == 1, output
    _no_success(deployment.run, output)
    assert f"error: job record chkq:job:{job}:run " in output, output
    assert "refused as not the job's own" in output
    failed = _wait_failed(deployment, job)
    assert failed["type"] == "ForgedRecordError", failed
    assert f"chkq:job:{job}:" in failed["message"] and "signing key" in failed["message"]
    assert snapshot(deployment.run) == before
    assert deployment.private.read_bytes() == private_before
    assert not (deployment.run / "run.h5").exists()
    assert _files_holding(deployment.run.parent, deployment.marker) == []
    assert _files_holding(deployment.attacker.home, deployment.marker) == []


def test_forged_scans_of_a_large_run_are_refused(deployment: Deployment) -> None:
    """A run of 260 files is scanned by scan units; the attacker pre-writes their records
    (one row a file, made-up stamps) before any unit runs."""
    large = deployment.run.parent / "large"
    make_run(large, MODEL, RunShape(checkpoints=260, trials=3))
    deployment.victim.chown_tree(large)
    large.chmod(0o755)
    before = snapshot(large)
    attacker = deployment.attack("scans")
    client = deployment.consolidate(large, "--cleanup")
    job = _finish(attacker, 100)[1].split()[0]
    deployment.start_workers()
    code, output = _finish(client)
    assert code == 1, output
    _no_success(large, output)
    assert f"error: job record chkq:job:{job}:scanned[" in output, output
    assert _wait_failed(deployment, job)["type"] == "ForgedRecordError"
    assert snapshot(large) == before
    assert not (large / "run.h5").exists()


def test_a_done_marker_moved_from_another_job_is_no_success(deployment: Deployment) -> None:
    """A genuine, sealed done marker of an earlier job, copied to this job's key, plus a
    forged SUCCESS under the job id: the client reports no success, nothing is deleted."""
    other = deployment.run.parent / "other"
    make_run(other, MODEL, RunShape(checkpoints=1, trials=10))
    deployment.victim.chown_tree(other)
    first = deployment.start_workers()
    code, output = _finish(deployment.consolidate(other))
    assert code == 0, output
    first.stop()
    genuine = next(k.decode() for k in deployment.redis.client().keys("chkq:job:*:done"))
    before = snapshot(deployment.run)
    attacker = deployment.attack("done", genuine_done=genuine)
    client = deployment.consolidate(deployment.run, "--cleanup")
    job = _finish(attacker, 100)[1].split()[0]
    code, output = _finish(client)
    deployment.start_workers()
    assert code == 1, output
    _no_success(deployment.run, output)
    assert f"chkq:job:{job}:done" in output and "refused" in output, output
    failed = _wait_failed(deployment, job)
    assert failed["type"] == "ForgedRecordError", failed
    assert f"chkq:job:{job}:done" in failed["message"]
    _wait(lambda: deployment.redis.client().get(f"chkq:job:{job}:done") is None,
          "removal of the planted done marker")
    assert snapshot(deployment.run) == before
    assert not (deployment.run / "run.h5").exists()


def test_without_signing_paths_from_records_stay_in_the_run(deployment: Deployment) -> None:
    """No signing: the attacker's records pass the (empty) seal, but every path read from
    them is checked where it is used, so no file outside the run is read or deleted."""
    deployment.env = {}
    before, private_before = snapshot(deployment.run), deployment.private.read_bytes()
    attacker = deployment.attack("records")
    client = deployment.consolidate(deployment.run, "--cleanup")
    job = _finish(attacker, 100)[1].split()[0]
    deployment.start_workers()
    code, output = _finish(client)
    assert code == 1, output
    _no_success(deployment.run, output)
    assert "../../private/V_chk00004.h5" in output and "not a checkpoint file of model" in output
    assert _wait_failed(deployment, job)["type"] == "BadMessageError"
    assert snapshot(deployment.run) == before
    assert deployment.private.read_bytes() == private_before
    assert _files_holding(deployment.run.parent, deployment.marker) == []


def test_without_signing_a_run_list_that_omits_checkpoints_is_refused(
        deployment: Deployment) -> None:
    """No signing: a well-formed run list naming one file of the run (forged to make a 1-row
    output whose cleanup deleted every checkpoint) is refused once compared with the run."""
    deployment.env = {}
    before = snapshot(deployment.run)
    attacker = deployment.attack("omit")
    client = deployment.consolidate(deployment.run, "--cleanup")
    job = _finish(attacker, 100)[1].split()[0]
    deployment.start_workers()
    code, output = _finish(client)
    assert code == 1, output
    _no_success(deployment.run, output)
    assert f"the checkpoints recorded for job {job} are not the run's" in output, output
    assert snapshot(deployment.run) == before


def _no_success(run: Path, output: str) -> None:
    """No success line, no output path printed, no cleanup warning (the no-worker notice
    aside: no worker ran while the attacker wrote)."""
    assert str(run / "run.h5") not in output and "wrote " not in output, output
    assert [line for line in output.splitlines() if line.startswith("warning:")
            and "no worker serves" not in line] == [], output


def _wait_failed(deployment: Deployment, job: str) -> dict[str, Any]:
    """The job's failure record, once written (read raw: this process has no key loaded)."""
    client = deployment.redis.client()
    deadline = time.monotonic() + TIMEOUT
    while (raw := client.get(f"chkq:job:{job}:failed")) is None:
        assert time.monotonic() < deadline, "the job recorded no failure"
        time.sleep(0.1)
    return dict(json.loads(raw.split(b" ", 2)[2]))


# ------------------------------------------------------------ the failure path never hangs


@pytest.fixture
def blocked(tmp_path: Path) -> tuple[Path, str, list[Path], Path]:
    """A run, a job id, a directory and a link named like the job's temporaries."""
    run = tmp_path / "run"
    files = make_run(run, MODEL, RunShape(checkpoints=2, writers=2, trials=2000))
    job = uuid.uuid4().hex
    prefix = JobFiles(run, MODEL, job).prefix
    (run / f"{prefix}.blocker").mkdir()
    (run / f"{prefix}.blocker" / "inside").write_text("planted")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the job's")
    (run / f"{prefix}.part00001.h5").symlink_to(outside)
    return run, job, files, outside


def test_a_failing_job_with_planted_temporaries_reports_its_failure(
        blocked: tuple[Path, str, list[Path], Path], worker: WorkerProcess) -> None:
    run, job, files, outside = blocked
    prefix = JobFiles(run, MODEL, job).prefix
    handle = ConsolidationJob(job, app=get_app())
    with consumers_paused(worker, COPY_QUEUE):
        state.records().record_submitted(job, MODEL, str(run))
        consolidation_signature(str(run), MODEL, job, True).apply_async()
        _wait(lambda: state.records().recorded_plan(job) is not None, "plan")
        temp = JobFiles(run, MODEL, job).temp
        assert temp.stat().st_size > 0
        # The output's template touched mid-job: the whole-output check refuses it.
        touched = Path(state.records().recorded_plan(job).reference_file)  # type: ignore[union-attr]
        os.utime(touched)
    started = time.monotonic()
    with pytest.raises(CheckpointChangedError, match=str(touched)):
        handle.wait_for_summary(timeout=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT / 2
    assert state.records().failure(job)["type"] == "CheckpointChangedError"  # type: ignore[index]
    assert not temp.exists()
    assert (run / f"{prefix}.blocker" / "inside").read_text() == "planted"
    assert (run / f"{prefix}.part00001.h5").is_symlink()
    assert outside.read_text() == "not the job's"
    assert all(f.exists() for f in files)
    assert not (run / "run.h5").exists()


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)
