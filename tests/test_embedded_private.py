"""The embedded cluster's broker is its owner's alone; another local user can neither reach it
nor have the owner's worker commit the owner's files to a store of theirs.

The attack is mounted for real, with two local users: the victim holds an embedded cluster
open (as ``chkq consolidate`` does while it runs) and has a private key in ``~/.ssh``; the
attacker looks for the broker as one would (listening TCP sockets of the victim's uid in
``/proc/net/tcp``, Unix sockets in ``/proc/net/unix``, the socket path itself, told by the
test), and sends an unsigned ``chkq.commit`` of the key to a store of theirs through any
endpoint that answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from chkq.workers.broker import PrivateRedis
from tests.plugins.users import LocalUser

TIMEOUT = 120.0

#: Run by the victim: an embedded cluster held open until the test says so, then a commit
#: of its own through it (the queue is first in, first out and the worker has one process:
#: a message the attacker managed to queue before would have run by then).
VICTIM = r"""
import json, sys, time
from pathlib import Path
from chkq.workers.embedded import EmbeddedCluster
from chkq.workers.commit_client import submit_commit

release, probe, store = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with EmbeddedCluster(1) as cluster:
    print(json.dumps({
        "socket": str(cluster.broker.socket_path), "password": cluster.broker.password,
        "redis_pid": cluster.broker.process.pid, "worker_pid": cluster.process.pid,
    }), flush=True)
    while not release.exists():
        cluster.check_alive()
        time.sleep(0.05)
    cluster.wait(submit_commit(store, "probe", probe), 120)
    print("probe committed", flush=True)
"""

#: Run by the attacker: find the victim's broker and send it an unsigned commit of the key.
ATTACKER = r"""
import errno, json, os, socket
params = json.loads(os.environ["ATTACK"])
report = {"tcp": [], "unix": [], "answered": [], "refused": {}, "sent": [], "environ": {}}

def victim_listeners(path):
    ports = []
    try:
        lines = open(path).read().splitlines()[1:]
    except OSError:
        return ports
    for line in lines:
        fields = line.split()
        if fields[3] == "0A" and int(fields[7]) == params["victim_uid"]:
            ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports

report["tcp"] = victim_listeners("/proc/net/tcp") + victim_listeners("/proc/net/tcp6")
paths = {params["socket"]}
for line in open("/proc/net/unix").read().splitlines()[1:]:
    fields = line.split()
    if len(fields) >= 8 and "chkq-redis" in fields[7]:
        paths.add(fields[7])
report["unix"] = sorted(paths)

endpoints = [("tcp", ("127.0.0.1", port), f"redis://127.0.0.1:{port}/0") for port in report["tcp"]]
endpoints += [("unix", path, f"redis+socket://{path}?virtual_host=0") for path in sorted(paths)]
for kind, address, url in endpoints:
    family = socket.AF_INET if kind == "tcp" else socket.AF_UNIX
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(address)
    except OSError as exc:
        report["refused"][str(address)] = errno.errorcode.get(exc.errno, str(exc.errno))
        continue
    finally:
        sock.close()
    report["answered"].append(str(address))
    try:
        from chkq.config.celery_app import make_app
        from chkq.config.settings import Settings

        app = make_app(Settings(broker_url=url, result_backend=url))
        app.conf.broker_connection_retry = False
        app.conf.broker_connection_max_retries = 0
        app.send_task("chkq.commit", args=(params["store"], "stolen", params["secret"]),
                      kwargs={"name": "id_rsa"})
        report["sent"].append(str(address))
    except Exception as exc:
        report["refused"][str(address)] = f"send: {type(exc).__name__}: {exc}"

for pid in params["pids"]:
    try:
        open(f"/proc/{pid}/environ", "rb").read()
        report["environ"][str(pid)] = "read"
    except OSError as exc:
        report["environ"][str(pid)] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(report))
