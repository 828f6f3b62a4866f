"""Who may do what: a Flower login, a holder of the signing key, a user with a key of their own.

The parties are real: two useradd'ed users (a victim with a private 0700 run, an attacker),
root workers with message signing on and ``CHKQ_ALLOWED_ROOTS`` covering both users' homes,
Flower started by ``chkq flower`` with a basic-auth login, and a password-protected Redis.
The signing key is readable by both users (each can submit). The attacks are those a
security review mounted: a consolidation of the victim's run into the attacker's directory
with cleanup, sent through Flower's API or signed by the attacker himself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from base64 import b64encode
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from chkq.demo import RunShape, make_run
from chkq.workers.broker import PrivateRedis, free_port
from chkq.workers.runtime.launch import launch_worker, stop_worker, worker_environment
from support.helpers import snapshot, wait_for
from support.plugins.signing import Secrets, signed_ping
from support.plugins.users import LocalUser

CLI = [sys.executable, "-m", "chkq.workers.cli"]
LOGIN = ("ops", "flower-login-pass")
MODEL = "run"
TIMEOUT = 90.0

pytestmark = pytest.mark.cluster
#: Long enough for a worker to have run a job sent to it (they take about a second here).
QUIET = 8.0


@dataclass
class Deployment:
    """A signed cluster (Redis, one root worker), its shared signing key, users' keys."""

    base: Path
    env: dict[str, str]
    worker_log: Path
    keys_dir: Path | None

    def user_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """What a user's shell has to submit: the broker, the signing key, the users' keys."""
        env = dict(self.env)
        if self.keys_dir is not None:
            env["CHKQ_USER_KEYS_DIR"] = str(self.keys_dir)
        return {**env, **(extra or {})}


def _shared_secrets(secrets: Secrets, base: Path) -> dict[str, str]:
    """The signing key and certificates, copied where every local user can read them."""
    shared = base / "secrets"
    shutil.copytree(secrets.store.parent, shared)
    for path in [shared, *shared.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"CHKQ_SECURITY_KEY": str(shared / secrets.key_file.name),
            "CHKQ_SECURITY_CERTIFICATE": str(shared / secrets.cert_file.name),
            "CHKQ_SECURITY_CERT_STORE": str(shared / "trusted")}


def _user_key(user: LocalUser, keys_dir: Path) -> None:
    """The user makes their own key, as the threat model tells them to."""
    done = user.run(["sh", "-c", f'umask 077 && head -c 32 /dev/urandom | od -An -tx1 | '
                                 f'tr -d " \\n" > {keys_dir}/{user.name}.key'])
    assert done.returncode == 0, done.stderr.decode()


@contextmanager
def deployment(users: tuple[LocalUser, LocalUser], secrets: Secrets, *,
               user_keys: bool) -> Iterator[Deployment]:
    """Redis, a root worker with signing and roots over both users' homes; users' keys if asked."""
    base = Path(tempfile.mkdtemp(prefix="chkq-parties-"))
    base.chmod(0o711)
    signing = _shared_secrets(secrets, base)
    keys_dir = None
    if user_keys:
        keys_dir = base / "users"
        keys_dir.mkdir()
        keys_dir.chmod(0o1733)
        for user in users:
            _user_key(user, keys_dir)
    worker_log = base / "worker.log"
    with PrivateRedis() as server:
        client = {"CHKQ_BROKER_URL": server.url, "CHKQ_RESULT_BACKEND": server.url, **signing}
        extra = {**signing, "CHKQ_SCRATCH_DIR": str(base / "scratch"),
                 "CHKQ_ALLOWED_ROOTS": os.pathsep.join([str(users[0].home.parent),
                                                        str(base / "scratch")])}
        if keys_dir is not None:
            extra["CHKQ_USER_KEYS_DIR"] = str(keys_dir)
        base_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("CHKQ_", "FLOWER_"))}
        name = f"parties-{uuid.uuid4().hex[:8]}@localhost"
        with open(worker_log, "wb") as log:
            worker = launch_worker(name, log=log, concurrency=2, peers=True,
                                   queues="control,copy,verify,commit",
                                   env=worker_environment(server.url, extra=extra,
                                                          base=base_env))
        try:
            wait_for(lambda: worker.poll() is None and signed_ping(name, {**base_env, **client}),
                     TIMEOUT, f"worker {name} to answer a signed ping")
            yield Deployment(base, client, worker_log, keys_dir)
        finally:
            stop_worker(worker)
            shutil.rmtree(base, ignore_errors=True)


