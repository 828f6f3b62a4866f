"""Several hosts on one machine: network namespaces on a bridge of the test's own.

:class:`Hosts` makes a bridge in the root network namespace, gives the root
namespace an address on it (it is the *broker host*: the machine's RabbitMQ,
reached through a ``socat`` relay on the bridge address since it listens on
loopback only, and a redis-server of the test's own bound to the bridge
address), and one namespace per other host (workers, the submitter), each
joined to the bridge by a veth pair and given its own address in a private
/24 (``10.231.N.0/24``) that exists only on this bridge. Everything is
deleted at :meth:`Hosts.close`, also after a failed test.

The filesystem is the machine's: namespaces separate the network only, as
nodes sharing a parallel filesystem would be. A host's link is cut with
``ip link set VETH down`` on the bridge side (its packets go nowhere, no
connection is told) and restored with ``up``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from chkq.workers.broker import free_port
from chkq.workers.runtime.launch import kill_worker, launch_worker, stop_worker
from support.machine import machine_lock

#: Third octet range of the private subnets: 10.231.N.0/24 on a bridge of the test's own.
SUBNET_PREFIX = "10.231"


def ip(*args: str, netns: str | None = None) -> str:
    """Run ``ip ARGS`` (in namespace ``netns``); its output, RuntimeError naming it on failure."""
    argv = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


class Host:
    """One namespace on the bridge: ``name`` (the netns), ``address``, ``veth`` (bridge side)."""

    def __init__(self, name: str, address: str, veth: str) -> None:
        self.name, self.address, self.veth = name, address, veth

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run on this host."""
        return ["ip", "netns", "exec", self.name, *command]

    def cut(self) -> None:
        """Cut this host's link: nothing goes in or out, no peer is told."""
        ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        ip("link", "set", self.veth, "up")


class HostWorker:
    """A ``chkq worker`` process on a host; stop it, or kill it with its pool (a node lost)."""

    def __init__(self, host: Host, env: dict[str, str], log_dir: Path, queues: str,
                 concurrency: int) -> None:
        self.host = host
        self.name = f"{host.name}-{uuid.uuid4().hex[:6]}@node"
        self.log_path = log_dir / f"{self.name}.log"
        with open(self.log_path, "wb") as log:
            self.process = launch_worker(self.name, log=log, env=env, concurrency=concurrency,
                                        queues=queues, peers=True, prefix=host.argv([]))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the main process and its pool at once, as when the node dies."""
        kill_worker(self.process)

    def stop(self) -> None:
        stop_worker(self.process)


class Hosts:
    """A bridge, the broker host (the root namespace) and namespaces for other hosts.

    Parameters
    ----------
    amqp_port
        Port of the machine's RabbitMQ on 127.0.0.1, relayed to the bridge
        address (None: no relay).
    """

    def __init__(self, amqp_port: int | None = 5672) -> None:
        self.id = uuid.uuid4().hex[:5]
        self.subnet = ""
        self.bridge = f"cqbr{self.id}"
        self.address = ""
        self.amqp_port = amqp_port
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.workers: list[HostWorker] = []
        self.redis_port = free_port()
        self._redis_dir = tempfile.mkdtemp(prefix="chkq-hosts-redis-")

    # ---------------------------------------------------------------- set-up

    def start(self) -> Hosts:
        with machine_lock("subnets.lock"):
            # Tests run side by side: a subnet no other bridge of the machine has now.
            taken = ip("-o", "-4", "addr", "show")
            free = [n for n in range(1, 251) if f" {SUBNET_PREFIX}.{n}." not in taken]
            self.subnet = f"{SUBNET_PREFIX}.{random.choice(free)}"
            self.address = f"{self.subnet}.1"
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        redis = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
             "--bind", f"{self.address} 127.0.0.1", "--protected-mode", "no",
             "--dir", self._redis_dir, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(redis)
        if self.amqp_port is not None:
            relay = subprocess.Popen(
                ["socat", f"TCP-LISTEN:{self.amqp_port},bind={self.address},fork,reuseaddr",
                 f"TCP:127.0.0.1:{self.amqp_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.processes.append(relay)
        self._wait_listening(self.redis_port)
        if self.amqp_port is not None:
            self._wait_listening(self.amqp_port)
        return self

    def _wait_listening(self, port: int, timeout: float = 10.0) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    (self.address, port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"nothing listens on {self.address}:{port} after {timeout} s")

    def add_host(self, role: str) -> Host:
        """A new namespace on the bridge (``role`` names it), reachable at its own address."""
        number = len(self.hosts) + 2
        name = f"chkq-{self.id}-{role}"
        veth = f"cq{self.id}h{number}"
        ip("netns", "add", name)
        host = Host(name, f"{self.subnet}.{number}", veth)
        self.hosts.append(host)
        ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        ip("link", "set", f"{veth}p", "netns", name)
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        ip("link", "set", "lo", "up", netns=name)
        ip("link", "set", f"{veth}p", "name", "eth0", netns=name)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=name)
        ip("link", "set", "eth0", "up", netns=name)
        return host

    # ------------------------------------------------------------- addresses

    @property
    def redis_url(self) -> str:
        """The result backend as the other hosts reach it."""
        return f"redis://{self.address}:{self.redis_port}/0"

    @property
    def local_redis_url(self) -> str:
        """The result backend as the broker host (the test process) reaches it."""
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def worker(self, host: Host, env: dict[str, str], log_dir: Path,
               queues: str = "control,copy,verify,commit", concurrency: int = 1) -> HostWorker:
        started = HostWorker(host, env, log_dir, queues, concurrency)
        self.workers.append(started)
        return started

    # -------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stop every process, delete every namespace, veth and the bridge."""
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.kill()
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for host in self.hosts:
            with contextlib.suppress(RuntimeError):
                ip("link", "del", host.veth)
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", host.name)
        with contextlib.suppress(RuntimeError):
            ip("link", "del", self.bridge)
        shutil.rmtree(self._redis_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this harness still present (none after close)."""
        names = ip("netns", "list")
        links = ip("-o", "link", "show")
        return [n for n in (h.name for h in self.hosts) if n in names] + [
            n for n in [self.bridge, *(h.veth for h in self.hosts)] if f" {n}:" in links
            or f" {n}@" in links]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """A bridge and the broker host for one test; hosts added with ``add_host``."""
    if os.geteuid() != 0:
        pytest.fail("the several-hosts tests need root (they make network namespaces with "
                    "`ip netns`): run the suite as root, as CI does")
    if shutil.which("socat") is None:
        pytest.fail("the several-hosts tests need socat on PATH (it relays RabbitMQ to the "
                    "hosts' bridge): `apt-get install socat`")
    harness = Hosts().start()
    try:
        yield harness
    finally:
        harness.close()
        assert harness.leftovers() == [], "network namespaces or links left behind"