"""


def user_env(user: LocalUser) -> dict[str, str]:
    """The environment :meth:`LocalUser.run` gives a user's commands (no broker configured)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(user.home),
            "USER": user.name, "LANG": "C.UTF-8"}


def start_as(user: LocalUser, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, env=user_env(user), cwd=user.home, user=user.uid,
                            group=user.gid, extra_groups=[], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def victim_listening_ports(uid: int) -> list[int]:
    """TCP ports in LISTEN state owned by ``uid`` (``/proc/net/tcp`` and ``tcp6``)."""
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[7]) == uid:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 9)
        process.wait(10)


@pytest.fixture
def shared_store(local_users: tuple[LocalUser, LocalUser]) -> Iterator[Path]:
    """A store directory of the attacker's that anyone may write into (so the attack would work
    if the victim's worker ever took the message)."""
    _, attacker = local_users
    path = Path(tempfile.mkdtemp(prefix="chkq-attacker-store-"))
    os.chown(path, attacker.uid, attacker.gid)
    path.chmod(0o777)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_another_user_cannot_reach_the_embedded_broker_nor_have_the_victims_key_committed(
    local_users: tuple[LocalUser, LocalUser], shared_store: Path
) -> None:
    victim, attacker = local_users
    ssh = victim.mkdir(".ssh")
    secret = ssh / "id_rsa"
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + os.urandom(64).hex().encode())
    os.chown(secret, victim.uid, victim.gid)
    secret.chmod(0o600)
    probe = victim.home / "probe.bin"
    probe.write_bytes(b"the victim's own checkpoint")
    os.chown(probe, victim.uid, victim.gid)
    release = victim.home / "release"
    own_store = f"file://{victim.home / 'store'}"

    holder = start_as(victim, [sys.executable, "-c", VICTIM, str(release), str(probe),
                               own_store])
    try:
        assert holder.stdout is not None
        first = holder.stdout.readline()
        assert first, holder.stderr.read() if holder.stderr else ""
        info = json.loads(first)
        socket_path = Path(info["socket"])
        pids = [p.pid for pid in (info["redis_pid"], info["worker_pid"]) for p in tree(pid)]

        # What the owner can check: no TCP port at all, a private socket, no password in ps.
        assert victim_listening_ports(victim.uid) == [], "the embedded broker listens on TCP"
        assert socket_path.parent.stat().st_mode & 0o777 == 0o700
        assert socket_path.parent.stat().st_uid == victim.uid
        for process in tree(info["redis_pid"]) + tree(info["worker_pid"]):
            assert info["password"] not in " ".join(process.cmdline()), process.cmdline()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(unix_socket_path=str(socket_path)).ping()  # root, without the password

        attack = attacker.python(ATTACKER, env={"ATTACK": json.dumps({
            "victim_uid": victim.uid, "socket": str(socket_path), "pids": pids,
            "store": f"file://{shared_store}", "secret": str(secret),
        })}, timeout=TIMEOUT)
        assert attack.returncode == 0, attack.stderr.decode(errors="replace")[-3000:]
        report = json.loads(attack.stdout.decode().splitlines()[-1])

        assert report["tcp"] == [], f"the attacker found a TCP port of the victim: {report}"
        assert str(socket_path) in report["unix"]
        assert report["refused"].get(str(socket_path)) == "EACCES", report
        assert report["answered"] == [] and report["sent"] == [], report
        assert set(report["environ"].values()) == {"EACCES"}, report

        release.touch()
        out, err = holder.communicate(timeout=TIMEOUT)
        assert holder.returncode == 0, err[-3000:]
        assert "probe committed" in out
    finally:
        stop(holder)
    assert list(shared_store.iterdir()) == [], "the victim's worker wrote to the attacker's store"
    assert not socket_path.parent.exists(), "the broker's private directory was left behind"