@dataclass
class Scene:
    """The victim's private run (with its snapshot) and the attacker's open directory."""

    victim: LocalUser
    attacker: LocalUser
    run: Path
    loot: Path
    before: dict[str, str]

    def untouched(self) -> None:
        assert snapshot(self.run) == self.before, "the victim's run was changed"
        assert sorted(p.name for p in self.loot.iterdir()) == [], "the attacker got an output"


def _scene(users: tuple[LocalUser, LocalUser]) -> Scene:
    victim, attacker = users
    tag = uuid.uuid4().hex[:8]
    run = victim.mkdir(f"run-{tag}", 0o700)
    make_run(run, MODEL, RunShape(checkpoints=2, writers=2, trials=30))
    victim.chown_tree(run)
    loot = attacker.mkdir(f"loot-{tag}", 0o755)
    return Scene(victim, attacker, run, loot, snapshot(run))


@pytest.fixture
def scene(local_users: tuple[LocalUser, LocalUser]) -> Iterator[Scene]:
    found = _scene(local_users)
    yield found
    shutil.rmtree(found.run, ignore_errors=True)
    shutil.rmtree(found.loot, ignore_errors=True)


# ---------------------------------------------------------------------------- Flower


def _http(url: str, method: str = "GET", body: dict[str, object] | None = None,
          auth: tuple[str, str] | None = LOGIN) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if auth:
        token = b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.fixture(scope="module")
def plain(local_users: tuple[LocalUser, LocalUser], secrets: Secrets
          ) -> Iterator[Deployment]:
    """The deployment as most run it: signing on, no users' keys (one party)."""
    with deployment(local_users, secrets, user_keys=False) as found:
        yield found


