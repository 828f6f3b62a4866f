"""A store job's hand-offs rest on sealed records: an attacker with the Redis password only.

The deployment is real: a redis-server with a password, a signed ``chkq worker``
with ``CHKQ_ALLOWED_ROOTS`` set, the victim's ``chkq consolidate --from
file://... --cleanup`` run as the victim user, and the attacker as the attacker
user, with the Redis password but not the signing key. The job's fetch units
wait in the worker's own queue (its consumer of that queue cancelled by a signed
control command, as a busy worker would leave them) while the attacker deletes
some of them from the queue and lowers the fetch chord's size in the result
backend (``celery-taskset-meta-GROUP.s``, GROUP read from a fetch message's
headers, which Celery's Redis backend compares with the results counted), so
that planning is called with only some files fetched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_trust_job_state import PasswordRedis, _self_signed

from chkq.demo import RunShape, make_run
from support.helpers import assert_consolidated, snapshot
from support.plugins.signing import SignedWorker
from support.plugins.users import LocalUser

TIMEOUT = 150
MODEL = "sim"
CHECKPOINTS = 4

#: The attacker: waits for the job's fetch messages in the worker's queue, deletes those
#: of units 1.. (mode ``queue``) and lowers the chord's size to what is left to run, or
#: (mode ``counter``) leaves the queue alone and lowers the size by one.
ATTACKER = r'''
import json, os, sys, time
import redis

client = redis.Redis.from_url(os.environ["ATTACK_REDIS"])
queue, mode, units = os.environ["ATTACK_QUEUE"], os.environ["ATTACK_MODE"], 4
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    raws = client.lrange(queue, 0, -1)
    fetches = {json.loads(r)["headers"]["id"]: r for r in raws
               if "-fetch-" in json.loads(r)["headers"]["id"]}
    if len(fetches) == units:
        break
    time.sleep(0.02)
else:
    sys.exit(f"no fetch messages in {queue}")
job = next(iter(fetches)).split("-fetch-")[0]
group = json.loads(next(iter(fetches.values())))["headers"]["group"]
size_key = f"celery-taskset-meta-{group}.s"
if mode == "queue":
    for task, raw in fetches.items():
        if not task.endswith("-fetch-0"):
            client.lrem(queue, 1, raw)
    client.set(size_key, 1, keepttl=True)
else:
    client.set(size_key, units - 1, keepttl=True)
print(job, size_key, client.get(size_key).decode(), flush=True)
'''


def _signed_celery(env: dict[str, str], *argv: str) -> None:
    """A signed ``celery control`` command, as the deployment's operator sends it."""
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "chkq.config.celery_app:app",
                           "control", *argv, "--timeout", "5"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    server = PasswordRedis(tmp_path_factory.mktemp("password-redis"))
    yield server
    server.stop()


@pytest.fixture
def deployment(password_redis: PasswordRedis, local_users: tuple[LocalUser, LocalUser],
               tmp_path: Path) -> Iterator[tuple[SignedWorker, Path, dict[str, str]]]:
    """A signed worker (its node queue not consumed), and the victim's run in a file store."""
    victim, _ = local_users
    home = victim.mkdir(f"h-{uuid.uuid4().hex[:8]}", 0o755)
    env = _self_signed(home / "keys", "chkq")
    store = home / "store"
    make_run(tmp_path / "run", MODEL, RunShape(checkpoints=CHECKPOINTS, writers=0, trials=500))
    store.mkdir()
    for path in sorted((tmp_path / "run").iterdir()):
        (store / path.name).write_bytes(path.read_bytes())
    victim.chown_tree(home)
    scratch = tmp_path / "scratch"
    password_redis.client().flushdb()
    worker = SignedWorker(password_redis.url, tmp_path, {
        **env, "CHKQ_ALLOWED_ROOTS": f"{home}:{scratch}", "CHKQ_SCRATCH_DIR": str(scratch),
        "CHKQ_TASK_FILES": "1"})
    try:
        worker.wait_ready()
        client_env = {**env, "CHKQ_BROKER_URL": password_redis.url,
                      "CHKQ_RESULT_BACKEND": password_redis.url}
        _signed_celery(client_env, "cancel_consumer", f"chkq.node.{worker.name}",
                       "-d", worker.name)
        yield worker, store, client_env
    finally:
        worker.stop()


def _as(user: LocalUser, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(user.home),
                   "LANG": "C.UTF-8", **env}
    return subprocess.Popen(argv, env=environment, cwd=user.home, user=user.uid,
                            group=user.gid, extra_groups=[], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _finish(process: subprocess.Popen[bytes], timeout: float = TIMEOUT) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out.decode(errors="replace") + err.decode(errors="replace")


@pytest.mark.parametrize("mode", ["queue", "counter"])
def test_a_fetch_chord_fired_early_publishes_nothing_and_deletes_no_source(
        deployment: tuple[SignedWorker, Path, dict[str, str]],
        local_users: tuple[LocalUser, LocalUser], mode: str, tmp_path: Path) -> None:
    worker, store, env = deployment
    victim, attacker = local_users
    before = snapshot(store)
    client = _as(victim, [sys.executable, "-m", "chkq.workers.cli", "consolidate", MODEL,
                          "--from", store.as_uri() + "/", "--cleanup", "--timeout", "120"], env)
    attack = _as(attacker, [sys.executable, "-c", ATTACKER],
                 {"ATTACK_REDIS": env["CHKQ_RESULT_BACKEND"], "ATTACK_MODE": mode,
                  "ATTACK_QUEUE": f"chkq.node.{worker.name}"})
    code, said = _finish(attack, 100)
    assert code == 0, said + worker.log()[-3000:] + _finish(client, 5)[1] if code else said
    job = said.split()[0]
    _signed_celery(env, "add_consumer", f"chkq.node.{worker.name}", "-d", worker.name)
    code, output = _finish(client)
    if mode == "counter" and code == 0:
        # The unit left out of the count may still finish before planning reads the
        # records (the worker runs units side by side): the job is then whole, and only so.
        assert_consolidated(store / f"{MODEL}.h5", sorted((tmp_path / "run").iterdir()))
    else:
        assert code == 1, output
        assert f"job {job} cannot be planned: fetch units" in output, output
        assert not (store / f"{MODEL}.h5").exists(), output
        assert snapshot(store) == before
    deadline = time.monotonic() + 30
    while list((Path(worker.log_path).parent / "scratch").glob("*")):
        assert time.monotonic() < deadline, "the job's workspace was left"
        time.sleep(0.2)