def test_chkq_watch_runs_no_broker_and_no_worker_while_the_simulation_runs(
    local_users: tuple[LocalUser, LocalUser], shared_store: Path
) -> None:
    victim, _ = local_users
    run = victim.mkdir("run")
    made = victim.run([sys.executable, "-P", "-m", "chkq.workers.cli", "demo", str(run)])
    assert made.returncode == 0, made.stderr
    files = sorted(run.glob("demo_chk*/thread_*.h5"))
    done = victim.home / "sim.done"
    watch = start_as(victim, [
        sys.executable, "-P", "-m", "chkq.workers.cli", "watch", str(run), "demo",
        "--store", f"file://{victim.home / 'watch-store'}", "--run", "r1",
        "--done-file", str(done), "--interval", "0.2"])
    try:
        assert watch.stdout is not None
        committed = []
        deadline = time.monotonic() + TIMEOUT
        while len(committed) < len(files):
            assert time.monotonic() < deadline and watch.poll() is None, (
                watch.stderr.read() if watch.stderr else "")
            line = watch.stdout.readline()
            if line.startswith("committed "):
                committed.append(line.split()[1])
        # Every file is committed and the watch goes on: nothing listens, nothing was started.
        assert victim_listening_ports(victim.uid) == []
        assert psutil.Process(watch.pid).children(recursive=True) == []
        done.touch()
        out, err = watch.communicate(timeout=TIMEOUT)
        assert watch.returncode == 0, err
    finally:
        stop(watch)
    assert sorted(committed) == sorted(str(f.relative_to(run)) for f in files)


def test_the_private_broker_refuses_clients_without_its_password_and_has_no_tcp_port() -> None:
    with PrivateRedis(unix_socket=True) as server:
        assert server.kind == "redis-server"
        assert server.process is not None
        listening = [c for c in psutil.Process(server.process.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening == []
        assert server.password not in " ".join(psutil.Process(server.process.pid).cmdline())
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(unix_socket_path=str(server.socket_path)).ping()
        assert server.client().ping()
        assert server.socket_path.stat().st_mode & 0o777 == 0o700
    assert not server.private_dir.exists()


def _listening_inet() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_the_fakeredis_fallback_serves_only_a_unix_socket_another_user_cannot_reach(
    local_users: tuple[LocalUser, LocalUser]
) -> None:
    _, attacker = local_users
    before = _listening_inet()
    with PrivateRedis(unix_socket=True, prefer_fake=True) as server:
        assert server.kind == "fakeredis"
        assert _listening_inet() == before, "the fakeredis fallback opened a TCP port"
        assert server.private_dir.stat().st_mode & 0o777 == 0o700
        assert server.socket_path.stat().st_mode & 0o777 == 0o700
        client = server.client()
        client.set("k", "v")
        assert client.get("k") == b"v"
        probe = attacker.python(
            "import errno, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({str(server.socket_path)!r})\n"
            "except OSError as exc:\n"
            "    print(errno.errorcode[exc.errno])\n"
            "else:\n"
            "    print('connected')\n")
        assert probe.stdout.decode().strip() == "EACCES", probe
    assert not server.private_dir.exists()


HOLDER = r"""
import sys, time
from chkq.workers.embedded import EmbeddedCluster

with EmbeddedCluster(1) as cluster:
    print(cluster.broker.private_dir, cluster.broker.process.pid, flush=True)
    while True:
        time.sleep(1)
"""


def test_the_broker_directory_goes_even_when_its_command_is_killed_outright() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert holder.stdout is not None
        directory, redis_pid = holder.stdout.readline().split()
        assert Path(directory, "redis.sock").exists()
        holder.kill()
        holder.wait(10)
        deadline = time.monotonic() + TIMEOUT
        while Path(directory).exists() or psutil.pid_exists(int(redis_pid)):
            assert time.monotonic() < deadline, f"{directory} or redis-server outlived SIGKILL"
            time.sleep(0.1)
    finally:
        stop(holder)