@pytest.fixture(scope="module")
def flower(plain: Deployment) -> Iterator[str]:
    """``chkq flower`` with a basic-auth login and the signing key, as compose runs it."""
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **plain.env,
           "CHKQ_FLOWER_BASIC_AUTH": ":".join(LOGIN)}
    with open(plain.base / "flower.log", "wb") as log:
        process = subprocess.Popen([*CLI, "flower", "--port", str(port)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def online() -> bool:
        assert process.poll() is None, (plain.base / "flower.log").read_text()[-3000:]
        try:
            return _http(url + "/api/workers")[0] == 200
        except OSError:
            return False

    try:
        wait_for(online, TIMEOUT, "Flower to answer")
        yield url
    finally:
        os.killpg(process.pid, 15)
        process.wait(30)


def test_a_flower_login_sends_no_task_and_controls_no_worker(
        plain: Deployment, flower: str, scene: Scene) -> None:
    """The review's attack: ``send-task/chkq.stage`` of the victim's run into the attacker's
    directory with cleanup, and the other acting routes; every one answers 403 and nothing
    runs, while Flower still shows the workers."""
    job = uuid.uuid4().hex
    stage = {"args": [f"file://{scene.run}/", MODEL, job],
             "kwargs": {"to": f"file://{scene.loot}/{MODEL}.h5", "cleanup": True}}
    plan = {"args": [str(scene.run), MODEL, uuid.uuid4().hex], "kwargs": {"cleanup": True}}
    answers = {
        "send-task": _http(f"{flower}/api/task/send-task/chkq.stage", "POST", stage),
        "async-apply": _http(f"{flower}/api/task/async-apply/chkq.plan", "POST", plan),
        "apply": _http(f"{flower}/api/task/apply/chkq.plan", "POST", plan),
        "revoke": _http(f"{flower}/api/task/revoke/{job}?terminate=true", "POST", {}),
        "pool-shrink": _http(f"{flower}/api/worker/pool/shrink/x@localhost?n=1", "POST", {}),
        "shutdown": _http(f"{flower}/api/worker/shutdown/x@localhost", "POST", {}),
    }
    time.sleep(QUIET)
    scene.untouched()
    assert {k: v[0] for k, v in answers.items()} == dict.fromkeys(answers, 403), answers
    assert "read-only" in answers["send-task"][1]
    assert "task=chkq.stage" not in plain.worker_log.read_text()
    assert "task=chkq.plan" not in plain.worker_log.read_text()
    status, body = _http(f"{flower}/api/workers")
    assert status == 200 and json.loads(body), body


# ---------------------------------------------------------------------------- users' keys


@pytest.fixture(scope="module")
def keyed(local_users: tuple[LocalUser, LocalUser], secrets: Secrets
          ) -> Iterator[Deployment]:
    """Signing on and every user with a key of their own in ``CHKQ_USER_KEYS_DIR``."""
    with deployment(local_users, secrets, user_keys=True) as found:
        yield found


#: Python an attacker who holds the signing key runs: a job message of his own making.
ATTACK = """
import json, sys
from celery.result import AsyncResult
from chkq.config.celery_app import get_app
kind, job, target, dest, how, victim = sys.argv[1:]
kwargs = {}
if how == "own":
    from chkq.tasks.parties import plan_credential, stage_credential
    kwargs["party"] = (stage_credential(job, target, "run", None, dest, True, False)
                       if kind == "stage" else plan_credential(job, target, "run", True, False))
elif how == "forged":
    from chkq.identity import issue
    from chkq.tasks.parties import stage_claim
    kwargs["party"] = issue(victim, b"0" * 64, "chkq.stage",
                            stage_claim(job, target, "run", None, dest, True, False))
if kind == "stage":
    from chkq.tasks.from_store import stage_signature
    stage_signature(target, "run", job, to=dest, cleanup=True, **kwargs).apply_async()
else:
    from chkq.tasks.consolidate import consolidation_signature
    consolidation_signature(target, "run", job, True, **kwargs).apply_async()
try:
    print(json.dumps({"ok": str(AsyncResult(job, app=get_app()).get(timeout=80))}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def _attack(deployment: Deployment, scene: Scene, kind: str, how: str) -> dict[str, str]:
    job = uuid.uuid4().hex
    target = f"file://{scene.run}/" if kind == "stage" else str(scene.run)
    done = scene.attacker.run([sys.executable, "-c", ATTACK, kind, job, target,
                               f"file://{scene.loot}/{MODEL}.h5", how, scene.victim.name],
                              env=deployment.user_env(), timeout=TIMEOUT + 30)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    outcome: dict[str, str] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return outcome


@pytest.mark.parametrize(("kind", "how", "why"), [
    ("stage", "none", "carries no user credential"),
    ("stage", "forged", "was not made with their key"),
    ("stage", "own", "user {attacker} may not read the source store"),
    ("plan", "none", "carries no user credential"),
    ("plan", "own", "user {attacker} may not read the run directory"),
])
def test_the_signing_key_alone_runs_no_job_on_another_users_run(
        keyed: Deployment, scene: Scene, kind: str, how: str, why: str) -> None:
    """An attacker holding the signing key sends the job himself: with no credential, with
    one in the victim's name he cannot make, or with his own. Each is refused naming why,
    and the victim's run is as it was."""
    outcome = _attack(keyed, scene, kind, how)
    scene.untouched()
    assert outcome.get("error") == "NotPermittedError", outcome
    assert why.format(attacker=scene.attacker.name) in outcome["message"], outcome


def test_a_user_with_their_key_consolidates_their_own_run(
        keyed: Deployment, scene: Scene) -> None:
    """The same cluster runs the victim's own jobs, cleanup and a store job included."""
    victim = scene.victim
    out = victim.mkdir(f"out-{uuid.uuid4().hex[:8]}", 0o700)
    try:
        copy = out / "copy"
        shutil.copytree(scene.run, copy)
        victim.chown_tree(out)
        published = victim.run([*CLI, "consolidate", MODEL, "--from", f"file://{copy}/",
                                "--to", f"file://{out}/{MODEL}.h5"], env=keyed.user_env(),
                               timeout=TIMEOUT)
        assert published.returncode == 0, published.stderr.decode()
        assert (out / f"{MODEL}.h5").stat().st_uid == victim.uid
        done = victim.run([*CLI, "consolidate", MODEL, "--out-dir", str(scene.run),
                           "--cleanup"], env=keyed.user_env(), timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr.decode()
        assert sorted(p.name for p in scene.run.iterdir()) == [f"{MODEL}.h5"]
        assert (scene.run / f"{MODEL}.h5").stat().st_uid == victim.uid
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_a_user_without_a_key_is_told_before_anything_is_sent(
        keyed: Deployment, scene: Scene) -> None:
    empty = scene.attacker.mkdir(f"nokeys-{uuid.uuid4().hex[:8]}", 0o755)
    make_run(scene.loot, MODEL, RunShape(checkpoints=1, trials=10))
    scene.attacker.chown_tree(scene.loot)
    done = scene.attacker.run([*CLI, "consolidate", MODEL, "--out-dir", str(scene.loot)],
                              env=keyed.user_env({"CHKQ_USER_KEYS_DIR": str(empty)}),
                              timeout=TIMEOUT)
    assert done.returncode == 1
    assert f"{empty}/{scene.attacker.name}.key" in done.stderr.decode()
    assert not (scene.loot / f"{MODEL}.h5").exists()
    shutil.rmtree(empty)
